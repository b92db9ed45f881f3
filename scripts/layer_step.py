"""One attention layer step of a Llama-3-8B-shaped model as a serving engine runs it, eager
or captured once in a CUDA graph: RoPE + fp8 quantize + append of the step's new tokens
into the paged cache, then batch decode over the decode requests and batch prefill over
the prefill requests (chunks, prompts), reading the cache just written.

Shape: 32 query / 8 KV heads, head_dim 128, fp8 e4m3 KV cache of 16-token pages (NHD, CSR
page table), bf16 activations. Tokens are laid out as an engine pads them for a graph:
`decode_cap` decode rows first (one token per decode request), then `prefill_tokens` rows
of prefill chunks; rows past the live ones are padding tokens (batch_indices == -1: no
RoPE, nothing written to the cache), requests past the live ones are absent, and a prefill
request may have no new tokens (qo_len 0, its kv_len 0 or not).

Used by tests/test_layer_graph.py (graph replay after re-planning == eager, eager ==
float64 reference) and scripts/bench_deploy.py (cold start, warm start, host time per
step). Needs a GPU; importing it touches neither the GPU nor torch's CUDA state.

    step = LayerStep(device="cuda", decode_cap=16, prefill_cap=4, prefill_tokens=512, graph=True)
    batch = Batch(decode_kv=[37, 900], prefill=[(100, 612), (0, 0)])
    step.prepare(batch, seed=1)   # new tokens' data, positions, page tables, then plan()
    step.run()                    # or step.replay() once captured (step.capture())
    step.out_rows()               # the live output rows, decode requests first
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import flashinfer_jit as fij
from flashinfer_jit.reference.rope import cos_sin_cache_ref

HQ, HK, D, PAGE = 32, 8, 128, 16
ACT, FP8 = torch.bfloat16, torch.float8_e4m3fn
MAX_POSITION = 1 << 15


@dataclass
class Batch:
    decode_kv: list[int]            # each decode request's kv_len after this step (>= 1: its new token)
    prefill: list[tuple[int, int]]  # each prefill request's (qo_len, kv_len) after this step, qo_len <= kv_len

    @property
    def requests(self) -> int:
        return len(self.decode_kv) + len(self.prefill)

    def lens(self) -> tuple[list[int], list[int]]:
        """(qo_lens, kv_lens) of every request, decode requests first."""
        return [1] * len(self.decode_kv) + [m for m, _ in self.prefill], \
            list(self.decode_kv) + [n for _, n in self.prefill]


class LayerStep:
    """The buffers, page tables and wrappers of one layer step. graph=True: the wrappers are
    CUDA-graph wrappers over fixed buffers of the capacities given, and every tensor the step
    reads or writes is a fixed buffer (a captured step replays after prepare() of another
    batch); graph=False: plain wrappers and tensors of the live size, as an eager engine runs."""

    def __init__(self, device="cuda", decode_cap: int = 16, prefill_cap: int = 4, prefill_tokens: int = 512,
                 pool_pages: int = 4096, graph: bool = False, seed: int = 0):
        self.device = torch.device(device)
        self.decode_cap, self.prefill_cap, self.prefill_tokens = decode_cap, prefill_cap, prefill_tokens
        self.graph, self.pool_pages = graph, pool_pages
        gen = torch.Generator(device=self.device).manual_seed(seed)
        # the cache holds earlier tokens' K/V: random fp8 values, never zeros
        self.k_cache = torch.randn(pool_pages, PAGE, HK, D, generator=gen, device=self.device).to(FP8)
        self.v_cache = torch.randn(pool_pages, PAGE, HK, D, generator=gen, device=self.device).to(FP8)
        self.cos_sin = cos_sin_cache_ref(MAX_POSITION, D).to(self.device)
        self.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
        self.prefill_workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=self.device)
        dev, i32 = self.device, torch.int32
        requests = decode_cap + prefill_cap
        tokens = decode_cap + prefill_tokens
        if graph:
            self.tokens = tokens
            self.q = torch.empty(tokens, HQ, D, dtype=ACT, device=dev)
            self.k = torch.empty(tokens, HK, D, dtype=ACT, device=dev)
            self.v = torch.empty(tokens, HK, D, dtype=ACT, device=dev)
            self.pos_ids = torch.zeros(tokens, dtype=i32, device=dev)
            self.batch_indices = torch.full((tokens,), -1, dtype=i32, device=dev)
            self.positions = torch.zeros(tokens, dtype=i32, device=dev)
            self.q8 = torch.empty(tokens, HQ, D, dtype=FP8, device=dev)
            self.qa = torch.empty(tokens, HQ, D, dtype=ACT, device=dev)
            self.out = torch.empty(tokens, HQ, D, dtype=ACT, device=dev)
            self.kv_indptr = torch.zeros(requests + 1, dtype=i32, device=dev)
            self.kv_indices = torch.zeros(pool_pages, dtype=i32, device=dev)
            self.decode = fij.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(decode_cap + 1, dtype=i32, device=dev),
                paged_kv_indices_buffer=torch.zeros(pool_pages, dtype=i32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(decode_cap, dtype=i32, device=dev))
            self.prefill = fij.BatchPrefillWithPagedKVCacheWrapper(
                self.prefill_workspace, "NHD", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(prefill_cap + 1, dtype=i32, device=dev),
                paged_kv_indptr_buf=torch.zeros(prefill_cap + 1, dtype=i32, device=dev),
                paged_kv_indices_buf=torch.zeros(pool_pages, dtype=i32, device=dev),
                paged_kv_last_page_len_buf=torch.zeros(prefill_cap, dtype=i32, device=dev))
        else:
            self.decode = fij.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.prefill = fij.BatchPrefillWithPagedKVCacheWrapper(self.prefill_workspace, "NHD")
        self.graph_obj = None
        self.batch = None

    # --- the batch ------------------------------------------------------------------------------
    def prepare(self, batch: Batch, seed: int, pages: list[list[int]] | None = None, data=None) -> None:
        """The step's inputs for `batch`: new tokens' q/k/v drawn from `seed` (or `data`, a
        dict of q, k, v [live tokens, heads, D] to share with another LayerStep), each
        request's pages (`pages`, or drawn from the pool), then plan() of both wrappers."""
        nd, npf = len(batch.decode_kv), len(batch.prefill)
        if nd > self.decode_cap or npf > self.prefill_cap:
            raise ValueError(f"batch: {nd} decode / {npf} prefill requests, capacity {self.decode_cap} / "
                             f"{self.prefill_cap}")
        qo_lens, kv_lens = batch.lens()
        if sum(qo_lens[nd:]) > self.prefill_tokens:
            raise ValueError(f"batch: {sum(qo_lens[nd:])} prefill tokens, capacity {self.prefill_tokens}")
        if any(m > n or n < 0 for m, n in zip(qo_lens, kv_lens)) or any(n < 1 for n in batch.decode_kv):
            raise ValueError("batch: each request needs 0 <= qo_len <= kv_len (decode: kv_len >= 1)")
        rnd = random.Random(seed)
        if pages is None:
            need = [-(-n // PAGE) for n in kv_lens]
            assert sum(need) <= self.pool_pages, "the pool is too small for this batch"
            perm = rnd.sample(range(self.pool_pages), sum(need))
            starts = [sum(need[:b]) for b in range(len(need) + 1)]
            pages = [perm[starts[b]:starts[b + 1]] for b in range(len(need))]
        self.batch, self.pages = batch, pages
        live = sum(qo_lens)
        if data is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            data = {"q": torch.randn(live, HQ, D, generator=gen, device=self.device).to(ACT),
                    "k": torch.randn(live, HK, D, generator=gen, device=self.device).to(ACT),
                    "v": torch.randn(live, HK, D, generator=gen, device=self.device).to(ACT)}
        self.data = data
        # each live token: its request, its position in the request's kv, its row
        req = [b for b, m in enumerate(qo_lens) for _ in range(m)]
        pos = [n - m + t for m, n in zip(qo_lens, kv_lens) for t in range(m)]
        rows = self.live_rows()
        dev, i32 = self.device, torch.int32
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + len(p))
        flat = [i for p in pages for i in p]
        last = [n - (len(p) - 1) * PAGE if p else 0 for p, n in zip(pages, kv_lens)]
        if self.graph:
            rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
            self.q[rows_t], self.k[rows_t], self.v[rows_t] = data["q"], data["k"], data["v"]
            self.batch_indices.fill_(-1)
            self.pos_ids.zero_()
            self.positions.zero_()
            self.batch_indices[rows_t] = torch.tensor(req, dtype=i32, device=dev)
            self.pos_ids[rows_t] = torch.tensor(pos, dtype=i32, device=dev)
            self.positions[rows_t] = torch.tensor(pos, dtype=i32, device=dev)
            # the append's page table: the live requests' entries, the rest empty requests
            full = indptr + [indptr[-1]] * (self.decode_cap + self.prefill_cap + 1 - len(indptr))
            self.kv_indptr.copy_(torch.tensor(full, dtype=i32))
            self.kv_indices[: len(flat)] = torch.tensor(flat, dtype=i32, device=dev)
            kv_indptr, kv_indices = self.kv_indptr, self.kv_indices
        else:
            self.q, self.k, self.v = data["q"], data["k"], data["v"]
            self.tokens = live
            self.batch_indices = torch.tensor(req, dtype=i32, device=dev)
            self.pos_ids = torch.tensor(pos, dtype=i32, device=dev)
            self.positions = self.pos_ids.clone()
            self.q8 = torch.empty(live, HQ, D, dtype=FP8, device=dev)
            self.qa = torch.empty(live, HQ, D, dtype=ACT, device=dev)
            self.out = torch.empty(live, HQ, D, dtype=ACT, device=dev)
            self.kv_indptr = torch.tensor(indptr, dtype=i32, device=dev)
            self.kv_indices = torch.tensor(flat + [0], dtype=i32, device=dev)  # one spare id: no empty slice
            kv_indptr, kv_indices = self.kv_indptr, self.kv_indices
        self._kv_table = (kv_indptr, kv_indices)
        self._last_page_len = torch.tensor(last, dtype=i32, device=dev)
        # the two wrappers' page tables: host indptr / last_page_len, device page ids. A graph
        # step plans a side with no live request as one empty request (its captured run()
        # still launches: it must not replay the previous batch)
        nd_plan, qo_ptr = nd, [0]
        for m in qo_lens[nd:]:
            qo_ptr.append(qo_ptr[-1] + m)
        d_ptr, d_last = indptr[: nd + 1], last[:nd]
        p_ptr, p_last = [x - indptr[nd] for x in indptr[nd:]], last[nd:]
        if self.graph and not nd:
            d_ptr, d_last, nd_plan = [0, 0], [0], 1
        if self.graph and not npf:
            qo_ptr, p_ptr, p_last = [0, 0], [0, 0], [0]
        self._plans = []  # (plan method, its arguments): what plan() calls again
        if nd_plan:
            self._plans.append((self.decode.plan, (
                torch.tensor(d_ptr, dtype=i32), kv_indices[: max(indptr[nd], 1)], torch.tensor(d_last, dtype=i32),
                HQ, HK, D, PAGE), dict(q_data_type=ACT, kv_data_type=FP8)))
        if len(qo_ptr) > 1:
            self._plans.append((self.prefill.plan, (
                torch.tensor(qo_ptr, dtype=i32), torch.tensor(p_ptr, dtype=i32),
                kv_indices[indptr[nd]: max(indptr[-1], indptr[nd] + 1)], torch.tensor(p_last, dtype=i32),
                HQ, HK, D, PAGE), dict(causal=True, q_data_type=ACT, kv_data_type=FP8, o_data_type=ACT)))
        self.plan()

    def plan(self) -> None:
        """plan() of both wrappers for the prepared batch (what an engine calls once per step,
        before the layers: host work and one copy to the device each)."""
        for method, args, kwargs in self._plans:
            method(*args, **kwargs)

    def live_rows(self) -> list[int]:
        """The rows of the live tokens in the step's token buffers, decode requests first."""
        nd = len(self.batch.decode_kv)
        prefill = sum(m for m, _ in self.batch.prefill)
        if not self.graph:
            return list(range(nd + prefill))
        return list(range(nd)) + list(range(self.decode_cap, self.decode_cap + prefill))

    # --- the step ---------------------------------------------------------------------------------
    def run(self) -> None:
        """RoPE + fp8 quantize + append, q back to bf16, decode, prefill (on the current stream)."""
        kv_indptr, kv_indices = self._kv_table
        fij.rope_quantize_fp8_append_paged_kv_cache(
            self.q, self.k, None, None, self.v, self.cos_sin, self.pos_ids, (self.k_cache, self.v_cache),
            kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=self.batch_indices, positions=self.positions,
            is_neox=True, quantize_dtype=FP8, page_size=PAGE, kv_layout="NHD", q_rope_out=self.q8)
        self.qa.copy_(self.q8)
        if self.graph:
            self.decode.run(self.qa[: self.decode_cap], (self.k_cache, self.v_cache), out=self.out[: self.decode_cap])
            self.prefill.run(self.qa[self.decode_cap:], (self.k_cache, self.v_cache), out=self.out[self.decode_cap:])
            return
        nd = len(self.batch.decode_kv)
        if nd:
            self.decode.run(self.qa[:nd], (self.k_cache, self.v_cache), out=self.out[:nd])
        if self.batch.prefill and self.tokens > nd:
            self.prefill.run(self.qa[nd:], (self.k_cache, self.v_cache), out=self.out[nd:])

    def capture(self) -> None:
        """Capture run() once (warm-up on a side stream first, as capture needs). Prepare
        the captured size first: a CUDA-graph decode wrapper's capacity is its first batch."""
        assert self.graph, "capture() needs LayerStep(graph=True)"
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph_obj = torch.cuda.CUDAGraph()
        # a capture stream of this device: torch.cuda.graph's default one is made once per
        # process, on the device current at its first use (a capture for another device on it
        # records nothing: the launches go to this device's streams and run at once)
        with torch.cuda.graph(self.graph_obj, stream=torch.cuda.Stream(self.device)):
            self.run()

    def replay(self) -> None:
        self.graph_obj.replay()

    # --- results ----------------------------------------------------------------------------------
    def out_rows(self) -> torch.Tensor:
        """The live output rows [live tokens, HQ, D], decode requests first."""
        rows = self.live_rows()
        return self.out[torch.tensor(rows, dtype=torch.long, device=self.device)]

    def q_rows(self) -> torch.Tensor:
        """The live rows of the rotated, fp8-quantized q, back in bf16 (what attention read)."""
        return self.qa[torch.tensor(self.live_rows(), dtype=torch.long, device=self.device)]

    def page_table(self):
        """The step's CSR page table over every live request (for a reference)."""
        from flashinfer_jit.runtime.page_table import csr_page_table

        kv_indptr, kv_indices = self._kv_table
        return csr_page_table(kv_indptr[: self.batch.requests + 1], kv_indices, self._last_page_len)


def llama8b_batch(rnd: random.Random, decode: int, prefill: int, prefill_tokens: int, max_kv: int = 3000) -> Batch:
    """A mixed batch: `decode` decode requests of random lengths, `prefill` chunks sharing
    `prefill_tokens` tokens at the end of random prefixes."""
    decode_kv = [rnd.randint(1, max_kv) for _ in range(decode)]
    cuts = sorted(rnd.sample(range(1, prefill_tokens), prefill - 1)) if prefill > 1 else []
    chunks = [b - a for a, b in zip([0] + cuts, cuts + [prefill_tokens])] if prefill else []
    return Batch(decode_kv, [(m, m + rnd.randint(0, max_kv)) for m in chunks])


# --- the check against float64 references ---------------------------------------------------------
def _fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp8 e4m3 values equal up to one step of the format's rounding (the kernel rotates in
    float32, the reference in float64)."""
    g, w = got.float(), want.float()
    bad = (g - w).abs() > w.abs() * 0.0625 + 2 ** -9
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} fp8 values differ, max |diff| {(g - w).abs().max().item()}"


def verify(step: LayerStep, before: tuple[torch.Tensor, torch.Tensor], what: str = "step") -> None:
    """Asserts what step.run() (or its replay) did, from `before` (clones of the K and V
    caches taken before it): the cache rows written are RoPE + fp8 of the new keys and fp8
    of the new values and nothing else changed, and the live output rows are float64
    attention (causal, bottom-right aligned) of the q attention read over the cache."""
    from flashinfer_jit.reference.prefill import prefill_ref
    from flashinfer_jit.reference.rope import rope_quantize_append_ref

    rows = torch.tensor(step.live_rows(), dtype=torch.long, device=step.device)
    q, k, v = step.q[rows], step.k[rows], step.v[rows]
    if step.graph:  # the reference appends the live tokens only
        bi, pos = step.batch_indices[rows], step.positions[rows]
    else:
        bi, pos = step.batch_indices, step.positions
    _, _, (k_ref, v_ref) = rope_quantize_append_ref(
        q, k, q[..., :0], k[..., :0], v, step.cos_sin, pos, before, step.page_table(), bi, pos, False, 1.0, 1.0)
    _fp8_close(step.k_cache, k_ref, f"{what}: K cache")
    _fp8_close(step.v_cache, v_ref, f"{what}: V cache")
    qo_lens, _ = step.batch.lens()
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    out = step.out_rows()
    if bool(out.isnan().any()):
        nan_rows = out.isnan().flatten(1).any(1).nonzero().flatten().tolist()
        raise AssertionError(f"{what}: {len(nan_rows)} of {out.shape[0]} live output rows left unwritten (decode "
                             f"rows are the first {len(step.batch.decode_kv)}): {nan_rows[:12]}")
    ref, _ = prefill_ref(step.q_rows(), qo_indptr, step.k_cache, step.v_cache, page_table=step.page_table(),
                         causal=True)
    err = (out.double() - ref).abs() - 2e-2 * ref.abs()
    assert float(err.max()) <= 2e-2 if out.numel() else True, f"{what}: output off by {float(err.max())}"
