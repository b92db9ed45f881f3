"""CPU checks of the tuning and benchmark scripts that nothing else imports: the read
ceiling's CUDA source still compiles, bench_decode.py's dense peers gather the paged cache
and attend as a float64 reference does, sweep_decode.py picks its cases, and
bench_prefill.py merges a provider's two blocks of runs and ends its warm-ups before it
times anything, lists its rows without a GPU, and plans its columns with the backends they
name (ours fa2; the sm90 columns fa3, ragged checked against ours ragged and paged against
ours paged, skipped where the constructor or plan() declines), on the CPU with stand-in
wrappers; sass_hot_path.py reads the stall field and keeps to ncu's hot path."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_read_ceiling_source_compiles():
    import bench_read_ceiling

    exe = bench_read_ceiling.build("90a")
    assert exe.is_file() and exe.stat().st_size > 0
    shutil.rmtree(exe.parent)


def test_bench_decode_dense_peer_matches_a_float64_reference():
    torch = pytest.importorskip("torch")
    import bench_decode as bd

    gen = torch.Generator().manual_seed(7)
    batch, hq, hk, dim, page, kv_len = 3, 8, 2, 64, 16, 37  # a partial last page
    pages_each = -(-kv_len // page)
    cache_k = torch.randn(batch * pages_each + 2, page, hk, dim, generator=gen)
    cache_v = torch.randn(batch * pages_each + 2, page, hk, dim, generator=gen)
    ids = torch.randperm(batch * pages_each + 2, generator=gen)[:batch * pages_each].view(batch, pages_each)
    k = bd.dense_from_paged(cache_k, ids, kv_len)
    v = bd.dense_from_paged(cache_v, ids, kv_len)
    assert k.shape == (batch, hk, kv_len, dim) and k.is_contiguous()
    for b in range(batch):
        for t in (0, page - 1, page, kv_len - 1):
            assert torch.equal(k[b, :, t], cache_k[ids[b, t // page], t % page])
            assert torch.equal(v[b, :, t], cache_v[ids[b, t // page], t % page])
    q = torch.randn(batch, hq, 1, dim, generator=gen)
    out = bd.eager_attention(q, k, v)
    kk = k.double().repeat_interleave(hq // hk, dim=1)  # query head h reads KV head h // group
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    ref = torch.softmax(q.double() @ kk.transpose(-1, -2) / dim ** 0.5, dim=-1) @ vv
    assert out.shape == (batch, hq, 1, dim)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bench_decode_dense_peers_say_why_they_skip():
    import bench_decode as bd

    fp8 = bd.uniform("float8_e4m3fn", 4, 1, 2048)
    assert "float8_e4m3fn" in bd.dense_skip_reason(fp8, 12.0)
    assert "variable lengths" in bd.dense_skip_reason(bd.skewed(), 12.0)
    big = bd.uniform("bfloat16", 4, 256, 32768)
    assert "--sdpa-max-gb 12" in bd.dense_skip_reason(big, 12.0)
    assert bd.dense_skip_reason(bd.uniform("bfloat16", 8, 64, 4096), 12.0) is None


def test_sweep_decode_runs_full_grid_cases_only_when_named():
    import sweep_decode as sd

    assert sd.split_cases() == sd.SPLIT_CASES
    picked = sd.split_cases(["bfloa gqa4 b=16 kv=512", "bfloa gqa4 b=1 kv=2048"])
    assert picked == [("bfloat16", 4, 1, 2048), ("bfloat16", 4, 16, 512)]


def test_bench_prefill_interleaves_the_providers_of_a_row(monkeypatch):
    """time_interleaved runs every provider once a round (each first in turn, none twice in a
    row), each after a flush, and drops a provider that raises from the rounds without ending
    the row."""
    import bench_prefill as bp

    calls = []

    class Event:
        clock = 0.0

        def __init__(self, **_):
            self.t = None

        def record(self):
            Event.clock += 0.5  # 0.5 ms a run: under 1 ms
            self.t = Event.clock

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    import torch

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bp, "_gate", lambda: None)
    monkeypatch.setattr(bp.bc, "warmup_ms", lambda: 0.0)

    def provider(name, fail_at=None):
        def run():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} failed")
        return run

    out = bp.time_interleaved([provider("a"), provider("b"), provider("c", fail_at=6)], 4, lambda: calls.append("flush"))
    runs = [c for c in calls if c != "flush"]
    assert calls.count("flush") == len(runs)  # a flush before every run
    # one timed run each, 3 warm-up rounds, then rotated rounds (c leaves at its 6th call)
    assert runs[:12] == ["a", "b", "c"] * 4
    assert runs[12:15] == ["a", "b", "c"] and runs[15:17] == ["b", "c"] and runs[17] == "a"
    assert runs[18:20] == ["b", "a"] and runs[20:22] == ["b", "a"]  # two left (a ran last): b, a every round
    assert all(x != y for x, y in zip(runs[12:], runs[13:]))  # none twice in a row
    assert out[2]["error"] == "RuntimeError: c failed"
    for t in out[:2]:
        assert t["runs"] == 8 and t["warmup_runs"] == 3 and len(t["halves_median_us"]) == 2  # under 1 ms: 2 x reps
        assert t["median_us"] > 0


def test_bench_prefill_round_order():
    """A Williams design: over a cycle of rounds (n, or 2n for an odd n) each provider takes
    every place of a round equally often and follows every other provider equally often; none
    runs twice in a row, also across rounds, and `last` never opens a round."""
    import collections

    import bench_prefill as bp

    for n in range(2, 10):
        live = list(range(10, 10 + n))
        seq = [i for r in range(4 * n) for i in bp.round_order(live, r)]
        assert all(x != y for x, y in zip(seq, seq[1:]))
        cycle = [bp.round_order(live, r) for r in range(n if n % 2 == 0 else 2 * n)]
        assert all(sorted(o) == live for o in cycle)
        places = collections.Counter((i, o.index(i)) for o in cycle for i in o)
        after = collections.Counter((o[j - 1], o[j]) for o in cycle for j in range(1, n))
        if n > 2:  # (two: a, b every round, each after the other)
            assert len(places) == n * n and len(set(places.values())) == 1
            assert len(after) == n * (n - 1) and len(set(after.values())) == 1
        for r in range(2 * n):
            assert bp.round_order(live, r, last=live[0])[0] != live[0]


def test_bench_prefill_pairs_each_round(monkeypatch):
    """derive() pairs FA2's and our runs of the same round: a clock drift that moves both
    leaves the paired ratio where it is; a row whose providers ran unequal rounds gets none."""
    import bench_prefill as bp

    drift = [1.0, 1.1, 0.9, 1.3, 0.8]  # the GPU's clock moving between rounds
    ours = [100.0 * f for f in drift]
    fa2 = [104.0 * f for f in drift]
    res = {"forms": ["ragged", "paged"], "kind": "prefill", "impls": {
        "ours_ragged": {"median_us": 100.0, "timing": {"samples_us": ours}},
        "fa2_ragged": {"median_us": 104.0, "timing": {"samples_us": fa2}},
        "ours_paged": {"median_us": 100.0, "timing": {"samples_us": ours}},
        "fa2_paged": {"median_us": 100.0, "timing": {"samples_us": fa2[:3]}}}}
    bp.derive(res)
    got = res["paired_speedup_vs_fa2"]
    assert abs(got["ragged"]["median"] - 1.04) < 1e-9 and got["ragged"]["rounds"] == 5
    assert got["ragged"]["p10"] <= got["ragged"]["median"] <= got["ragged"]["p90"]
    assert "paged" not in got
    assert abs(res["speedup_vs_fa2"]["ragged"] - 1.04) < 1e-9


def test_bench_prefill_starts_every_warm_up_before_timing(monkeypatch):
    """Our warm-ups run kernels: all of them start with the first stage (none with a later
    one), and ours_done() returns once they have ended."""
    import time

    import bench_prefill as bp

    monkeypatch.setattr(bp, "OURS_WARMUP", "print('{\"ok\": true}')")
    builds = bp.Builds([(128, [], ["ragged_full"]), (64, [], ["paged_full", "decode1"])], None)
    assert sorted(builds.jobs) == [("ours", 64, "decode1"), ("ours", 64, "paged_full"), ("ours", 128, "ragged_full")]
    builds.ours_done(time.perf_counter() + 60)
    assert all(job["result"] is not None and job["result"].get("ok") for job in builds.jobs.values())
    assert not builds.running()


def test_bench_prefill_list_runs_without_a_gpu(capsys):
    import bench_prefill as bp

    assert bp.main(["--list", "--only", "hd128 causal 1x16k;hd64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hd128 causal 1x16k") and len(lines) == 11  # one hd128 row, ten hd64 rows
    assert bp.ours_configs(bp.row_list((128,), ("hd128 causal 1x16k", "spec")), 128, True, fa3=True) == \
        ["decode1", "decode4", "paged_causal", "paged_causal_fa3", "ragged_causal", "ragged_causal_fa3"]
    assert bp.ours_configs(bp.row_list((128,), ("chunked",)), 128, True, fa3=True) == \
        ["paged_causal", "paged_causal_fa3"]  # the paged-only rows warm up the paged sm90 column
    assert not any(c.endswith("_fa3") for c in bp.ours_configs(bp.row_list((128,)), 128, True))
    compile(bp.OURS_WARMUP, "OURS_WARMUP", "exec")  # the warm-up program (run on the GPU) parses


def _fake_fij(declines_hd=(256,), fa3_offset=0.0, paged_declines_hd=(256,), fa3_paged_offset=0.0,
              paged_ctor_declines=False):
    """A stand-in for flashinfer_jit's prefill wrappers on the CPU: out = q (+ fa3_offset, for
    the paged wrapper fa3_paged_offset, with backend="fa3"); backend="fa3" declines the head
    dims `declines_hd` (ragged) / `paged_declines_hd` (paged) at plan() with a ValueError, and
    with paged_ctor_declines the paged wrapper's constructor declines it."""
    import types

    class Ragged:
        def __init__(self, ws, layout, backend="auto"):
            self.backend = backend

        def plan(self, qo_indptr, kv_indptr, hq, hk, hd, causal=False, **_):
            if self.backend == "fa3" and hd in declines_hd:
                raise ValueError(f"backend='fa3': head_dim {hd} is not supported (64, 128)")
            self.planned_backend = "fa3" if self.backend == "fa3" else "fa2"

        def run(self, q, k, v, out):
            out.copy_(q + (fa3_offset if self.backend == "fa3" else 0.0))

    class Paged(Ragged):
        def __init__(self, ws, layout, backend="auto"):
            if backend == "fa3" and paged_ctor_declines:
                raise ValueError("backend='fa3': not supported on the Hopper path yet: use_cuda_graph")
            super().__init__(ws, layout, backend)

        def plan(self, qo_indptr, indptr, indices, last, hq, hk, hd, page_size, causal=False, **_):
            if self.backend == "fa3" and hd in paged_declines_hd:
                raise ValueError(f"backend='fa3': not supported on the Hopper path yet: page_size={page_size} "
                                 f"at head_dim {hd}")
            self.planned_backend = "fa3" if self.backend == "fa3" else "fa2"

        def run(self, q, kv, out):
            out.copy_(q + (fa3_paged_offset if self.backend == "fa3" else 0.0))

    calls = []

    def make(cls):
        def new(*args, **kw):
            calls.append((cls.__name__, kw.get("backend")))
            return cls(*args, **kw)
        return new

    return types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=make(Ragged),
                                 BatchPrefillWithPagedKVCacheWrapper=make(Paged)), calls


