"""The web service: FastAPI app factory, routes, schemas, settings and the web page."""

from fragsearch.service.app import create_app
from fragsearch.service.version import __version__
from fragsearch.settings import Settings

__all__ = ["Settings", "__version__", "create_app"]
