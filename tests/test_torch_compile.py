"""torch.compile through every wrapper's run() and every functional call (issue 63, item 7).

Under Dynamo each run() takes its traced path (runtime.checks.compiling): checks of shapes
and dtypes only, outputs from torch.empty, and the module's op by its torch.ops name
(runtime.launch.traced_namespace), never fij_fastcall or a recorded launch. The tensors a
plan keeps are marked static inputs (runtime.checks.static_inputs), so that under
mode="reduce-overhead" CUDA-graph trees neither copy them nor skip the graph because an op
writes one (partial states, merge counters).

CPU tests (no marker) trace the wrappers on CPU tensors with stand-in ops of the real
schemas (DecodeSpec/PrefillSpec/PodSpec.op_schemas) registered for the CPU: fullgraph=True
with no graph break, the op in the graph, the outputs it wrote returned. No module is
built (FLASHINFER_JIT_NATIVE_PLAN=0: the planners' numpy twins). GPU tests (marked `gpu`)
compile the real kernels: fullgraph=True equal to eager bit for bit, outputs poisoned with
NaN first; mode="reduce-overhead" with the kernel inside the captured graph (no cudagraph
skip, no "CUDA Graph is empty", replays on new inputs in the same tensors equal eager).
Their modules are in scripts/matrices/tests (bf16/fp16 head_dim 128, 32 query / 8 KV heads).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import flashinfer_jit as fi
from flashinfer_jit.decode import wrapper as decode_wrapper
from flashinfer_jit.decode.spec import DecodeSpec
from flashinfer_jit.pod import wrapper as pod_wrapper
from flashinfer_jit.pod.spec import PodSm90Spec, PodSpec
from flashinfer_jit.prefill import wrapper as prefill_wrapper
from flashinfer_jit.prefill.spec import PrefillSm90Spec, PrefillSpec
from flashinfer_jit.runtime.checks import constant_result

HQ, HK, D, PS = 32, 8, 128, 16
BF16 = torch.bfloat16


def _csr(lens, page_size=PS, device="cpu"):
    pages = [-(-n // page_size) for n in lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
    ids = torch.randperm(indptr[-1] + 3, generator=torch.Generator().manual_seed(5))[: indptr[-1]]
    return (torch.tensor(indptr, dtype=torch.int32, device=device), ids.to(torch.int32).to(device),
            torch.tensor(last, dtype=torch.int32, device=device))


def _explain_and_compile(fn, *args):
    """(Dynamo's graphs of fn, fn compiled with fullgraph=True and aot_eager) after checking
    that it traces with no graph break."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    torch._dynamo.reset()
    return graphs, torch.compile(fn, fullgraph=True, backend=_aot_without_synthetic_bases())


def _aot_without_synthetic_bases():
    """aot_eager that fails on an as_strided in the functionalized graph: what AOTAutograd
    emits where two inputs an op mutates are views of one buffer (a synthetic base, copied
    whole at every call; inductor read such a copy past the buffer's end on an H200)."""
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, example_inputs):
        strided = [str(n.target) for n in gm.graph.nodes if "as_strided" in str(n.target)]
        assert not strided, f"a synthetic base in the compiled graph: {strided}"
        return gm.forward

    return aot_autograd(fw_compiler=forward)


# === CPU: stand-in ops of the real schemas =========================================================
_NS = "fij_compile_test"
_LIB = None


