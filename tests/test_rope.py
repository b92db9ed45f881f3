"""RoPE family against float64 references: apply_rope*, llama31, cos/sin cache,
rope_quantize_fp8 and the fused rope + quantize + append (padding untouched)."""

from __future__ import annotations

import pytest
import torch

import flashinfer_jit as fij
from flashinfer_jit.reference.append import page_slots_ref
from flashinfer_jit.reference.rope import (
    apply_rope_ref,
    cos_sin_cache_ref,
    positions_from_indptr,
    rope_quantize_append_ref,
    rope_quantize_ref,
)
from flashinfer_jit.runtime.page_table import block_page_table, csr_page_table

DEV = "cuda"
FP8_TOL = {torch.float8_e4m3fn: 0.13, torch.float8_e5m2: 0.26}  # one fp8 step, relative


def _close(out, ref, dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    out = out.double().cpu()
    assert not torch.isnan(out).any()
    err = (out - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.2e} > {tol}"


def _fp8_close(out, ref, dtype):
    """Quantized outputs: within one fp8 step of the quantized reference (rounding of a
    float32 vs float64 pre-image may land on the neighbouring value)."""
    o, r = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, r, rtol=FP8_TOL[dtype], atol=2 ** -6)


def _qk(nnz, hq, hk, d, dtype):
    return (torch.randn(nnz, hq, d, dtype=dtype, device=DEV), torch.randn(nnz, hk, d, dtype=dtype, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, None), (128, None), (128, 64), (256, None), (256, 128)])
@pytest.mark.parametrize("interleave", [False, True])
def test_apply_rope_pos_ids(dtype, head_dim, rotary_dim, interleave):
    q, k = _qk(300, 8, 2, head_dim, dtype)
    pos = torch.randint(0, 4096, (300,), dtype=torch.int32, device=DEV)
    q_out, k_out = fij.apply_rope_pos_ids(q, k, pos, rotary_dim=rotary_dim, interleave=interleave,
                                          rope_theta=1e4)
    q_ref, k_ref = apply_rope_ref(q, k, pos, rotary_dim, interleave)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    # in place gives the same bits
    q2, k2 = q.clone(), k.clone()
    fij.apply_rope_pos_ids_inplace(q2, k2, pos, rotary_dim=rotary_dim, interleave=interleave)
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


@pytest.mark.gpu
@pytest.mark.parametrize("llama31", [False, True])
def test_apply_rope_indptr_offsets(llama31):
    dtype = torch.bfloat16
    lens = [7, 0, 130, 64]
    indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 5, 1000, 9000], dtype=torch.int32, device=DEV)
    q, k = _qk(sum(lens), 32, 8, 128, dtype)
    pos = positions_from_indptr(indptr, offsets)
    if llama31:
        q_out, k_out = fij.apply_llama31_rope(q, k, indptr, offsets)
        q_ref, k_ref = apply_rope_ref(q, k, pos, rope_scale=8, rope_theta=5e5, llama31=(1, 4, 8192))
        q_pid, k_pid = fij.apply_llama31_rope_pos_ids(q, k, pos.to(DEV))
    else:
        q_out, k_out = fij.apply_rope(q, k, indptr, offsets, rope_scale=2.0, rope_theta=1e4)
        q_ref, k_ref = apply_rope_ref(q, k, pos, rope_scale=2.0, rope_theta=1e4)
        q_pid, k_pid = fij.apply_rope_pos_ids(q, k, pos.to(DEV), rope_scale=2.0)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    assert torch.equal(q_pid, q_out) and torch.equal(k_pid, k_out)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_apply_rope_with_cos_sin_cache(is_neox):
    dtype = torch.bfloat16
    nnz, hq, hk, d = 257, 16, 4, 128
    cache = cos_sin_cache_ref(8192, 128).to(DEV)
    query = torch.randn(nnz, hq * d, dtype=dtype, device=DEV)
    key = torch.randn(nnz, hk * d, dtype=dtype, device=DEV)
    pos = torch.randint(0, 8192, (nnz,), dtype=torch.int32, device=DEV)
    q_out, k_out = fij.apply_rope_with_cos_sin_cache(pos, query, key, d, cache, is_neox=is_neox)
    q_ref, k_ref = apply_rope_ref(query.view(nnz, hq, d), key.view(nnz, hk, d), pos,
                                  interleave=not is_neox, cos_sin_cache=cache)
    _close(q_out.view(nnz, hq, d), q_ref, dtype)
    _close(k_out.view(nnz, hk, d), k_ref, dtype)
    q2, k2 = query.clone(), key.clone()
    fij.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, d, cache, is_neox=is_neox)
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


