"""The batch prefill reference (flashinfer_jit/reference/prefill.py) against independent
computations, on the CPU: a per-element Python loop, torch's scaled_dot_product_attention,
the decode reference at qo_len 1, RoPE and the masks applied by hand, numpy.packbits.

Batches mix request shapes on purpose: kv_len > qo_len (chunked prefill), qo_len 0 and
kv_len 0 (padding), GQA groups and MQA. Paged caches are built from the same rows as the
ragged K/V, on randomly drawn pages; pages no request uses hold NaN, so a read through a
wrong page id shows.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from flashinfer_jit.reference.decode import decode_ref, merge_state_ref
from flashinfer_jit.reference.prefill import packbits_ref, prefill_ref, segment_packbits_ref, unpack_mask_ref
from flashinfer_jit.reference.rope import apply_rope_ref, positions_from_indptr
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table

LOG2E = 1.0 / math.log(2.0)
# (qo_len, kv_len) per request: chunked prefill, padding with no queries / no keys, equal
MIXED = [(3, 7), (0, 4), (2, 0), (4, 4), (1, 5), (0, 0)]


def indptr(lens, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=dtype)


def make_batch(shapes, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, seed=0, dtype=torch.float32):
    """(q, qo_indptr, k, v, kv_indptr) with random values."""
    gen = torch.Generator().manual_seed(seed)
    qo_lens, kv_lens = zip(*shapes)
    q = torch.randn(sum(qo_lens), num_qo_heads, head_dim_qk, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), num_kv_heads, head_dim_qk, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), num_kv_heads, head_dim_vo, generator=gen).to(dtype)
    return q, indptr(qo_lens), k, v, indptr(kv_lens)


def to_paged(k, v, kv_indptr, page_size, table_layout="csr", kv_layout="NHD", form="tuple", seed=0):
    """(k_cache, v_cache, PageTable) holding the ragged rows: pages drawn at random (K and V
    apart for block_table_kv_separate); form "halves": K and V are slices of one buffer
    [..., Dqk + Dvo] (MLA-style strides). Unused pages and slots hold NaN."""
    rnd = random.Random(seed)
    bounds = kv_indptr.tolist()
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 2
    heads, dqk, dvo = k.shape[1], k.shape[2], v.shape[2]
    buf = torch.full((num_pages, page_size, heads, dqk + dvo), math.nan, dtype=k.dtype)
    if form == "halves":
        k_nhd, v_nhd = buf[..., :dqk], buf[..., dqk:]
    else:
        k_nhd, v_nhd = buf[..., :dqk].clone(), buf[..., dqk:].clone()
    k_perm = rnd.sample(range(num_pages), num_pages)
    v_perm = rnd.sample(range(num_pages), num_pages) if table_layout == "block_table_kv_separate" else k_perm
    starts = list(itertools.accumulate(pages, initial=0))
    for b, n in enumerate(lens):
        for j in range(n):
            slot = starts[b] + j // page_size
            k_nhd[k_perm[slot], j % page_size] = k[bounds[b] + j]
            v_nhd[v_perm[slot], j % page_size] = v[bounds[b] + j]
    if table_layout == "csr":
        last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
        table = csr_page_table(indptr(pages), torch.tensor(k_perm[: sum(pages)], dtype=torch.int32),
                               torch.tensor(last, dtype=torch.int32))
    else:
        width = max(pages) + 1
        rows = [[perm[s: s + p] + [perm[-1]] * (width - p) for s, p in zip(starts, pages)]
                for perm in ((k_perm, v_perm) if table_layout == "block_table_kv_separate" else (k_perm,))]
        bt = torch.tensor(rows, dtype=torch.int32)
        bt = bt[0] if table_layout == "block_table" else bt.transpose(0, 1).contiguous()
        table = block_page_table(bt, torch.tensor(lens, dtype=torch.int32),
                                 kv_separate=table_layout == "block_table_kv_separate")
    if kv_layout == "HND":  # same values, HND strides (a transposed view of the NHD pages)
        k_nhd, v_nhd = k_nhd.transpose(1, 2), v_nhd.transpose(1, 2)
    return k_nhd, v_nhd, table


def loop_ref(q, qo_indptr, k, v, kv_indptr, allowed, scale, soft_cap=0.0, sinks=None):
    """Python floats, one (row, head) at a time. allowed(b, i, j, qo_len, kv_len) -> bool."""
    qs, ks, vs = q.double().tolist(), k.double().tolist(), v.double().tolist()
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=torch.float64)
    for b in range(len(qb) - 1):
        m, n = qb[b + 1] - qb[b], kb[b + 1] - kb[b]
        for i, h in itertools.product(range(m), range(q.shape[1])):
            row = qs[qb[b] + i][h]
            weights, values = [], []
            for j in range(n):
                if not allowed(b, i, j, m, n):
                    continue
                key = ks[kb[b] + j][h // group]
                s = sum(x * y for x, y in zip(row, key)) * scale
                if soft_cap > 0:
                    s = soft_cap * math.tanh(s / soft_cap)
                weights.append(math.exp(s))
                values.append(vs[kb[b] + j][h // group])
            total = sum(weights) + (0.0 if sinks is None else math.exp(float(sinks[h])))
            if total == 0.0:
                continue
            for w, val in zip(weights, values):
                out[qb[b] + i, h] += torch.tensor(val, dtype=torch.float64) * (w / total)
            lse[qb[b] + i, h] = math.log2(total)
    return out, lse


def assert_same(got, want, tol=1e-10):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


def causal_allowed(b, i, j, m, n):
    return j <= n - m + i


# --- against a per-element loop --------------------------------------------------------------
def _random_custom(shapes, seed):
    """Per request a random qo_len x kv_len bool mask with row 0 all false; flattened."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for m, n in shapes:
        mask = torch.rand(m, n, generator=gen) < 0.6
        if m:
            mask[0] = False
        parts.append(mask.reshape(-1))
    return parts