def _measure_rows_on_cpu(monkeypatch, fake, labels, head_dims):
    torch = pytest.importorskip("torch")
    import bench_prefill as bp

    monkeypatch.setattr(bp, "DEVICE", "cpu")
    monkeypatch.setattr(bp, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setitem(sys.modules, "flashinfer_jit", fake)
    # each provider's runs: 100 us x its place in the row (ours paged fastest), 5 rounds
    monkeypatch.setattr(bp, "time_interleaved", lambda fns, reps, flush: [
        bp.bc.summarize([100.0 * (i + 1)] * 5) | {"_samples": [100.0 * (i + 1)] * 5} for i in range(len(fns))])
    monkeypatch.setattr(bp, "PREFILL_SHAPES", ((2, 64),))  # small rows
    monkeypatch.setattr(bp, "SPEC", (2, 4, 64))
    monkeypatch.setattr(bp, "CHUNKED", (2, 16, 64))
    ctx = bp.Context(None, "no FlashInfer here", "no FlashInfer here", None, False, None, 5, None, 1000.0, None)
    rows = [bp.measure_row(r, ctx, seed=0) for r in bp.row_list(head_dims, labels)]
    return bp, rows


def test_bench_prefill_sm90_column_plans_fa3_checks_and_skips(monkeypatch):
    """ours paged / ragged plan with backend="fa2"; ours_fa3_ragged with backend="fa3", is
    checked against ours ragged, and where plan() declines (ValueError) its cell is skipped
    with the error's text; paged-only rows skip it; report() shows it all."""
    fake, calls = _fake_fij(paged_declines_hd=())
    bp, rows = _measure_rows_on_cpu(monkeypatch, fake, ("causal 2x64", "spec"), (128, 256))
    assert [r["label"] for r in rows] == ["hd128 causal 2x64", "hd128 spec 2x4 on 64",
                                          "hd256 causal 2x64", "hd256 spec 2x4 on 64"]
    assert {b for _, b in calls} == {"fa2", "fa3"}
    assert ("Paged", "fa2") in calls and ("Ragged", "fa2") in calls and ("Ragged", "fa3") in calls
    hd128, spec, hd256 = rows[0], rows[1], rows[2]
    e = hd128["impls"][bp.FA3_PATH]
    assert e["planned_backend"] == "fa3" and hd128["impls"]["ours_ragged"]["planned_backend"] == "fa2"
    assert e["checked_against"] == "ours_ragged" and e["vs_ours"]["agrees"] and e["vs_ours"]["max_abs_diff"] == 0
    assert hd128["check_fa3_path"]["agrees"] and hd128["targets"]["sm90 rg agrees with ours"]
    # the fake timings: ours paged 100, ours ragged 200, ours sm90 300 us; no peer ran
    assert e["median_us"] == 300.0 and abs(hd128["fa3_path_vs_ours_ragged"] - 2 / 3) < 1e-9
    assert hd128["fa3_path_vs_best_peer"] is None and hd128["fa3_path_best_peer"] is None
    assert hd256["impls"][bp.FA3_PATH] == {
        "skipped": "ValueError: backend='fa3': head_dim 256 is not supported (64, 128)"}
    assert "check_fa3_path" not in hd256 and hd256["fa3_path_vs_best_peer"] is None
    assert hd256["impls"]["ours_ragged"]["median_us"] == 200.0  # the skip leaves the others' timing alone
    assert spec["impls"][bp.FA3_PATH] == {"skipped": "spec rows are paged only"}
    res = {"meta": {}, "flashinfer": {"available": False, "reason": "no FlashInfer here"}, "rows": rows}
    text = bp.report(res)
    assert "ours sm90 rg" in text and "sm90 x best" in text
    assert "ours_fa3_ragged: ValueError: backend='fa3': head_dim 256 is not supported (64, 128)  [1 rows]" in text


def test_bench_prefill_sm90_column_disagreeing_misses_the_target(monkeypatch):
    fake, _ = _fake_fij(fa3_offset=1.0)
    bp, rows = _measure_rows_on_cpu(monkeypatch, fake, ("causal 2x64",), (64,))
    row = rows[0]
    assert not row["check_fa3_path"]["agrees"] and row["targets"]["sm90 rg agrees with ours"] is False
    assert "MISS" in bp.report({"meta": {}, "flashinfer": {}, "rows": rows})


def test_bench_prefill_fa3_path_vs_best_peer():
    """fa3_path_vs_best_peer: the fastest of FA3 ragged, SDPA cuDNN and SDPA flash (that ran)
    over ours_fa3_ragged, also paired round by round."""
    import bench_prefill as bp

    t = lambda us: {"median_us": us, "timing": {"samples_us": [us, us * 1.1, us * 0.9]}}
    res = {"forms": ["paged", "ragged"], "kind": "prefill", "impls": {
        "ours_ragged": t(150.0), bp.FA3_PATH: t(100.0), "fa3_ragged": t(120.0), "sdpa_flash": t(110.0),
        "sdpa_cudnn": {"error": "RuntimeError: no"}, "fa2_ragged": t(50.0)}}  # FA2: not one of the peers
    bp.derive(res)
    assert res["fa3_path_best_peer"] == "sdpa_flash" and abs(res["fa3_path_vs_best_peer"] - 1.1) < 1e-9
    assert abs(res["paired_fa3_path_vs_best_peer"]["median"] - 1.1) < 1e-9
    assert abs(res["fa3_path_vs_ours_ragged"] - 1.5) < 1e-9


def test_bench_prefill_sm90_paged_column_runs_every_row(monkeypatch):
    """ours_fa3_paged: the paged wrapper with backend="fa3" on every row (the chunked and the
    speculative rows too), on ours_paged's page table and cache, checked against ours paged;
    where plan() declines (ValueError) its cell is skipped with the error's text; report()
    shows the column, its best-peer ratio and its check."""
    fake, calls = _fake_fij(declines_hd=(), paged_declines_hd=(256,))
    bp, rows = _measure_rows_on_cpu(monkeypatch, fake, ("causal 2x64", "chunked", "spec"), (128, 256))
    assert [r["label"] for r in rows] == ["hd128 causal 2x64", "hd128 chunked 2x16 on 64", "hd128 spec 2x4 on 64",
                                          "hd256 causal 2x64", "hd256 chunked 2x16 on 64", "hd256 spec 2x4 on 64"]
    assert ("Paged", "fa3") in calls and ("Ragged", "fa3") in calls
    hd128, chunked, spec = rows[:3]
    # the fake timings, 100 us a place: prefill rows ours pg, ours rg, sm90 rg, sm90 pg; paged-only
    # rows ours pg, sm90 pg
    e = hd128["impls"][bp.FA3_PAGED]
    assert e["planned_backend"] == "fa3" and e["checked_against"] == "ours_paged"
    assert e["vs_ours"]["agrees"] and e["vs_ours"]["max_abs_diff"] == 0 and e["median_us"] == 400.0
    assert hd128["check_fa3_paged"]["agrees"] and hd128["check_fa3_paged"]["reference"] == "ours_paged"
    assert hd128["check_fa3_paged"]["tolerance"].startswith("|ours_fa3_paged - ref|")
    assert hd128["targets"]["sm90 pg agrees with ours"] and hd128["targets"]["sm90 rg agrees with ours"]
    assert abs(hd128["fa3_paged_vs_ours_paged"] - 0.25) < 1e-9
    assert hd128["fa3_paged_vs_best_peer"] is None and hd128["fa3_paged_best_peer"] is None  # no peer ran
    assert hd128["impls"][bp.FA3_PATH]["median_us"] == 300.0  # the ragged column where it was
    for row in (chunked, spec):
        e = row["impls"][bp.FA3_PAGED]
        assert e["planned_backend"] == "fa3" and e["checked_against"] == "ours_paged" and e["vs_ours"]["agrees"]
        assert e["median_us"] == 200.0 and abs(row["fa3_paged_vs_ours_paged"] - 0.5) < 1e-9
        assert row["targets"]["sm90 pg agrees with ours"]
        assert row["impls"][bp.FA3_PATH] == {"skipped": f"{row['kind']} rows are paged only"}
    why = "ValueError: backend='fa3': not supported on the Hopper path yet: page_size=16 at head_dim 256"
    for row in rows[3:]:
        assert row["impls"][bp.FA3_PAGED] == {"skipped": why}
        assert "check_fa3_paged" not in row and row["fa3_paged_vs_best_peer"] is None
        assert "sm90 pg agrees with ours" not in row["targets"]
        assert row["impls"]["ours_paged"]["median_us"] == 100.0
    assert rows[3]["impls"][bp.FA3_PATH]["median_us"] == 300.0  # the ragged column still runs at hd256
    text = bp.report({"meta": {}, "flashinfer": {"available": False, "reason": "no FlashInfer here"}, "rows": rows})
    for name in ("ours sm90 pg", "sm90 pg x best", "pg best peer", "paired pg best", "sm90 pg check",
                 "ours sm90 pg us"):
        assert name in text
    assert f"ours_fa3_paged: {why}  [3 rows]" in text


def test_bench_prefill_sm90_paged_column_disagreeing_misses_the_target(monkeypatch):
    fake, _ = _fake_fij(fa3_paged_offset=1.0)
    bp, rows = _measure_rows_on_cpu(monkeypatch, fake, ("causal 2x64", "spec"), (64,))
    for row in rows:
        assert not row["check_fa3_paged"]["agrees"] and row["check_fa3_paged"]["max_abs_diff"] >= 1.0
        assert row["targets"]["sm90 pg agrees with ours"] is False
    assert rows[0]["targets"]["sm90 rg agrees with ours"]  # the ragged column is fine
    text = bp.report({"meta": {}, "flashinfer": {}, "rows": rows})
    assert "MISS sm90 pg agrees with ours" in text and "DIFFERS 1." in text


def test_bench_prefill_sm90_paged_column_constructor_declines(monkeypatch):
    """A ValueError from the paged wrapper's constructor (not only plan()) skips the cell."""
    fake, _ = _fake_fij(paged_ctor_declines=True)
    bp, rows = _measure_rows_on_cpu(monkeypatch, fake, ("causal 2x64",), (128,))
    assert rows[0]["impls"][bp.FA3_PAGED] == {
        "skipped": "ValueError: backend='fa3': not supported on the Hopper path yet: use_cuda_graph"}
    assert rows[0]["impls"][bp.FA3_PATH]["vs_ours"]["agrees"]


def test_bench_prefill_fa3_paged_vs_best_peer():
    """fa3_paged_vs_best_peer: the fastest of FA3 paged, FA3 ragged, SDPA cuDNN and SDPA flash
    (that ran) over ours_fa3_paged, also paired round by round; fa3_paged_vs_ours_paged."""
    import bench_prefill as bp

    t = lambda us: {"median_us": us, "timing": {"samples_us": [us, us * 1.1, us * 0.9]}}
    res = {"forms": ["paged", "ragged"], "kind": "prefill", "impls": {
        "ours_paged": t(200.0), bp.FA3_PAGED: t(100.0), "fa3_paged": t(130.0), "fa3_ragged": t(105.0),
        "sdpa_flash": t(110.0), "sdpa_cudnn": {"error": "RuntimeError: no"}, "fa2_paged": t(50.0)}}
    bp.derive(res)
    assert res["fa3_paged_best_peer"] == "fa3_ragged" and abs(res["fa3_paged_vs_best_peer"] - 1.05) < 1e-9
    assert abs(res["paired_fa3_paged_vs_best_peer"]["median"] - 1.05) < 1e-9
    assert abs(res["fa3_paged_vs_ours_paged"] - 2.0) < 1e-9
    assert res["fa3_path_vs_best_peer"] is None and "check_fa3_paged" not in res  # no ragged sm90 run; no check
    del res["impls"]["fa3_ragged"]
    bp.derive(res)
    assert res["fa3_paged_best_peer"] == "sdpa_flash" and abs(res["fa3_paged_vs_best_peer"] - 1.1) < 1e-9
    res = {"forms": ["paged"], "kind": "spec", "impls": {
        "ours_paged": t(200.0), "fa3_paged": t(130.0), bp.FA3_PAGED: {"skipped": "ValueError: no"}}}
    bp.derive(res)
    assert res["fa3_paged_vs_best_peer"] is None and res["fa3_paged_best_peer"] is None
    assert "paired_fa3_paged_vs_best_peer" not in res and "fa3_paged_vs_ours_paged" not in res


def test_bench_prefill_features_lists_its_rows_and_needs_a_gpu_to_measure():
    """bench_prefill_features.py --list prints every option on both batches without a GPU;
    --only filters them; without a GPU a run exits with status 2 (nothing measured)."""
    import subprocess

    script = str(SCRIPTS / "bench_prefill_features.py")
    listed = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True, check=True).stdout
    lines = [ln.split() for ln in listed.splitlines() if ln.strip()]
    import bench_prefill_features as bpf

    assert len(lines) == len(bpf.OPTIONS) * len(bpf.BATCHES)
    assert {ln[0] for ln in lines} == set(bpf.OPTIONS)
    some = subprocess.run([sys.executable, script, "--list", "--only", "rope;fp8"], capture_output=True, text=True,
                          check=True).stdout
    assert {ln.split()[0] for ln in some.splitlines() if ln.strip()} == {"rope", "fp8_kv"}
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert subprocess.run([sys.executable, script, "--only", "none"], capture_output=True).returncode == 2


