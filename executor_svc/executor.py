"""Executor stage: load a Bundle and its weights into a session, run it.

The bundle's kernel modules (named by their content's hash) and its entry module are written
to the kernel cache and imported from there, so numba caches their machine code on disk: a
warm start compiles nothing, and a kernel shared by several bundles compiles once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from kiln.cas.digest import Digest
from kiln.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kiln.ir.dtypes import DType
from kiln.ir.graph import TensorSpec
from kiln.ir.evaluate import evaluate
from kiln.ir.serialize import dim_from_pb, dtype_from_pb, graph_from_pb, tensor_spec_from_pb
from kiln.ir.kernel import kernel_named_by_content
from kiln.ir.shape import Dim, Sym, evaluate_dim, format_shape, numel
from kiln.core import progress as live
from kiln.core.limits import CpuLoad, memory_limit, positive_setting
from kiln.core.localcache import evict_kernels, kernel_cache_cap, kernel_cache_dir
from kiln.cas.store import BlobStore
from kiln.core.telemetry import child_span, span, start_span, untraced
from executor_svc.precompile import kernel_signatures, precompile
from kiln.v1 import ir_pb2

log = logging.getLogger(__name__)

MAX_SESSIONS = 64  # least recently used sessions beyond this are evicted
# a session's first runs call its compiled kernels from its entry's Python function; the compiled
# entry, which numba builds by linking every kernel into it and optimizing and emitting the whole
# again (5-6 s for a 2-layer GPT-2's 93 kernel calls whose kernels were compiled already), runs
# from the next one on. A program run once or twice (a check after a compile, a calibration) never
# waits for it; Python between kernels costs about 1-2 us per kernel call until then. After the
# HOST_RUNS-th run a background thread builds it while runs go on from Python: concurrent callers
# never queue behind the build (32 load-test clients missed their deadline when the third run
# built it under the session's lock), and the first run after the build uses it.
HOST_RUNS = 2


def cuda_device():
    """numba.cuda, when this process has a CUDA device (or numba's simulator: NUMBA_ENABLE_CUDASIM=1)."""
    from numba import cuda

    if not cuda.is_available():
        raise FailedPrecondition("the bundle targets cuda and this executor has no CUDA device "
                                 "(NUMBA_ENABLE_CUDASIM=1 runs numba's simulator)")
    return cuda


# target -> the device a session of its bundles runs on (None: this host's CPUs)
DEVICES = {"cpu": lambda: None, "cuda": cuda_device}


@dataclass(frozen=True)
class MemoryNeed:
    """What one run of a session holds (weights, memory-plan slots, inputs and outputs), in bytes:
    a polynomial over the bundle's symbols, evaluated per run when symbols size it."""
    bytes: Dim

    @staticmethod
    def of(bundle) -> "MemoryNeed":
        total: Dim = bundle.memory.arena_bytes
        for s in bundle.memory.slots if not bundle.memory.arena_bytes else ():
            total = dtype_from_pb(s.dtype).itemsize * dim_from_pb(s.elements) + total
        for t in (*bundle.weights, *bundle.inputs, *bundle.outputs):
            spec = tensor_spec_from_pb(t)
            total = spec.dtype.itemsize * numel(spec.shape) + total
        return MemoryNeed(total)

    def check(self, env: Mapping[str, int], what: str) -> None:
        """RESOURCE_EXHAUSTED past the per-session budget (KILN_SESSION_MEMORY_MB, default half the machine)."""
        need, budget = evaluate_dim(self.bytes, env), memory_limit("KILN_SESSION_MEMORY_MB", 0.5)
        if need > budget:
            raise ResourceExhausted(f"{what} needs {need / (1 << 20):.1f} MiB (weights, inputs, intermediates and "
                                    f"outputs), over this executor's per-session budget of "
                                    f"{budget / (1 << 20):.1f} MiB (KILN_SESSION_MEMORY_MB)")


_import_lock = threading.Lock()
_written = 0  # bytes of modules written since the cache's size was last checked


def load_module(name: str, source: str, subdir: str):
    """Import generated source as module `name` from the kernel cache, writing the file first
    when absent. A file is written once and never replaced (its name is its content's hash),
    so numba's disk cache of it stays valid across processes; concurrent writers race safely
    (each links a complete temporary file; the first wins, the rest find it). Each import marks
    the file used; the cache is kept under its cap, least recently used modules first
    (kiln.core.localcache)."""
    global _written
    with _import_lock:
        if name in sys.modules:
            return sys.modules[name]
        root = kernel_cache_dir()
        d = root / subdir
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{name}.py"
        if path.exists():
            os.utime(path)
        else:
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".py")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(source)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            finally:
                os.unlink(tmp)
            _written += len(source)
            cap = kernel_cache_cap()
            if _written > cap // 50:  # a check walks the cache: now and then, not per module
                _written = 0
                evict_kernels(root, {n for n in sys.modules if n.startswith("kiln_")}, cap)
        if path.read_text() != source:
            raise InvalidArgument(f"kernel cache file {path} does not hold the source its name promises; "
                                  "remove it (the cache is corrupt)")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # numba's disk cache finds the module by name
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
        return mod