def _stand_in_library():
    """Ops `decode`, `prefill`, `pod` in namespace _NS with the modules' schemas, for the CPU:
    out = q x 2 (decode side of POD: x 3), lse = 3 (where it has rows)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library(_NS, "DEF")
    lib.define("decode" + DecodeSpec.op_schemas(None)["decode"])
    lib.define("prefill" + PrefillSpec.op_schemas(None)["prefill"])
    lib.define("pod" + PodSpec.op_schemas(None)["pod"])
    lib.define("pod_sm90" + PodSm90Spec.op_schemas(None)["pod_sm90"])
    lib.define("prefill_sm90" + PrefillSm90Spec.op_schemas(None)["prefill_sm90"])

    def decode(q, k, v, page_table, work, merge, out, lse, *rest):
        out.copy_(q * 2)
        lse.fill_(3.0)

    def prefill(q, k, v, kv_index, qo, work, merge, mask, mask_indptr, sinks, out, lse, *rest):
        out.copy_(q[..., : out.shape[-1]] * 2)
        lse.fill_(3.0)

    def pod(q_p, k_p, v_p, kv_p, qo_p, work_p, merge_p, mask_p, mask_indptr_p, out_p, lse_p, po_p, pl_p, c_p,
            ls_p, vs_p, w_p, g_p, t_p, m_p, q_d, k_d, v_d, pt_d, work_d, merge_d, out_d, lse_d, *rest):
        out_p.copy_(q_p * 2)
        lse_p.fill_(3.0)
        out_d.copy_(q_d * 3)
        lse_d.fill_(3.0)

    def pod_sm90(q_p, k_p, v_p, work_p, ids_p, out_p, lse_p, ls_p, w_p, vs_p, q_d, k_d, v_d, pt_d, work_d, merge_d,
                 out_d, lse_d, *rest):
        out_p.copy_(q_p * 4)
        lse_p.fill_(5.0)
        out_d.copy_(q_d * 3)
        lse_d.fill_(3.0)

    def prefill_sm90(q, k, v, work, ids, mask, counters, out, lse, *rest):
        out.copy_(q * 4)
        lse.fill_(5.0)

    for name, fn in (("decode", decode), ("prefill", prefill), ("pod", pod), ("pod_sm90", pod_sm90),
                     ("prefill_sm90", prefill_sm90)):
        lib.impl(name, fn, "CPU")
    _LIB = lib


@pytest.fixture
def stand_in(monkeypatch):
    """The wrappers' traced paths look their ops up in _NS; the planners run their numpy twins."""
    _stand_in_library()
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", "0")
    name = constant_result(lambda *args: _NS)
    monkeypatch.setattr(decode_wrapper, "traced_namespace", name)
    monkeypatch.setattr(prefill_wrapper, "traced_namespace", name)
    monkeypatch.setattr(pod_wrapper, "_pod_namespace", name)
    monkeypatch.setattr(pod_wrapper, "_pod_sm90_namespace", name)
    return getattr(torch.ops, _NS)


def _has_op(graphs, op) -> bool:
    return any(node.target is op.default for gm in graphs for node in gm.graph.nodes)


def _cpu_cache(num_pages):
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randn(num_pages, PS, HK, D, generator=gen).to(BF16) for _ in range(2))


@pytest.mark.parametrize("n_tok", [1, 2])
def test_decode_run_traces_to_its_op(stand_in, n_tok):
    lens = [37, 5, 300]
    table = _csr(lens)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(32 << 20, dtype=torch.uint8), "NHD", use_tensor_cores=True)
    w.plan(*table, HQ, HK, D, PS, q_data_type=BF16, q_len_per_req=n_tok)
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in w._plan.args[0])
    q = torch.randn(len(lens) * n_tok, HQ, D).to(BF16)
    k, v = _cpu_cache(int(table[0][-1]) + 3)

    def layer(q, k, v):
        out, lse = w.run(q * 1.0, (k, v), return_lse=True)
        return out.float() + 1.0, lse

    graphs, compiled = _explain_and_compile(layer, q, k, v)
    assert _has_op(graphs, stand_in.decode)
    out, lse = compiled(q, k, v)
    assert torch.equal(out, (q * 2).float() + 1.0) and lse.shape == (q.shape[0], HQ) and bool((lse == 3).all())


