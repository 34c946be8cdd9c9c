"""The kiln command line: compile, run, serve, show, generate, demo."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np


def _pipeline(args):
    from kiln.pipeline import Pipeline

    addrs = {}
    for s in ("importer", "optimizer", "codegen", "executor"):
        v = getattr(args, f"{s}_addr", None)
        if v:
            addrs[s] = v
    return Pipeline(args.store, addrs or None)


def cmd_compile(args) -> int:
    from kiln.cas.digest import Digest

    from kiln.hf import is_hf_directory

    p = _pipeline(args)
    path = Path(args.model)
    if is_hf_directory(path):
        program = p.upload_program(_load_model(args))
    elif path.is_file():
        program = p.store.put(path.read_bytes())  # the importer loads it safely, wherever it runs
    else:
        _load_model(args)  # raises the error that says what is expected
    from kiln.pipeline import default_candidates

    from kiln.core.progress import progress, stage

    candidates = args.candidates if args.candidates is not None else default_candidates()
    with progress(f"kiln compile {path.name}"):
        if args.predict or (candidates > 1 and not args.no_search):
            stage("calibrate")
            profile = p.calibrate(args.target)[0]
        else:
            profile = None
        r = p.compile_program(program, search=not args.no_search, target=args.target, target_profile=profile,
                              candidates=candidates)
    out = {"program": str(program), "graph": str(r.graph), "manifest": str(r.manifest),
           "kernel_graph": str(r.kernel_graph), "bundle": str(r.bundle), "kernels": r.kernels,
           "peak_bytes": r.peak_bytes, "search": r.report.stop_reason, "nodes_before": r.report.nodes_before,
           "nodes_after": r.report.nodes_after, "cost_before": r.report.cost_before,
           "cost_after": r.report.cost_after, "rules_fired": {c.rule: c.matches for c in r.report.rulesets}}
    if profile is not None:
        out["target_profile"] = str(profile)
        out["predicted_ms"] = r.report.predicted_s * 1e3
    if len(r.report.candidates) > 1:
        out["candidates"] = [{"schedule": c.schedule, "kernels": c.kernels, "predicted_ms": c.predicted_s * 1e3,
                              "measured_ms": c.measured_s * 1e3, "relative": c.relative, "chosen": c.chosen}
                             for c in r.report.candidates]
    print(json.dumps(out, indent=2))
    return 0


def _load_model(args):
    """An ExportedProgram from a .pt2 file or a Hugging Face directory, without running its code."""
    import torch

    from kiln.hf import is_hf_directory, load_hf_directory

    path = Path(args.model)
    if is_hf_directory(path):
        from kiln.hf import dynamic_shapes_for

        module, kwargs = load_hf_directory(path, batch=args.batch, seq_len=args.seq_len)
        dyn = None
        if getattr(args, "max_batch", None) or getattr(args, "max_seq_len", None):
            dyn = dynamic_shapes_for(kwargs, args.max_batch, args.max_seq_len)
        try:
            return torch.export.export(module, (), kwargs, dynamic_shapes=dyn, strict=False)
        except Exception as e:  # torch raises many types when a model cannot be exported
            from kiln.core.errors import FailedPrecondition

            raise FailedPrecondition(f"torch.export failed for {path}: {type(e).__name__}: {e}") from e
    if path.is_file():
        from importer_svc.safe_load import load_program

        return load_program(path.read_bytes())
    raise ValueError(f"{args.model}: expected a .pt2 file written by torch.export.save or a Hugging Face "
                     "directory (config.json + *.safetensors)")


def cmd_calibrate(args) -> int:
    from google.protobuf.json_format import MessageToDict

    d, profile = _pipeline(args).calibrate(args.target, force=args.force)
    print(json.dumps({"profile": str(d), **MessageToDict(profile)}, indent=2))
    return 0


def cmd_ops(args) -> int:
    from importer_svc.importer import required_ops

    uses = required_ops(_load_model(args))
    missing = [u for u in uses if not u.supported]
    width = max((len(u.op) for u in uses), default=10)
    for u in uses:
        print(f"{u.op:<{width}}  {u.count:>4}  {'ok' if u.supported else 'MISSING  first used at ' + u.first_use}")
    print(f"{len(uses)} ops, {len(missing)} missing")
    return 1 if missing else 0


def cmd_run(args) -> int:
    from kiln.cas.digest import Digest

    p = _pipeline(args)
    inputs = []
    for spec in args.input:
        name, _, file = spec.partition("=")
        if not file:
            print(f"kiln run: --input takes NAME=FILE.npy, got {spec!r}", file=sys.stderr)
            return 2
        inputs.append((name, np.load(file, allow_pickle=False)))
    session = p.load(Digest.parse(args.bundle), Digest.parse(args.manifest))
    outs = p.run(session, inputs)
    for name, a in outs:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            np.save(Path(args.out) / f"{name}.npy", a)
            print(f"{name}: {a.dtype}{list(a.shape)} -> {Path(args.out) / (name + '.npy')}")
        else:
            print(f"{name}: {a.dtype}{list(a.shape)}")
            print(np.array2string(a, threshold=50))
    return 0


def cmd_serve(args) -> int:
    from kiln.apps.serve import STAGES, serve
    from kiln.cas.store import open_store
    from kiln.core.metrics import serve_metrics
    from kiln.core.telemetry import setup_tracing
    from kiln.rpc.auth import AuthConfig

    stages = list(STAGES) if args.stage == "all" else [args.stage]
    flags = {"KILN_TLS_CERT": args.tls_cert, "KILN_TLS_KEY": args.tls_key, "KILN_TLS_CLIENT_CA": args.tls_client_ca,
             "KILN_AUTH_TOKEN_FILE": args.auth_token_file}
    auth = AuthConfig.from_env({**os.environ, **{k: v for k, v in flags.items() if v}})
    setup_tracing(f"kiln-{args.stage}")
    server, port = serve(stages, args.port, open_store(args.store), host=args.host, auth=auth)
    security = ("mTLS" if auth.client_ca else "TLS" if auth.cert else "plaintext") + \
        (", bearer token" if auth.tokens else "")
    print(f"kiln {args.stage} serving on {args.host}:{port} ({security})", flush=True)
    if args.metrics_port is not None:
        mport = serve_metrics(args.metrics_port, args.host)
        print(f"kiln {args.stage} metrics on http://{args.host}:{mport}/metrics", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
    return 0


def cmd_farm(args) -> int:
    from kiln.apps import farm

    if args.action == "down":
        n = farm.down(args.dir, purge=args.purge)
        kept = "deleted its store's data" if args.purge else f"kept its store's data ({args.dir}/s3; --purge deletes it)"
        print(f"farm in {args.dir}: stopped {n} processes, {kept}", file=sys.stderr)
        return 0
    env = dict(os.environ)
    if args.store:
        env["KILN_STORE"] = args.store
    f = farm.up({s: getattr(args, s) for s in farm.STAGES}, args.dir, env)
    for r in f.replicas:
        print(f"# {r.stage}[{r.index}] pid {r.pid} at {r.address}, log {f.dir / 'logs' / f'{r.stage}-{r.index}.log'}",
              file=sys.stderr)
    for k, v in f.client_env().items():
        print(f"{k}={v}")
    return 0


def cmd_show(args) -> int:
    from kiln.cas.digest import Digest
    from kiln.apps.show import show
    from kiln.cas.store import open_store

    print(show(open_store(args.store), Digest.parse(args.digest)))
    return 0


def cmd_trace(args) -> int:
    from kiln.apps import trace_view
    from kiln.core.telemetry import read_spans, trace_file

    path = Path(args.file).expanduser() if args.file else trace_file()
    spans = read_spans(path)
    if args.list:
        for t in trace_view.traces(spans):
            print(f"{t['trace_id']}  {t['root']:<28} {t['ms']:>10.1f} ms  {t['spans']:>4} spans  "
                  f"{','.join(t['services'])}")
        return 0
    chosen = trace_view.select(spans, args.trace_id)
    if args.html:
        Path(args.html).write_text(trace_view.render_html(chosen))
        print(f"wrote {args.html} (trace {chosen[0]['trace_id']}, {len(chosen)} spans)")
    else:
        print(trace_view.render_tree(chosen))
    return 0


def cmd_demo(args) -> int:
    from kiln.apps.demo import main

    return main(args)


def cmd_bench(args) -> int:
    from kiln.apps.bench import MODELS, bench, plot, report, write_json

    names = list(MODELS) if args.model == "all" else [args.model]
    results = []
    for name in names:
        r = bench(name, repeats=args.repeats, inductor=not args.no_inductor, pipeline=_pipeline(args),
                  start=args.start)
        print(report(r), flush=True)
        results.append(r)
    if args.json:
        write_json(results, args.json)
    if args.plot:
        plot(results, args.plot)
    return 0


def cmd_profile(args) -> int:
    """Per-kernel times of a bundle (by digest, with --manifest) or of a model compiled first."""
    from executor_svc.kernel_profile import kernel_times
    from kiln.cas.digest import Digest
    from kiln.v1 import ir_pb2

    p = _pipeline(args)
    if p.remote:
        print("kiln profile: times kernels in this process; unset the service addresses", file=sys.stderr)
        return 2
    from kiln.apps import bench

    path = Path(args.model)
    program = None
    if args.model in bench.MODELS and not path.exists():  # a benchmark model, built with random weights
        import torch

        program = p.upload_program(torch.export.export(*bench.build(args.model)))
    elif path.exists():
        from kiln.hf import is_hf_directory

        program = p.upload_program(_load_model(args)) if is_hf_directory(path) else p.store.put(path.read_bytes())
    elif not args.manifest:
        print("kiln profile: a bundle digest needs --manifest", file=sys.stderr)
        return 2
    if program is not None:
        r = p.compile_program(program)
        bundle_d, manifest_d = r.bundle, r.manifest
    else:
        bundle_d, manifest_d = Digest.parse(args.model), Digest.parse(args.manifest)
    ex = p.local_executor()
    session = ex.open(bundle_d, manifest_d)
    bundle = p.store.get_message(bundle_d, ir_pb2.Bundle)
    times, whole = kernel_times(session, bundle, args.repeats)
    total = sum(t.seconds for t in times)
    print(f"bundle {bundle_d}: {len(times)} kernels, median of {args.repeats} runs")
    print(f"{'kernel':<20} {'kind':<12} {'ms':>9} {'share':>7}")
    for t in sorted(times, key=lambda t: -t.seconds)[:args.top]:
        print(f"{t.name:<20} {t.kind:<12} {t.seconds * 1e3:9.4f} {100 * t.seconds / total:6.1f}%")
    print(f"sum of kernels {total * 1e3:.4f} ms (each timed from Python, a dispatch included); "
          f"compiled entry {whole * 1e3:.4f} ms")
    return 0


def cmd_generate(args) -> int:
    """Compile a causal LM directory for generation (cached: a second call does no stage work)
    and generate: new token ids on one line for --prompt-ids, text as it is made for --prompt."""
    from kiln.core.errors import InvalidArgument
    from kiln.llm import compile_causal_lm, load_tokenizer

    if (args.prompt is None) == (args.prompt_ids is None):
        raise InvalidArgument("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    tokenizer = None
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise InvalidArgument(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    else:
        tokenizer = load_tokenizer(args.model)
        prompt = tokenizer.encode(args.prompt).ids
    p = _pipeline(args)
    lm = compile_causal_lm(args.model, p, max_context=args.max_context, max_batch=args.max_batch)
    stops = [[int(t) for t in s.split(",")] for s in args.stop_ids]
    tokens = p.generate(lm, prompt, args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_sequences=stops)
    if tokenizer is None:
        print(" ".join(str(t) for t, _ in tokens))
        return 0
    made = []
    shown = ""
    for t, _ in tokens:  # decode the whole text each time: a token may complete a character
        made.append(t)
        text = tokenizer.decode(made)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    print()
    return 0


def cmd_serve_openai(args) -> int:
    from kiln.apps.openai_api import load_model, serve

    p = _pipeline(args)
    print(f"kiln serve-openai: compiling {args.model} for generation (max context {args.max_context}, "
          f"{args.max_batch} sequences at once); the port opens when it is done", file=sys.stderr, flush=True)
    model = load_model(p, args.model, args.max_context, args.max_batch, args.name)
    server = serve(p, model, args.port, args.host)
    host, port = server.server_address[:2]
    routes = "/v1/models, /v1/completions" + (", /v1/chat/completions" if model.chat_template else "")
    print(f"serving {model.name} at http://{host}:{port}/v1 ({routes})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from codegen_svc.targets import TARGETS

    ap = argparse.ArgumentParser(prog="kiln", description="kiln: an ahead-of-time search compiler for inference")
    ap.add_argument("--store", default=None, help="blob store URL (default $KILN_STORE or file://~/.cache/kiln)")
    for s in ("importer", "optimizer", "codegen", "executor"):
        ap.add_argument(f"--{s}-addr", default=None, help=f"{s} service address(es) (default $KILN_{s.upper()}_ADDR)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile a .pt2 program or a Hugging Face directory; prints the digests")
    c.add_argument("model", help="a .pt2 file, or a directory written by save_pretrained")
    c.add_argument("--batch", type=int, default=1, help="batch size of a Hugging Face model's example input")
    c.add_argument("--seq-len", type=int, default=16, help="sequence length of a Hugging Face model's example input")
    c.add_argument("--max-batch", type=int, default=None,
                   help="make the batch dim symbolic up to this size (Hugging Face directories)")
    c.add_argument("--max-seq-len", type=int, default=None,
                   help="make the sequence dim symbolic up to this length (Hugging Face directories)")
    c.add_argument("--no-search", action="store_true", help="skip equality saturation (one kernel per op)")
    c.add_argument("--target", default="cpu", choices=sorted(TARGETS),
                   help="cpu (numba) or cuda (numba.cuda kernels; the executor needs a device, or "
                   "NUMBA_ENABLE_CUDASIM=1)")
    c.add_argument("--predict", action="store_true",
                   help="calibrate the target (once per machine kind) and report the predicted run time")
    c.add_argument("--candidates", type=int, default=None,
                   help="schedule candidates to time on the executor, the fastest kept (default $KILN_CANDIDATES "
                        "or 8; 1: the cost model's pick, no timing); with several the target is calibrated first, "
                        "once per machine kind")
    c.set_defaults(fn=cmd_compile)
    cal = sub.add_parser("calibrate", help="measure the target's cost-model constants (GEMM rates, bandwidth, "
                                           "kernel overhead); kept in the store per target fingerprint")
    cal.add_argument("--target", default="cpu", choices=sorted(TARGETS))
    cal.add_argument("--force", action="store_true", help="measure again even if the store has a profile")
    cal.set_defaults(fn=cmd_calibrate)
    o = sub.add_parser("ops", help="list the ATen ops a model needs and which have no lowering (no compile)")
    o.add_argument("model", help="a .pt2 file, or a directory written by save_pretrained")
    o.add_argument("--batch", type=int, default=1)
    o.add_argument("--seq-len", type=int, default=16)
    o.set_defaults(fn=cmd_ops)
    r = sub.add_parser("run", help="run a compiled bundle on .npy inputs")
    r.add_argument("bundle")
    r.add_argument("--manifest", required=True)
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    r.add_argument("--out", default=None, help="directory to write outputs as .npy")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("serve", help="serve one stage, or all four on one port")
    s.add_argument("stage", choices=["importer", "optimizer", "codegen", "executor", "all"])
    s.add_argument("--port", type=int, default=int(os.environ.get("KILN_PORT", "50051")))
    s.add_argument("--host", default=os.environ.get("KILN_HOST", "127.0.0.1"),
                   help="address to bind (default $KILN_HOST or 127.0.0.1; 0.0.0.0 in a container)")
    metrics_port = os.environ.get("KILN_METRICS_PORT")
    s.add_argument("--metrics-port", type=int, default=int(metrics_port) if metrics_port else None,
                   help="serve Prometheus /metrics over HTTP on this port (default $KILN_METRICS_PORT; unset: off)")
    s.add_argument("--tls-cert", help="server certificate chain, PEM (default $KILN_TLS_CERT; unset: plaintext)")
    s.add_argument("--tls-key", help="its private key, PEM (default $KILN_TLS_KEY)")
    s.add_argument("--tls-client-ca", help="require client certificates signed by this CA: mTLS "
                   "(default $KILN_TLS_CLIENT_CA)")
    s.add_argument("--auth-token-file", help="accepted bearer tokens, one per line (default $KILN_AUTH_TOKEN_FILE "
                   "or the token in $KILN_AUTH_TOKEN; unset: no token check)")
    s.set_defaults(fn=cmd_serve)
    fa = sub.add_parser("farm", help="start (up) or stop (down) a local farm of server processes over one S3 store; "
                                     "up prints the KILN_* settings that point a client at it")
    fa.add_argument("action", choices=["up", "down"])
    for st, n in (("importer", 1), ("optimizer", 1), ("codegen", 1), ("executor", 1)):
        fa.add_argument(f"--{st}", type=int, default=n, help=f"{st} replicas (default {n})")
    fa.add_argument("--dir", default=os.environ.get("KILN_FARM_DIR", "~/.cache/kiln/farm"),
                    help="where the farm keeps its state, logs and S3 data (default $KILN_FARM_DIR or "
                         "~/.cache/kiln/farm)")
    fa.add_argument("--purge", action="store_true", help="with down: delete the farm's S3 data too")
    fa.set_defaults(fn=cmd_farm)
    sh = sub.add_parser("show", help="print a graph, kernel graph, bundle or manifest by digest")
    sh.add_argument("digest")
    sh.set_defaults(fn=cmd_show)
    tr = sub.add_parser("trace", help="print a recorded trace as a tree with durations (the latest by default), "
                        "or write it as an HTML timeline")
    tr.add_argument("trace_id", nargs="?", help="a trace id or a unique prefix of one (default: the latest)")
    tr.add_argument("--html", metavar="FILE", help="write a self-contained timeline page instead")
    tr.add_argument("--list", action="store_true", help="list the recorded traces")
    tr.add_argument("--file", help="the OTLP JSON lines file (default $KILN_TRACE_FILE or traces.jsonl in "
                                   "$KILN_CACHE_DIR, beside the store)")
    tr.set_defaults(fn=cmd_trace)
    pr = sub.add_parser("profile", help="time each kernel of a bundle, or of a model compiled first")
    pr.add_argument("model", help="a .pt2 file, a Hugging Face directory, a kiln bench model name, or a bundle "
                    "digest (with --manifest)")
    pr.add_argument("--manifest", default=None, help="the weight manifest digest, for a bundle digest")
    pr.add_argument("--repeats", type=int, default=20)
    pr.add_argument("--top", type=int, default=1 << 30, help="show only the N slowest kernels")
    pr.add_argument("--batch", type=int, default=1, help="batch size of a Hugging Face model's example input")
    pr.add_argument("--seq-len", type=int, default=16, help="sequence length of a Hugging Face model's example input")
    pr.set_defaults(fn=cmd_profile)
    b = sub.add_parser("bench", help="kiln vs torch eager vs torch.compile: latency, error, peak memory")
    b.add_argument("model", choices=["mlp", "llama-seq1", "llama-seq128", "bert", "resnet", "all"])
    b.add_argument("--repeats", type=int, default=20, help="timed calls of each, interleaved (median)")
    b.add_argument("--json", default=None, help="write the results as JSON")
    b.add_argument("--plot", default=None, help="write a PNG bar chart")
    b.add_argument("--no-inductor", action="store_true", help="skip torch.compile (it compiles for minutes)")
    b.add_argument("--start", action="store_true", help="also time cold and warm start: a new process loading "
                   "the bundle, from Load to its first result, with an empty and then a filled kernel cache")
    b.set_defaults(fn=cmd_bench)
    gen = sub.add_parser("generate", help="generate from a causal LM directory (compiled for prefill and decode "
                                          "first, cached)")
    gen.add_argument("model", help="a directory written by save_pretrained (config.json, *.safetensors)")
    gen.add_argument("--prompt", default=None, help="text, tokenized with the directory's tokenizer.json")
    gen.add_argument("--prompt-ids", default=None, help="token ids, comma-separated; prints the new ids")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (the same as --temperature 0)")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0, help="sampling is reproducible for a seed")
    gen.add_argument("--stop-ids", action="append", default=[], metavar="1,2",
                     help="stop after this token sequence (repeatable)")
    gen.add_argument("--max-context", type=int, default=256, help="prompt and new tokens together")
    gen.add_argument("--max-batch", type=int, default=16, help="sequences one decode step can take")
    gen.set_defaults(fn=cmd_generate)
    oa = sub.add_parser("serve-openai", help="an OpenAI-compatible HTTP endpoint (/v1/completions, "
                                             "/v1/chat/completions, /v1/models) for a causal LM directory")
    oa.add_argument("model", help="a directory written by save_pretrained, with tokenizer.json")
    oa.add_argument("--port", type=int, default=8000)
    oa.add_argument("--host", default="127.0.0.1")
    oa.add_argument("--name", default="", help="the model's id in the API (default: the directory's name)")
    oa.add_argument("--max-context", type=int, default=256, help="prompt and new tokens together")
    oa.add_argument("--max-batch", type=int, default=16, help="sequences one decode step can take")
    oa.set_defaults(fn=cmd_serve_openai)
    d = sub.add_parser("demo", help="compile the example encoder and compare it with torch eager")
    d.add_argument("--repeats", type=int, default=50)
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> int:
    from kiln.core.errors import KilnError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KilnError as e:
        print(f"kiln {args.cmd}: {e.code}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"kiln {args.cmd}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped reading (`kiln trace | head`): nothing went wrong here
        # the interpreter flushes stdout again at exit; that write must not fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