@pytest.mark.parametrize("name, heads, dims, options", [
    ("plain", (4, 2), (8, 8), {}),
    ("causal_window_cap_scale", (4, 4), (8, 8),
     dict(causal=True, window_left=2, logits_soft_cap=3.0, sm_scale=0.7)),
    ("custom_sinks", (6, 2), (8, 8), dict(custom=True, sinks=True)),
    ("mqa_qk_vo_window", (3, 1), (6, 4), dict(window_left=1)),
])
def test_matches_a_per_element_loop(name, heads, dims, options):
    q, qo_indptr, k, v, kv_indptr = make_batch(MIXED, *heads, *dims, seed=1)
    parts = _random_custom(MIXED, seed=2) if options.get("custom") else None
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -3.0])[: heads[0]] if options.get("sinks") else None
    window = options.get("window_left", -1)
    scale = options.get("sm_scale", 1.0 / math.sqrt(dims[0]))

    def allowed(b, i, j, m, n):
        keep = bool(parts[b][i * n + j]) if parts else (not options.get("causal") or causal_allowed(b, i, j, m, n))
        return keep and (window < 0 or j >= n - m + i - window)

    got = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=options.get("causal", False),
                      custom_mask=torch.cat(parts) if parts else None, sm_scale=options.get("sm_scale"),
                      window_left=window, logits_soft_cap=options.get("logits_soft_cap"), sinks=sinks)
    want = loop_ref(q, qo_indptr, k, v, kv_indptr, allowed, scale, options.get("logits_soft_cap", 0.0), sinks)
    assert_same(got, want)


# --- against torch's scaled_dot_product_attention -------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, dims", [((8, 2), (64, 64)), ((4, 4), (128, 128)), ((4, 1), (192, 128))])
def test_matches_torch_sdpa(causal, heads, dims):
    shapes = [(5, 5), (9, 9), (1, 1), (16, 16)] if causal else [(5, 9), (9, 3), (1, 1), (16, 16)]
    q, qo_indptr, k, v, kv_indptr = make_batch(shapes, *heads, *dims, seed=3, dtype=torch.float64)
    out, lse = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=causal, sm_scale=0.3)
    qb, kb = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(shapes)):
        qr, kr, vr = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in
                      ((q, qb[b], qb[b + 1]), (k, kb[b], kb[b + 1]), (v, kb[b], kb[b + 1])))
        want = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=0.3,
                                                                enable_gqa=True)
        torch.testing.assert_close(out[qb[b]: qb[b + 1]], want[0].transpose(0, 1), rtol=1e-12, atol=1e-12)