def test_decode_rejects_a_q_of_another_q_len_per_req():
    """Item 8: a q whose rows are not plan()'s batch x q_len_per_req is a ValueError that
    names q and the planned q_len_per_req, before anything is launched (FlashInfer's
    test_tensor_core_decode_rejects_mismatched_q_len)."""
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(32 << 20, dtype=torch.uint8), "NHD",
                                              use_tensor_cores=True)
    table = _csr([PS] * 4)
    w.plan(*table, 8, 2, D, PS, q_data_type=BF16, kv_data_type=BF16, q_len_per_req=2)
    k, v = (torch.zeros(8, PS, 2, D, dtype=BF16) for _ in range(2))
    for rows in (12, 9, 4):
        with pytest.raises(ValueError, match=r"q: .*q_len_per_req 2") as info:
            w.run(torch.zeros(rows, 8, D, dtype=BF16), (k, v))
        assert f"{rows} rows" in str(info.value)
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(torch.zeros(8, 8, D, dtype=BF16), (k, v), q_len_per_req=4)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_prefill_run_traces_to_its_op(stand_in, kind):
    qo = torch.tensor([0, 10, 11, 40], dtype=torch.int32)
    ws = torch.zeros(32 << 20, dtype=torch.uint8)
    kv_lens = [30, 300, 29]
    if kind == "paged":
        table = _csr(kv_lens)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo, *table, HQ, HK, D, PS, causal=True, q_data_type=BF16)
        k, v = _cpu_cache(int(table[0][-1]) + 3)
    else:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(qo, torch.tensor([0, 30, 330, 359], dtype=torch.int32), HQ, HK, D, causal=True, q_data_type=BF16)
        k, v = (torch.randn(359, HK, D).to(BF16) for _ in range(2))
    q = torch.randn(40, HQ, D).to(BF16)
    out_given = torch.full((40, HQ, D), float("nan"), dtype=BF16)

    def layer(q, k, v, out):
        kv = (k, v) if kind == "paged" else None
        a, lse = (w.run(q, kv, return_lse=True) if kind == "paged" else w.run(q, k, v, return_lse=True))
        b = w.run(q, kv, out=out) if kind == "paged" else w.run(q, k, v, out=out)
        return a * 1, lse, b

    graphs, compiled = _explain_and_compile(layer, q, k, v, out_given.clone())
    assert _has_op(graphs, stand_in.prefill)
    out = out_given.clone()
    a, lse, b = compiled(q, k, v, out)
    assert torch.equal(a, q * 2) and bool((lse == 3).all()) and torch.equal(out, q * 2) and torch.equal(b, q * 2)


def test_single_functions_trace_once_planned(stand_in):
    """single_prefill/single_decode_with_kv_cache: planned at their first (eager) call, kept;
    under torch.compile the kept plan's run() traces (a plan cannot be traced: a clear error)."""
    q, k, v = torch.randn(20, HQ, D).to(BF16), torch.randn(50, HK, D).to(BF16), torch.randn(50, HK, D).to(BF16)
    with pytest.raises(ValueError, match="CUDA"):  # planned, then the CPU tensors are refused
        fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    qd = torch.randn(HQ, D).to(BF16)
    with pytest.raises(ValueError, match="CUDA"):
        fi.single_decode_with_kv_cache(qd, k, v)

    def step(q, k, v, qd):
        return fi.single_prefill_with_kv_cache(q, k, v, causal=True) + 1, fi.single_decode_with_kv_cache(qd, k, v)

    graphs, compiled = _explain_and_compile(step, q, k, v, qd)
    assert _has_op(graphs, stand_in.prefill) and _has_op(graphs, stand_in.decode)
    a, b = compiled(q, k, v, qd)
    assert torch.equal(a, q * 2 + 1) and torch.equal(b, qd * 2)

    def unplanned(q, k, v):
        return fi.single_prefill_with_kv_cache(q[:7], k, v, causal=True)

    with pytest.raises(Exception, match="call it once eagerly"):
        torch.compile(unplanned, fullgraph=True, backend="eager")(q, k, v)


def _traced_batch_pod(op, d_table, k, v, q_d, qo_lens_p, kv_lens_p, backend: str = "fa2"):
    """A BatchPODWithPagedKVCacheWrapper (prefill_backend `backend`) planned causal for prefills
    of qo_lens_p query tokens on kv_lens_p keys beside d_table's decodes, its run() compiled
    (fullgraph) and traced to `op`: (the wrapper, q_p, the compiled outputs out_p, out_d, lse_p,
    lse_d)."""
    batch_pod = fi.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    batch_pod.prefill_backend = backend
    qo_p = torch.tensor([0, *itertools.accumulate(qo_lens_p)], dtype=torch.int32)
    batch_pod.plan(qo_p, *_csr(kv_lens_p), torch.arange(q_d.shape[0] + 1, dtype=torch.int32), *d_table, HQ, HK, D,
                   PS, q_data_type=BF16, causal=True)
    q_p = torch.randn(int(qo_p[-1]), HQ, D).to(BF16)

    def batch(q_p, q_d, k, v):
        (out_p, out_d), (lse_p, lse_d) = batch_pod.run(q_p, (k, v), q_d, (k, v), causal_p=True, return_lse=True)
        return out_p, out_d, lse_p, lse_d

    graphs, compiled = _explain_and_compile(batch, q_p, q_d, k, v)
    assert _has_op(graphs, op)
    return batch_pod, q_p, *compiled(q_p, q_d, k, v)


