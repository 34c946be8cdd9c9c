"""kiln: an ahead-of-time search compiler for model inference.

The package is the public front (`kiln.compile`, `kiln.Pipeline`) over its layers: `kiln.core`,
`kiln.ir`, `kiln.cas` and `kiln.runtime` (foundation), `kiln.rpc` (gRPC plumbing), the four
`*_svc` stages, and `kiln.apps` (the command line and the tools built on it). The front is
loaded on first use, so that importing a foundation module never pulls in the stages above it.
"""

from __future__ import annotations

__all__ = ["Pipeline", "compile"]


def __getattr__(name: str):
    if name in __all__:
        from kiln import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