def test_bench_prefill_features_plans_each_option_as_named():
    """make_plans on a CPU workspace: the mma.sync kernel's plan carries the option (RoPE and
    ALiBi in the spec's pos_encoding, fp8 in its K/V dtype, the custom mask, the soft cap,
    head_dim 192 with 128 for V); the Hopper kernel's providers are skipped with a reason (the
    arch here, or the option it lacks)."""
    torch = pytest.importorskip("torch")
    import bench_prefill_features as bpf

    bpf.DEV = "cpu"
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    want = {"rope": ("pos_encoding", "rope_llama"), "alibi": ("pos_encoding", "alibi"),
            "fp8_kv": ("dtype_kv", "float8_e4m3fn"), "custom_mask": ("mask", "custom"), "soft_cap": ("soft_cap", True),
            "hd192x128": ("head_dim_qk", 192), "none": ("mask", "causal")}
    for option, (field, value) in want.items():
        wrappers, skipped, _ = bpf.make_plans(option, "causal 16x1k", ws)
        assert getattr(wrappers["fa2"]._plan.spec, field) == value, option
        assert {"fa3", "fa3_plain"} <= set(skipped), option
        assert all(why for why in skipped.values())



def test_bench_pod_reports_pod_on_hopper_against_ours_and_flashinfer():
    """bench_pod.py's POD-on-Hopper table: its ratios to our serial pair, the mma.sync POD, the
    overlap bound and FlashInfer's POD (over its second-pass time), and its check cell."""
    import bench_pod
    r = {"label": "mix", "impls": {"pod_hopper": {"median_us": 100.0, "pass2": {"median_us": 104.0}},
                                   "serial": {"median_us": 110.0}, "pod": {"median_us": 120.0},
                                   "prefill_only": {"median_us": 50.0}, "decode_only": {"median_us": 70.0},
                                   "flashinfer_pod": {"median_us": 130.0}},
         "check": {"pod_hopper": {"agrees": True, "max_abs_diff": 0.001}}}
    bench_pod.derive(r)
    sp = r["speedup"]
    assert sp["pod_hopper_vs_serial"] == pytest.approx(1.1) and sp["pod_hopper_vs_pod"] == pytest.approx(1.2)
    assert sp["pod_hopper_vs_ideal"] == pytest.approx(0.7) and sp["pod_hopper_vs_flashinfer_pod"] == pytest.approx(1.25)
    cells = bench_pod.line4(r)
    assert len(cells) == len(bench_pod.COLS4) and cells[-1] == "podH ok 0.0010" and not r["mismatch"]
    assert "pod_hopper" in bench_pod.OURS and "batch_attention_hopper" in bench_pod.NO_DECODES