def _traced_batch_attention(op, qo_lens, kv_lens, k, v, backend: str = "fa2"):
    """A BatchAttention (prefill_backend `backend`) planned causal for one batch of qo_lens
    query tokens on kv_lens keys, its run() compiled (fullgraph) and traced to `op`: (the
    wrapper, q, the compiled out and lse, which rows are decodes)."""
    ba = fi.BatchAttention("NHD", device="cpu")
    ba.prefill_backend = backend
    qo = torch.tensor([0, *itertools.accumulate(qo_lens)], dtype=torch.int32)
    indptr, ids, _ = _csr(kv_lens)
    ba.plan(qo, indptr, ids, torch.tensor(kv_lens, dtype=torch.int32), HQ, HK, D, D, PS, causal=True)
    assert ba._planned[0] == "pod"
    q = torch.randn(int(qo[-1]), HQ, D).to(BF16)

    def mixed(q, k, v):
        out, lse = ba.run(q, (k, v))
        return out * 1, lse

    graphs, compiled = _explain_and_compile(mixed, q, k, v)
    assert _has_op(graphs, op)
    out, lse = compiled(q, k, v)
    decode_rows = torch.tensor([n == 1 for n in qo_lens]).repeat_interleave(torch.tensor(qo_lens))
    return ba, q, out, lse, decode_rows


def test_pod_wrappers_and_batch_attention_trace_to_the_pod_op(stand_in):
    ws = torch.zeros(64 << 20, dtype=torch.uint8)
    d_table = _csr([40, 300])
    k, v = _cpu_cache(int(d_table[0][-1]) + 3)
    q_d = torch.randn(2, HQ, D).to(BF16)
    # one prefill (ragged K/V) and decodes: the prefill side planned at an eager run()
    pod = fi.PODWithPagedKVCacheWrapper(ws, "NHD")
    pod.plan(*d_table, HQ, HK, D, PS, q_data_type=BF16)
    q_p, k_p, v_p = torch.randn(30, HQ, D).to(BF16), torch.randn(60, HK, D).to(BF16), torch.randn(60, HK, D).to(BF16)
    with pytest.raises(ValueError, match="CUDA"):
        pod.run(q_p, k_p, v_p, q_d, (k, v), causal_p=True)

    def one(q_p, k_p, v_p, q_d, k, v):
        out_p, out_d = pod.run(q_p, k_p, v_p, q_d, (k, v), causal_p=True)
        return out_p + 1, out_d

    graphs, compiled = _explain_and_compile(one, q_p, k_p, v_p, q_d, k, v)
    assert _has_op(graphs, stand_in.pod)
    out_p, out_d = compiled(q_p, k_p, v_p, q_d, k, v)
    assert torch.equal(out_p, q_p * 2 + 1) and torch.equal(out_d, q_d * 3)
    # a batch of prefills and decodes over the paged cache
    _, q_pp, out_p, out_d, lse_p, lse_d = _traced_batch_pod(stand_in.pod, d_table, k, v, q_d, [10, 15], [30, 70])
    assert torch.equal(out_p, q_pp * 2) and torch.equal(out_d, q_d * 3) and bool((lse_d == 3).all())
    # BatchAttention: decodes last (one run of rows each side), then interleaved (gather, scatter)
    for qo_lens in ([10, 15, 1, 1], [1, 10, 1, 15]):
        ba, q, out, lse, decode_rows = _traced_batch_attention(stand_in.pod, qo_lens, [30, 70, 40, 300], k, v)
        expect = torch.where(decode_rows[:, None, None], q * 3, q * 2)
        assert torch.equal(out, expect) and bool((lse == 3).all())

        # in place: the caller's out and lse are graph inputs, each side's rows a view of them
        def into(q, k, v, out, lse):
            ba.run(q, (k, v), out=out, lse=lse)
            return out * 1

        out, lse = torch.full_like(q, float("nan")), torch.full((q.shape[0], HQ), float("nan"))
        graphs, compiled = _explain_and_compile(into, q, k, v, out, lse)
        assert torch.equal(compiled(q, k, v, out, lse), expect) and torch.equal(out, expect)
        assert bool((lse == 3).all())


