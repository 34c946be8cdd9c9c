"""Hostile input over gRPC against a `kiln serve all` process of its own: each request gets the
right status code, and after each the server still serves (health SERVING, a real Run correct).
Then a hypothesis fuzz sends random bytes and well-typed but wrong messages to every RPC."""

from __future__ import annotations


import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kiln
import kiln.apps.examples
from kiln.cas.digest import Digest
from kiln.cas.store import FileStore
from kiln.rpc.tensors import array_from_pb, array_to_pb
from kiln.v1 import ir_pb2, services_pb2
from helpers import Server

pytestmark = pytest.mark.slow(minutes=3)  # its file starts first under make test

# every RPC: (full method name, request type, server-streaming)
METHODS = [(f"/kiln.v1.{svc.name}/{m.name}", m.input_type._concrete_class, m.server_streaming)
           for svc in services_pb2.DESCRIPTOR.services_by_name.values() for m in svc.methods]
# a server that answers a client's mistake with INTERNAL or UNKNOWN blames itself: never allowed
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS,
                grpc.StatusCode.DEADLINE_EXCEEDED}


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return torch.softmax(self.norm(torch.relu(self.a(x))), dim=-1) + torch.sigmoid(x).sum(-1, keepdim=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, kiln_serve_module):
    root = tmp_path_factory.mktemp("hostile")
    s = Server(kiln_serve_module("all", "--port", "0", env={"KILN_STORE": f"file://{root / 'store'}"}),
               FileStore(root / "store"))
    torch.manual_seed(0)
    model, x = TinyNet().eval(), torch.randn(3, 12)
    s.compiled = kiln.compile(model, (x,), pipeline=s.pipeline())
    s.model, s.x = model, x
    r = s.compiled.result
    REAL["digests"] = [d.to_pb() for d in (r.graph, r.manifest, r.kernel_graph, r.bundle)]
    REAL["sessions"] = [s.compiled.session]
    yield s
    s.close()


def assert_serving(s: Server) -> None:
    """The process lives, reports SERVING, and a real Run still matches torch."""
    assert s.process.alive(), "the server died"
    health = health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    r = s.executor.Run(services_pb2.RunRequest(session=s.compiled.session,
                                               inputs=[array_to_pb("x", s.x.numpy())]), timeout=30)
    with torch.no_grad():
        np.testing.assert_allclose(array_from_pb(r.outputs[0]), s.model(s.x).numpy(), rtol=1e-5, atol=1e-5)


def raw(s: Server, method: str, streaming: bool):
    return (s.channel.unary_stream if streaming else s.channel.unary_unary)(method)


def run_request(s: Server, *tensors) -> services_pb2.RunRequest:
    return services_pb2.RunRequest(session=s.compiled.session, inputs=list(tensors))


def test_malformed_protobuf_is_invalid_argument_on_every_rpc(server):
    for method, _, streaming in METHODS:
        # a field header announcing 2^63 bytes, then a truncated varint: no message parses from it
        with pytest.raises(grpc.RpcError) as e:
            out = raw(server, method, streaming)(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\x7f\x01", timeout=30)
            if streaming:
                list(out)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        assert "malformed request" in e.value.details()
    assert_serving(server)


def test_corrupted_or_truncated_blob_is_data_loss(server):
    program = server.compiled.result.graph  # any blob; here the graph, handed to Optimize
    data = server.store.get(program)
    d = server.store.put(data + b"\x00tail")
    path = server.store.root / server.store.blob_key(d)
    path.write_bytes(data[:-7] + b"garbage")  # same length, wrong bytes
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=d.to_pb(), search=True)) \
        == grpc.StatusCode.DATA_LOSS
    path.write_bytes(data[: len(data) // 2])  # truncated
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=d.to_pb())) \
        == grpc.StatusCode.DATA_LOSS
    wrong_size = Digest(program.hash, program.size_bytes + 1)
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=wrong_size.to_pb())) in \
        (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND)
    assert_serving(server)


def _graph(server) -> ir_pb2.Graph:
    return server.store.get_message(server.compiled.result.graph, ir_pb2.Graph)


