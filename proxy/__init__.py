"""streamwarden: a sidecar proxy that makes LLM stream failures visible to clients and metrics."""

__version__ = "0.1.0"
__all__ = ["__version__"]