@pytest.mark.gpu
def test_position_past_cos_sin_cache_is_nan_not_stale(monkeypatch):
    """A position without a cache row: NaN in the rotated dims (never a wrong finite
    value); debug mode rejects it before launch."""
    cache = cos_sin_cache_ref(64, 64).to(DEV)
    q, k = _qk(4, 2, 1, 64, torch.float16)
    pos = torch.tensor([0, 63, 64, 5], dtype=torch.int32, device=DEV)
    q_out, _ = fij.apply_rope_with_cos_sin_cache(pos, q.view(4, -1), k.view(4, -1), 64, cache)
    q_out = q_out.view(4, 2, 64)
    assert torch.isnan(q_out[2]).all() and not torch.isnan(q_out[[0, 1, 3]]).any()
    monkeypatch.setenv("FLASHINFER_JIT_DEBUG", "1")
    with pytest.raises(ValueError, match="cos_sin_cache"):
        fij.apply_rope_with_cos_sin_cache(pos, q.view(4, -1), k.view(4, -1), 64, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mla", [False, True])
def test_rope_quantize_fp8(qdtype, mla):
    dtype = torch.bfloat16
    nnz, hq, hk, rope_dim, nope_dim = 200, 16, 4, 64, (512 if mla else 64)
    cache = cos_sin_cache_ref(4096, rope_dim).to(DEV)
    pos = torch.randint(0, 4096, (nnz,), dtype=torch.int32, device=DEV)
    q_rope = torch.randn(nnz, hq, rope_dim, dtype=dtype, device=DEV)
    q_nope = torch.randn(nnz, hq, nope_dim, dtype=dtype, device=DEV)
    k_shape = (nnz,) if mla else (nnz, hk)
    k_rope = torch.randn(*k_shape, rope_dim, dtype=dtype, device=DEV)
    k_nope = torch.randn(*k_shape, nope_dim, dtype=dtype, device=DEV)
    outs = fij.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, quantize_dtype=qdtype,
                                 quant_scale_q=0.5, quant_scale_kv=2.0)
    refs = rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cache, pos, False, 0.5, 2.0, qdtype)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == qdtype
        _fp8_close(out, ref, qdtype)


