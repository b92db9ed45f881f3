"""pos_encoding_mode="ALIBI" in batch decode, single decode, batch prefill (paged and ragged)
and single prefill, against the float64 references (flashinfer_jit/reference/), with
FlashInfer's semantics (csrc/common/pos_encoding.cuh):

  logit(i, j) = (q_i . k_j) * sm_scale * q_scale * k_scale + slope[h] * (j - i)

i the query row's index in its request (0 for a decode query), j the key's, slope[h] by
FlashInfer's get_alibi_slopes over num_qo_heads, powers of two or not. The LSE (base 2)
includes the bias as FlashInfer's does.

CPU: the slopes against FlashInfer's formula for 1..48 heads, the references' convention,
the specs' and plan()'s validation, the rendered sources, and the AOT matrix holding the
GPU tests' modules (8: three decode, five prefill). GPU (marked gpu): decode (CUDA-core
kernel, also with use_tensor_cores=True; GQA, non-power-of-two head counts, fp8, window,
split-KV), single decode, prefill (paged and ragged, causal, custom and packed masks, fp8,
window, split-KV, both query tiles, kv_len < qo_len) and single prefill, each output and LSE
NaN-poisoned before the call (inside sentinel rows that must stay untouched).
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import pytest
import torch
from kv_helpers import DEV, assert_sentinels, assert_tests_matrix_has, dtype_of, make_page_table, poisoned, randn
from test_decode import check_decode, make_cache, nan_pages
from test_prefill import (
    check_out,
    indptr_of,
    make_q,
    make_rows,
    mask_args,
    paged_kv,
    paged_wrapper,
    plan_kv,
    ragged_kv,
    ragged_wrapper,
    random_masks,
    reference,
    run_poisoned,
    tolerance,
)

import flashinfer_jit as fij
from flashinfer_jit.decode.spec import group_tile
from flashinfer_jit.pipeline import render
from flashinfer_jit.prefill.spec import PrefillSpec
from flashinfer_jit.reference.common import alibi_bias_ref, alibi_slopes_ref
from flashinfer_jit.reference.decode import decode_ref
from flashinfer_jit.reference.prefill import prefill_ref
from flashinfer_jit.specs import DecodeSpec

LOG2E = 1.0 / math.log(2.0)


# --- slopes (CPU) ------------------------------------------------------------------------------
def flashinfer_slopes(n_heads: int) -> torch.Tensor:
    """FlashInfer's get_alibi_slopes (flashinfer/utils.py) as it computes them, in float64:
    the powers of 2^(-8/n') for the first n' heads, then the odd powers of 2^(-4/n')."""
    n = 2 ** math.floor(math.log2(n_heads))
    m = torch.pow(torch.tensor(2.0 ** (-8.0 / n), dtype=torch.float64), torch.arange(1, 1 + n))
    if n < n_heads:
        m_hat = torch.pow(torch.tensor(2.0 ** (-4.0 / n), dtype=torch.float64),
                          torch.arange(1, 1 + 2 * (n_heads - n), 2))
        m = torch.cat([m, m_hat])
    return m


@pytest.mark.parametrize("num_heads", range(1, 49))
def test_slopes_match_flashinfers_formula(num_heads):
    ours = alibi_slopes_ref(num_heads)
    assert ours.shape == (num_heads,) and ours.dtype == torch.float64
    torch.testing.assert_close(ours, flashinfer_slopes(num_heads), rtol=1e-13, atol=0)


def test_slopes_known_values():
    assert alibi_slopes_ref(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes_ref(1).tolist() == [2.0 ** -8]
    # 12 heads: the 8 of n' = 8, then the odd steps of 16 heads: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    want = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes_ref(12), torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
    # 20 and 40 heads: n' = 16 and 32, the extra heads from 2^(-4/16) and 2^(-4/32)
    torch.testing.assert_close(alibi_slopes_ref(20)[16:], torch.tensor([2.0 ** (-0.25 * k) for k in (1, 3, 5, 7)],
                                                                        dtype=torch.float64))
    torch.testing.assert_close(alibi_slopes_ref(40)[32:], torch.tensor([2.0 ** (-0.125 * k) for k in range(1, 16, 2)],
                                                                        dtype=torch.float64))
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes_ref(0)


# --- the references' convention (CPU) ---------------------------------------------------------
def _ragged(qo_len, kv_len, hq, hk, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(qo_len, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(kv_len, hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_len, hk, d, generator=gen, dtype=torch.float64)
    return q, k, v


def test_prefill_reference_bias_and_lse_by_hand():
    """logits + slope (j - i), i the row's index in the request; the softmax of that and its
    base-2 LSE, written out for one request (GQA 12/4: non-power-of-two heads)."""
    qo_len, kv_len, hq, hk, d = 5, 11, 12, 4, 16
    q, k, v = _ragged(qo_len, kv_len, hq, hk, d, 1)
    out, lse = prefill_ref(q, indptr_of([qo_len], "cpu"), k, v, indptr_of([kv_len], "cpu"), causal=True,
                           pos_encoding_mode="ALIBI", sm_scale=0.3)
    kk, vv = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    logits = torch.einsum("mhd,nhd->hmn", q, kk) * 0.3
    slopes = flashinfer_slopes(hq)
    i, j = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
    logits = logits + slopes[:, None, None] * (j - i)
    logits = logits.masked_fill(j > i + kv_len - qo_len, -math.inf)
    torch.testing.assert_close(lse, (torch.logsumexp(logits, -1) * LOG2E).T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, torch.einsum("hmn,nhd->mhd", torch.softmax(logits, -1), vv), rtol=1e-12, atol=1e-12)


def test_bias_by_row_index_and_by_position_give_the_same_output():
    """What the kernels compute (slope (j - pos_i), pos_i = kv_len - qo_len + i) and
    FlashInfer's bias differ by slope (kv_len - qo_len) a row: the same output, LSEs apart by
    that constant (base 2), which the kernels add back."""
    qo_len, kv_len, hq = 3, 9, 6
    q, k, v = _ragged(qo_len, kv_len, hq, hq, 8, 2)
    out, lse = prefill_ref(q, indptr_of([qo_len], "cpu"), k, v, indptr_of([kv_len], "cpu"), pos_encoding_mode="ALIBI")
    logits = torch.einsum("mhd,nhd->hmn", q, k) / math.sqrt(8)
    by_position = logits + alibi_bias_ref(hq, torch.arange(kv_len - qo_len, kv_len), torch.arange(kv_len))
    torch.testing.assert_close(out, torch.einsum("hmn,nhd->mhd", torch.softmax(by_position, -1), v))
    shift = alibi_slopes_ref(hq) * (kv_len - qo_len) * LOG2E
    torch.testing.assert_close(lse, (torch.logsumexp(by_position, -1) * LOG2E).T + shift[None, :])


def test_decode_reference_is_prefill_with_one_row():
    """A decode query is FlashInfer's qo_idx 0: bias slope j."""
    from flashinfer_jit.runtime.page_table import csr_page_table

    kv_len, hq, hk, d, ps = 37, 20, 4, 16, 8
    q, k, v = _ragged(1, kv_len, hq, hk, d, 3)
    pages = -(-kv_len // ps)
    k_cache = torch.zeros(pages, ps, hk, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, hk, d)[:kv_len] = k
    v_cache.view(-1, hk, d)[:kv_len] = v
    table = csr_page_table(torch.tensor([0, pages], dtype=torch.int32), torch.arange(pages, dtype=torch.int32),
                           torch.tensor([kv_len - (pages - 1) * ps], dtype=torch.int32))
    d_out, d_lse = decode_ref(q.float(), k_cache.float(), v_cache.float(), table, [kv_len], pos_encoding_mode="ALIBI")
    p_out, p_lse = prefill_ref(q, indptr_of([1], "cpu"), k, v, indptr_of([kv_len], "cpu"), pos_encoding_mode="ALIBI")
    torch.testing.assert_close(d_out.double(), p_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_lse.double(), p_lse, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="ALIBI"):
        decode_ref(q.float(), k_cache.float(), v_cache.float(), table, [kv_len], pos_encoding_mode="ALIBI",
                   logits_soft_cap=30.0)


# --- specs, rendering, plan() (CPU) -------------------------------------------------------------
def test_decode_spec_alibi():
    spec = DecodeSpec("bfloat16", "bfloat16", 128, 4, alibi=True).validate()
    assert spec.name.endswith("_alibi") and spec.positional and not spec.pairs_kv_heads
    ctx = spec.context()
    assert ctx["tensor_cores"] is False and ctx["pos_encoding"] == "alibi"
    kernel = render.render(spec).sources["kernel.cu"]
    assert "fij::PosEncoding::kAlibi" in kernel and '#include "decode/decode.cuh"' in kernel
    assert DecodeSpec("bfloat16", "bfloat16", 128, 4).context()["pos_encoding"] == "none"
    for kwargs, match in ((dict(rope=True), "rope and alibi"), (dict(soft_cap=True), "soft_cap"),
                          (dict(q_tokens=2), "q_tokens")):
        with pytest.raises(ValueError, match=match):
            DecodeSpec("bfloat16", "bfloat16", 128, 4, alibi=True, **kwargs).validate()


def test_prefill_spec_alibi():
    spec = PrefillSpec("bfloat16", "bfloat16", "bfloat16", 128, 128, mask="causal", pos_encoding="alibi").validate()
    assert spec.name.endswith("_causal_alibi")
    assert "fij::PosEncoding::kAlibi" in render.render(spec).sources["kernel.cu"]
    PrefillSpec("bfloat16", "bfloat16", "bfloat16", 192, 128, pos_encoding="alibi").validate()  # any head dims
    for kwargs in (dict(soft_cap=True), dict(sinks=True)):
        with pytest.raises(ValueError, match="alibi"):
            PrefillSpec("bfloat16", "bfloat16", "bfloat16", 128, 128, pos_encoding="alibi", **kwargs).validate()


def _decode_plan(use_tensor_cores=False, **kwargs):
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    indptr, indices = torch.tensor([0, 2, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    last = torch.tensor([3, 16], dtype=torch.int32)
    wrapper.plan(indptr, indices, last, **{**dict(num_qo_heads=40, num_kv_heads=10, head_dim=128, page_size=16,
                                                 q_data_type="bfloat16"), **kwargs})
    return wrapper


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_plan_takes_alibi_on_cuda_cores(use_tensor_cores):
    plan = _decode_plan(use_tensor_cores, pos_encoding_mode="ALIBI")._plan
    assert plan.spec == DecodeSpec("bfloat16", "bfloat16", 128, 4, alibi=True)
    assert not plan.config.tensor_cores and not plan.config.orders_pages and plan.kv_heads_per_block == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(logits_soft_cap=30.0), "ALIBI"),
    (dict(q_len_per_req=2), "q_len_per_req"),
    (dict(pos_encoding_mode="ALIBI_SLOPES"), "pos_encoding_mode"),
])
def test_decode_plan_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _decode_plan(True, **{"pos_encoding_mode": "ALIBI", **kwargs})  # (q_len_per_req > 1 needs tensor cores)


def _prefill_plan(source, **kwargs):
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    heads = dict(num_qo_heads=12, num_kv_heads=4, head_dim_qk=128, q_data_type="bfloat16")
    qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    if source == "paged":
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, torch.tensor([0, 1, 3], dtype=torch.int32), torch.arange(3, dtype=torch.int32),
                     torch.tensor([10, 4], dtype=torch.int32), page_size=16, **heads, **kwargs)
    else:
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, torch.tensor([0, 10, 30], dtype=torch.int32), **heads, **kwargs)
    return wrapper


@pytest.mark.parametrize("source", ["paged", "ragged"])
def test_prefill_plan_takes_alibi(source):
    plan = _prefill_plan(source, pos_encoding_mode="ALIBI", causal=True)._plan
    assert plan.spec.pos_encoding == "alibi" and plan.spec.mask == "causal"
    assert not plan.config.pages_movable
    with pytest.raises(ValueError, match="ALIBI"):
        _prefill_plan(source, pos_encoding_mode="ALIBI", logits_soft_cap=30.0)


def test_pod_rejects_alibi():
    """POD runs no positional encoding in its kernel (as FlashInfer's POD)."""
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    wrapper = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                     torch.tensor([1], dtype=torch.int32), 32, 8, 128, 16, pos_encoding_mode="ALIBI")


# --- the GPU cases and their modules --------------------------------------------------------------
class DecodeCase(NamedTuple):
    q_dtype: str
    kv_dtype: str
    head_dim: int
    heads: tuple          # (num_qo_heads, num_kv_heads)
    page_table: str
    kv_layout: str
    page_size: int
    tensor_cores: bool    # use_tensor_cores= (ALiBi runs on CUDA cores either way)
    split: dict           # plan()'s split-KV arguments
    window_left: int


DECODE_CASES = [
    DecodeCase("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", 16, False, {}, -1),
    DecodeCase("bfloat16", "bfloat16", 128, (40, 10), "csr", "NHD", 16, True, dict(fixed_split_size=64), -1),
    DecodeCase("bfloat16", "bfloat16", 128, (12, 3), "csr", "NHD", 1, False, dict(disable_split_kv=True), 37),
    DecodeCase("float16", "float16", 128, (12, 12), "csr", "NHD", 16, True, dict(fixed_split_size=64), -1),
    DecodeCase("float16", "float16", 128, (20, 4), "csr", "NHD", 8, False, {}, 37),
    DecodeCase("bfloat16", "float8_e4m3fn", 64, (24, 12), "block_table", "HND", 16, False,
               dict(fixed_split_size=64), -1),
    DecodeCase("bfloat16", "float8_e4m3fn", 64, (6, 3), "block_table", "HND", 32, True, {}, 37),
]


class PrefillCase(NamedTuple):
    q_dtype: str
    kv_dtype: str
    source: str           # "ragged", or the page table
    kv_layout: str
    page_size: int | None
    heads: tuple
    mask: str             # "none", "causal", "custom", "packed"
    tile: int | None      # the query tile pinned (64, 128) or plan()'s choice
    split: dict
    window_left: int


PREFILL_CASES = [
    PrefillCase("bfloat16", "bfloat16", "csr", "NHD", 16, (32, 8), "causal", None, {}, -1),
    PrefillCase("bfloat16", "bfloat16", "csr", "NHD", 1, (12, 4), "causal", 64, dict(fixed_split_size=64), -1),
    PrefillCase("bfloat16", "bfloat16", "csr", "NHD", 16, (40, 8), "custom", 128, {}, -1),
    PrefillCase("bfloat16", "bfloat16", "csr", "NHD", 8, (32, 8), "packed", 64, dict(fixed_split_size=64), 37),
    PrefillCase("bfloat16", "bfloat16", "ragged", "NHD", None, (20, 4), "causal", 128, dict(fixed_split_size=64), -1),
    PrefillCase("bfloat16", "bfloat16", "ragged", "NHD", None, (32, 32), "causal", None, {}, 37),
    PrefillCase("float16", "float16", "ragged", "NHD", None, (12, 4), "none", None, dict(fixed_split_size=64), -1),
    PrefillCase("bfloat16", "float8_e4m3fn", "block_table", "HND", 16, (24, 8), "none", None, {}, -1),
    PrefillCase("bfloat16", "float8_e4m3fn", "block_table", "HND", 16, (12, 4), "none", 64,
                dict(fixed_split_size=64), -1),
]
SINGLE_DECODE_HEADS = ((12, 12), (20, 4))       # f16 head_dim 128, NHD: the CUDA-core g1 module
SINGLE_PREFILL = (("float16", False), ("bfloat16", True))  # (dtype, causal) at (12, 4) heads, head_dim 128


def _decode_spec(c: DecodeCase) -> DecodeSpec:
    return DecodeSpec(c.q_dtype, c.kv_dtype, c.head_dim, group_tile(*c.heads, c.head_dim), c.page_table, c.kv_layout,
                      alibi=True)


def _prefill_spec(q_dtype, kv_dtype, source, kv_layout, mask) -> PrefillSpec:
    ragged = source == "ragged"
    return PrefillSpec(q_dtype, kv_dtype, q_dtype, 128, 128, "ragged" if ragged else "paged",
                       "csr" if ragged else source, kv_layout, "custom" if mask == "packed" else mask, "alibi")


def specs_needed() -> set:
    specs = {_decode_spec(c) for c in DECODE_CASES}
    specs |= {DecodeSpec("float16", "float16", 128, group_tile(hq, hk), "csr", "NHD", alibi=True)
              for hq, hk in SINGLE_DECODE_HEADS}
    specs |= {_prefill_spec(c.q_dtype, c.kv_dtype, c.source, c.kv_layout, c.mask) for c in PREFILL_CASES}
    specs |= {_prefill_spec(dtype, dtype, "ragged", "NHD", "causal" if causal else "none")
              for dtype, causal in SINGLE_PREFILL}
    return specs


def test_tests_matrix_has_every_alibi_module():
    needed = specs_needed()
    assert_tests_matrix_has(needed, DecodeSpec, 3, "ALiBi decode")
    assert_tests_matrix_has(needed, PrefillSpec, 5, "ALiBi prefill")


# --- GPU: decode -----------------------------------------------------------------------------------
def _decode_lengths(rnd: random.Random, page_size: int) -> list[int]:
    lens = [rnd.randint(1, 2048) for _ in range(9)]
    lens += [0, 1, page_size, page_size + 1, 3000]  # an empty request, page boundaries, a long one
    rnd.shuffle(lens)
    return lens


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(DECODE_CASES)),
                         ids=[f"{c.q_dtype}-{c.kv_dtype}-hd{c.head_dim}-{c.heads[0]}x{c.heads[1]}-{c.page_table}-"
                              f"{c.kv_layout}-p{c.page_size}" + "-tc" * c.tensor_cores for c in DECODE_CASES])