# --- paged == ragged ---------------------------------------------------------------------------
@pytest.mark.parametrize("table_layout", ["csr", "block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size, form", [(1, "tuple"), (3, "halves"), (16, "tuple")])
def test_paged_equals_ragged(table_layout, kv_layout, page_size, form):
    q, qo_indptr, k, v, kv_indptr = make_batch(MIXED, 8, 2, 16, 8, seed=4)
    k_cache, v_cache, table = to_paged(k, v, kv_indptr, page_size, table_layout, kv_layout, form, seed=5)
    options = dict(causal=True, window_left=3, logits_soft_cap=5.0)
    got = prefill_ref(q, qo_indptr, k_cache, v_cache, page_table=table, kv_layout=kv_layout, **options)
    want = prefill_ref(q, qo_indptr, k, v, kv_indptr, **options)
    assert_same(got, want, tol=0)
    assert not got[0].isnan().any()


# --- qo_len 1 == decode ----------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    {},
    dict(window_left=2, logits_soft_cap=4.0, sm_scale=0.2),
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e4),
    dict(fp8=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0),
], ids=["plain", "window_cap_scale", "rope", "fp8"])
def test_one_query_token_equals_decode(options):
    options = dict(options)
    kv_lens = [7, 0, 1, 12, 5]
    q, qo_indptr, k, v, kv_indptr = make_batch([(1, n) for n in kv_lens], 8, 2, 32, 32, seed=6)
    fp8 = options.pop("fp8", None)
    if fp8 is not None:
        k, v = k.to(fp8), v.to(fp8)
    k_cache, v_cache, table = to_paged(k.float(), v.float(), kv_indptr, 4, "csr", "HND", seed=7)
    if fp8 is not None:
        k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)
    got = prefill_ref(q, qo_indptr, k_cache, v_cache, page_table=table, kv_layout="HND", **options)
    want = decode_ref(q, k_cache, v_cache, table, kv_lens, "HND", **options)
    assert_same(got, want, tol=2e-6)  # decode_ref returns float32


# --- masks -------------------------------------------------------------------------------------
def _causal_parts(shapes, window_left=-1):
    parts = []
    for m, n in shapes:
        pos = torch.arange(n - m, n)[:, None]
        keys = torch.arange(n)[None, :]
        keep = keys <= pos
        if window_left >= 0:
            keep &= keys >= pos - window_left
        parts.append(keep.reshape(-1))
    return parts


@pytest.mark.parametrize("window_left", [-1, 2])
def test_causal_as_a_custom_mask_bool_and_packed(window_left):
    shapes = [(3, 7), (0, 4), (4, 4), (1, 5), (5, 9)]
    q, qo_indptr, k, v, kv_indptr = make_batch(shapes, 4, 2, 16, 16, seed=8)
    want = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True, window_left=window_left)
    parts = _causal_parts(shapes)
    flat = torch.cat(parts)
    lens = [p.numel() for p in parts]
    packed, packed_indptr = segment_packbits_ref(flat, indptr(lens), bitorder="little")
    common = dict(window_left=window_left)
    for got in (
        prefill_ref(q, qo_indptr, k, v, kv_indptr, custom_mask=flat, **common),
        prefill_ref(q, qo_indptr, k, v, kv_indptr, custom_mask=flat, mask_indptr=indptr(lens), **common),
        prefill_ref(q, qo_indptr, k, v, kv_indptr, packed_custom_mask=packed, **common),
        prefill_ref(q, qo_indptr, k, v, kv_indptr, packed_custom_mask=packed, mask_indptr=packed_indptr,
                    causal=True, custom_mask=~flat, **common),  # packed wins over both
    ):
        assert_same(got, want, tol=0)


