"""Executor.Calibrate (the cost model's measured constants), the roofline prediction in the
optimizer's report, and Executor.Profile timing candidate bundles."""

import pytest
import torch

import kiln
from kiln.cas.digest import Digest
from kiln.apps.examples import mlp_example
from kiln.v1 import services_pb2

def test_calibrate_measures_once_per_fingerprint(file_store, tmp_path, monkeypatch):
    from executor_svc.calibrate import GEMM_CLASSES, calibrate, fingerprint
    from kiln.cas.store import open_store
    from kiln.core.limits import CpuLoad

    # measured as if the machine were quiet, whatever else runs beside the suite (a contended
    # measurement is replaced by a quieter one, which the next test checks on its own)
    monkeypatch.setattr(CpuLoad, "others_busy", lambda self: 0.0)

    d, p, cached = calibrate(file_store, force=True)
    assert not cached and p.fingerprint == fingerprint("cpu") and p.target == "cpu"
    assert [g.shape_class for g in p.gemm] == [c[0] for c in GEMM_CLASSES]
    assert all(g.gflops > 0.05 for g in p.gemm)  # real BLAS: far above a naive scalar loop
    assert p.bandwidth_gbs > 0.1 and p.elementwise_gelems > 0 and 0 < p.kernel_overhead_us < 1e5
    assert p.cached_gelems > p.elementwise_gelems  # in cache, not streamed from memory (~10x here)
    from kiln.runtime.vectorwidth import host_widths  # the in-cache loop at LLVM's width and each the CPU has

    assert [v.bits for v in p.vector_rates] == [0, *host_widths()] and all(v.gelems > 0 for v in p.vector_rates)
    d2, p2, cached2 = calibrate(file_store)
    assert cached2 and d2 == d and p2 == p
    # another store in this process gets the same measurement without measuring again
    d3, p3, cached3 = calibrate(open_store(f"file://{tmp_path / 'other'}"))
    assert cached3 and d3 == d and p3 == p


def test_a_contended_calibration_is_cached_and_replaced_when_the_machine_is_quieter(tmp_path, monkeypatch):
    """A profile measured while other processes took over CONTENDED of the CPUs is cached with
    that share and used: calibrating again while the machine stays busy measures nothing. Once
    the machine is quieter a calibration measures again, and the quieter profile replaces it. A
    measurement that agrees with the recorded profile (the same machine, within SAME_MACHINE)
    keeps it: two calibrations of one machine give one profile digest, so one optimize key."""
    from executor_svc import calibrate as cal
    from kiln.core.limits import CONTENDED, CpuLoad
    from kiln.cas import cache
    from kiln.cas.store import open_store
    from optimizer_svc.optimizer import OptimizeOptions

    calls, rates = [], iter([10.0, 20.0, 30.0, 33.0])  # each measurement's GEMM rate

    def measure(target):
        calls.append(target)
        p = services_pb2.TargetProfile(target=target, fingerprint=cal.fingerprint(target), threads=2)
        p.gemm.add(shape_class="square", m=8, n=8, k=8, gflops=next(rates))
        return p

    def machine(busy_while_measuring, quieter_now):
        monkeypatch.setattr(CpuLoad, "others_busy", lambda self: busy_while_measuring)
        monkeypatch.setattr(cal, "quieter_now", lambda than, seconds=0.25: quieter_now)

    monkeypatch.setattr(cal, "measure", measure)
    monkeypatch.setattr(cal, "_measured", {})
    store = open_store(f"file://{tmp_path / 'busy'}")
    machine(CONTENDED + 0.3, False)
    busy_d, busy_p, cached = cal.calibrate(store)  # measured busy: cached, and used
    assert (len(calls), cached, busy_p.gemm[0].gflops) == (1, False, 10.0)
    assert cal.known_profile(store) == (busy_d, busy_p)
    assert cal.calibrate(store) == (busy_d, busy_p, True) and len(calls) == 1  # still busy: nothing measured
    machine(0.1, True)
    quiet_d, quiet_p, cached = cal.calibrate(store)  # quieter now: measured again, and it replaces
    assert (len(calls), cached, quiet_p.gemm[0].gflops) == (2, False, 20.0) and quiet_d != busy_d
    assert cal.known_profile(store) == (quiet_d, quiet_p)
    assert cal.calibrate(store) == (quiet_d, quiet_p, True) and len(calls) == 2  # a quiet profile is kept
    machine(0.0, True)
    d30, p30, _ = cal.calibrate(store, force=True)  # other constants (30 against 20): a new profile
    assert p30.gemm[0].gflops == 30.0 and d30 != quiet_d
    d33, p33, _ = cal.calibrate(store, force=True)  # 33 against 30: the same machine, the same profile
    assert len(calls) == 4 and (d33, p33) == (d30, p30) == cal.known_profile(store)

    def optimize_key(profile):
        return cache.action_key("optimize", "v", {"graph": d30}, OptimizeOptions(target_profile=profile).canonical())
    assert optimize_key(d33) == optimize_key(d30)