def test_batch_decode_alibi(index, workspace):
    case = DECODE_CASES[index]
    rnd, gen = random.Random(index), torch.Generator(device=DEV).manual_seed(6300 + index)
    q_dtype, kv_dtype = dtype_of(case.q_dtype), dtype_of(case.kv_dtype)
    (hq, hk), d, ps = case.heads, case.head_dim, case.page_size
    lens = _decode_lengths(rnd, ps)
    num_pages = sum(-(-n // ps) for n in lens) + 4
    paged = make_page_table(case.page_table, lens, ps, num_pages, rnd)
    cache, k_cache, v_cache = make_cache("tuple", case.kv_layout, num_pages, ps, hk, d, kv_dtype, gen)
    nan_pages(k_cache, paged.k_unused)
    nan_pages(v_cache, paged.v_unused)
    q = randn((len(lens), hq, d), q_dtype, gen)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype.itemsize == 1 else dict(q_scale=1.25)

    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, case.kv_layout, use_tensor_cores=case.tensor_cores)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 pos_encoding_mode="ALIBI", window_left=case.window_left, q_data_type=q_dtype, kv_data_type=kv_dtype,
                 **case.split)
    assert wrapper._plan.spec == _decode_spec(case)
    for _ in range(2):  # the op's launch, then run()'s recorded fast path
        out_buf, out = poisoned((len(lens), hq, d), q_dtype)
        lse_buf, lse = poisoned((len(lens), hq), torch.float32)
        wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **scales)
        torch.cuda.synchronize()
        assert_sentinels(out_buf, "out")
        assert_sentinels(lse_buf, "lse")
        ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, case.kv_layout,
                                      window_left=case.window_left, pos_encoding_mode="ALIBI", **scales)
        check_decode(out, lse, ref_out, ref_lse, lens, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("heads", SINGLE_DECODE_HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("kv_len", [1, 9, 81, 729, 4099])
def test_single_decode_alibi(kv_len, heads, use_tensor_cores):
    """single_decode_with_kv_cache against the prefill reference of one query row (qo_idx 0)."""
    gen = torch.Generator(device=DEV).manual_seed(kv_len)
    (hq, hk), d = heads, 128
    q = randn((hq, d), torch.float16, gen)
    k, v = randn((kv_len, hk, d), torch.float16, gen), randn((kv_len, hk, d), torch.float16, gen)
    out, lse = fij.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ALIBI", use_tensor_cores=use_tensor_cores,
                                               return_lse=True)
    ref_out, ref_lse = prefill_ref(q[None], indptr_of([1]), k, v, indptr_of([kv_len]), pos_encoding_mode="ALIBI")
    check_decode(out[None], lse[None], ref_out.float(), ref_lse.float(), [kv_len], torch.float16)


# --- GPU: prefill ----------------------------------------------------------------------------------
def _prefill_shapes(rnd: random.Random, causal: bool) -> list[tuple[int, int]]:
    shapes = [(1, 700), (rnd.randint(2, 90), rnd.randint(100, 1200)), (200, 200), (0, 33), (5, 0),
              (rnd.randint(60, 300), rnd.randint(300, 2000)), (17, 17), (130, 1500)]
    if causal:
        shapes.append((40, 25))  # kv_len < qo_len: its first 15 rows see no key (FlashInfer's causal)
    return shapes


def check_lse_absolute(lse, ref_lse, tol: float = 1e-2) -> None:
    """-inf exactly where the reference is; elsewhere |lse - ref| <= tol + 2e-6 |ref| (ALiBi's
    LSEs reach thousands: float32 holds them to about 1e-7 relative)."""
    s, r = lse.double().cpu(), ref_lse.double().cpu()
    assert not torch.isnan(s).any(), "NaN in lse"
    empty = torch.isneginf(r)
    assert bool((torch.isneginf(s) == empty).all()), "lse: -inf where the reference is finite or the other way round"
    err = torch.where(empty, 0.0, (s - r).abs() - 2e-6 * r.abs())
    assert float(err.max()) <= tol, f"lse off by {float(err.max()):.3e} (rows {err.amax(1).argmax().item()})"


def _case_id(c: PrefillCase) -> str:
    return "-".join([c.q_dtype, c.kv_dtype, c.source, c.kv_layout, f"{c.heads[0]}x{c.heads[1]}", c.mask,
                     f"t{c.tile}" if c.tile else "tauto", "split" if c.split else "whole",
                     f"w{c.window_left}" if c.window_left >= 0 else "nowin"])


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(PREFILL_CASES)), ids=[_case_id(c) for c in PREFILL_CASES])
def test_batch_prefill_alibi(index, workspace):
    case = PREFILL_CASES[index]
    rnd, gen = random.Random(100 + index), torch.Generator(device=DEV).manual_seed(6400 + index)
    q_dtype, kv_dtype = dtype_of(case.q_dtype), dtype_of(case.kv_dtype)
    fp8 = kv_dtype.itemsize == 1
    (hq, hk), dims = case.heads, (128, 128)
    shapes = _prefill_shapes(rnd, case.mask == "causal")
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    if case.source == "ragged":
        k_rows, v_rows = make_rows(kv_lens, hk, dims, q_dtype, gen)
        kv = ragged_kv(k_rows, v_rows, kv_lens)
    else:
        k_rows, v_rows = make_rows(kv_lens, hk, dims, torch.float32, gen)
        kv = paged_kv(k_rows, v_rows, kv_lens, case.page_size, case.source, case.kv_layout, "tuple", rnd, kv_dtype)
    q = make_q(sum(qo_lens), hq, 128, q_dtype, gen)
    qo_indptr = indptr_of(qo_lens)
    masks = dict(causal=True) if case.mask == "causal" else {}
    if case.mask in ("custom", "packed"):
        masks = mask_args(random_masks(shapes, gen), shapes, case.mask == "packed")
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else dict(q_scale=1.25)

    wrapper = ragged_wrapper(workspace) if case.source == "ragged" else paged_wrapper(workspace, case.kv_layout)
    wrapper._force_tile_rows = case.tile
    plan_kv(wrapper, qo_indptr, kv, hq, hk, dims, case.page_size, **masks, pos_encoding_mode="ALIBI",
            window_left=case.window_left, q_data_type=q_dtype, kv_data_type=kv_dtype, **case.split)
    assert wrapper._plan.spec == _prefill_spec(case.q_dtype, case.kv_dtype, case.source, case.kv_layout, case.mask)
    ref_out, ref_lse = reference(q, qo_indptr, kv, **masks, window_left=case.window_left, pos_encoding_mode="ALIBI",
                                 **scales)
    for _ in range(2):  # the op's launch, then run()'s recorded fast path
        out, lse = run_poisoned(wrapper, q, kv, 128, q_dtype, **scales)
        check_out(out, ref_out, shapes, tolerance(q_dtype, fp8=fp8), v_scale=scales.get("v_scale"))
        empty = torch.isneginf(ref_lse.to(out.device))
        assert bool((out.double()[empty] == 0).all()), "rows that see no key must be exactly zero"
        check_lse_absolute(lse, ref_lse)
    with pytest.raises(ValueError, match="sinks"):
        wrapper.run(q, *kv.run_args, sinks=torch.zeros(hq, dtype=torch.float32, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, causal", SINGLE_PREFILL, ids=lambda x: str(x))
@pytest.mark.parametrize("qo_len, kv_len", [(1, 1), (17, 81), (81, 17), (987, 987), (81, 987)])
def test_single_prefill_alibi(qo_len, kv_len, dtype, causal):
    gen = torch.Generator(device=DEV).manual_seed(qo_len * 1000 + kv_len)
    q_dtype = dtype_of(dtype)
    q = randn((qo_len, 12, 128), q_dtype, gen)
    k, v = randn((kv_len, 4, 128), q_dtype, gen), randn((kv_len, 4, 128), q_dtype, gen)
    out, lse = fij.single_prefill_with_kv_cache(q, k, v, causal=causal, pos_encoding_mode="ALIBI", return_lse=True)
    ref_out, ref_lse = prefill_ref(q, indptr_of([qo_len]), k, v, indptr_of([kv_len]), causal=causal,
                                   pos_encoding_mode="ALIBI")
    shapes = [(qo_len, kv_len)]
    check_out(out, ref_out, shapes, tolerance(q_dtype))
    check_lse_absolute(lse, ref_lse)
