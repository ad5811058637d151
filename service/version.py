"""The project's version (pyproject.toml's), shown by --version and in the OpenAPI document."""

__version__ = "0.1.0"