# === GPU: the kernels compiled, fullgraph and reduce-overhead ======================================
DEV = "cuda"


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _gpu_cache(num_pages, dtype=BF16, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(num_pages, PS, HK, D, generator=gen, device=DEV).to(dtype) for _ in range(2))


def _gpu_prefill_setup(kind, ws):
    qo = torch.tensor([0, 100, 101, 400], dtype=torch.int32)
    kv_lens = [300, 2000, 299]
    if kind == "paged":
        table = _csr(kv_lens, device=DEV)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo, *table, HQ, HK, D, PS, causal=True, q_data_type=BF16)
        kv = _gpu_cache(int(table[0][-1]) + 3)
    else:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(qo, torch.tensor([0, 300, 2300, 2599], dtype=torch.int32), HQ, HK, D, causal=True, q_data_type=BF16)
        gen = torch.Generator(device=DEV).manual_seed(2)
        kv = tuple(torch.randn(2599, HK, D, generator=gen, device=DEV).to(BF16) for _ in range(2))
    return w, kv, 400


def _call(w, kind, q, kv, **kw):
    return w.run(q, kv, **kw) if kind == "paged" else w.run(q, *kv, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "decode_mtp", "paged", "ragged"])
def test_gpu_fullgraph_equals_eager(kind):
    """fullgraph=True (Inductor) around run() with out= / lse= poisoned with NaN and without:
    no graph break, eager's bits, and still right after a re-plan (the graph reads the plan's
    buffers)."""
    import torch._dynamo

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(7)
    if kind.startswith("decode"):
        n = 4 if kind == "decode_mtp" else 1
        lens = [900, 65, 3000]
        table = _csr(lens, device=DEV)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(*table, HQ, HK, D, PS, q_data_type=BF16, q_len_per_req=n)
        kv = _gpu_cache(int(table[0][-1]) + 3)
        rows, call = 3 * n, (lambda q, kv, **kw: w.run(q, kv, **kw))
    else:
        w, kv, rows = _gpu_prefill_setup(kind, ws)
        call = functools_partial(_call, w, kind)
    q = torch.randn(rows, HQ, D, generator=gen, device=DEV).to(BF16)

    def layer(q, k, v, out, lse):
        a, a_lse = call(q * 1.0, (k, v), return_lse=True)
        b = call(q, (k, v), out=out, lse=lse)
        return a.float() * 2.0, a_lse, b

    out0 = _nan_like(torch.empty(rows, HQ, D, dtype=BF16, device=DEV))
    lse0 = _nan_like(torch.empty(rows, HQ, dtype=torch.float32, device=DEV))
    expected = [t.clone() for t in layer(q, *kv, out0.clone(), lse0.clone())]
    explained = torch._dynamo.explain(layer)(q, *kv, out0.clone(), lse0.clone())
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    out, lse = out0.clone(), lse0.clone()
    got = compiled(q, *kv, out, lse)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.testing.assert_close(out, expected[2], rtol=0, atol=0)
    assert not out.isnan().any() and not lse.isnan().any()


def functools_partial(fn, *args):
    import functools

    return functools.partial(fn, *args)