def test_known_profile_never_measures(tmp_path, monkeypatch):
    from executor_svc import calibrate as cal
    from kiln.cas.store import open_store

    monkeypatch.setattr(cal, "measure", lambda target: pytest.fail("a lookup measured the machine"))
    store = open_store(f"file://{tmp_path / 'fresh'}")
    assert cal.known_profile(store) is None
    monkeypatch.undo()
    d, p, _ = cal.calibrate(store)
    assert cal.known_profile(store) == (d, p)


def test_optimizer_predicts_run_time_per_kernel(local_pipeline):
    model, inputs = mlp_example()
    profile_d, profile = local_pipeline.calibrate()
    ep = torch.export.export(model, inputs)
    graph, _ = local_pipeline.import_program(local_pipeline.upload_program(ep))
    _, plain = local_pipeline.optimize(graph)
    assert plain.predicted_s == 0 and not plain.kernel_predictions  # no profile, no prediction
    _, report = local_pipeline.optimize(graph, target_profile=profile_d)
    assert report.kernels == len(report.kernel_predictions) > 0
    assert report.predicted_s == pytest.approx(sum(k.seconds for k in report.kernel_predictions))
    overhead = min(profile.kernel_overhead_us, profile.serial_overhead_us) * 1e-6
    assert profile.threads >= 1 and profile.serial_overhead_us > 0
    assert all(k.seconds >= overhead and k.bound in ("compute", "memory", "overhead")
               for k in report.kernel_predictions)
    assert any(k.kind == "gemm" for k in report.kernel_predictions)


def test_gemm_rate_picks_the_nearest_class():
    from optimizer_svc.cost import gemm_rate

    p = services_pb2.TargetProfile(gemm=[services_pb2.GemmRate(shape_class="gemv", m=1, n=1536, k=384, gflops=5),
                                         services_pb2.GemmRate(shape_class="small", m=64, n=64, k=64, gflops=20),
                                         services_pb2.GemmRate(shape_class="big", m=512, n=512, k=512, gflops=100)])
    assert gemm_rate(p, 1, 512, 512) == 5
    assert gemm_rate(p, 48, 64, 80) == 20
    assert gemm_rate(p, 400, 600, 500) == 100


def test_profile_times_candidates_over_grpc(remote_pipeline):
    model, inputs = mlp_example()
    searched = kiln.compile(model, inputs, pipeline=remote_pipeline)
    unsearched = kiln.compile(model, inputs, pipeline=remote_pipeline, search=False)
    r1, r2 = searched.result, unsearched.result
    timings = remote_pipeline.profile([r1.bundle, r2.bundle], r1.manifest, repeats=5)
    assert [t[0] for t in timings] == [r1.bundle, r2.bundle]
    assert all(0 < lo <= med and rel >= 1 and 0 <= others <= 1 for _, med, lo, rel, others in timings)
    d, p = remote_pipeline.calibrate()
    assert remote_pipeline.store.get_message(d, services_pb2.TargetProfile) == p
    assert remote_pipeline.known_profile() == d  # Calibrate(lookup_only) over gRPC


def test_candidates_are_ranked_by_paired_ratios_not_medians():
    """20 rounds; from round 10 on the machine is 20% slower (a VM's neighbour wakes up), except
    that b's run of round 10 fell in a lull. b is 3% slower than a in every other round, so it
    is the worse program, yet its median is the lower: half the rounds fast and half slow put
    each median at the edge between the two, where one run decides. The ratio to the round's
    fastest run does not see the level: a ranks first."""
    import statistics

    from executor_svc.executor import paired_ratios

    a = [100.0] * 10 + [120.0] * 10
    b = [103.0] * 11 + [123.6] * 9
    assert statistics.median(b) < statistics.median(a)  # medians would keep b
    rel = paired_ratios([a, b])
    assert rel[0] == 1.0 and rel[1] == pytest.approx(1.03)
    assert paired_ratios([[5.0, 6.0, 7.0]]) == [1.0]  # one candidate is its own fastest