def test_bench_fp8_attention_needs_a_gpu_and_plans_both_forms_on_the_cpu(monkeypatch):
    """bench_fp8_attention.py exits with status 2 without a GPU; its two providers' plans (the
    fp8 form and the bf16 kernel of the same wrapper, with the arch check passed) are what its
    rows time."""
    import subprocess

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        script = str(SCRIPTS / "bench_fp8_attention.py")
        assert subprocess.run([sys.executable, script], capture_output=True).returncode == 2
    import bench_fp8_attention as bfa

    import flashinfer_jit as fij
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    indptr = torch.arange(0, 2 * 1024 + 1, 1024, dtype=torch.int32)
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        w = fij.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD", backend="fa3")
        w.plan(indptr, indptr, *bfa.HEADS, bfa.HEAD_DIM, causal=True, q_data_type=dt, kv_data_type=dt,
               o_data_type=torch.bfloat16)
        assert w.planned_backend == "fa3" and w._plan.spec.fp8 == (dt == torch.float8_e4m3fn)


def test_sass_hot_path_sums_the_stall_field_along_ncus_hot_path(monkeypatch, tmp_path, capsys):
    import subprocess

    import sass_hot_path as shp

    # three instructions; the stall field is bits 41-44 of each instruction's second word
    insns = [("FMNMX R1, R2, R3, !PT", 2), ("@!P0 BRA 0x40", 5), ("MUFU.EX2 R4, R4", 4)]
    listing = "".join(
        f"        /*{16 * i:04x}*/                   {t} ;   /* 0x{i:016x} */\n"
        f"                                                     /* 0x{st << 41:016x} */\n"
        for i, (t, st) in enumerate(insns))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listing))
    assert shp.sass("m.so") == insns
    csv_path = tmp_path / "src.csv"
    header = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
    rows = [("FMNMX R1, R2, R3, !PT", 7, 64), ("@!P0 BRA 0x40", 1, 8), ("MUFU.EX2 R4, R4", 3, 64)]
    csv_path.write_text('"Kernel Name","k"\n' + header + "".join(
        f'"0x{i}","      {t}","{s}","{n}"\n' for i, (t, s, n) in enumerate(rows)))
    monkeypatch.setattr(sys, "argv", ["sass_hot_path.py", "m.so", "--ncu", str(csv_path), "--list"])
    assert shp.main() == 0
    out = capsys.readouterr().out
    assert "executed 64 times" in out and "instructions 2, stall cycles 6" in out  # the branch is off the path
    # another binary than ncu's: refused
    rows[2] = ("FFMA R4, R4, R4, R4", 3, 64)
    csv_path.write_text('"Kernel Name","k"\n' + header + "".join(
        f'"0x{i}","      {t}","{s}","{n}"\n' for i, (t, s, n) in enumerate(rows)))
    with pytest.raises(SystemExit, match="is not the kernel of"):
        shp.main()
    # without ncu: between two patterns, every instruction counted
    monkeypatch.setattr(sys, "argv", ["sass_hot_path.py", "m.so", "--from", "FMNMX", "--to", "MUFU"])
    assert shp.main() == 0
    assert "instructions 2, stall cycles 7" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["sass_hot_path.py", "m.so", "--from", "HGMMA", "--to", "MUFU"])
    with pytest.raises(SystemExit, match="no instruction matches"):
        shp.main()
