"""kiln: an ahead-of-time search compiler for model inference."""

from kiln.pipeline import Pipeline, compile  # noqa: F401

__all__ = ["Pipeline", "compile"]