def _optimize_code(server, g: ir_pb2.Graph) -> tuple[grpc.StatusCode, str]:
    d = server.store.put_message(g)
    try:
        server.optimizer.Optimize(services_pb2.OptimizeRequest(graph=d.to_pb(), search=True), timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_cycles_dangling_references_and_absurd_shapes_in_a_graph(server):
    g = _graph(server)
    last = len(g.nodes) - 1
    cyclic = ir_pb2.Graph()
    cyclic.CopyFrom(g)
    cyclic.nodes[1].inputs[:] = [last]  # an early node reads the last one: a cycle
    assert _optimize_code(server, cyclic)[0] == grpc.StatusCode.INVALID_ARGUMENT
    dangling = ir_pb2.Graph()
    dangling.CopyFrom(g)
    dangling.outputs[:] = [last + 1000]
    code, details = _optimize_code(server, dangling)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in details
    negative = ir_pb2.Graph()
    negative.CopyFrom(g)
    negative.nodes[0].shape[0].terms[0].coefficient = -3
    assert _optimize_code(server, negative)[0] == grpc.StatusCode.INVALID_ARGUMENT
    unknown_op = ir_pb2.Graph()
    unknown_op.CopyFrom(g)
    unknown_op.nodes[2].op = "Launch"
    assert _optimize_code(server, unknown_op)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(server)


def test_a_program_of_two_to_the_forty_elements_compiles_but_is_refused_at_load(server, tmp_path):
    class Huge(torch.nn.Module):
        def forward(self, x):  # 2^20 x 2^20 floats: 4 TiB
            return (x.unsqueeze(1) * x.unsqueeze(0)).sum(0)

    p = server.pipeline()
    x = torch.ones(1 << 20)
    ep = torch.export.export(Huge(), (x,))
    r = p.compile_program(p.upload_program(ep), search=False)
    with pytest.raises(kiln.core.errors.ResourceExhausted, match="per-session budget"):
        p.load(r.bundle, r.manifest)
    assert_serving(server)


def test_run_inputs_of_wrong_shape_dtype_or_size_are_invalid_argument(server):
    x = server.x.numpy()
    bad = [
        array_to_pb("x", x.astype(np.int64)),                         # wrong dtype
        array_to_pb("x", x.astype(np.float16)),
        ir_pb2.Tensor(name="x", dtype=99, shape=[3, 12], data=x.tobytes()),  # no such dtype
        array_to_pb("x", np.zeros((3, 0), np.float32)),               # a zero dim
        array_to_pb("x", np.zeros((3, 13), np.float32)),              # wrong shape
        ir_pb2.Tensor(name="x", shape=[3, 12], data=x.tobytes()),        # dtype unspecified
        ir_pb2.Tensor(name="x", dtype=array_to_pb("x", x).dtype, shape=[-3, -12], data=x.tobytes()),
        ir_pb2.Tensor(name="x", dtype=array_to_pb("x", x).dtype, shape=[1 << 20, 1 << 20], data=x.tobytes()),
        ir_pb2.Tensor(name="x", dtype=array_to_pb("x", x).dtype, shape=[3, 12], data=x.tobytes()[:-4]),
    ]
    for t in bad:
        assert server.code(server.executor.Run, run_request(server, t)) == grpc.StatusCode.INVALID_ARGUMENT, t.shape
    assert server.code(server.executor.Run, run_request(server)) == grpc.StatusCode.INVALID_ARGUMENT
    two = run_request(server, array_to_pb("x", x), array_to_pb("y", x))
    assert server.code(server.executor.Run, two) == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(server)


def test_nan_and_inf_inputs_propagate_as_torch_does(server):
    x = server.x.clone()
    x[0, 0] = float("nan")
    x[1, 3] = float("inf")
    x[2, 5] = float("-inf")
    r = server.executor.Run(run_request(server, array_to_pb("x", x.numpy())), timeout=30)
    with torch.no_grad():
        expected = server.model(x).numpy()
    got = array_from_pb(r.outputs[0])
    assert np.isnan(expected).any() and np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert_serving(server)


def test_unknown_session_oversized_message_and_past_deadline(server):
    assert server.code(server.executor.Run, services_pb2.RunRequest(session="no-such-session")) \
        == grpc.StatusCode.NOT_FOUND
    fake = "ab" * 32 + "-10-" + "cd" * 32 + "-10-0123456789abcdef"  # well-formed id, nothing stored
    assert server.code(server.executor.Run, services_pb2.RunRequest(session=fake)) == grpc.StatusCode.NOT_FOUND
    huge = ir_pb2.Tensor(name="x", data=b"\0" * (65 << 20))  # over the 64 MiB message limit
    assert server.code(server.executor.Run, run_request(server, huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a search that cannot finish in a millisecond: the client gives up; the server drops the work
    g = server.store.get_message(server.compiled.result.graph, ir_pb2.Graph)
    g.output_names[:] = [n + "-deadline" for n in g.output_names]  # a graph the action cache has not seen
    d = server.store.put_message(g)
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=d.to_pb(), search=True),
                       timeout=0.001) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_serving(server)


def test_search_bounds_over_the_caps_are_resource_exhausted(server):
    d = server.compiled.result.graph.to_pb()
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=d, search=True,
                                                                                 max_enodes=1 << 40)) \
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.code(server.optimizer.SaturateRegion, services_pb2.SaturateRegionRequest(
        region=d, max_enodes=1 << 40)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.code(server.optimizer.Optimize, services_pb2.OptimizeRequest(graph=d, search=True,
                                                                                 max_iterations=-1)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(server)


def test_memory_caps_per_search_and_per_session(tmp_path, kiln_serve):
    """A server with a 1 MiB search memory cap and a 64 KiB session budget refuses both, and serves on."""
    s = Server(kiln_serve("all", "--port", "0", env={"KILN_STORE": f"file://{tmp_path / 'store'}",
                                                     "KILN_OPTIMIZE_MEMORY_MB": "1", "KILN_SESSION_MEMORY_MB": "0.0625"}),
               FileStore(tmp_path / "store"))
    try:
        torch.manual_seed(0)
        ep = torch.export.export(kiln.apps.examples.Encoder().eval(), (torch.randn(2, 16, 64),))
        p = s.pipeline()
        with pytest.raises(kiln.core.errors.ResourceExhausted, match="KILN_OPTIMIZE_MEMORY_MB"):
            p.compile_program(p.upload_program(ep), search=True)
        r = p.compile_program(p.upload_program(ep), search=False)  # no search: no e-graph
        with pytest.raises(kiln.core.errors.ResourceExhausted, match="KILN_SESSION_MEMORY_MB"):
            p.load(r.bundle, r.manifest)
        assert s.process.alive()
        health = health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        s.close()


# ---- fuzz ----

_SCALARS = {
    1: st.floats(allow_nan=True), 2: st.floats(width=32), 3: st.integers(-(1 << 63), (1 << 63) - 1),
    4: st.integers(0, (1 << 64) - 1), 5: st.integers(-(1 << 31), (1 << 31) - 1), 8: st.booleans(),
    9: st.text(max_size=80), 12: st.binary(max_size=256), 13: st.integers(0, (1 << 32) - 1),
    14: st.integers(-5, 40), 15: st.integers(-(1 << 31), (1 << 31) - 1), 16: st.integers(-(1 << 63), (1 << 63) - 1),
    17: st.integers(-(1 << 31), (1 << 31) - 1), 18: st.integers(-(1 << 63), (1 << 63) - 1),
    6: st.integers(0, (1 << 64) - 1), 7: st.integers(0, (1 << 32) - 1),
}


REAL: dict[str, list] = {"digests": [], "sessions": []}  # the fixture's compiled artifacts, filled in once


def _digest_like():
    """Digests of nothing stored, malformed ones, and the real artifacts of the server's compile
    (so a wrong message also reaches the code behind the lookups)."""
    return st.one_of(st.builds(lambda h, n: ir_pb2.Digest(hash=h, size_bytes=n),
                               st.text("0123456789abcdef", min_size=64, max_size=64), st.integers(-2, 1 << 20)),
                     st.builds(lambda h: ir_pb2.Digest(hash=h), st.text(max_size=70)),
                     st.deferred(lambda: st.sampled_from(REAL["digests"])))


@st.composite
def messages(draw, cls, depth: int = 0):
    """A message of type `cls` with random values in random fields (well-typed, mostly wrong)."""
    if cls is ir_pb2.Digest:
        return draw(_digest_like())
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if f.type == f.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                key = draw(st.text(max_size=12))
                getattr(msg, f.name)[key] = draw(st.integers(-(1 << 40), 1 << 40))
                continue
            if depth >= 3:
                continue
            sub_cls = f.message_type._concrete_class
            if f.is_repeated:
                for _ in range(draw(st.integers(0, 3))):
                    getattr(msg, f.name).add().CopyFrom(draw(messages(sub_cls, depth + 1)))
            else:
                getattr(msg, f.name).CopyFrom(draw(messages(sub_cls, depth + 1)))
            continue
        value = st.sampled_from([v.number for v in f.enum_type.values] + [99]) if f.type == f.TYPE_ENUM \
            else _SCALARS[f.type]
        if f.name == "session":
            value = st.one_of(value, st.deferred(lambda: st.sampled_from(REAL["sessions"])))
        if f.is_repeated:
            getattr(msg, f.name).extend(draw(st.lists(value, max_size=4)))
        else:
            setattr(msg, f.name, draw(value))
    return msg


def _call_any(server, method: str, streaming: bool, payload: bytes) -> grpc.StatusCode:
    try:
        out = raw(server, method, streaming)(payload, timeout=60)
        if streaming:
            for _ in out:
                pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)


@FUZZ
@given(st.sampled_from(METHODS), st.binary(max_size=512))
def test_fuzz_random_bytes_to_every_rpc(server, method, data):
    name, _, streaming = method
    code = _call_any(server, name, streaming, data)
    event(f"{name.rsplit('/', 1)[1]}: {code.name}")  # --hypothesis-show-statistics shows the spread
    assert code in CLIENT_CODES, (name, code)
    assert server.process.alive()


@FUZZ
@given(st.data())
def test_fuzz_well_typed_wrong_messages_to_every_rpc(server, data):
    name, cls, streaming = data.draw(st.sampled_from(METHODS))
    request = data.draw(messages(cls))
    if cls is services_pb2.CalibrateRequest:
        request.force = False  # a forced calibration measures for seconds: the cached one is the answer
    if cls in (services_pb2.OptimizeRequest, services_pb2.SaturateRegionRequest) and request.time_budget_s > 0.5:
        request.time_budget_s = 0.5  # a search of the real graph ends soon
    code = _call_any(server, name, streaming, request.SerializeToString())
    event(f"{name.rsplit('/', 1)[1]}: {code.name}")
    assert code in CLIENT_CODES, (name, code, request)
    assert server.process.alive()


def test_server_still_serves_after_the_fuzz(server):
    assert_serving(server)
