"""A parallel kernel's loops optimized and emitted once, not three times.

numba compiles each prange loop of a kernel into a gufunc in a code library of its own, wraps it
in two more libraries (a gufunc wrapper, then `parallelgufuncwrapper`, which hands it to the
thread pool) and links those into the kernel's library. Every library is finalized on its own:
its module, with everything linked into it, is optimized at O3 and emitted as machine code. The
two wrappers' code never runs by itself (the kernel's library links it in again and calls it by
symbol), so a kernel's loops were optimized and emitted three times, each time after inlining
and unrolling: a max over 8x12x64 rows of 64 compiled in 10-12.5 s, 3.8-4.9 s when the wrappers are
only linked, with the same machine code speed and bit-identical results.

While a kiln kernel is lowered (`linking_once()`, entered by kiln.runtime.pipeline), those two
wrapper libraries are finalized for linking only: linked, verified and marked finalized, neither
optimized nor emitted; the kernel's library optimizes and emits all of it once. Nothing in that
window asks them for a function's address (numba's parfor lowering calls them by symbol; the
gufunc's own library, whose environment numba binds by address, is finalized as before).

This reaches into numba's code libraries, so it is installed only over the numba release it was
written against (TESTED, the version requirements.txt pins); over any other, kernels compile as
numba does by itself, only slower.
"""

from __future__ import annotations

import contextlib
import threading

TESTED = "0.68.1"

_state = threading.local()
_install_lock = threading.Lock()
_installed = None  # None: not tried yet; then whether the hook is in place


def _link_only(library) -> bool:
    """numba's names for the two wrapper libraries of a parfor gufunc (numba.np.ufunc.parallel
    build_gufunc_wrapper and wrappers._GufuncWrapper, which names its library after itself)."""
    name = library.name
    return name == "parallelgufuncwrapper" or name.startswith("<numba.np.ufunc.wrappers._GufuncWrapper ")


def _finalize_for_linking(library) -> None:
    """CPUCodeLibrary.finalize without optimizing or emitting the module: link its libraries in,
    verify, and mark it finalized, so that a library linking it takes its module as it is."""
    from numba.core.compiler_lock import require_global_compiler_lock

    require_global_compiler_lock()
    library._raise_if_finalized()
    seen = set()
    for dependency in library._linking_libraries:
        if dependency not in seen:
            library._reload_init.update(dependency._reload_init)
            seen.add(dependency)
            library._final_module.link_in(dependency._get_module_for_linking(), preserve=True)
    library._final_module.verify()
    library._finalized = True


def _install() -> bool:
    global _installed
    with _install_lock:
        if _installed is None:
            import numba
            from numba.core.codegen import CPUCodeLibrary

            _installed = numba.__version__ == TESTED and all(
                hasattr(CPUCodeLibrary, a) for a in ("finalize", "_get_module_for_linking", "_raise_if_finalized"))
            if _installed:
                original = CPUCodeLibrary.finalize

                def finalize(self):
                    if getattr(_state, "active", False) and _link_only(self):
                        return _finalize_for_linking(self)
                    return original(self)

                CPUCodeLibrary.finalize = finalize
        return _installed


@contextlib.contextmanager
def linking_once():
    """While it is open (a kiln kernel's lowering), parfor wrapper libraries are only linked."""
    _install()
    outer = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = outer
