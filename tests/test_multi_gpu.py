"""Several GPUs: one process driving two devices, and one process per device on an empty
cache (skipped where fewer than two GPUs are visible).

One process: layer steps (RoPE + fp8 quantize + append, decode, prefill; scripts/layer_step.py)
and plain appends alternate between cuda:0 and cuda:1 with the other device current, wrappers
created under each device, eager and captured in a CUDA graph, on the device's default and
side streams; each result is checked against float64 references. A wrapper given tensors of
the other device is a clear error, before any launch.

Processes: one per GPU (CUDA_VISIBLE_DEVICES), started together on one empty cache, each
builds or waits for the modules it needs and runs them; each module is built once."""

from __future__ import annotations

import itertools
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from layer_step import Batch, LayerStep, llama8b_batch, verify  # noqa: E402
from race_helpers import run_together  # noqa: E402

import flashinfer_jit as fij  # noqa: E402
from flashinfer_jit.reference.append import append_paged_kv_cache_ref  # noqa: E402
from flashinfer_jit.runtime.page_table import csr_page_table  # noqa: E402

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
needs_two = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")


def _step_and_check(step: LayerStep, batch: Batch, seed: int, what: str) -> None:
    step.prepare(batch, seed)
    before = (step.k_cache.clone(), step.v_cache.clone())
    step.out.fill_(float("nan"))
    step.run()
    torch.cuda.synchronize(step.device)
    verify(step, before, what)


@pytest.mark.gpu
@needs_two
def test_one_process_alternates_between_two_gpus():
    import random

    rnd = random.Random(1)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    # wrappers created under each device, the other one current
    steps = {}
    for dev, other in zip(devices, reversed(devices)):
        with torch.cuda.device(other):
            steps[dev.index] = LayerStep(device=dev, graph=False, seed=dev.index)
    torch.cuda.set_device(0)
    for i in range(6):
        dev = devices[i % 2]
        batch = llama8b_batch(rnd, decode=5 + i, prefill=2, prefill_tokens=200 + 40 * i)
        _step_and_check(steps[dev.index], batch, 10 + i, f"eager step {i} on {dev}")
    # a side stream of cuda:1 while cuda:0 is current: the fast run() path launches on the
    # current stream of the tensors' device
    side = torch.cuda.Stream(devices[1])
    with torch.cuda.stream(side):
        _step_and_check(steps[1], llama8b_batch(rnd, 7, 3, 300), 30, "step on a side stream of cuda:1")
    torch.cuda.set_device(0)

    # a CUDA-graph step on each device, replayed after re-plans, alternately
    graphs = {}
    for dev in devices:
        with torch.cuda.device(dev):
            graphs[dev.index] = LayerStep(device=dev, graph=True, decode_cap=8, prefill_cap=2, prefill_tokens=256,
                                          pool_pages=2048, seed=5 + dev.index)
    for i in range(4):
        dev = devices[i % 2]
        g = graphs[dev.index]
        # each device's first plan at the captured size (a decode graph's capacity is its first batch)
        g.prepare(llama8b_batch(rnd, decode=8 if i < 2 else 8 - i, prefill=2 if i < 2 else 1,
                                prefill_tokens=256 - 50 * i), seed=50 + i)
        before = (g.k_cache.clone(), g.v_cache.clone())
        with torch.cuda.device(dev):
            if g.graph_obj is None:
                g.capture()
            g.out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize(dev)
        verify(g, before, f"graph replay {i} on {dev}")


