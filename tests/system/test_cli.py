"""The command line: compile / run / show on a .pt2, and `kiln serve all` on one port."""

import json

import numpy as np
import pytest
import torch

from helpers import kiln_cli
from kiln.apps.examples import mlp_example
from kiln.apps.s3local import free_port

pytestmark = pytest.mark.slow(minutes=3)  # its file starts first under make test


@pytest.fixture(scope="module")
def compiled_mlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model, (x,) = mlp_example(seed=7)
    torch.export.save(torch.export.export(model, (x,)), d / "mlp.pt2")
    np.save(d / "x.npy", x.numpy())
    env = {"KILN_STORE": f"file://{d / 'store'}"}
    out = json.loads(kiln_cli("compile", str(d / "mlp.pt2"), env=env).stdout)
    return d, env, out, model, x


def test_compile_run_matches_eager(compiled_mlp):
    d, env, out, model, x = compiled_mlp
    kiln_cli("run", out["bundle"], "--manifest", out["manifest"], "--input", f"x={d / 'x.npy'}",
             "--out", str(d / "out"), env=env)
    (result,) = [np.load(p) for p in (d / "out").iterdir()]
    assert np.allclose(result, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_show_graph_kernel_graph_bundle(compiled_mlp):
    d, env, out, _, _ = compiled_mlp
    g = kiln_cli("show", out["graph"], env=env).stdout
    assert g.startswith("Graph ") and "SumReduce" in g and "weight fc1.weight: f32[256, 64]" in g
    kg = kiln_cli("show", out["kernel_graph"], env=env).stdout
    assert kg.startswith("KernelGraph ") and ": gemm," in kg
    b = kiln_cli("show", out["bundle"], env=env).stdout
    assert "def run_graph(" in b and "np.dot(" in b and "@njit" in b and "inputs:  x: f32[8, 64]" in b
    m = kiln_cli("show", out["manifest"].split("/")[0], env=env).stdout  # a bare hash works too
    assert m.startswith("WeightManifest") and "fc2.bias: f32[10]" in m


def test_show_unknown_digest_fails_clearly(compiled_mlp):
    _, env, _, _, _ = compiled_mlp
    r = kiln_cli("show", "0" * 64, env=env, check=False)
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr


def test_serve_all_on_one_port(s3, kiln_serve):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    import kiln
    from kiln.pipeline import Pipeline

    port = free_port()
    server = kiln_serve("all", "--port", str(port), env=s3.env("kiln-tests/serve-all"))
    try:
        addr = f"127.0.0.1:{port}"
        assert server.addr == addr
        with grpc.insecure_channel(addr) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kiln.v1.Executor"),
                                                          timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        from kiln.cas.store import S3Store
        from kiln.apps.s3local import ACCESS_KEY, SECRET_KEY

        store = S3Store("kiln-tests", s3.endpoint, ACCESS_KEY, SECRET_KEY, prefix="serve-all")
        p = Pipeline(store, {s: addr for s in ("importer", "optimizer", "codegen", "executor")})
        model, inputs = mlp_example(seed=7)
        compiled = kiln.compile(model, inputs, pipeline=p)
        assert torch.allclose(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    finally:
        server.stop()


def test_ops_lists_needs_and_missing(tmp_path):
    class Mixed(torch.nn.Module):
        def forward(self, x):
            return torch.sort(torch.relu(x) + 1, dim=0)[0]

    torch.export.save(torch.export.export(Mixed(), (torch.randn(4, 3),)), tmp_path / "m.pt2")
    r = kiln_cli("ops", str(tmp_path / "m.pt2"), check=False)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert any(l.startswith("aten.relu.default") and l.rstrip().endswith("ok") for l in lines)
    sort = next(l for l in lines if l.startswith("aten.sort.default"))
    assert "MISSING" in sort and "test_cli.py" in sort
    assert lines[-1].endswith("1 missing")


def test_calibrate_then_compile_with_a_prediction(compiled_mlp):
    d, env, out, model, x = compiled_mlp
    # cache the measurement however busy the machine is (else a run beside other work measures
    # again: tests/stages/test_calibrate.py checks that on its own)
    env = {**env, "KILN_CONTENDED": "1"}
    first = json.loads(kiln_cli("calibrate", env=env).stdout)
    assert first["target"] == "cpu" and len(first["gemm"]) == 4 and first["bandwidthGbs"] > 0
    again = json.loads(kiln_cli("calibrate", env=env).stdout)
    assert again["profile"] == first["profile"]  # measured once per fingerprint, then read from the store
    predicted = json.loads(kiln_cli("compile", str(d / "mlp.pt2"), "--predict", env=env).stdout)
    assert predicted["target_profile"] == first["profile"] and predicted["predicted_ms"] > 0
    # Once the target is calibrated every compile ranks under its profile (the pick may differ
    # from the uncalibrated one); asking for the prediction only reports it.
    plain = json.loads(kiln_cli("compile", str(d / "mlp.pt2"), env=env).stdout)
    assert "predicted_ms" not in plain and plain["bundle"] == predicted["bundle"]


def test_profile_times_each_kernel(compiled_mlp):
    d, env, out, _, _ = compiled_mlp
    for args in ((out["bundle"], "--manifest", out["manifest"]), (str(d / "mlp.pt2"),)):
        r = kiln_cli("profile", *args, "--repeats", "5", env=env)
        lines = r.stdout.splitlines()
        rows = [l.split() for l in lines[2:-1]]
        # (compiling the .pt2 again may pick another schedule once the target is calibrated)
        assert lines[0].startswith("bundle ") and lines[0].split(": ")[1].startswith(f"{len(rows)} kernels")
        assert {row[1] for row in rows} >= {"gemm"}
        if args[0] == out["bundle"]:
            assert len(rows) == out["kernels"]
        shares = [float(row[3].rstrip("%")) for row in rows]
        assert abs(sum(shares) - 100) < 1 and shares == sorted(shares, reverse=True)
        assert "compiled entry" in lines[-1]
    bad = kiln_cli("profile", out["bundle"], env=env, check=False)
    assert bad.returncode == 2 and "--manifest" in bad.stderr


def test_generate_prints_new_token_ids_and_text(tmp_path):
    """`kiln generate DIR --prompt-ids 1,2,3 --max-new-tokens N --greedy` prints the new token
    ids on one line, those of transformers' greedy generate; with --prompt the text goes through
    the directory's tokenizer.json, and the same tokens come out as text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                         eos_token_id=1, max_position_embeddings=128)).eval()
    d = tmp_path / "tiny-llama"
    model.save_pretrained(d)
    words = [f"w{i}" for i in range(64)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    env = {"KILN_STORE": f"file://{tmp_path / 'store'}"}
    args = ("generate", str(d), "--max-new-tokens", "12", "--greedy", "--max-context", "64", "--max-batch", "2")
    first = kiln_cli(*args, "--prompt-ids", "5,6,7", env={**env, "KILN_PROGRESS": "1"})  # asked: progress on stderr
    out = first.stdout.strip()
    assert "compile tiny-llama: prefill · " in first.stderr and "compile tiny-llama: decode · " in first.stderr
    assert "regions searched" in first.stderr and "tiny-llama: decode · done · " in first.stderr
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)[0, 3:]
    assert out == " ".join(str(t) for t in want.tolist())
    text = kiln_cli(*args, "--prompt", "w5 w6 w7", env=env).stdout.strip()
    assert text == tok.decode(want.tolist())
    bad = kiln_cli("generate", str(d), "--prompt-ids", "5,x", env=env, check=False)
    assert bad.returncode == 1 and "comma-separated integers" in bad.stderr
