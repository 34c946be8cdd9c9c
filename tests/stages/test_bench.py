"""`kiln bench`: the harness's JSON, chart and checks, on the MLP (eager and inductor in one run)."""

import json
import math

from helpers import kiln_cli


def test_bench_mlp_writes_json_and_chart(tmp_path):
    r = kiln_cli("bench", "mlp", "--repeats", "5", "--start", "--json", str(tmp_path / "b.json"),
                 "--plot", str(tmp_path / "b.png"), env={"KILN_STORE": f"file://{tmp_path / 'store'}"})
    (res,) = json.loads((tmp_path / "b.json").read_text())
    for key in ("model", "kiln_ms", "eager_ms", "inductor_ms", "max_abs_err", "kiln_peak_mb", "eager_peak_mb"):
        assert key in res, key
    assert res["model"] == "mlp" and res["repeats"] == 5 and res["threads"] >= 1
    assert all(res[k] > 0 for k in ("kiln_ms", "eager_ms", "inductor_ms"))
    assert res["max_abs_err"] < 1e-5  # kiln's output against eager's on the same input
    assert res["gemm_gflop"] > 0 and res["sgemm_ms"] > 0 and 0 < res["roofline"]
    assert not math.isnan(res["kiln_peak_mb"]) and "peak memory <= eager" in res["targets"]
    assert "kiln is" in r.stdout and "inductor" in r.stdout
    # start in a new process: the warm one compiles nothing (its time is a figure, not asserted)
    assert res["cold_start_s"] > 0 and res["warm_start_s"] > 0 and res["warm_start_compiled"] == 0
    assert "warm start < 1 s" in res["targets"] and "start (new process" in r.stdout
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_an_unknown_model():
    r = kiln_cli("bench", "gpt-5", check=False)
    assert r.returncode == 2 and "invalid choice" in r.stderr