@pytest.mark.gpu
@needs_two
def test_tensors_moved_between_devices_and_a_wrapper_of_the_other_device():
    """append_paged_kv_cache on data moved from cuda:0 to cuda:1 and back; a wrapper planned on
    cuda:0 given cuda:1 tensors raises naming the device, before any launch."""
    gen = torch.Generator().manual_seed(3)
    pages, page, hk, d = 32, 16, 8, 128
    lens = [5, 40, 17]
    indptr = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    indices = torch.randperm(pages, generator=gen)[:6].to(torch.int32)
    last = torch.tensor([5, 8, 1], dtype=torch.int32)
    k_cache = torch.randn(pages, page, hk, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(pages, page, hk, d, generator=gen).to(torch.bfloat16)
    key = torch.randn(sum(lens), hk, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(sum(lens), hk, d, generator=gen).to(torch.bfloat16)
    append_indptr = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
        torch.cuda.set_device(1 if dev == "cuda:0" else 0)  # the other device current
        t = {name: x.to(dev) for name, x in dict(k=k_cache, v=v_cache, key=key, value=value, indptr=indptr,
                                                 indices=indices, last=last, append_indptr=append_indptr).items()}
        seq_lens = fij.get_seq_lens(t["indptr"], t["last"], page)
        bi, pos = fij.get_batch_indices_positions(t["append_indptr"], seq_lens, sum(lens))
        fij.append_paged_kv_cache(t["key"], t["value"], bi, pos, (t["k"], t["v"]), t["indices"], t["indptr"],
                                  t["last"], "NHD")
        torch.cuda.synchronize(dev)
        table = csr_page_table(indptr, indices, last)
        k_ref, v_ref = append_paged_kv_cache_ref(key, value, bi.cpu(), pos.cpu(), k_cache, v_cache, table, "NHD")
        assert torch.equal(t["k"].cpu(), k_ref) and torch.equal(t["v"].cpu(), v_ref), f"append on {dev}"
    torch.cuda.set_device(0)

    workspace = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda:0")
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    kc0, vc0 = k_cache.to("cuda:0"), v_cache.to("cuda:0")
    wrapper.plan(indptr.to("cuda:0"), indices.to("cuda:0"), last, 32, hk, d, page, q_data_type=torch.bfloat16)
    q = torch.randn(3, 32, d, generator=gen).to(torch.bfloat16)
    out0 = wrapper.run(q.to("cuda:0"), (kc0, vc0))
    with pytest.raises(ValueError, match="device|cuda:1"):
        wrapper.run(q.to("cuda:1"), (k_cache.to("cuda:1"), v_cache.to("cuda:1")))
    torch.testing.assert_close(wrapper.run(q.to("cuda:0"), (kc0, vc0)), out0, atol=0, rtol=0)


# --- one process per GPU, started together on an empty cache ------------------------------------
WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
    ready, go = sys.argv[1], sys.argv[2]
    from layer_step import LayerStep, llama8b_batch, verify
    import random
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    start = time.perf_counter()
    step = LayerStep(device="cuda", graph=False, pool_pages=1024)
    step.prepare(llama8b_batch(random.Random(0), 4, 2, 100, max_kv=500), seed=1)
    before = (step.k_cache.clone(), step.v_cache.clone())
    step.run()
    torch.cuda.synchronize()
    verify(step, before, "worker")
    print(json.dumps({"device": torch.cuda.get_device_name(), "visible": os.environ["CUDA_VISIBLE_DEVICES"],
                      "seconds": time.perf_counter() - start}))
""")


@pytest.mark.gpu
@pytest.mark.slow
@needs_two
def test_one_process_per_gpu_on_an_empty_cache(tmp_path):
    root = tmp_path / "cache"
    envs = [dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), FLASHINFER_JIT_CACHE_DIR=str(root),
                 FLASHINFER_JIT_VERBOSE="1", FLASHINFER_JIT_CACHE_PATH="") for i in range(torch.cuda.device_count())]
    outputs = run_together(tmp_path, WORKER, envs, REPO, 120, 900, "worker")
    results = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    assert sorted(r["visible"] for r in results) == [str(i) for i in range(len(envs))]
    built = [line.split("building", 1)[1].split()[0] for text in outputs for line in text.splitlines()
             if "flashinfer_jit: building" in line]
    assert built and len(built) == len(set(built)), f"a module was built more than once: {sorted(built)}"
    # (the run() fast path's extension, fij_fastcall, builds into the cache's hidden .fastcall/)
    modules = [name for name in built if name != "fij_fastcall"]
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert len(entries) == len(modules), (sorted(p.name for p in entries), modules)
    if len(modules) < len(built):
        assert (root / ".fastcall").is_dir(), sorted(p.name for p in root.iterdir())


@pytest.mark.gpu
@needs_two
@pytest.mark.parametrize("backend", ["fa2", "auto"], ids=["pod", "pod-on-hopper"])
def test_pod_alternates_between_two_gpus(backend):
    """BatchAttention (one POD launch: persistent blocks taking units from their device's
    scheduling counters) planned on cuda:0 and on cuda:1, each with the other device
    current, then run in turn, four times, with either device current. Counters shared
    between the devices, or left non-zero by the other device's launch, would leave rows
    unwritten (NaN-poisoned here) or give them twice; every run is checked against the
    float64 reference. backend "auto": POD on Hopper (csrc/pod/pod_sm90.cuh) on sm_90."""
    if backend == "auto" and torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    import random

    from flashinfer_jit.reference.prefill import prefill_ref

    rnd = random.Random(3)
    page_size, hq, hk, hd, bf16 = 16, 32, 8, 128, torch.bfloat16
    runs = {}
    for idx, other in ((0, 1), (1, 0)):
        dev = torch.device("cuda", idx)
        gen = torch.Generator(device=dev).manual_seed(idx)
        # decodes, a prompt chunk, a speculative verification, ... (long enough for the Hopper kernel)
        qo = [1] * 40 + ([300, 4, 1, 77] if backend == "fa2" else [900, 4, 1, 500])
        rnd.shuffle(qo)
        kv = [n + rnd.randint(0, 1500) for n in qo]
        pages = [-(-n // page_size) for n in kv]
        ids = rnd.sample(range(sum(pages) + 3), sum(pages) + 3)

        def i32(values):
            return torch.tensor(values, dtype=torch.int32, device=dev)

        qo_indptr, kv_indptr = (i32([0, *itertools.accumulate(x)]) for x in (qo, pages))
        kv_indices, kv_lens = i32(ids[: sum(pages)]), i32(kv)
        q = torch.randn(sum(qo), hq, hd, generator=gen, device=dev).to(bf16)
        cache = torch.randn(len(ids), 2, page_size, hk, hd, generator=gen, device=dev).to(bf16)
        last = i32([n - (p - 1) * page_size for n, p in zip(kv, pages)])
        ref, _ = prefill_ref(q, qo_indptr, cache[:, 0], cache[:, 1],
                             page_table=csr_page_table(kv_indptr, kv_indices, last), causal=True)
        with torch.cuda.device(other):
            w = fij.BatchAttention(kv_layout="NHD", device=str(dev))
            w.prefill_backend = backend
            w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, hq, hk, hd, hd, page_size, causal=True,
                   q_data_type=bf16, kv_data_type=bf16)
            if backend == "auto":
                assert w._pod._prefill.planned_backend == "fa3"
        runs[idx] = (w, q, cache, ref)
    for i in range(4):
        for idx in (1, 0) if i % 2 else (0, 1):
            w, q, cache, ref = runs[idx]
            with torch.cuda.device(i % 2):  # the other device current every second time
                out = torch.full_like(q, float("nan"))
                w.run(q, cache, out=out)
            torch.cuda.synchronize(idx)
            err = (out.double() - ref).abs() - 2e-2 * (1 + ref.abs())
            assert not torch.isnan(out).any(), f"cuda:{idx}, run {i}: rows left unwritten"
            assert float(err.max()) <= 0, f"cuda:{idx}, run {i}: off by {float(err.max()):.3e} beyond tolerance"