def _page_table(layout, lens, page_size, num_pages, gen):
    pages = [(n + page_size - 1) // page_size for n in lens]
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    if layout == "csr":
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        return csr_page_table(indptr.to(DEV), perm[: int(indptr[-1])].to(DEV))
    max_pages = max(pages) + 1
    if layout == "block_table":
        bt = torch.full((len(lens), max_pages), -7, dtype=torch.int32)
        used = 0
        for b, p in enumerate(pages):
            bt[b, :p] = perm[used: used + p]
            used += p
        return block_page_table(bt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV))
    bt = torch.full((len(lens), 2, max_pages), -7, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):  # K and V pages drawn independently
        bt[b, 0, :p] = perm[used: used + p]
        bt[b, 1, :p] = perm.flip(0)[used: used + p]
        used += p
    return block_page_table(bt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), kv_separate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["csr", "block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rope_quantize_append_gqa_padding_untouched(layout, kv_layout, qdtype):
    """Fill the cache with a byte pattern, append a batch whose last tokens are padding,
    check appended slots against the reference and every other byte unchanged."""
    gen = torch.Generator().manual_seed(1)
    dtype, page_size, num_pages, hq, hk, rope_dim, nope_dim = torch.bfloat16, 16, 40, 8, 2, 64, 64
    head_dim = rope_dim + nope_dim
    kv_lens, append_lens = [20, 33, 1, 47], [3, 33, 1, 16]
    append_indptr = torch.tensor([0] + list(torch.tensor(append_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    nnz = int(append_indptr[-1]) + 5  # 5 padding tokens, as a CUDA-graph batch would have
    batch_indices, positions = fij.get_batch_indices_positions(
        append_indptr, torch.tensor(kv_lens, dtype=torch.int32, device=DEV), nnz)
    table = _page_table(layout, kv_lens, page_size, num_pages, gen)
    shape = (num_pages, page_size, hk, head_dim) if kv_layout == "NHD" else (num_pages, hk, page_size, head_dim)
    pattern = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    pattern[pattern == 0x7F] = 0  # keep the fill free of e4m3 NaN bytes
    k_cache, v_cache = pattern.clone().view(qdtype).to(DEV), pattern.flip(0).clone().view(qdtype).to(DEV)
    before = (k_cache.clone(), v_cache.clone())
    cos_sin = cos_sin_cache_ref(4096, rope_dim).to(DEV)
    pos_ids = positions.clone()
    pos_ids[int(append_indptr[-1]):] = 100000  # padding positions far outside the cos/sin cache
    q_rope = torch.randn(nnz, hq, rope_dim, dtype=dtype, device=DEV)
    q_nope = torch.randn(nnz, hq, nope_dim, dtype=dtype, device=DEV)
    k_rope = torch.randn(nnz, hk, rope_dim, dtype=dtype, device=DEV)
    k_nope = torch.randn(nnz, hk, nope_dim, dtype=dtype, device=DEV)
    v = torch.randn(nnz, hk, head_dim, dtype=dtype, device=DEV)
    q_rope_out, q_nope_out = fij.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin, pos_ids, (k_cache, v_cache), None, None,
        batch_indices, positions, quantize_dtype=qdtype, quant_scale_q=0.7, quant_scale_kv=1.3,
        page_size=page_size, kv_layout=kv_layout, page_table=table)
    qr_ref, qn_ref, (k_ref, v_ref) = rope_quantize_append_ref(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin, pos_ids, before, table, batch_indices, positions,
        False, 0.7, 1.3, kv_layout)
    _fp8_close(q_rope_out, qr_ref, qdtype)
    _fp8_close(q_nope_out, qn_ref, qdtype)
    written = torch.zeros(shape[:3] if kv_layout == "NHD" else (num_pages, hk, page_size), dtype=torch.bool)
    tokens, kp, vp, slot = (x.cpu() for x in page_slots_ref(batch_indices, positions, table, page_size, num_pages))
    for cache, ref, pages in ((k_cache, k_ref, kp), (v_cache, v_ref, vp)):
        mask = torch.zeros_like(written)
        if kv_layout == "NHD":
            mask[pages, slot] = True
        else:
            mask[pages, :, slot] = True
        got, exp = cache.cpu(), ref.cpu()
        assert torch.equal(got.view(torch.uint8)[~mask], exp.view(torch.uint8)[~mask]), "bytes outside the appended slots changed"
        _fp8_close(got[mask], exp[mask], qdtype)


@pytest.mark.gpu
def test_rope_quantize_append_mla():
    gen = torch.Generator().manual_seed(2)
    dtype, qdtype, page_size, num_pages, hq, rope_dim, ckv_dim = torch.bfloat16, torch.float8_e4m3fn, 32, 16, 16, 64, 512
    kv_lens, append_lens = [40, 1, 70], [40, 1, 2]
    append_indptr = torch.tensor([0] + list(torch.tensor(append_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    nnz = int(append_indptr[-1]) + 3
    batch_indices, positions = fij.get_batch_indices_positions(
        append_indptr, torch.tensor(kv_lens, dtype=torch.int32, device=DEV), nnz)
    table = _page_table("csr", kv_lens, page_size, num_pages, gen)
    ckv = torch.randint(0, 0x70, (num_pages, page_size, ckv_dim), dtype=torch.uint8, generator=gen).view(qdtype).to(DEV)
    kpe = torch.randint(0, 0x70, (num_pages, page_size, rope_dim), dtype=torch.uint8, generator=gen).view(qdtype).to(DEV)
    before = (ckv.clone(), kpe.clone())
    cos_sin = cos_sin_cache_ref(1024, rope_dim).to(DEV)
    q_rope = torch.randn(nnz, hq, rope_dim, dtype=dtype, device=DEV)
    q_nope = torch.randn(nnz, hq, ckv_dim, dtype=dtype, device=DEV)
    k_rope = torch.randn(nnz, rope_dim, dtype=dtype, device=DEV)
    k_nope = torch.randn(nnz, ckv_dim, dtype=dtype, device=DEV)
    indptr, indices, _ = table.tensors
    q_rope_out, q_nope_out = fij.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, None, cos_sin, positions, (ckv, kpe), indices, indptr,
        batch_indices, positions, page_size=page_size)
    qr_ref, qn_ref, (ckv_ref, kpe_ref) = rope_quantize_append_ref(
        q_rope, k_rope, q_nope, k_nope, None, cos_sin, positions, before, table, batch_indices, positions,
        False, 1.0, 1.0)
    _fp8_close(q_rope_out, qr_ref, qdtype)
    _fp8_close(q_nope_out, qn_ref, qdtype)
    _fp8_close(ckv, ckv_ref, qdtype)
    _fp8_close(kpe, kpe_ref, qdtype)


# --- argument checks (run everywhere: they fire before any build or launch) ------------
def test_rope_rejects_bad_arguments():
    q, k = torch.randn(4, 2, 64, dtype=torch.float16), torch.randn(4, 1, 64, dtype=torch.float16)
    pos = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="q: expected dtype float16 or bfloat16"):
        fij.apply_rope_pos_ids(q.float(), k, pos)
    with pytest.raises(ValueError, match="rotary_dim"):
        fij.apply_rope_pos_ids(q, k, pos, rotary_dim=40)
    with pytest.raises(TypeError, match="pos_ids"):
        fij.apply_rope_pos_ids(q, k, pos.short())
    with pytest.raises(ValueError, match="pos_ids"):
        fij.apply_rope_pos_ids(q, k, pos[:3])
    with pytest.raises(TypeError, match="cos_sin_cache"):
        fij.apply_rope_with_cos_sin_cache(pos, q.view(4, -1), k.view(4, -1), 64, torch.zeros(8, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        fij.apply_rope_pos_ids(q, k, pos)


def test_rope_append_rejects_bad_arguments():
    nnz, f8 = 3, torch.float8_e4m3fn
    q_rope = torch.randn(nnz, 4, 64, dtype=torch.bfloat16)
    k_rope = torch.randn(nnz, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(nnz, 2, 64, dtype=torch.bfloat16)
    cache = (torch.empty(8, 16, 2, 64, dtype=f8), torch.empty(8, 16, 2, 64, dtype=f8))
    cs = cos_sin_cache_ref(32, 64)
    idx = torch.zeros(nnz, dtype=torch.int32)
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    kw = dict(batch_indices=idx, positions=idx)
    with pytest.raises(ValueError, match="k_rope: 3 heads"):
        fij.rope_quantize_fp8_append_paged_kv_cache(q_rope, torch.randn(nnz, 3, 64, dtype=torch.bfloat16), None, None,
                                                    torch.randn(nnz, 3, 64, dtype=torch.bfloat16), cs, idx, cache,
                                                    idx[:1], indptr, **kw)
    with pytest.raises(TypeError, match="paged_kv_cache: expected dtype float8_e4m3fn"):
        fij.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, None, None, v, cs, idx,
                                                    tuple(c.to(torch.bfloat16) for c in cache), idx[:1], indptr, **kw)
    with pytest.raises(ValueError, match="block_table_kv_separate expects"):
        fij.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, None, None, v, cs, idx, cache, page_table=block_page_table(
                torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), kv_separate=True), **kw)
    with pytest.raises(ValueError, match="v: GQA/MHA needs a V tensor"):
        fij.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, None, None, None, cs, idx, cache, idx[:1], indptr, **kw)
    with pytest.raises(ValueError, match="page_size"):
        fij.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, None, None, v, cs, idx, cache, idx[:1], indptr,
                                                    page_size=32, **kw)
