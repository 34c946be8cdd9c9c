"""End to end, in process and over gRPC with the S3 store: outputs match torch eager."""

import threading

import grpc

import numpy as np
import pytest
import torch

import kiln
from kiln.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kiln.apps.examples import encoder_example, mlp_example, resnet_example


@pytest.mark.parametrize("example", [mlp_example, encoder_example], ids=["mlp", "encoder"])
def test_model_matches_eager(pipeline, example):
    model, inputs = example()
    compiled = kiln.compile(model, inputs, pipeline=pipeline)
    with torch.no_grad():
        ref = model(*inputs)
    out = compiled(*inputs)
    assert isinstance(out, torch.Tensor) and out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5), (out - ref).abs().max()
    # new inputs of the same shape, same bundle
    x2 = torch.randn_like(inputs[0])
    with torch.no_grad():
        assert torch.allclose(compiled(x2), model(x2), rtol=1e-4, atol=1e-5)


def test_kernel_graph_fuses_and_finds_gemms(local_pipeline):
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import ir_pb2

    model, inputs = mlp_example()
    compiled = kiln.compile(model, inputs, pipeline=local_pipeline, candidates=1)  # the default schedule
    kg = kernel_graph_from_pb(local_pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    kinds = [k.kind for k in kg.kernels]
    assert kinds.count("gemm") == 2  # fc1 and fc2, each a broadcast Mul + SumReduce
    # the bias add after each GEMM and the GELU polynomial are fused into loop nests
    compute = sum(1 for n in kg.graph.nodes if n.op.value not in ("Input", "Weight", "Constant", "View"))
    assert len(kg.kernels) <= compute // 2
    assert torch.allclose(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def test_elementwise_chain_is_one_kernel(local_pipeline):
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import ir_pb2

    class Chain(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(torch.sqrt(torch.exp(torch.sin(x) * 2.0 + 3.0)))

    x = torch.randn(4, 32)
    compiled = kiln.compile(Chain(), (x,), pipeline=local_pipeline)
    kg = kernel_graph_from_pb(local_pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    assert [k.kind for k in kg.kernels] == ["elementwise"]
    assert len(kg.kernels[0].nodes) >= 10
    assert torch.allclose(compiled(x), Chain()(x), rtol=1e-4, atol=1e-5)


def test_output_structure_is_kept(pipeline):
    class TwoOut(torch.nn.Module):
        def forward(self, x, y):
            return {"sum": x + y, "prod": (x * y, torch.relu(x))}

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = kiln.compile(TwoOut(), (x, y), pipeline=pipeline)
    out = compiled(x, y)
    assert set(out) == {"sum", "prod"}
    assert torch.allclose(out["sum"], x + y) and torch.allclose(out["prod"][0], x * y)
    assert torch.equal(out["prod"][1], torch.relu(x))


def test_remote_trace_spans_all_services(remote_pipeline, span_exporter):
    span_exporter.clear()
    model, inputs = mlp_example(seed=3)
    compiled = kiln.compile(model, inputs, pipeline=remote_pipeline)
    compiled(*inputs)
    spans = span_exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "kiln.compile")
    tid = root.context.trace_id
    in_trace = {s.name for s in spans if s.context.trace_id == tid}
    for name in ("importer.Import", "optimizer.Optimize", "codegen.Emit", "executor.Load"):
        assert name in in_trace, (name, sorted(in_trace))
    # the server-side spans are children of gRPC server spans, themselves children of client spans
    server_spans = [s for s in spans if s.context.trace_id == tid and s.kind.name == "SERVER"]
    assert {s.name.rsplit("/", 1)[-1] for s in server_spans} >= {"Import", "Optimize", "Emit", "Load"}
    # the call after the compile is its own trace, again across client and executor
    call = next(s for s in spans if s.name == "kiln.call")
    assert any(s.name == "executor.Run" and s.context.trace_id == call.context.trace_id for s in spans)


def test_unsupported_op_is_failed_precondition(remote_pipeline):
    class Sort(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x, dim=0)[0]

    with pytest.raises(FailedPrecondition, match=r"aten\.sort"):
        kiln.compile(Sort(), (torch.randn(4, 3),), pipeline=remote_pipeline)


def test_bad_run_inputs_are_invalid_argument(remote_pipeline):
    model, inputs = mlp_example()
    compiled = kiln.compile(model, inputs, pipeline=remote_pipeline)
    p, sid = remote_pipeline, compiled.session
    with pytest.raises(InvalidArgument, match=r"input 'x': expected shape \[8, 64\], got \[8, 63\]"):
        p.run(sid, [("x", np.zeros((8, 63), np.float32))])
    with pytest.raises(InvalidArgument, match=r"input 'x': expected dtype f32, got int64"):
        p.run(sid, [("x", np.zeros((8, 64), np.int64))])
    with pytest.raises(InvalidArgument, match=r"missing input 'x'"):
        p.run(sid, [("y", np.zeros((8, 64), np.float32))])
    # still serving
    out = p.run(sid, [("x", inputs[0].numpy())])
    assert np.allclose(out[0][1], model(*inputs).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_every_form_of_a_valid_input_gives_the_same_outputs(local_pipeline):
    """A run takes its inputs by position or by name, C-ordered or not: the fast path (plain
    comparisons against a static signature) and the general one agree, and a bad input still
    gets the general path's error."""
    model, inputs = mlp_example()
    compiled = kiln.compile(model, inputs, pipeline=local_pipeline)
    p, sid = local_pipeline, compiled.session
    x = inputs[0].numpy()
    ref = model(*inputs).detach().numpy()
    strided = np.asfortranarray(x)
    outs = [p.run(sid, [("", x)]), p.run(sid, [("x", x)]), p.run(sid, [("x", strided)]),
            p.run(sid, [("", x[:, :].copy())])]
    for out in outs:
        assert out[0][1].shape == ref.shape and out[0][1].dtype == np.float32
        np.testing.assert_allclose(out[0][1], ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidArgument, match=r"input 'x': expected shape \[8, 64\], got \[64, 8\]"):
        p.run(sid, [("", x.T.copy())])


def test_unknown_digest_and_session_are_not_found(remote_pipeline):
    from kiln.cas.digest import digest_bytes

    missing = digest_bytes(b"no such artifact")
    with pytest.raises(NotFound):
        remote_pipeline.import_program(missing)
    with pytest.raises(NotFound):
        remote_pipeline.optimize(missing)
    with pytest.raises(NotFound):
        remote_pipeline.emit(missing)
    with pytest.raises(NotFound):
        remote_pipeline.load(missing, missing)
    with pytest.raises(NotFound, match="no session"):
        remote_pipeline.run("feedface", [("x", np.zeros((1,), np.float32))])


def test_malformed_program_is_invalid_argument(remote_pipeline):
    d = remote_pipeline.store.put(b"this is not a .pt2 archive")
    with pytest.raises(InvalidArgument, match="not a torch.export program"):
        remote_pipeline.import_program(d)


def test_a_client_pointed_at_a_wrong_address_fails_in_seconds_naming_it(tmp_path, caplog):
    """Nothing listens at the importer's address: the compile fails within UNREACHABLE_S (plus a
    margin) with UNAVAILABLE naming the stage and the address, after saying it retries; not at
    the calls' ten-minute deadline."""
    import logging
    import socket
    import time

    from kiln.core.errors import Unavailable
    from kiln.pipeline import Pipeline
    from kiln.rpc.client import UNREACHABLE_S

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    p = Pipeline(f"file://{tmp_path / 'store'}", {s: addr for s in ("importer", "optimizer", "codegen", "executor")})
    model, inputs = mlp_example()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kiln.rpc.client"):
        with pytest.raises(Unavailable, match=f"the importer at {addr} did not answer"):
            kiln.compile(model, inputs, pipeline=p)
    assert time.monotonic() - t0 < UNREACHABLE_S + 5
    assert any("retrying" in r.getMessage() and addr in r.getMessage() for r in caplog.records)


def test_a_client_whose_store_is_not_the_services_is_told_so(services, tmp_path):
    """The client's store is a local directory, the services' is S3: the importer cannot find
    the program the client put, or (when the services' store had it already) the client's store
    lacks the graph the importer wrote; either way the error says the two use different stores."""
    from kiln.pipeline import Pipeline

    _, addrs = services
    for seed in (4242, 0):  # a program the services' store lacks, and one it may hold from other tests
        model, inputs = mlp_example(seed=seed)
        if seed == 0:
            kiln.compile(model, inputs, pipeline=Pipeline(*services))  # now the services' store holds it
        p = Pipeline(f"file://{tmp_path / f'elsewhere-{seed}'}", addrs)
        with pytest.raises(NotFound, match="use different stores"):
            kiln.compile(model, inputs, pipeline=p)


def test_health_and_reflection(services):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, addrs = services
    for stage, addr in addrs.items():
        with grpc.insecure_channel(addr) as ch:
            service = f"kiln.v1.{stage.capitalize()}"
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in reply.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_remote_mode_from_environment(services, monkeypatch):
    from kiln.pipeline import Pipeline

    store, addrs = services
    for stage, addr in addrs.items():
        monkeypatch.setenv(f"KILN_{stage.upper()}_ADDR", addr)
    p = Pipeline(store)
    assert p.remote and p.addresses == addrs
    model, inputs = mlp_example()
    compiled = kiln.compile(model, inputs, pipeline=p)
    assert torch.allclose(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


def test_least_recently_used_session_is_evicted_and_reloads_on_use(local_pipeline, monkeypatch):
    import executor_svc.executor as ex

    monkeypatch.setattr(ex, "MAX_SESSIONS", 2)
    model, inputs = mlp_example()
    compiled = kiln.compile(model, inputs, pipeline=local_pipeline)
    r = compiled.result
    executor = local_pipeline.local_executor()
    second = local_pipeline.load(r.bundle, r.manifest)
    compiled(*inputs)  # touches the first session
    third = local_pipeline.load(r.bundle, r.manifest)
    assert second not in executor.sessions and len(executor.sessions) == 2
    ref = model(*inputs).detach().numpy()
    # the id names its bundle and weights: an evicted session (or one Loaded on another
    # replica) is loaded again from the store on its next Run, under the same id
    for sid in (second, compiled.session, third):
        assert np.allclose(local_pipeline.run(sid, [("x", inputs[0].numpy())])[0][1], ref, rtol=1e-4, atol=1e-5)
    assert set(executor.sessions) == {compiled.session, third}  # still at most two, most recent kept


def test_first_runs_call_the_kernels_from_python_then_the_compiled_entry(local_pipeline):
    """A session's first HOST_RUNS runs call its compiled kernels from the entry's Python
    function, and numba does not build the entry; the last of them starts building it in the
    background, runs during the build still call the kernels from Python (no caller waits on
    it), and the first run after it uses the compiled entry, with the same outputs (to the last
    bits the entry's own optimization may move)."""
    from executor_svc.executor import HOST_RUNS

    model, inputs = encoder_example()
    compiled = kiln.compile(model, inputs, pipeline=local_pipeline)
    executor = local_pipeline.local_executor()
    session = executor.open(compiled.result.bundle, compiled.result.manifest)
    feeds = [("x", inputs[0].numpy())]
    ref = model(*inputs).detach().numpy()
    calls, entry, host, release = [], session.entry, session.host, threading.Event()

    class Entry:  # the compiled entry, its calls and its build recorded; the build held until released
        typeof_pyval = staticmethod(entry.typeof_pyval)

        def __call__(self, *a):
            calls.append("entry")
            return entry(*a)

        def compile(self, types):
            calls.append("build")
            assert release.wait(60)
            return entry.compile(types)

    session.entry = Entry()
    session.host = lambda *a: calls.append("host") or host(*a)
    built = len(entry.signatures)  # another test in this process may have run this bundle already
    first = [executor.run_session(session, feeds)[0][1] for _ in range(HOST_RUNS - 1)]
    assert calls == ["host"] * (HOST_RUNS - 1) and len(entry.signatures) == built and session.build is None
    first.append(executor.run_session(session, feeds)[0][1])
    during = executor.run_session(session, feeds)[0][1]  # the build is held: this run must not wait
    assert calls.count("host") == HOST_RUNS + 1 and "entry" not in calls and not session.built.is_set()
    release.set()
    session.build.join(120)
    assert session.built.is_set() and calls.count("build") == 1 and len(entry.signatures) == 1
    compiled_out = executor.run_session(session, feeds)[0][1]
    assert calls[-1] == "entry" and calls.count("build") == 1
    for out in first + [during, compiled_out]:
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(compiled_out, first[0], rtol=1e-6, atol=1e-7)


def test_resnet_style_cnn_matches_eager(local_pipeline):
    model, inputs = resnet_example()
    compiled = kiln.compile(model, inputs, pipeline=local_pipeline)
    with torch.no_grad():
        ref = model(*inputs)
    assert torch.allclose(compiled(*inputs), ref, rtol=1e-4, atol=1e-4)
