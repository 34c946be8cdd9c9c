"""A key for what torch.export makes of a module, computed without exporting it.

A warm compile (the same model compiled again, in a new process, over the same store) spent most
of its time exporting: 1.5 s of a MiniLM-shaped encoder's 3 s, and for a causal LM's prefill and
decode programs (dynamic batch and sequence) 8-14 s at 2 layers, growing with layers; everything
after the export was found in the store in under a second. What the export led to (the
imported graph and weight manifest of each program) is recorded in the action cache under this
key, so a compile that finds it skips the export and the import and goes on with the graph.

The key covers everything the export reads:
- the code: every class in the module tree and every function, class and module their modules'
  globals reach, transitively, by the bytes of their source files; code under an installed
  distribution (site-packages) by that distribution's version, kiln's own by the source of the
  kiln package, and the standard library by the Python version (a package edited in place in
  site-packages is not noticed);
- the state: per submodule its class, its attributes (configs included, walked as plain data;
  a function by its bytecode, constants and what its closure captured) and its parameters,
  buffers and tensor attributes by their bytes (sha256, hashed in threads:
  about 3 GB/s on two cores);
- the call: the example inputs' structure, dtypes and shapes (export reads no values), the
  dynamic shapes, the caller's own options, torch's and Python's versions and the grad mode.

Anything the walk cannot describe as data (an object with neither plain attributes nor a known
type, nesting past MAX_DEPTH) makes the module unkeyable: it is exported as always. With
KILN_EXPORT_CACHE=0 nothing is looked up. A model whose behavior depends on state the walk cannot
see (a global variable changed between two compiles, an environment variable a forward reads)
is the case to turn it off for.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import os
import sys
import sysconfig
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)

EXPORT_KEY_VERSION = "2"  # 2: the record holds the imported graphs and manifests, not .pt2 archives
MAX_DEPTH = 8  # attribute nesting walked before a module is called unkeyable
HASH_THREADS = 4  # hashlib releases the GIL on large buffers
# kiln's packages: keyed by the source of the kiln package (its export wrappers and callers), not
# walked, since what a walk reaches depends on which of its modules this process has imported yet
PROJECT = ("kiln", "importer_svc", "optimizer_svc", "codegen_svc", "executor_svc")
# attributes that differ from process to process and that no forward reads: transformers'
# GenerationConfig keeps hash(self) (salted per process for its strings) to see later edits
PER_PROCESS = frozenset({"_original_object_hash"})


class Unkeyable(Exception):
    """The module holds something the key cannot describe: export it as always."""


def enabled() -> bool:
    return os.environ.get("KILN_EXPORT_CACHE", "1") not in ("0", "false", "no", "off")


def export_key(module, example_args: tuple, example_kwargs: Optional[dict], dynamic_shapes,
               options: Mapping[str, object], code: tuple = ()) -> Optional[str]:
    """The hex key of torch.export's program for this module and call, or None when the module
    cannot be keyed (see Unkeyable) or the cache is off. `code`: more module objects whose
    source the export depends on (the caller's own, which runs the export)."""
    if not enabled():
        return None
    import torch
    from torch.utils import _pytree as pytree

    try:
        walk = _Walk(module.modules())
        h = hashlib.sha256()
        add = lambda *parts: [h.update(str(p).encode() + b"\0") for p in parts]  # noqa: E731
        add(EXPORT_KEY_VERSION, sys.version, torch.__version__, torch.is_grad_enabled(), torch.get_default_dtype())
        add(*sorted(f"{k}={v!r}" for k, v in options.items()))
        roots = {type(m) for m in module.modules()} | set(code)
        add(*_code_fingerprint(roots))
        for name, m in module.named_modules(remove_duplicate=False):
            add("module", name, _qualname(type(m)), walk.describe(_attributes(m), 0))
            for pname, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                add(pname, walk.describe(t, 0))
        leaves, spec = pytree.tree_flatten((tuple(example_args), dict(example_kwargs or {})))
        add("call", spec)
        for x in leaves:  # export traces shapes and dtypes; values are never read
            add(f"tensor {x.dtype} {tuple(x.shape)} {x.requires_grad}" if isinstance(x, torch.Tensor)
                else walk.describe(x, 0))
        add("dynamic", walk.describe(dynamic_shapes, 0))
        add(*walk.tensor_digests())
        return h.hexdigest()
    except (Unkeyable, RecursionError):
        return None
    except Exception as e:  # noqa: BLE001 - a key is only a shortcut: anything unforeseen exports as always
        log.info("not keyed for the export cache: %s: %s", type(e).__name__, e)
        return None


def _code_text(code: types.CodeType) -> str:
    """A function's code as text: two lambdas of one function share a qualified name and a file,
    not their bytecode and constants (set constants sorted: their order follows string hashes)."""
    consts = [_code_text(c) if isinstance(c, types.CodeType) else
              repr(sorted(c, key=repr)) if isinstance(c, frozenset) else repr(c) for c in code.co_consts]
    return f"{code.co_filename}:{code.co_firstlineno} {code.co_code.hex()} {consts} {code.co_names}"


def _attributes(m) -> dict:
    skip = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
    return {k: v for k, v in vars(m).items() if k not in skip}


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


class _Walk:
    """Describes attribute values as text; tensors by position, their bytes hashed at the end."""

    def __init__(self, tree=()):
        self.tree = {id(m) for m in tree}  # the modules whose own walk describes them
        self.tensors: list = []
        self.by_storage: dict = {}

    def describe(self, v, depth: int) -> str:
        import torch

        if depth > MAX_DEPTH:
            raise Unkeyable(f"attributes nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes, enum.Enum)):
            return repr(v)
        if isinstance(v, (torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)):
            return repr(v)
        if isinstance(v, torch.Tensor):
            return self._tensor(v)
        if isinstance(v, (list, tuple, set, frozenset)):
            items = [self.describe(x, depth + 1) for x in v]
            return f"{type(v).__name__}[{', '.join(sorted(items) if isinstance(v, (set, frozenset)) else items)}]"
        if isinstance(v, dict):
            items = sorted(f"{self.describe(k, depth + 1)}: {self.describe(x, depth + 1)}" for k, x in v.items()
                           if k not in PER_PROCESS)
            return f"{type(v).__name__}{{{', '.join(items)}}}"
        if isinstance(v, torch.nn.Module):  # one of the tree's, described there; any other is not
            if id(v) not in self.tree:
                raise Unkeyable(f"a {_qualname(type(v))} held outside the module tree")
            return f"module {_qualname(type(v))}"
        if isinstance(v, functools.partial):
            return f"partial({self.describe(v.func, depth + 1)}, {self.describe(v.args, depth + 1)}, " \
                   f"{self.describe(v.keywords, depth + 1)})"
        if isinstance(v, types.MethodType):  # and the object it is bound to
            return f"method {self.describe(v.__func__, depth + 1)} of {self.describe(v.__self__, depth + 1)}"
        if isinstance(v, types.FunctionType):  # its code is keyed by file; what it captured, here
            try:
                cells = [c.cell_contents for c in v.__closure__ or () if c.cell_contents is not v]
            except ValueError as e:  # a cell not yet filled
                raise Unkeyable(f"function {_qualname(v)} captured an empty cell") from e
            return (f"{_qualname(v)} {_code_text(v.__code__)}({self.describe(cells, depth + 1)}, "
                    f"{self.describe(v.__defaults__, depth + 1)}, {self.describe(v.__kwdefaults__, depth + 1)})")
        if isinstance(v, (types.BuiltinFunctionType, type, types.ModuleType)):
            return _qualname(v) if not isinstance(v, types.ModuleType) else f"module {v.__name__}"
        if hasattr(v, "__dict__"):  # a config, an activation object: its class and its attributes
            return f"{_qualname(type(v))}{self.describe(dict(vars(v)), depth + 1)}"
        raise Unkeyable(f"an attribute of type {_qualname(type(v))}")

    def _tensor(self, t) -> str:
        import torch

        if t.is_meta or t.device.type != "cpu" or t.layout != torch.strided:
            raise Unkeyable(f"a {t.device.type} {t.layout} tensor")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self.by_storage:  # tied weights: hashed once
            self.by_storage[key] = len(self.tensors)
            self.tensors.append(t)
        return f"tensor#{self.by_storage[key]} {t.dtype} {tuple(t.shape)} {t.requires_grad}"

    def tensor_digests(self) -> list[str]:
        import torch

        def digest(t) -> str:
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
            return hashlib.sha256(memoryview(data)).hexdigest()

        with ThreadPoolExecutor(HASH_THREADS) as pool:
            return list(pool.map(digest, self.tensors))


def _code_fingerprint(roots) -> list[str]:
    """Per source the export may run: a user file's path and content hash, an installed
    distribution's name and version. Walks, from the roots' modules, every module their globals
    reach (modules, and the modules of functions, classes and instances), stopping at installed
    distributions and the standard library."""
    stdlib = {str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")}
    parts, seen, todo = set(), set(), []

    def visit(name: Optional[str]):
        if isinstance(name, str) and name not in seen:
            seen.add(name)
            todo.append(name)

    for r in roots:
        visit(r.__name__ if isinstance(r, types.ModuleType) else getattr(r, "__module__", None))
    while todo:
        mod = sys.modules.get(todo.pop())
        path = getattr(mod, "__file__", None)
        if mod is None or not path:  # builtin or frozen: part of Python
            continue
        if mod.__name__.split(".")[0] in PROJECT:  # kiln's own code, as a whole: not as loaded so far
            parts.add(f"kiln {_kiln_code()}")
            continue
        path = str(Path(path).resolve())
        dist = _distribution(mod.__name__, path)
        if dist is not None:
            parts.add(dist)
            continue
        if any(path.startswith(s + os.sep) for s in stdlib):
            continue
        parts.add(f"{path} {_file_digest(path)}")
        for v in list(vars(mod).values()):
            if isinstance(v, types.ModuleType):
                visit(v.__name__)
            else:
                visit(getattr(v, "__module__", None) if isinstance(getattr(v, "__module__", None), str)
                      else getattr(type(v), "__module__", None))
    return sorted(parts)


@functools.lru_cache(maxsize=None)
def _kiln_code() -> str:  # the code this process runs: it does not change while it runs
    from kiln.cas.cache import code_version

    return code_version("kiln")


def _distribution(module_name: str, path: str) -> Optional[str]:
    """"name==version" when the file lies in an installed distribution (site-packages)."""
    if os.sep + "site-packages" + os.sep not in path and os.sep + "dist-packages" + os.sep not in path:
        return None
    return _top_level_version(module_name.split(".")[0]) or f"site-packages {path} {_file_digest(path)}"


@functools.lru_cache(maxsize=None)
def _top_level_version(top: str) -> Optional[str]:
    """The version of the distribution a top-level package comes from: most are named as their
    package (torch, transformers); the rest are looked up in every distribution's file list
    (packages_distributions, about 0.4 s: only when needed). None when none names it."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    try:
        return f"{top}=={version(top)}"
    except PackageNotFoundError:
        dists = packages_distributions().get(top)
        return " ".join(f"{d}=={version(d)}" for d in sorted(dists)) if dists else None


def _file_digest(path: str) -> str:
    try:
        st = os.stat(path)
        return _content_digest(path, st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise Unkeyable(f"source {path} cannot be read: {e}") from e


@functools.lru_cache(maxsize=4096)
def _content_digest(path: str, mtime_ns: int, size: int) -> str:  # read again once the file changes
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]
