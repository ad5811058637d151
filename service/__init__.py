"""The web service: FastAPI app factory, routes, schemas, settings and the web page."""

from service.app import create_app
from service.settings import Settings
from service.version import __version__

__all__ = ["Settings", "__version__", "create_app"]