def test_each_timed_run_follows_one_of_its_own(local_pipeline, monkeypatch):
    """Candidates are timed round-robin, and each timed run right after an untimed run of the same
    candidate, so one candidate's cache state never lands on the next one's time (unless their runs
    are all long: PAIR_BELOW_S)."""
    import time as time_module

    model, inputs = mlp_example()
    searched = kiln.compile(model, inputs, pipeline=local_pipeline).result
    unsearched = kiln.compile(model, inputs, pipeline=local_pipeline, search=False).result
    executor = local_pipeline.local_executor()
    events, real_run = [], executor.run_session
    clock = time_module.perf_counter

    def run_session(session, feeds):
        events.append(("run", session.bundle))
        return real_run(session, feeds)

    def perf_counter():
        events.append(("clock", None))
        return clock()

    monkeypatch.setattr(executor, "run_session", run_session)
    monkeypatch.setattr("executor_svc.executor.time.perf_counter", perf_counter)
    local_pipeline.profile([searched.bundle, unsearched.bundle], searched.manifest, repeats=3)
    # per round and candidate: an untimed run, the clock, the timed run of the same one, the clock
    # (the first round's untimed runs are the warm-up: no run of its own before them)
    timed = events[[kind for kind, _ in events].index("run"):]
    rounds = [timed[i:i + 4] for i in range(0, len(timed), 4)]
    assert len(rounds) == 6 and [r[0][1] for r in rounds] == [searched.bundle, unsearched.bundle] * 3
    assert all([kind for kind, _ in r] == ["run", "clock", "run", "clock"] and r[0] == r[2] for r in rounds)
    # candidates whose runs all take PAIR_BELOW_S or longer go unpaired after the first round: a run
    # that long streams more than the caches hold, and it halves a real model's timing
    monkeypatch.setattr("executor_svc.executor.PAIR_BELOW_S", 0.0)
    events.clear()
    local_pipeline.profile([searched.bundle, unsearched.bundle], searched.manifest, repeats=3)
    timed = events[[kind for kind, _ in events].index("run"):]
    first, rest = timed[:8], timed[8:]
    assert [kind for kind, _ in first] == ["run", "clock", "run", "clock"] * 2
    assert [kind for kind, _ in rest] == ["clock", "run", "clock"] * 4
    assert [b for kind, b in rest if kind == "run"] == [searched.bundle, unsearched.bundle] * 2


def test_profile_rejects_bad_requests(remote_pipeline):
    from kiln.core.errors import InvalidArgument, NotFound

    model, inputs = mlp_example()
    r = kiln.compile(model, inputs, pipeline=remote_pipeline).result
    with pytest.raises(InvalidArgument, match="repeats"):
        remote_pipeline.profile([r.bundle], r.manifest, repeats=-3)
    with pytest.raises(InvalidArgument, match="at least one bundle"):
        remote_pipeline.profile([], r.manifest)
    with pytest.raises(NotFound):
        remote_pipeline.profile([Digest("0" * 64, 10)], r.manifest)


def test_prediction_prices_a_reductions_loop_order():
    """The roofline prices a reduce kernel's loop order as extraction does: over an axis with 256
    floats after it, the default order reads with a stride (STRIDED_READ) and the axis-outer order
    updates accumulators (ACCUMULATE), so axis-outer is predicted cheaper; along the innermost
    axis there is nothing to reorder and the prediction is the plain one."""
    import dataclasses

    from kiln.ir.builder import GraphBuilder
    from kiln.ir.dtypes import DType
    from kiln.ir.kernel import KernelGraph
    from kiln.ir.ops import Op
    from optimizer_svc.cost import predict
    from optimizer_svc.partition import partition
    from optimizer_svc.cost import ACCUMULATE, STRIDED_READ

    profile = services_pb2.TargetProfile(target="cpu", threads=2, elementwise_gelems=2.0, bandwidth_gbs=1000.0,
                                         kernel_overhead_us=2.0, serial_overhead_us=0.25)
    profile.gemm.add(shape_class="square", m=512, n=512, k=512, gflops=100.0)

    def seconds(axis: int, order: str) -> float:
        b = GraphBuilder()
        x = b.input("x", (4096, 256), DType.F32)
        kg = partition(b.build([b.reduce(Op.SUM_REDUCE, x, axis)]))
        kg = KernelGraph(kg.graph, tuple(dataclasses.replace(k, order=order, parallel=False) if k.kind == "reduce"
                                         else k for k in kg.kernels))
        return sum(c.seconds for c in predict(kg, profile) if c.kind == "reduce")

    plain = seconds(1, "")
    assert seconds(0, "") > seconds(0, "axis-outer")
    assert seconds(0, "") == pytest.approx((plain - 0.25e-6) * (1 + STRIDED_READ) + 0.25e-6)
    assert seconds(0, "axis-outer") == pytest.approx((plain - 0.25e-6) * (1 + ACCUMULATE) + 0.25e-6)