def test_window_equals_its_custom_mask():
    shapes = [(3, 7), (4, 4), (2, 9)]
    q, qo_indptr, k, v, kv_indptr = make_batch(shapes, 4, 4, 16, 16, seed=9)
    for causal in (False, True):
        got = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=causal, window_left=1)
        parts = [p if causal else p | (torch.arange(n)[None, :] > torch.arange(n - m, n)[:, None]).reshape(-1)
                 for p, (m, n) in zip(_causal_parts(shapes, 1), shapes)]
        want = prefill_ref(q, qo_indptr, k, v, kv_indptr, custom_mask=torch.cat(parts))
        assert_same(got, want, tol=0)


def test_rows_that_see_no_key_give_zeros_and_minus_inf():
    shapes = [(3, 5), (2, 0), (0, 3), (2, 2)]
    q, qo_indptr, k, v, kv_indptr = make_batch(shapes, 4, 2, 8, 8, seed=10)
    parts = [torch.ones(m * n, dtype=torch.bool) for m, n in shapes]
    parts[0].view(3, 5)[1] = False   # one all-false row
    parts[3][:] = False              # a whole request
    mask = torch.cat(parts)
    out, lse = prefill_ref(q, qo_indptr, k, v, kv_indptr, custom_mask=mask, logits_soft_cap=2.0)
    blind = [1, 3, 4, 5, 6]  # rows: request 0 row 1, request 1 (kv_len 0), request 3
    assert out.shape == (7, 4, 8)
    assert (out[blind] == 0).all() and (lse[blind] == -math.inf).all()
    assert torch.isfinite(lse[[0, 2]]).all() and not out.isnan().any()
    sinks = torch.tensor([0.25, -1.0, 3.0, 0.0])
    out_s, lse_s = prefill_ref(q, qo_indptr, k, v, kv_indptr, custom_mask=mask, sinks=sinks)
    assert (out_s[blind] == 0).all()
    torch.testing.assert_close(lse_s[blind], (sinks * LOG2E).double().expand(len(blind), -1))
    causal = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True)  # kv_len 0 is padding, not an error
    assert (causal[0][3:5] == 0).all() and (causal[1][3:5] == -math.inf).all()


# --- soft cap, sinks, sm_scale ----------------------------------------------------------------------
def _dense_logits(q, k, scale):
    """One request with Hq == Hk: [H, m, n]."""
    return torch.einsum("mhd,nhd->hmn", q.double(), k.double()) * scale


def test_soft_cap_formula_and_zero_is_off():
    q, qo_indptr, k, v, kv_indptr = make_batch([(4, 6)], 2, 2, 16, 16, seed=11)
    plain = prefill_ref(q, qo_indptr, k, v, kv_indptr)
    assert_same(prefill_ref(q, qo_indptr, k, v, kv_indptr, logits_soft_cap=0.0), plain, tol=0)
    logits = 1.5 * torch.tanh(_dense_logits(q, k, 0.25) / 1.5)
    want = torch.einsum("hmn,nhd->mhd", torch.softmax(logits, dim=-1), v.double())
    got, lse = prefill_ref(q, qo_indptr, k, v, kv_indptr, logits_soft_cap=1.5, sm_scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).T * LOG2E, rtol=1e-12, atol=1e-12)


def test_sinks_hand_written_formula():
    q, qo_indptr, k, v, kv_indptr = make_batch([(3, 6)], 3, 3, 8, 8, seed=12)
    sinks = torch.tensor([1.0, -0.5, 2.5])
    got, lse = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True, sinks=sinks, sm_scale=0.5)
    weights = torch.exp(_dense_logits(q, k, 0.5)) * torch.tril(torch.ones(3, 6), diagonal=3)  # causal, kv - qo = 3
    total = weights.sum(-1) + torch.exp(sinks.double())[:, None]  # [H, m]
    want = torch.einsum("hmn,nhd->mhd", weights / total[..., None], v.double())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.log2(total).T, rtol=1e-12, atol=1e-12)
    no_sink = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True, sm_scale=0.5)
    assert_same(prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True, sm_scale=0.5,
                            sinks=torch.full((3,), -math.inf)), no_sink, tol=0)


