"""The HTTP layer (FastAPI): thin request models over ``draftline.core.engine``."""