def test_prediction_prices_gemm_and_attention_tiles():
    """The roofline prices tiles as extraction does (cost.gemm_tile_extra,
    attention_tile_extra): a GEMM of 2048 rows and 1024 columns with a ReLU after it, on one
    thread: in 256-row tiles it pays four more BLAS calls and packs of B than in 512-row ones
    (2 MiB of C, still in cache); in one 2048-row block none, but its 8 MiB of C is read back
    from memory. Fused attention in 16-row tiles pays two BLAS calls per extra tile."""
    import dataclasses

    from importer_svc.importer import lower_program
    from kiln.ir.kernel import KernelGraph
    from optimizer_svc.cost import predict
    from optimizer_svc.partition import partition
    from optimizer_svc.cost import GEMM_PACK, STRIDED_READ
    from optimizer_svc.saturate import SearchLimits, saturate
    from helpers import Fn

    profile = services_pb2.TargetProfile(target="cpu", threads=2, elementwise_gelems=2.0, bandwidth_gbs=1000.0,
                                         kernel_overhead_us=2.0, serial_overhead_us=0.25)
    profile.gemm.add(shape_class="square", m=512, n=512, k=512, gflops=100.0)
    one_thread_s = 2 / 2.0e9  # one element unit on one of the two threads

    def seconds(fn, args, kind: str, tile: int) -> float:
        g, _ = lower_program(torch.export.export(Fn(fn), args))
        opt, _ = saturate(g, SearchLimits())
        kg = partition(opt)
        kg = KernelGraph(kg.graph, tuple(dataclasses.replace(k, tile=tile, parallel=False) if k.kind == kind
                                         else k for k in kg.kernels))
        return sum(c.seconds for c in predict(kg, profile) if c.kind == kind)

    w = torch.randn(256, 1024)
    gemm = lambda x: torch.relu(x @ w)  # noqa: E731
    x = (torch.randn(2048, 256),)
    t256, t512, t2048 = (seconds(gemm, x, "gemm", t) for t in (256, 512, 2048))
    repack = 0.25e-6 + 256 * 1024 * GEMM_PACK * one_thread_s  # one more BLAS call, B packed again
    assert t256 - t512 == pytest.approx(4 * repack)
    assert t2048 - t512 == pytest.approx(STRIDED_READ * 2048 * 1024 * one_thread_s - 3 * repack)
    assert t512 < min(t256, t2048)
    attend = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    qkv = (torch.randn(1, 2, 256, 16),) * 3
    t16, t64 = (seconds(attend, qkv, "attention", t) for t in (16, 64))
    assert t16 - t64 == pytest.approx(2 * 2 * (16 - 4) * 0.25e-6)


def test_prediction_prices_an_epilogue_at_the_in_cache_rate():
    """A GEMM's epilogue works on its block of C while it is in cache: its ops are priced at the
    profile's in-cache rate, and a separate elementwise pass (streaming C back from memory) at
    the streaming rate, so the fused GEMM is predicted faster, by the difference of the two rates
    and the second kernel's fixed cost. A profile without an in-cache rate prices both alike."""
    from importer_svc.importer import lower_program
    from optimizer_svc.cost import predict
    from optimizer_svc.partition import Schedule, partition
    from optimizer_svc.saturate import SearchLimits, saturate
    from helpers import Fn

    w, bias = torch.randn(256, 1024), torch.randn(1024)
    g, _ = lower_program(torch.export.export(Fn(lambda x: torch.relu(x @ w + bias)), (torch.randn(512, 256),)))
    opt, _ = saturate(g, SearchLimits())
    fused, split = (partition(opt, schedule=Schedule(epilogues=e, searched=False)) for e in (True, False))
    assert [k.kind for k in fused.kernels] == ["gemm"] and [k.kind for k in split.kernels] == ["gemm", "elementwise"]
    for cached in (20.0, 0.0):
        profile = services_pb2.TargetProfile(target="cpu", threads=2, elementwise_gelems=2.0, cached_gelems=cached,
                                             bandwidth_gbs=1000.0, kernel_overhead_us=2.0, serial_overhead_us=0.25)
        profile.gemm.add(shape_class="square", m=512, n=512, k=512, gflops=100.0)
        t_fused, t_split = (sum(c.seconds for c in predict(kg, profile)) for kg in (fused, split))
        ops = 512 * 1024 * 3  # per element of C: the bias add, and the ReLU's compare and select
        in_cache = ops / ((cached or 2.0) * 1e9)
        assert t_split - t_fused == pytest.approx(ops / 2.0e9 - in_cache + 2e-6, rel=1e-6), cached


