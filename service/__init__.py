"""The web service: FastAPI app factory, routes, schemas, settings and the web page."""

from fragsearch.service.app import create_app
from fragsearch.service.settings import Settings
from fragsearch.service.version import __version__

__all__ = ["Settings", "__version__", "create_app"]