def test_sinks_are_counted_once_by_a_merge():
    """The LSE includes the sink: a state over the first keys with sinks merged with one over
    the other keys without equals the whole request with sinks (split-KV, cascade)."""
    q, _, k, v, _ = make_batch([(4, 10)], 4, 2, 16, 16, seed=13)
    sinks = torch.tensor([0.5, 1.0, -2.0, 3.0])
    one = indptr([4])
    whole = prefill_ref(q, one, k, v, indptr([10]), sinks=sinks)
    first = prefill_ref(q, one, k[:6], v[:6], indptr([6]), sinks=sinks)
    rest = prefill_ref(q, one, k[6:], v[6:], indptr([4]))
    assert_same(merge_state_ref(first[0], first[1], rest[0], rest[1]), whole, tol=1e-5)  # merge is float32


def test_default_sm_scale_is_one_over_sqrt_head_dim_qk():
    q, qo_indptr, k, v, kv_indptr = make_batch([(3, 5)], 2, 1, 192, 128, seed=14)
    assert_same(prefill_ref(q, qo_indptr, k, v, kv_indptr),
                prefill_ref(q, qo_indptr, k, v, kv_indptr, sm_scale=1 / math.sqrt(192)), tol=0)
    scaled = prefill_ref(q, qo_indptr, k, v, kv_indptr, sm_scale=0.1, q_scale=2.0, k_scale=0.5, v_scale=3.0)
    base = prefill_ref(q, qo_indptr, k, v, kv_indptr, sm_scale=0.1)
    assert_same(scaled, (base[0] * 3.0, base[1]))


# --- fp8 and RoPE -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_is_dequantized_with_its_scales(fp8):
    q, qo_indptr, k, v, kv_indptr = make_batch(MIXED, 4, 2, 16, 16, seed=15)
    k8, v8 = k.to(fp8), v.to(fp8)
    k_cache, v_cache, table = to_paged(k8.float(), v8.float(), kv_indptr, 4, "block_table", "NHD", seed=16)
    got = prefill_ref(q, qo_indptr, k_cache.to(fp8), v_cache.to(fp8), page_table=table, causal=True,
                      k_scale=0.25, v_scale=4.0)
    want = prefill_ref(q, qo_indptr, k8.double() * 0.25, v8.double() * 4.0, kv_indptr, causal=True)
    assert_same(got, want)


def test_rope_llama_rotates_q_and_k_at_their_absolute_positions():
    q, qo_indptr, k, v, kv_indptr = make_batch(MIXED, 4, 2, 32, 16, seed=17)
    qo_lens = (qo_indptr[1:] - qo_indptr[:-1])
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1])
    rope = dict(rope_scale=2.0, rope_theta=1e3)
    q_rot = apply_rope_ref(q, q, positions_from_indptr(qo_indptr, kv_lens - qo_lens), **rope)[0]
    k_rot = apply_rope_ref(k, k, positions_from_indptr(kv_indptr, torch.zeros_like(kv_lens)), **rope)[0]
    want = prefill_ref(q_rot, qo_indptr, k_rot, v, kv_indptr, causal=True)
    k_cache, v_cache, table = to_paged(k, v, kv_indptr, 5, "block_table_kv_separate", "HND", seed=18)
    got = prefill_ref(q, qo_indptr, k_cache, v_cache, page_table=table, kv_layout="HND", causal=True,
                      pos_encoding_mode="ROPE_LLAMA", **rope)
    assert_same(got, want)


# --- index dtypes, bad input ---------------------------------------------------------------------------
def test_int64_index_tensors_give_the_same_result():
    q, qo_indptr, k, v, kv_indptr = make_batch(MIXED, 4, 2, 8, 8, seed=19)
    parts = _random_custom(MIXED, seed=20)
    lens = [p.numel() for p in parts]
    packed, mask_indptr = segment_packbits_ref(torch.cat(parts), indptr(lens), "little")
    k_cache, v_cache, table = to_paged(k, v, kv_indptr, 2, "csr", seed=21)
    table64 = PageTable(table.layout, tuple(t.long() for t in table.tensors), table.batch_size)
    want = prefill_ref(q, qo_indptr, k_cache, v_cache, page_table=table, packed_custom_mask=packed,
                       mask_indptr=mask_indptr)
    got = prefill_ref(q, qo_indptr.long(), k_cache, v_cache, page_table=table64, packed_custom_mask=packed,
                      mask_indptr=mask_indptr.long())
    assert_same(got, want, tol=0)
    assert_same(prefill_ref(q, qo_indptr.long(), k, v, kv_indptr.long(), causal=True),
                prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True), tol=0)