def test_candidates_that_clearly_lost_stop_being_timed():
    """Every few rounds the slower half of the candidates still timed stop (down to two), except
    those within TIE of the best; ratios of a candidate timed in fewer rounds are over those."""
    from executor_svc.executor import TIE, paired_ratios, still_timed

    times = [[100.0] * 5, [130.0] * 5, [101.0] * 5, [100.5] * 5, [150.0] * 5, [120.0] * 5]
    assert still_timed(times, range(6)) == [0, 2, 3]  # the faster half
    times[5] = [100.0 * (1 + TIE / 2)] * 5
    assert still_timed(times, range(6)) == [0, 2, 3, 5]  # and a near-tie
    assert still_timed(times, [1, 4]) == [1, 4]  # two stay, however slow
    # round j's fastest is over the candidates timed in round j
    rel = paired_ratios([[100.0, 100.0, 90.0], [110.0, 120.0, 90.0], [105.0]])
    assert rel == pytest.approx([1.0, 1.1, 1.05])


def test_candidates_that_run_long_are_halved_every_round(local_pipeline, monkeypatch):
    """Halvings come every DROP_AFTER_ROUNDS rounds, and after every round once the first round's
    runs all took LONG_RUN_S or more (a run of a real model is hundreds of kernel calls)."""
    import executor_svc.executor as ex

    model, inputs = mlp_example()
    bundles = [kiln.compile(model, inputs, pipeline=local_pipeline).result,
               kiln.compile(model, inputs, pipeline=local_pipeline, search=False).result]
    monkeypatch.setenv("KILN_PROFILE_BUDGET_S", "600")
    halved_at, real = [], ex.still_timed

    def still_timed(times, timing):
        halved_at.append(max(len(t) for t in times))  # rounds timed so far
        return real(times, timing)

    monkeypatch.setattr(ex, "still_timed", still_timed)
    for long_run_s, rounds in ((1e9, [ex.DROP_AFTER_ROUNDS]), (0.0, [1, 2, 3])):
        monkeypatch.setattr(ex, "LONG_RUN_S", long_run_s)
        halved_at.clear()
        local_pipeline.profile([b.bundle for b in bundles], bundles[0].manifest, repeats=ex.DROP_AFTER_ROUNDS + 1)
        assert halved_at == rounds


def test_timing_stops_at_its_budget_once_every_candidate_is_ranked(local_pipeline, monkeypatch, span_exporter):
    """Past MIN_ROUNDS rounds, Profile stops once it has timed for KILN_PROFILE_BUDGET_S seconds,
    and once the last two candidates have met in FINAL_ROUNDS rounds; the span says how many
    rounds it timed and what stopped it. A bad budget is refused."""
    from executor_svc.executor import FINAL_ROUNDS, MIN_ROUNDS
    from kiln.core.errors import InvalidArgument

    model, inputs = mlp_example()
    searched = kiln.compile(model, inputs, pipeline=local_pipeline).result
    unsearched = kiln.compile(model, inputs, pipeline=local_pipeline, search=False).result
    bundles = [searched.bundle, unsearched.bundle]
    monkeypatch.setenv("KILN_PROFILE_BUDGET_S", "1e-9")
    span_exporter.clear()
    timings = local_pipeline.profile(bundles, searched.manifest, repeats=20)
    (ps,) = [s for s in span_exporter.get_finished_spans() if s.name == "executor.profile"]
    assert ps.attributes["kiln.rounds"] == MIN_ROUNDS and ps.attributes["kiln.over_budget"] is True
    assert ps.attributes["kiln.stopped"] == "budget"
    assert all(t[1] > 0 for t in timings)
    monkeypatch.setenv("KILN_PROFILE_BUDGET_S", "60")
    for repeats, rounds, stopped in ((FINAL_ROUNDS - 1, FINAL_ROUNDS - 1, "repeats"),
                                     (20, FINAL_ROUNDS, "decided")):
        span_exporter.clear()
        local_pipeline.profile(bundles, searched.manifest, repeats=repeats)
        (ps,) = [s for s in span_exporter.get_finished_spans() if s.name == "executor.profile"]
        assert (ps.attributes["kiln.rounds"], ps.attributes["kiln.stopped"]) == (rounds, stopped)
        assert ps.attributes["kiln.over_budget"] is False
    monkeypatch.setenv("KILN_PROFILE_BUDGET_S", "soon")
    with pytest.raises(InvalidArgument, match="KILN_PROFILE_BUDGET_S"):
        local_pipeline.profile(bundles, searched.manifest)