def _assert_kernels_in_graph(compiled, args, fresh_args, eager, what):
    """compiled (mode="reduce-overhead") replays its CUDA graph with the kernels inside: no
    cudagraph skip, no "The CUDA Graph is empty" warning, and each replay on new values
    written into the same input tensors equals eager (a kernel left out of the graph would
    leave the outputs of the recorded inputs). Every argument is marked a static input first
    (compiled must not have run yet)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    for a in args:  # static inputs (as a model's buffers are): no copy kernels before each replay
        torch._dynamo.mark_static_address(a)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            for a, f in zip(args, fresh_args(step)):
                if f is not None:  # (None: that input keeps its values)
                    a.copy_(f)
            expected = [t.clone() for t in eager(*args)]
            got = [t.clone() for t in compiled(*args)]  # (the graph's outputs are reused by the next replay)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{what}, step {step}: {m}")
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    # the replay launches one graph and no more kernels of its own than a replay of a trivial
    # compiled function (an H200 run showed one cudaLaunchKernel beside every replay's graph,
    # ours or not: CUDA-graph trees' own)
    names, launches, kernels = _replay_events(compiled, args)
    assert any("cudaGraphLaunch" in n for n in names), what
    x = torch.ones(8, device=DEV)
    trivial = torch.compile(lambda t: t * 2 + 1, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        trivial(x)
    _, base_launches, _ = _replay_events(trivial, [x])
    assert len(launches) <= len(base_launches), f"{what}: {launches} beside the graph (a trivial replay: " \
        f"{base_launches}); kernels: {kernels}"


def _replay_events(fn, args):
    """(every event name, the kernel launches from the host, the GPU kernels) of one call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = prof.events()
    names = [e.name for e in events]
    return (names, [n for n in names if n.startswith(("cudaLaunchKernel", "cuLaunchKernel"))],
            [e.name for e in events if e.device_type == DeviceType.CUDA])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "paged", "ragged"])
def test_gpu_reduce_overhead_captures_the_kernel(kind):
    import torch._dynamo

    torch._dynamo.reset()
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    if kind == "decode":
        lens = [900, 65, 3000]
        table = _csr(lens, device=DEV)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*table, HQ, HK, D, PS, q_data_type=BF16)
        kv, rows = _gpu_cache(int(table[0][-1]) + 3), 3

        def step(q, k, v):
            out, lse = w.run(q * 1.0, (k, v), return_lse=True)
            return out + 1, lse
    else:
        w, kv, rows = _gpu_prefill_setup(kind, ws)

        def step(q, k, v):
            out, lse = _call(w, kind, q * 1.0, (k, v), return_lse=True)
            return out + 1, lse
    for t in kv:  # the cache: a static input, as a model's buffer is (no copy before each replay)
        torch._dynamo.mark_static_address(t)
    q = torch.empty(rows, HQ, D, dtype=BF16, device=DEV)
    step(torch.randn_like(q), *kv)  # eager first: modules loaded
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)

    def fresh(i):
        gen = torch.Generator(device=DEV).manual_seed(100 + i)
        return [torch.randn(q.shape, generator=gen, device=DEV).to(BF16), None, None]

    _assert_kernels_in_graph(compiled, [q, *kv], fresh, step, kind)


@pytest.mark.gpu
def test_gpu_single_functions_compile():
    """single_prefill/single_decode_with_kv_cache called straight in the compiled function
    (fullgraph, then reduce-overhead with the kernels in the graph), after an eager call
    that planned them; and inside a custom op (FlashInfer's
    test_single_prefill_torch_compile_cuda_graph: the compiled call is the first)."""
    import torch._dynamo

    gen = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn(128, HQ, D, generator=gen, device=DEV).to(BF16)
    k = torch.randn(700, HK, D, generator=gen, device=DEV).to(BF16)
    v = torch.randn(700, HK, D, generator=gen, device=DEV).to(BF16)
    qd = torch.randn(HQ, D, generator=gen, device=DEV).to(torch.float16)
    kd, vd = k.to(torch.float16), v.to(torch.float16)

    def step(q, k, v, qd, kd, vd):
        return fi.single_prefill_with_kv_cache(q, k, v, causal=True) * 1, fi.single_decode_with_kv_cache(qd, kd, vd)

    expected = [t.clone() for t in step(q, k, v, qd, kd, vd)]
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v, qd, kd, vd)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch._dynamo.reset()
    args = [q, k, v, qd, kd, vd]
    for t in (k, v, kd, vd):
        torch._dynamo.mark_static_address(t)

    def fresh(i):
        g = torch.Generator(device=DEV).manual_seed(200 + i)
        return [torch.randn(q.shape, generator=g, device=DEV).to(BF16), None, None,
                torch.randn(qd.shape, generator=g, device=DEV).to(torch.float16), None, None]

    _assert_kernels_in_graph(torch.compile(step, mode="reduce-overhead", fullgraph=True), args, fresh, step,
                             "single")


