"""The API's routers: search, images, health."""
