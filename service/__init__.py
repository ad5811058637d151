"""The web service: FastAPI app factory, routes, schemas, settings and the web page."""

from service.app import create_app
from service.settings import Settings

__all__ = ["Settings", "create_app"]