def load_bundle_module(bundle_d: Digest, bundle):
    """The bundle's entry module, its kernel modules imported first."""
    for k in bundle.kernels:  # a wrong name would poison every bundle sharing the kernel
        if not kernel_named_by_content(k.symbol, k.source):
            raise InvalidArgument(f"bundle {bundle_d}: kernel {k.name!r} is not named by its source's hash")
    for k in bundle.kernels:
        load_module("kiln_" + k.symbol, k.source, "k")
    return load_module(f"kiln_bundle_{bundle_d.hash[:24]}", bundle.module_source, "b")


_blas_limited = False


def single_threaded_blas() -> None:
    """Run the BLAS that kernels call (SciPy's, through numba's np.dot) on one thread.

    Kernels parallelize with numba's OpenMP pool; a multi-threaded BLAS beside it puts two
    spinning pools on the same cores, and a parallel loop right after a GEMM then waits for
    BLAS threads still spinning: measured here, a prange reduction and a small np.dot in turn
    took 8.7 ms a pair instead of 0.09 ms. Large GEMMs are split across numba's pool instead
    (codegen's parallel GEMM). Only SciPy's BLAS is limited, when it can be told apart; the
    numpy and torch of the calling process keep theirs."""
    global _blas_limited
    with _import_lock:
        if _blas_limited:
            return
        import scipy
        import scipy.linalg.cython_blas  # noqa: F401  (loads the library)
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().select(user_api="blas").lib_controllers
        scipy_dir = Path(scipy.__file__).resolve().parent.parent
        own = [lib for lib in libs if Path(lib.filepath).resolve().is_relative_to(scipy_dir)
               and "numpy" not in Path(lib.filepath).parent.name]
        for lib in own or libs:
            lib.set_num_threads(1)
        _blas_limited = True


_pool_started = False


def start_pool() -> None:
    """Start numba's thread pool, leaving torch's as it was.

    numba's OpenMP layer calls its runtime's omp_set_num_threads(NUMBA_NUM_THREADS) when it starts
    its pool, on the calling thread. In a process that has imported torch, that runtime is
    torch's libgomp (one runtime serves both: torch loads it into the global namespace, and a
    libgomp loaded before torch is reused by soname), so the call resized torch's intra-op pool
    to numba's count: measured here, torch at 2 threads with numba at 1 fell to 1 thread after
    kiln's first parallel run. By default numba takes every logical CPU and torch every physical
    core, so on an SMT machine torch's pool doubled. This restores torch's thread count right
    after numba's pool starts."""
    global _pool_started
    with _import_lock:
        if _pool_started:
            return
        import numba

        torch = sys.modules.get("torch")
        torch_threads = torch.get_num_threads() if torch is not None else None
        numba.get_num_threads()  # starts the pool (numba.np.ufunc.parallel._launch_threads)
        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        _pool_started = True


def pool_threads() -> np.int64:
    """numba's pool size, the entry's last argument (GEMMs split their rows by it); the first
    call starts the pool (start_pool)."""
    import numba

    if not _pool_started:
        start_pool()
    return np.int64(numba.get_num_threads())