_SINGLE_PREFILL_IN_A_CUSTOM_OP = """
import torch
from flashinfer_jit import single_prefill_with_kv_cache

torch.library.define("fij_test541p::op", "(Tensor q, Tensor k, Tensor v) -> Tensor")

@torch.library.impl("fij_test541p::op", "cuda")
def _impl(q, k, v):
    return single_prefill_with_kv_cache(q, k, v, causal=True)

@torch.library.register_fake("fij_test541p::op")
def _fake(q, k, v):
    return torch.empty_like(q)

compiled_fn = torch.compile(lambda q, k, v: torch.ops.fij_test541p.op(q, k, v), mode="reduce-overhead",
                            fullgraph=True)
S, QH, KH, D = 128, 8, 8, 128
for i in range(3):
    q = torch.randn(S, QH, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, KH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S, KH, D, device="cuda", dtype=torch.bfloat16)
    o = compiled_fn(q, k, v)
    torch.testing.assert_close(o, single_prefill_with_kv_cache(q, k, v, causal=True), rtol=0, atol=0)
torch.cuda.synchronize()
print("PASS")
"""


@pytest.mark.gpu
def test_gpu_single_prefill_in_a_custom_op_under_cudagraph_trees():
    """FlashInfer issue 541's prefill test: its first call is the compiled one, so the plan
    (and the workspace) are made during CUDA-graph trees' warm-up: outside its pool, or
    "All live allocations must be tracked"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("USER", "ci")
    done = subprocess.run([sys.executable, "-c", _SINGLE_PREFILL_IN_A_CUSTOM_OP], capture_output=True, text=True,
                          timeout=600, env=env, cwd=root)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr[-3000:]


def _layer_inputs(seed, lens, nnz, num_pages):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(nnz, HQ, D, generator=gen, device=DEV).to(BF16),
            torch.randn(nnz, HK, D, generator=gen, device=DEV).to(BF16),
            torch.randn(nnz, HK, D, generator=gen, device=DEV).to(BF16)]


@pytest.mark.gpu
def test_gpu_layer_reduce_overhead_append_rope_prefill_decode():
    """A layer as an engine compiles it: RoPE, append into the paged cache, paged prefill
    and decode over it, in one graph under reduce-overhead with every kernel inside it."""
    import torch._dynamo

    torch._dynamo.reset()
    lens = [40, 300, 77]
    table = _csr(lens, device=DEV)
    num_pages = int(table[0][-1]) + 3
    k_cache, v_cache = _gpu_cache(num_pages)
    for t in (k_cache, v_cache):
        torch._dynamo.mark_static_address(t)
    append_indptr = torch.tensor([0, 8, 9, 17], dtype=torch.int32, device=DEV)  # the last tokens of each request
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    nnz = 17
    bi, pos = fi.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    pw = fi.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), "NHD")
    pw.plan(append_indptr, *table, HQ, HK, D, PS, causal=True, q_data_type=BF16)
    dw = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), "NHD")
    dw.plan(*table, HQ, HK, D, PS, q_data_type=BF16)
    # the step's index tensors, as an engine keeps them (persistent buffers): static inputs too,
    # or CUDA-graph trees copy each into the graph's own before every replay (copy kernels)
    for t in (append_indptr, bi, pos, *table):
        torch._dynamo.mark_static_address(t)

    def layer(q, k, v):
        q_rot, k_rot = fi.apply_rope_pos_ids(q, k, pos)
        fi.append_paged_kv_cache(k_rot, v, bi, pos, (k_cache, v_cache), table[1], table[0], table[2])
        out_p = pw.run(q_rot, (k_cache, v_cache))
        out_d = dw.run(q_rot[append_indptr[1:] - 1], (k_cache, v_cache))
        return out_p, out_d

    args = _layer_inputs(0, lens, nnz, num_pages)
    cache0 = (k_cache.clone(), v_cache.clone())

    def eager(*a):
        k_cache.copy_(cache0[0])  # (the same cache contents before each call: appends are idempotent anyway)
        v_cache.copy_(cache0[1])
        return layer(*a)

    layer(*args)  # eager first: modules loaded
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    _assert_kernels_in_graph(compiled, args, lambda i: _layer_inputs(300 + i, lens, nnz, num_pages), eager, "layer")


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["decodes-first", "interleaved"])
@pytest.mark.parametrize("backend", ["fa2", "auto"], ids=["pod", "pod-on-hopper"])
def test_gpu_batch_attention_compiles(interleaved, backend):
    """BatchAttention (one POD launch) under torch.compile: fullgraph=True gives eager's bits,
    then reduce-overhead replays with the POD kernel inside the graph on fresh q values (the
    cache, the plan's tensors and the row permutation static inputs). backend "auto": POD on
    Hopper (prefill_backend="auto") on sm_90."""
    import torch._dynamo

    if backend == "auto" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    torch._dynamo.reset()
    qo = [1] * 40 + [300, 4, 77]
    if interleaved:
        qo = [1] * 20 + [300] + [1] * 20 + [4, 77]
    kv = [n + 700 for n in qo]
    pages = [-(-n // PS) for n in kv]
    acc = list(itertools.accumulate(pages, initial=0))
    qo_indptr = torch.tensor(list(itertools.accumulate(qo, initial=0)), dtype=torch.int32)
    ba = fi.BatchAttention("NHD", device=DEV)
    ba.prefill_backend = backend
    ba.plan(qo_indptr, torch.tensor(acc, dtype=torch.int32), torch.arange(acc[-1], dtype=torch.int32, device=DEV),
            torch.tensor(kv, dtype=torch.int32), HQ, HK, D, D, PS, causal=True, q_data_type=BF16, kv_data_type=BF16)
    assert ba._pod._prefill.planned_backend == ("fa3" if backend == "auto" else "fa2")
    cache = torch.randn(acc[-1] + 2, 2, PS, HK, D, generator=torch.Generator(device=DEV).manual_seed(3),
                        device=DEV).to(BF16)
    q = torch.randn(sum(qo), HQ, D, generator=torch.Generator(device=DEV).manual_seed(4), device=DEV).to(BF16)

    def step(q, cache):
        out, lse = ba.run(q * 1.0, cache)
        return out + 1, lse

    expected = [t.clone() for t in step(q, cache)]
    explained = torch._dynamo.explain(step)(q, cache)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, cache)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch._dynamo.reset()
    torch._dynamo.mark_static_address(cache)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)

    def fresh(i):
        g = torch.Generator(device=DEV).manual_seed(400 + i)
        return [torch.randn(q.shape, generator=g, device=DEV).to(BF16), None]

    _assert_kernels_in_graph(compiled, [q, cache], fresh, step, "BatchAttention")


def test_pod_on_hopper_traces_to_its_op(stand_in, monkeypatch):
    """BatchPODWithPagedKVCacheWrapper and BatchAttention with prefill_backend="auto" whose
    prefill side planned the Hopper kernel (planned on the CPU with the arch check passed):
    run() under torch.compile traces to POD on Hopper's op, without graph breaks, eager's
    results."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    d_table = _csr([40, 300])
    k, v = _cpu_cache(int(d_table[0][-1]) + 40)
    q_d = torch.randn(2, HQ, D).to(BF16)
    batch_pod, q_p, out_p, out_d, lse_p, lse_d = _traced_batch_pod(stand_in.pod_sm90, d_table, k, v, q_d, [200, 200],
                                                                    [300, 500], backend="auto")
    assert batch_pod._prefill.planned_backend == "fa3" and batch_pod._sm90_blocks > 0
    assert torch.equal(out_p, q_p * 4) and torch.equal(out_d, q_d * 3) and bool((lse_p == 5).all())
    # BatchAttention: decodes first, then two chunks long enough for the Hopper kernel
    ba, q, out, lse, decode_rows = _traced_batch_attention(stand_in.pod_sm90, [1, 1, 200, 200], [40, 300, 300, 500],
                                                           k, v, backend="auto")
    assert ba._pod._prefill.planned_backend == "fa3"
    assert torch.equal(out, torch.where(decode_rows[:, None, None], q * 3, q * 4))
