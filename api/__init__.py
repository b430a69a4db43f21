"""The HTTP layer (FastAPI): thin request models over ``core.engine``."""