@dataclass
class Session:
    id: str
    bundle: Digest
    entry: object
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: tuple[np.ndarray, ...]
    lock: threading.Lock
    symbols: tuple[tuple[str, int, int], ...] = ()
    memory: Optional[MemoryNeed] = None  # checked per run when symbols size it
    device: object = None  # numba.cuda for a cuda bundle (weights live on the device), else None
    host: object = None  # the entry's Python function (a cuda entry is one already): see HOST_RUNS
    host_only: bool = False  # every run from Python (timing candidates)
    runs: int = 0
    built: Optional[threading.Event] = None  # set once the compiled entry is built (see HOST_RUNS)
    build: Optional[threading.Thread] = None  # the thread building it, once started

    def start_build(self, args: Sequence) -> None:
        """Build the compiled entry for these arguments' types in a background thread (once); a
        failed build is logged and leaves every run on the Python entry, whose results are the same."""
        if self.build is not None:
            return
        types = tuple(self.entry.typeof_pyval(a) for a in args)

        def build():
            try:
                with span("executor.build_entry", **{"kiln.session": self.id, "kiln.bundle": str(self.bundle)}):
                    self.entry.compile(types)
            except Exception:  # noqa: BLE001 - the Python entry keeps serving; say why once
                log.exception("session %s: building the compiled entry failed; its runs stay on the "
                              "kernels called from Python", self.id)
                return
            self.built.set()

        self.build = threading.Thread(target=build, name=f"kiln-entry-{self.id[:12]}", daemon=True)
        self.build.start()

    def __post_init__(self):
        if self.built is None:
            self.built = threading.Event()
            if self.host is None or self.host is self.entry:  # nothing to build (a cuda entry)
                self.host = self.entry
                self.built.set()
        # a signature without symbols or 16-bit floats is checked and returned by plain
        # comparisons (run_session's fast path; anything else goes through check_inputs)
        def static(specs):
            if self.symbols or any(t.dtype.is_half or not all(isinstance(d, int) for d in t.shape) for t in specs):
                return None
            return tuple((t.name, np.dtype(t.dtype.numpy), tuple(t.shape)) for t in specs)

        self.static_inputs = static(self.inputs)
        self.static_outputs = static(self.outputs)


def prepare_weights(bundle, read) -> dict[str, np.ndarray]:
    """The derived weights of the bundle's prepare graph (optimizer_svc/fold.py), computed from
    the model's weights that `read` returns."""
    try:
        prepare = graph_from_pb(bundle.prepare)
    except ValueError as e:
        raise InvalidArgument(f"bundle's prepare graph is malformed: {e}") from e
    if prepare.inputs or prepare.symbols:
        raise InvalidArgument("bundle's prepare graph reads more than weights")
    with child_span("executor.prepare", **{"kiln.derived_weights": len(prepare.outputs)}):
        given = {t.name: read(t).reshape(t.shape) for t in prepare.weights}
        outs = evaluate(prepare, {}, given)
    return dict(zip(prepare.output_names, outs))


def session_id(bundle: Digest, manifest: Digest) -> str:
    """A session id names what it runs (so any executor replica can serve it, loading the
    bundle and weights from the store on first use) plus a nonce (so two Loads are two sessions)."""
    return f"{bundle.hash}-{bundle.size_bytes}-{manifest.hash}-{manifest.size_bytes}-{uuid.uuid4().hex[:16]}"


def parse_session_id(sid: str) -> Optional[tuple[Digest, Digest]]:
    parts = sid.split("-")
    if len(parts) != 5 or not all(len(parts[i]) == 64 for i in (0, 2)):
        return None
    try:
        if not all(c in "0123456789abcdef" for c in parts[0] + parts[2]):
            return None
        return Digest(parts[0], int(parts[1])), Digest(parts[2], int(parts[3]))
    except ValueError:
        return None


