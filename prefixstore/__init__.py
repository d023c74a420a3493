"""prefixstore: the distributed external prefix store for LLM serving engines."""

__version__ = "0.1.0"