def test_bad_input_raises_value_error_naming_the_argument():
    q, qo_indptr, k, v, kv_indptr = make_batch([(3, 5), (4, 2)], 4, 2, 8, 8, seed=22)
    _, _, table = to_paged(k, v, kv_indptr, 2)
    cases = [
        (dict(custom_mask=torch.ones(22, dtype=torch.bool)), "custom_mask: expected elements per request"),
        (dict(custom_mask=torch.ones(23, dtype=torch.bool), mask_indptr=indptr([16, 7])), "custom_mask"),
        (dict(packed_custom_mask=torch.ones(2, dtype=torch.uint8)), "packed_custom_mask: expected bytes"),
        (dict(page_table=table), "not both or neither"),
        (dict(pos_encoding_mode="ALIBI_SQRT"), "pos_encoding_mode"),
        (dict(pos_encoding_mode="ALIBI", logits_soft_cap=30.0), "ALIBI"),
    ]
    # causal with fewer keys than queries is no error: bottom-right aligned, request 1's first
    # two rows (of 4 over 2 keys) see no key and give zeros and an LSE of -inf (FlashInfer's rule)
    out, lse = prefill_ref(q, qo_indptr, k, v, kv_indptr, causal=True)
    assert torch.all(out[3:5] == 0) and torch.all(torch.isneginf(lse[3:5]))
    assert torch.isfinite(lse[:3]).all() and torch.isfinite(lse[5:]).all() and not torch.isnan(out).any()
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            prefill_ref(q, qo_indptr, k, v, kv_indptr, **kwargs)
    with pytest.raises(ValueError, match="qo_indptr: ends at 7 but the tensor has 6 rows"):
        prefill_ref(q[:6], qo_indptr, k, v, kv_indptr)
    with pytest.raises(ValueError, match="qo_indptr: expected a non-decreasing"):
        prefill_ref(q, torch.tensor([0, 4, 3, 7]), k, v, torch.tensor([0, 5, 5, 7]))
    with pytest.raises(TypeError, match="kv_indptr"):
        prefill_ref(q, qo_indptr, k, v, kv_indptr.float())
    with pytest.raises(ValueError, match="num_kv_heads"):
        prefill_ref(q[:, :3], qo_indptr, k, v, kv_indptr)


# --- packbits ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 37])
def test_packbits_matches_numpy(bitorder, n):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    got = packbits_ref(x, bitorder)
    assert got.dtype == torch.uint8
    np.testing.assert_array_equal(got.numpy(), np.packbits(x.numpy(), bitorder=bitorder))
    if bitorder == "little":
        assert torch.equal(unpack_mask_ref(got, 0, n), x)


def test_segment_packbits_packs_each_segment_from_its_own_byte():
    x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)  # FlashInfer's docstring example
    packed, new_indptr = segment_packbits_ref(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
    assert packed.tolist() == [0b10110000, 0b00100000, 0b11010000]
    assert new_indptr.tolist() == [0, 1, 2, 3] and new_indptr.dtype == torch.int32
    bounds = [0, 0, 13, 21, 22, 40]
    x = torch.rand(40, generator=torch.Generator().manual_seed(1)) < 0.5
    packed, new_indptr = segment_packbits_ref(x, torch.tensor(bounds, dtype=torch.int64), bitorder="little")
    for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg = packed[new_indptr[b]: new_indptr[b + 1]].numpy()
        np.testing.assert_array_equal(seg, np.packbits(x[lo:hi].numpy(), bitorder="little"))
        assert torch.equal(unpack_mask_ref(packed, int(new_indptr[b]), hi - lo), x[lo:hi])
    with pytest.raises(ValueError, match="bitorder"):
        packbits_ref(x, "middle")