class Executor:
    def __init__(self, store: BlobStore):
        self.store = store
        single_threaded_blas()
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        # weights by blob digest, shared by every session that binds them (a causal LM's
        # prefill and decode programs): held while some session holds them
        self._weights: "weakref.WeakValueDictionary[str, np.ndarray]" = weakref.WeakValueDictionary()
        self._batchers: dict[Digest, object] = {}

    def open(self, bundle_d: Digest, manifest_d: Digest, sid: Optional[str] = None,
             host_only: bool = False) -> Session:
        """A session for the bundle with its weights bound, not yet registered; with host_only
        its compiled entry is never built (see HOST_RUNS)."""
        with span("executor.load", **{"kiln.bundle": str(bundle_d), "kiln.manifest": str(manifest_d)}):
            bundle = self.store.get_message(bundle_d, ir_pb2.Bundle)
            open_device = DEVICES.get(bundle.target)
            if open_device is None:
                raise FailedPrecondition(f"bundle {bundle_d} targets {bundle.target!r}; this executor runs "
                                         f"{' and '.join(DEVICES)}")
            device = open_device()
            try:
                memory = MemoryNeed.of(bundle)
            except ValueError as e:
                raise InvalidArgument(f"bundle {bundle_d} is malformed: {e}") from e
            # before any weight is read: the smallest run this session could do must fit
            memory.check({s.name: s.min for s in bundle.symbols}, f"bundle {bundle_d}")
            manifest = self.store.get_message(manifest_d, ir_pb2.WeightManifest)
            entries = {w.name: w for w in manifest.weights}

            def entry(spec: TensorSpec):
                e = entries.get(spec.name)
                if e is None:
                    raise InvalidArgument(f"manifest {manifest_d} has no weight {spec.name!r} that the bundle binds")
                if tuple(e.shape) != tuple(spec.shape) or dtype_from_pb(e.dtype) is not spec.dtype:
                    raise InvalidArgument(f"weight {spec.name!r}: manifest has {list(e.shape)}, bundle expects "
                                          f"{spec.dtype.value}{format_shape(spec.shape)}")
                return e

            def read(spec: TensorSpec) -> np.ndarray:
                return np.frombuffer(self.store.get(Digest.from_pb(entry(spec).digest)), dtype=spec.dtype.numpy)

            def bound(spec: TensorSpec) -> np.ndarray:  # the kernels' array, shared by digest
                key = f"{entry(spec).digest.hash}/{spec.dtype.value}"
                with self._lock:
                    a = self._weights.get(key)
                if a is None:
                    a = kernel_array(read(spec).copy())
                    with self._lock:
                        a = self._weights.setdefault(key, a)
                return a

            derived = self._derived_weights(bundle, manifest_d, read)
            weights = []
            for t in bundle.weights:
                spec = tensor_spec_from_pb(t)
                if spec.name in derived:
                    w = derived[spec.name]
                    want = np.dtype(np.uint16 if spec.dtype.is_half else spec.dtype.numpy)
                    if w.size != evaluate_dim(numel(spec.shape), {}) or w.dtype != want:
                        raise InvalidArgument(f"bundle's prepare graph makes {spec.name!r} as {w.dtype}"
                                              f"[{w.size}], the program reads {spec.dtype.value}"
                                              f"{format_shape(spec.shape)}")
                    weights.append(w)
                else:
                    weights.append(bound(spec))
            if device is not None:  # uploaded once; every run of the session reads them there
                weights = [device.to_device(w) for w in weights]
            fn = getattr(load_bundle_module(bundle_d, bundle), bundle.entry)
            return Session(sid or session_id(bundle_d, manifest_d), bundle_d, fn,
                           tuple(tensor_spec_from_pb(t) for t in bundle.inputs),
                           tuple(tensor_spec_from_pb(t) for t in bundle.outputs),
                           tuple(weights), threading.Lock(),
                           tuple((s.name, s.min, s.max) for s in bundle.symbols),
                           memory if bundle.symbols else None, device, getattr(fn, "py_func", fn), host_only)

    def _derived_weights(self, bundle, manifest_d: Digest, read) -> dict[str, np.ndarray]:
        """The bundle's derived weights (its prepare graph over the manifest's weights) as the
        kernels take them, shared by every session whose bundle has the same prepare graph over
        the same weights: a compile's candidates are hoisted from one program, so 8 of them hold
        one copy, not 8."""
        if not bundle.HasField("prepare"):
            return {}
        key = f"prepare/{hashlib.sha256(bundle.prepare.SerializeToString()).hexdigest()}/{manifest_d.hash}"
        names = list(bundle.prepare.output_names)
        with self._lock:
            held = {n: self._weights.get(f"{key}/{n}") for n in names}
        if names and all(a is not None for a in held.values()):
            return held
        out = {}
        for name, w in prepare_weights(bundle, read).items():
            a = kernel_array(np.ascontiguousarray(w).reshape(-1).copy())
            with self._lock:
                out[name] = self._weights.setdefault(f"{key}/{name}", a)
        return out

    def load(self, bundle_d: Digest, manifest_d: Digest) -> str:
        s = self.open(bundle_d, manifest_d)
        self.register(s)
        return s.id

    def register(self, s: Session) -> None:
        with self._lock:
            while len(self.sessions) >= MAX_SESSIONS:
                # evict the least recently used; its client gets NOT_FOUND and loads again
                self.sessions.pop(next(iter(self.sessions)))
            self.sessions[s.id] = s

    def session(self, sid: str) -> Session:
        with self._lock:
            s = self.sessions.pop(sid, None)
            if s is not None:
                self.sessions[sid] = s  # most recently used last
                return s
        # loaded on another replica, evicted here, or from before a restart: the id names its
        # bundle and weights, so this executor loads them from the store under the same id
        parsed = parse_session_id(sid)
        if parsed is None:
            raise NotFound(f"no session {sid!r}: not an id that Executor.Load gave")
        try:
            s = self.open(*parsed, sid=sid)
        except NotFound as e:
            raise NotFound(f"session {sid!r} cannot be loaded here: {e}") from e
        self.register(s)
        return s

    def run(self, sid: str, inputs: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
        return self.run_session(self.session(sid), inputs)

    def run_session(self, s: Session, inputs: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
        args, sym_args, env = _static_args(s.static_inputs, inputs), (), {}  # static: no symbols to bind
        if args is None:
            args, env = check_inputs(s.inputs, inputs, s.symbols)
            sym_args = [np.int64(env[name]) for name, _, _ in s.symbols]
            if s.memory is not None:
                s.memory.check(env, "a run with " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
        with child_span("executor.run", **{"kiln.session": s.id, "kiln.bundle": str(s.bundle)}):
            with s.lock:  # buffers in the entry are per call, but numba's first call compiles
                if s.device is not None:
                    args = [s.device.to_device(np.ascontiguousarray(a)) for a in args]
                compiled = s.built.is_set() and not s.host_only
                s.runs += 1
                call = (*args, *s.weights, *sym_args, pool_threads())
                try:
                    outs = (s.entry if compiled else s.host)(*call)
                except IndexError as e:  # raised by generated Gather/Scatter bounds checks
                    raise InvalidArgument(f"an input holds an out-of-range index: {e}") from e
                if not compiled and not s.host_only and s.runs >= HOST_RUNS:
                    s.start_build(call)
                if s.device is not None:
                    outs = [o.copy_to_host() for o in outs]
        if s.static_outputs is not None:
            return [(name, (o if o.dtype == dtype else o.view(dtype)).reshape(shape))
                    for (name, dtype, shape), o in zip(s.static_outputs, outs)]
        return [(spec.name, np.asarray(o).view(spec.dtype.numpy).reshape(tuple(evaluate_dim(d, env) for d in spec.shape)))
                for spec, o in zip(s.outputs, outs)]


    def wait_compiled(self, timeout: Optional[float] = None) -> bool:
        """Wait until every compiled entry whose build has started is built (benchmarks call this
        after warm-up runs, so that their timed runs all use it); False when one is not by then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            sessions = list(self.sessions.values())
            sessions += [s for b in self._batchers.values() for s in (b.prefill, b.decode)]
        for s in sessions:
            if s.build is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                s.build.join(left)
                if not s.built.is_set():
                    return False
        return True

    def batcher(self, lm_d: Digest):
        """The Batcher serving the CausalLM `lm_d` (executor_svc/generate.py): its prefill and
        decode programs loaded once, over one set of weights."""
        from executor_svc.generate import Batcher, max_sequences_setting
        from kiln.v1 import services_pb2

        with self._lock:
            b = self._batchers.get(lm_d)
        if b is not None:
            return b
        with span("executor.load_lm", **{"kiln.model": str(lm_d)}):
            lm = self.store.get_message(lm_d, services_pb2.CausalLM)
            if not (lm.layers > 0 and lm.max_context > 1 and lm.max_batch > 0 and lm.vocab_size > 0):
                raise InvalidArgument(f"{lm_d} is not a CausalLM (layers, context, batch and vocabulary must be set)")
            prefill = self.open(Digest.from_pb(lm.prefill_bundle), Digest.from_pb(lm.prefill_manifest))
            decode = self.open(Digest.from_pb(lm.decode_bundle), Digest.from_pb(lm.decode_manifest))
            want = 1 + 2 * lm.layers
            for name, s in (("prefill", prefill), ("decode", decode)):
                if len(s.outputs) != want:
                    raise InvalidArgument(f"{lm_d}: its {name} program has {len(s.outputs)} outputs; a model of "
                                          f"{lm.layers} layers has logits and {2 * lm.layers} cache tensors")
            b = Batcher(lm, prefill, decode, self.run_session, max_sequences_setting(lm.max_batch))
        with self._lock:
            return self._batchers.setdefault(lm_d, b)

    def profile(self, bundles: Sequence[Digest], manifest: Digest, repeats: int = 20,
                symbols: Mapping[str, int] | None = None) -> list[tuple[Digest, float, float, float, float]]:
        """Time each candidate bundle on the same random inputs: (bundle, median s, min s,
        relative, others' share of the machine while it was timed; see paired_ratios and
        others_busy). Runs are interleaved round-robin, so every candidate sees the same machine
        state, and each timed run comes right after one of the same candidate, so it starts from
        its own cache state. A candidate that has clearly lost stops being timed (still_timed):
        its figures are over the rounds it was timed in (halvings come every DROP_AFTER_ROUNDS
        rounds, or every round for candidates that run long: LONG_RUN_S). The first round's
        untimed runs are the warm-up: they load the kernels (or compile those not compiled by
        then). Timing stops after `repeats` rounds, or earlier: once at most two candidates are
        left and each has been timed in FINAL_ROUNDS rounds (decided), or once it has run for
        profile_budget() seconds and every candidate has been ranked.

        Every run calls the candidate's compiled kernels from its entry's Python function
        (host_only): a losing candidate never waits for a compiled entry (HOST_RUNS; 5-6 s each
        for a 2-layer GPT-2's programs, against 0.1 s to call their kernels from Python), and
        kernels that candidates share are compiled once. Python between kernels adds about
        1-2 us per kernel call, alike in every candidate with as many calls (and where there are
        fewer, they do cost less)."""
        if not bundles:
            raise InvalidArgument("Profile needs at least one bundle")
        if not 1 <= repeats <= 10_000:
            raise InvalidArgument(f"repeats must be in 1..10000, got {repeats}")
        profile_budget()  # a bad setting is refused before anything is loaded
        # private sessions: timing candidates never evicts a client's session
        sessions = [self.open(b, manifest, host_only=True) for b in bundles]
        first = sessions[0]
        env = {}
        for name, lo, hi in first.symbols:
            v = int((symbols or {}).get(name, hi))
            if not lo <= v <= hi:
                raise InvalidArgument(f"symbol {name!r} = {v} is outside its range [{lo}, {hi}]")
            env[name] = v
        inputs = random_inputs(first.inputs, env)
        for s in sessions[1:]:
            if s.inputs != first.inputs:
                raise InvalidArgument("Profile candidates must share one input signature")
        times: list[list[float]] = [[] for _ in sessions]
        with span("executor.profile", **{"kiln.candidates": len(sessions), "kiln.repeats": repeats}) as ps:
            if first.device is None:  # the candidates' new kernels, compiled at once in worker processes
                self._precompile(sessions, inputs)
            # one span per timed candidate; they overlap because the candidates are timed interleaved
            candidate_spans = [start_span("executor.candidate", **{"kiln.bundle": str(b), "kiln.candidate": i})
                               for i, b in enumerate(bundles)]
            with untraced(), _counting_compiles(sessions) as recount:
                load = CpuLoad()
                paired = True  # the first round always is: its untimed runs load (or compile) the kernels
                timing = list(range(len(sessions)))
                # rounds between halvings (still_timed), and before the budget may stop timing
                every = MIN_ROUNDS
                budget, began, rounds, stopped = profile_budget(), time.monotonic(), 0, "repeats"
                for r in range(repeats):
                    if r >= every and time.monotonic() - began > budget:
                        stopped = "budget"  # every candidate has been ranked; the survivors have had their share
                        break
                    if r and r % every == 0:
                        timing = still_timed(times, timing)
                    if len(timing) <= 2 and r >= FINAL_ROUNDS:
                        stopped = "decided"  # the last two have met in FINAL_ROUNDS rounds
                        break
                    live.count("candidates timed, round", r + 1, repeats)
                    rounds = r + 1
                    for i in timing:
                        s = sessions[i]
                        # each timed run follows an untimed one of its own: a candidate is timed in
                        # the cache state its own run leaves, as when a model runs again and again,
                        # never in the state the candidate before it left (one that streams more
                        # memory evicted the next one's input: 0.76 ms vs 0.15 ms for one bundle);
                        # candidates that all run long are not (see PAIR_BELOW_S)
                        if paired:
                            self.run_session(s, inputs)
                            if r == 0:
                                recount()
                        t0 = time.perf_counter()
                        self.run_session(s, inputs)
                        times[i].append(time.perf_counter() - t0)
                    if r == 0:
                        shortest = min(t[0] for t in times)
                        paired = shortest < PAIR_BELOW_S
                        every = 1 if shortest >= LONG_RUN_S else every
                others = load.others_busy()
            relative = paired_ratios(times)
            ps.set_attribute("kiln.rounds", rounds)
            ps.set_attribute("kiln.stopped", stopped)  # repeats, decided, or budget (profile_budget())
            ps.set_attribute("kiln.over_budget", stopped == "budget")
            for cs, t, rel in zip(candidate_spans, times, relative):
                cs.set_attribute("kiln.median_ms", statistics.median(t) * 1e3)
                cs.set_attribute("kiln.min_ms", min(t) * 1e3)
                cs.set_attribute("kiln.relative", rel)
                cs.set_attribute("kiln.rounds", len(t))
                cs.set_attribute("kiln.paired", paired)  # timed after an untimed run of its own
                cs.set_attribute("kiln.others_busy", others)
                cs.end()
        return [(b, statistics.median(t), min(t), rel, others) for b, t, rel in zip(bundles, times, relative)]

    def _precompile(self, sessions: Sequence[Session], inputs: Sequence[tuple[str, np.ndarray]]) -> None:
        """Every kernel the sessions call, for the argument types these inputs give it, compiled
        in worker processes before the first timed run (executor_svc/precompile.py)."""
        signatures: dict = {}
        args, env = check_inputs(sessions[0].inputs, inputs, sessions[0].symbols)  # one signature (profile checks)
        rest = (*[np.int64(env[n]) for n, _, _ in sessions[0].symbols], pool_threads())
        for s in sessions:
            for name, (kernel, sigs) in kernel_signatures(s.host, (*args, *s.weights, *rest)).items():
                signatures.setdefault(name, (kernel, set()))[1].update(sigs)
        with span("executor.precompile", **{"kiln.kernels": len(signatures)}) as ps:
            ps.set_attribute("kiln.compiled_in_workers", precompile(signatures))


@contextlib.contextmanager
def _counting_compiles(sessions: Sequence[Session]):
    """Counts the sessions' kernels that numba has compiled (or loaded from its cache) into the
    shown progress as it goes: kernels compiled n/N. Yields a recount, for after each session."""
    from numba.core import event

    kernels = {n: f for s in sessions for n, f in getattr(s.host, "__globals__", {}).items() if n.startswith("k_")}

    def recount():
        live.count("kernels compiled", sum(1 for f in kernels.values() if getattr(f, "signatures", None)),
                   len(kernels))

    class Compiles(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            recount()

    recount()
    with event.install_listener("numba:compile", Compiles()):
        yield recount


def paired_ratios(times: Sequence[Sequence[float]]) -> list[float]:
    """Per candidate, the median over the rounds it was timed in of its time over the round's
    fastest time. A round times every candidate still timed back to back, so a machine that slows
    down for a while (another tenant, a lower clock) slows the whole round and the ratio stays. On
    a shared 2-core VM a BERT bundle ran 63 ms for nine of 30 rounds, then 75 ms: each median then
    sits in whichever phase most of its runs fell in, and with half the rounds in each it sits on
    the edge between them, where one run decides (test_candidates_are_ranked_by_paired_ratios_not_medians).
    A candidate no longer timed (still_timed) has fewer rounds: rounds are the first len(t)."""
    rounds = range(max(len(t) for t in times))
    fastest = [min(t[j] for t in times if j < len(t)) for j in rounds]
    return [statistics.median(t[j] / fastest[j] for j in range(len(t))) for t in times]


# Profile stops timing a candidate once it has clearly lost: every DROP_AFTER_ROUNDS rounds the
# slower half of the candidates still timed stop (down to two), except those within TIE of the
# best. 8 candidates over 20 rounds take 64 timed runs instead of 160; a real model's 8 ran
# 105-127 ms each here, 35 s of timing at every round.
DROP_AFTER_ROUNDS = 3
TIE = 0.01
# And it stops once it has timed for profile_budget() seconds, after MIN_ROUNDS rounds at least
# (every candidate timed in as many rounds as a halving takes): a causal LM's prefill at its
# longest context ran 0.3 s and more per run (a Qwen2-0.5B shape's about 2 s), 8 candidates over
# 20 rounds 20-70 s per program, growing with layers.
MIN_ROUNDS = DROP_AFTER_ROUNDS
PROFILE_BUDGET_S = 10.0
# Candidates whose runs all take LONG_RUN_S or more are halved after every round, not every
# DROP_AFTER_ROUNDS: one run of such a program is hundreds of kernel calls, and its noise a
# percent or two; three rounds of 8 candidates at a Qwen2-0.5B shape's 2 s prefill were 48 s.
LONG_RUN_S = 0.25
# Once at most two are left, they are compared over this many rounds and no more: 8 candidates
# are down to two after 6 rounds, and their paired ratios over those 6 rounds rank them. More
# rounds only separate two that are within a percent or two of each other (a MiniLM-shaped
# encoder's last two: 1.000 against 1.012 after 20 rounds, 1.8 s more of timing), which is
# less than this machine's noise over a compile.
FINAL_ROUNDS = 2 * DROP_AFTER_ROUNDS


def profile_budget() -> float:
    """KILN_PROFILE_BUDGET_S: seconds Profile times candidates for, past its first MIN_ROUNDS
    rounds (default PROFILE_BUDGET_S)."""
    return positive_setting("KILN_PROFILE_BUDGET_S", PROFILE_BUDGET_S, "seconds")

# A candidate's run is timed right after an untimed run of its own (Profile) unless, in the first
# round, every candidate's run took this long: a run of 50 ms streams far more than the caches
# hold (a MiniLM-shaped encoder 85 MB of weights; this machine's L3 is 32 MiB and refills from
# memory in about 3 ms), so the state the candidate before it left is gone within its first
# kernels. That halves the timing of a real model's candidates (20 s of a 74 s compile).
PAIR_BELOW_S = 0.05


def still_timed(times: Sequence[Sequence[float]], timing: Sequence[int]) -> list[int]:
    """The candidates (indices into times) that go on being timed: of those timed so far, the
    faster half by paired ratio, and any within TIE of the best; at least two."""
    if len(timing) <= 2:
        return list(timing)
    ratios = dict(zip(timing, paired_ratios([times[i] for i in timing])))
    ranked = sorted(timing, key=lambda i: (ratios[i], statistics.median(times[i])))
    best = ratios[ranked[0]]
    keep = max(2, (len(ranked) + 1) // 2)
    return sorted(ranked[:keep] + [i for i in ranked[keep:] if ratios[i] <= best * (1 + TIE)])


def random_inputs(specs: Sequence[TensorSpec], env: Mapping[str, int]) -> list[tuple[str, np.ndarray]]:
    """Inputs for timing: normal floats, zero indices (valid for any gather), all-true masks."""
    rng = np.random.default_rng(0)
    out = []
    for spec in specs:
        shape = tuple(evaluate_dim(d, env) for d in spec.shape)
        if spec.dtype.is_float:
            a = rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype.numpy)
        elif spec.dtype is DType.BOOL:
            a = np.ones(shape, dtype=np.bool_)
        else:
            a = np.zeros(shape, dtype=spec.dtype.numpy)
        out.append((spec.name, a))
    return out


def _static_args(static, inputs: Sequence[tuple[str, np.ndarray]]) -> Optional[list[np.ndarray]]:
    """The entry's input arrays when every input is exactly what a static signature wants
    (name or position, dtype, shape, C order); None sends the call through check_inputs."""
    if static is None or len(inputs) != len(static):
        return None
    out = []
    for (want_name, dtype, shape), (name, a) in zip(static, inputs):
        if (name and name != want_name) or type(a) is not np.ndarray or a.dtype != dtype or a.shape != shape \
                or not a.flags.c_contiguous:
            return None
        out.append(a.reshape(-1))
    return out


def kernel_array(a: np.ndarray) -> np.ndarray:
    """The array generated kernels take: flat, contiguous, 16-bit floats as their uint16 words."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(np.uint16) if DType.from_numpy(a.dtype).is_half else a


def check_inputs(specs: Sequence[TensorSpec], inputs: Sequence[tuple[str, np.ndarray]],
                 symbols: Sequence[tuple[str, int, int]] = ()) -> tuple[list[np.ndarray], dict[str, int]]:
    """Match inputs to the signature (by name, or by position when unnamed), bind the symbolic
    dims from their shapes; flat contiguous arrays and the bindings."""
    if len(inputs) != len(specs):
        raise InvalidArgument(f"expected {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(inputs)}")
    named = all(n for n, _ in inputs)
    by_name = dict(inputs) if named else {}
    out, arrays = [], []
    for i, spec in enumerate(specs):
        if named:
            if spec.name not in by_name:
                raise InvalidArgument(f"missing input {spec.name!r}; inputs are {', '.join(s.name for s in specs)}")
            a = by_name[spec.name]
        else:
            a = inputs[i][1]
        try:
            dt = DType.from_numpy(a.dtype)
        except ValueError:
            dt = None
        if dt is not spec.dtype:
            raise InvalidArgument(f"input {spec.name!r}: expected dtype {spec.dtype.value}, got {a.dtype}")
        if len(a.shape) != len(spec.shape):
            raise InvalidArgument(f"input {spec.name!r}: expected shape {format_shape(spec.shape)}, "
                                  f"got {list(a.shape)}")
        arrays.append((spec, a))
        out.append(kernel_array(a))
    env: dict[str, int] = {}
    for spec, a in arrays:  # a dim that is one symbol binds it
        for d, actual in zip(spec.shape, a.shape):
            if isinstance(d, Sym) and len(d.terms) == 1 and d.terms[0][1] == 1 and len(d.terms[0][0]) == 1:
                env.setdefault(d.terms[0][0][0], int(actual))
    ranges = {name: (lo, hi) for name, lo, hi in symbols}
    for name, value in env.items():
        lo, hi = ranges.get(name, (0, 1 << 62))
        if not lo <= value <= hi:
            raise InvalidArgument(f"dim {name} = {value} is outside the range the bundle was compiled for "
                                  f"[{lo}, {hi}]")
    for spec, a in arrays:
        try:
            want = tuple(evaluate_dim(d, env) for d in spec.shape)
        except KeyError:
            want = None
        if want != tuple(a.shape):
            raise InvalidArgument(f"input {spec.name!r}: expected shape {format_shape(spec.shape)}, "
                                  f"got {list(a.shape)}")
    return out, env
