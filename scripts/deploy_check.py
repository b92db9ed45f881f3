"""Deployment check: every module of an AOT matrix loads from the prebuilt cache and runs,
with no compiler (README, Deployment).

    FLASHINFER_JIT_CACHE_PATH=/opt/fij-cache FLASHINFER_JIT_DISABLE_JIT=1 \\
        python3 scripts/deploy_check.py --matrix scripts/matrices/llama [--json FILE]

For each spec of the matrix, the exerciser of its family (EXERCISERS) calls the public API
as a serving engine does, on small random inputs whose dtypes, head dims, GQA group, page
table, KV layout, mask and options select exactly that module, and compares the result
with the PyTorch references of flashinfer_jit/reference/ (outputs start as NaN where the
API takes out=). The host planners and the page order have no call of their own: plan()
loads them, so their exercisers plan a batch of the matrix. After each entry its module
must be one this process loaded; a family without an exerciser is a failure naming it.
Last, a batch decode at a head_dim outside the matrix must raise JitDisabledError naming
its matrix line and the `flashinfer-jit aot` command that builds it.

JIT is disabled for the whole run (a deployment check never compiles), and the helpers'
"flashinfer_jit: ..." RuntimeWarnings (a planner that did not load) count as failures.
Needs a CUDA GPU. Prints one line per entry and a summary; exit code 0 only if all passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
import warnings
import zlib
from functools import cache
from pathlib import Path

import torch

# ruff: noqa: E402 - the package's imports follow this: `python3 scripts/deploy_check.py` in a
# checkout puts only scripts/ on the path (an installed package is found either way)
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flashinfer_jit as fij
from flashinfer_jit.decode.spec import group_tile
from flashinfer_jit.pipeline import env, jit, toolchain
from flashinfer_jit.pipeline.errors import JitDisabledError
from flashinfer_jit.pipeline.matrix import parse_matrix, spec_line
from flashinfer_jit.pipeline.spec import HEAD_DIMS
from flashinfer_jit.reference.append import append_paged_kv_cache_ref, get_batch_indices_positions_ref
from flashinfer_jit.reference.decode import decode_ref, merge_states_ref
from flashinfer_jit.reference.flatten import flatten_kv_cache_ref
from flashinfer_jit.reference.prefill import prefill_ref
from flashinfer_jit.reference.rope import (
    apply_rope_ref,
    cos_sin_cache_ref,
    positions_from_indptr,
    rope_quantize_append_ref,
    rope_quantize_ref,
)
from flashinfer_jit.runtime.page_table import PageTable
from flashinfer_jit.specs import DecodeSpec, PrefillSpec, Spec

DEVICE = "cuda"  # tests/test_deploy_gpu.py runs the exercisers on the CPU up to the module lookup
PAGE = 16
KV_HEADS = 2
SOFT_CAP = 30.0
# The tests' tolerances: relative error per row for decode and merge (tests/test_decode.py)
# and RoPE (test_rope.py); elementwise tol x (1 + |ref|) for prefill, x 2.5 with an fp8
# cache (test_prefill.py); one fp8 step for quantized outputs.
DECODE_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
ROPE_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PREFILL_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
# FP8 attention (e4m3 q, K and V): P rounded to e4m3 and the fp8 MMA's ~13-14-bit sums make a
# few percent (docs/hopper.md; tests/test_prefill_sm90.py FP8_ATTN_TOL)
FP8_ATTENTION_TOL = 6e-2
FP8_RTOL = {torch.float8_e4m3fn: 0.13, torch.float8_e5m2: 0.26}
FP8_ATOL = 2 ** -6


class CheckFailed(Exception):
    """A result off its reference, or an entry no call could exercise."""


# --- inputs ---------------------------------------------------------------------------------------
def dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def randn(shape, dt: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Drawn on the host from the entry's seed (run_entry), then moved: the same values on any device."""
    return (torch.randn(shape) * scale).to(dt).to(DEVICE)


def int32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


def offsets(lengths) -> torch.Tensor:
    return int32(itertools.accumulate(lengths, initial=0))


@cache
def workspace(device: str) -> torch.Tensor:
    return torch.zeros(128 << 20, dtype=torch.uint8, device=device)


def synchronize() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def page_table(layout: str, lens: list[int]) -> tuple[PageTable, int]:
    """(table, number of pages): each request's pages drawn at random (K and V apart for
    block_table_kv_separate), spare pages no request reads; block-table rows padded with one."""
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages) + 4
    starts = list(itertools.accumulate(pages, initial=0))
    k_ids, v_ids = torch.randperm(num_pages).int(), torch.randperm(num_pages).int()
    if layout == "csr":
        last = [n - (p - 1) * PAGE for n, p in zip(lens, pages)]
        return fij.csr_page_table(offsets(pages), k_ids[:starts[-1]].to(DEVICE), int32(last)), num_pages

    def rows(ids):  # [batch, max pages + 1]; ids[-1] lies past the pages requests take: a spare
        bt = torch.full((len(lens), max(pages) + 1), int(ids[-1]), dtype=torch.int32)
        for b, (s, p) in enumerate(zip(starts, pages)):
            bt[b, :p] = ids[s:s + p]
        return bt

    bt = rows(k_ids) if layout == "block_table" else torch.stack([rows(k_ids), rows(v_ids)], dim=1)
    return fij.block_page_table(bt.to(DEVICE), int32(lens), kv_separate=bt.dim() == 3), num_pages


def plan_table_args(table: PageTable, prefix: str = "") -> dict:
    """plan()'s page-table arguments: FlashInfer's CSR triple (prefix + indptr, indices,
    last_page_len), or block_tables and seq_lens with that triple None."""
    names = [prefix + name for name in ("indptr", "indices", "last_page_len")]
    if table.layout == "csr":
        return dict(zip(names, table.tensors))
    return dict.fromkeys(names) | {"block_tables": table.tensors[0], "seq_lens": table.tensors[1]}


def paged_cache(dt: torch.dtype, kv_layout: str, num_pages: int, dim: int) -> torch.Tensor:
    shape = (num_pages, PAGE, KV_HEADS, dim) if kv_layout == "NHD" else (num_pages, KV_HEADS, PAGE, dim)
    return randn(shape, dt)


def appended_tokens(append_lens: list[int], kv_lens: list[int], padding: int = 3):
    """(batch_indices, positions) of the appended tokens, `padding` padding tokens at the end,
    from the reference (so an append entry needs no other module)."""
    return get_batch_indices_positions_ref(offsets(append_lens), int32(kv_lens), sum(append_lens) + padding)


def nan_like(shape, dt: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dt, device=DEVICE)


# --- checks ---------------------------------------------------------------------------------------
def _host(out, ref, what: str):
    o, r = out.double().cpu(), ref.double().cpu()
    if o.shape != r.shape:
        raise CheckFailed(f"{what}: shape {tuple(o.shape)}, expected {tuple(r.shape)}")
    if torch.isnan(o).any():
        raise CheckFailed(f"{what}: NaN (an output row the kernel did not write?)")
    return o, r


def expect_rows(out, ref, tol: float, what: str) -> None:
    """Relative error of each row (first dimension) within tol."""
    o, r = _host(out, ref, what)
    err = float(((o - r).flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1)).max())
    if not err < tol:
        raise CheckFailed(f"{what}: relative error {err:.2e} > {tol:.1e}")


def expect_close(out, ref, rtol: float, atol: float, what: str) -> None:
    """|out - ref| <= atol + rtol |ref| elementwise; an infinite ref (an LSE of no keys) must be matched."""
    o, r = _host(out, ref, what)
    diff = torch.where(o == r, 0.0, (o - r).abs())
    if bool((diff > torch.where(r.isinf(), 0.0, atol + rtol * r.abs())).any()):
        raise CheckFailed(f"{what}: off by up to {float(diff.max()):.3e} (atol {atol:g}, rtol {rtol:g})")


def expect_equal(out, ref, what: str) -> None:
    o, r = out.cpu(), ref.cpu()
    if o.shape != r.shape or not torch.equal(o.view(torch.uint8), r.view(torch.uint8)):
        raise CheckFailed(f"{what}: differs from the reference")


# --- exercisers: one per family, exercise(spec, matrix) -------------------------------------------
def exercise_append(spec, matrix=()) -> None:
    kv_lens, append_lens = [5, 40, 17], [2, 24, 17]
    dt = dtype(spec.dtype_kv)
    table, num_pages = page_table(spec.page_table, kv_lens)
    k_cache, v_cache = (paged_cache(dt, spec.kv_layout, num_pages, spec.head_dim) for _ in range(2))
    before = (k_cache.clone(), v_cache.clone())
    batch_indices, positions = appended_tokens(append_lens, kv_lens)
    key, value = (randn((batch_indices.shape[0], KV_HEADS, spec.head_dim), dt) for _ in range(2))
    tables = dict(zip(("kv_indptr", "kv_indices", "kv_last_page_len"), table.tensors)) \
        if table.layout == "csr" else {"page_table": table}
    fij.append_paged_kv_cache(key, value, batch_indices, positions, (k_cache, v_cache), kv_layout=spec.kv_layout,
                              **tables)
    synchronize()
    k_ref, v_ref = append_paged_kv_cache_ref(key, value, batch_indices, positions, *before, table, spec.kv_layout)
    expect_equal(k_cache, k_ref, "k_cache")
    expect_equal(v_cache, v_ref, "v_cache")


def exercise_batch_indices(spec, matrix=()) -> None:
    append_lens, kv_lens, nnz = [2, 24, 17], [5, 40, 17], 46  # 3 padding tokens
    got = fij.get_batch_indices_positions(offsets(append_lens), int32(kv_lens), nnz)
    synchronize()
    for out, ref, what in zip(got, appended_tokens(append_lens, kv_lens), ("batch_indices", "positions")):
        expect_equal(out, ref, what)


def decode_heads(spec: DecodeSpec) -> int:
    """num_qo_heads (over KV_HEADS) whose group plan() tiles as spec.group_tile: the group
    itself, or a multiple where the tile caps it (MQA's 32 heads take tiles of 16)."""
    for group in (spec.group_tile * m for m in (1, 2, 4)):
        if group_tile(group * KV_HEADS, KV_HEADS, spec.head_dim, spec.q_tokens) == spec.group_tile:
            return group * KV_HEADS
    raise CheckFailed(f"no head counts give group_tile {spec.group_tile} at head_dim {spec.head_dim}")


def exercise_decode(spec, matrix=()) -> None:
    lens = [16, 37, 100]  # the longest has full pages for plan() to sort (page_order)
    hq, d, n = decode_heads(spec), spec.head_dim, spec.q_tokens
    q_dt, kv_dt = dtype(spec.dtype_q), dtype(spec.dtype_kv)
    table, num_pages = page_table(spec.page_table, lens)
    k_cache, v_cache = (paged_cache(kv_dt, spec.kv_layout, num_pages, d) for _ in range(2))
    options = dict(pos_encoding_mode="ROPE_LLAMA" if spec.rope else "NONE",
                   logits_soft_cap=SOFT_CAP if spec.soft_cap else None)
    # (use_tensor_cores: what q_len_per_req > 1 needs; one token a request ignores it)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout, use_tensor_cores=True)
    wrapper.plan(**plan_table_args(table), num_qo_heads=hq, num_kv_heads=KV_HEADS, head_dim=d, page_size=PAGE,
                 q_data_type=q_dt, kv_data_type=kv_dt, q_len_per_req=n, **options)
    q = randn((len(lens) * n, hq, d), q_dt)
    out, lse = wrapper.run(q, (k_cache, v_cache), out=nan_like(q.shape, q_dt), return_lse=True)
    synchronize()
    ref_out, ref_lse = decode_ref(q, k_cache, v_cache, table, lens, spec.kv_layout, q_len_per_req=n, **options)
    expect_rows(out, ref_out, DECODE_TOL[q_dt], "out")
    expect_close(lse, ref_lse, 0.0, 1e-2, "lse")


def exercise_merge(spec, matrix=()) -> None:
    dt = dtype(spec.dtype)
    v, s = randn((5, 3, 4, spec.head_dim), dt), randn((5, 3, 4), torch.float32, 6.0)
    v_out, s_out = fij.merge_states(v, s)
    synchronize()
    ref_v, ref_s = merge_states_ref(v, s)
    expect_rows(v_out, ref_v, DECODE_TOL[dt], "v")
    expect_close(s_out, ref_s, 0.0, 1e-4, "s")


def exercise_rope(spec, matrix=()) -> None:
    """page_table: the fused rope + fp8 quantize + append; else an fp8 output: rope_quantize_fp8;
    else apply_rope_with_cos_sin_cache (cos_sin=cache), apply_rope_pos_ids or apply_rope (indptr)."""
    if spec.page_table != "none":
        return _rope_append(spec)
    quantized = spec.dtype_out != spec.dtype_in
    if (spec.cos_sin, spec.positions) == ("cache", "indptr") or (quantized and spec.cos_sin == "computed"):
        raise CheckFailed(f"no public function selects {spec.name}: a cos_sin_cache goes with pos_ids, and an fp8 "
                          "output with a cos_sin_cache")
    nnz, hq, d, dt, il = 33, 8, 128, dtype(spec.dtype_in), spec.interleave
    q, k = randn((nnz, hq, d), dt), randn((nnz, KV_HEADS, d), dt)
    pos = torch.randint(0, 4096, (nnz,), dtype=torch.int32).to(DEVICE)
    cos_sin = cos_sin_cache_ref(4096, d).to(DEVICE)
    if quantized:
        qdt = dtype(spec.dtype_out)
        outs = fij.rope_quantize_fp8(q, k, None, None, cos_sin, pos, is_neox=not il, quantize_dtype=qdt)
        synchronize()
        refs = rope_quantize_ref(q, k, q[..., :0], k[..., :0], cos_sin, pos, il, 1.0, 1.0, qdt)
        for out, ref, what in zip(outs[:2], refs[:2], ("q_rope_out", "k_rope_out")):
            expect_close(out, ref, FP8_RTOL[qdt], FP8_ATOL, what)
        return
    if spec.cos_sin == "cache":
        q_out, k_out = fij.apply_rope_with_cos_sin_cache(pos, q.view(nnz, -1), k.view(nnz, -1), d, cos_sin,
                                                         is_neox=not il)
        q_out, k_out = q_out.view(q.shape), k_out.view(k.shape)
        refs = apply_rope_ref(q, k, pos, interleave=il, cos_sin_cache=cos_sin)
    elif spec.positions == "pos_ids":
        q_out, k_out = fij.apply_rope_pos_ids(q, k, pos, interleave=il)
        refs = apply_rope_ref(q, k, pos, interleave=il)
    else:
        lens, starts = [10, 0, 23], int32([0, 500, 4000])
        q_out, k_out = fij.apply_rope(q, k, offsets(lens), starts, interleave=il)
        refs = apply_rope_ref(q, k, positions_from_indptr(offsets(lens), starts), interleave=il)
    synchronize()
    expect_rows(q_out, refs[0], ROPE_TOL[dt], "q")
    expect_rows(k_out, refs[1], ROPE_TOL[dt], "k")


def _rope_append(spec) -> None:
    """vLLM's fused step: q and k rotated over the whole head (no nope part), quantized, k and v
    written into the paged cache (FlashInfer's CSR arguments, or page_table= for block tables)."""
    if spec.cos_sin != "cache" or spec.positions != "pos_ids" or spec.dtype_out == spec.dtype_in:
        raise CheckFailed("rope_quantize_fp8_append_paged_kv_cache takes a cos_sin_cache, pos_ids and an fp8 "
                          f"cache; no public function selects {spec.name}")
    kv_lens, append_lens, hq, d = [5, 40, 17], [2, 24, 17], 8, 128
    dt, qdt = dtype(spec.dtype_in), dtype(spec.dtype_out)
    table, num_pages = page_table(spec.page_table, kv_lens)
    shape = (num_pages, PAGE, KV_HEADS, d) if spec.kv_layout == "NHD" else (num_pages, KV_HEADS, PAGE, d)
    k_cache, v_cache = (torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(qdt) for _ in range(2))
    before = (k_cache.clone(), v_cache.clone())
    batch_indices, positions = appended_tokens(append_lens, kv_lens)
    nnz = batch_indices.shape[0]
    q, k, v = randn((nnz, hq, d), dt), randn((nnz, KV_HEADS, d), dt), randn((nnz, KV_HEADS, d), dt)
    cos_sin = cos_sin_cache_ref(4096, d).to(DEVICE)
    tables = dict(kv_indices=table.tensors[1], kv_indptr=table.tensors[0]) if table.layout == "csr" \
        else {"page_table": table}
    q_out, _ = fij.rope_quantize_fp8_append_paged_kv_cache(
        q, k, None, None, v, cos_sin, positions, (k_cache, v_cache), batch_indices=batch_indices, positions=positions,
        is_neox=not spec.interleave, quantize_dtype=qdt, page_size=PAGE, kv_layout=spec.kv_layout, **tables)
    synchronize()
    q_ref, _, caches_ref = rope_quantize_append_ref(q, k, q[..., :0], k[..., :0], v, cos_sin, positions, before,
                                                    table, batch_indices, positions, spec.interleave, 1.0, 1.0,
                                                    spec.kv_layout)
    for out, ref, what in ((q_out, q_ref, "q_rope_out"), (k_cache, caches_ref[0], "k_cache"),
                           (v_cache, caches_ref[1], "v_cache")):
        expect_close(out, ref, FP8_RTOL[qdt], FP8_ATOL, what)


def exercise_flatten(spec, matrix=()) -> None:
    lens = [37, 16, 100]
    out_size, out_dt = sum(lens) + 5, dtype(spec.dtype_out)
    table, num_pages = page_table(spec.page_table, lens)
    k_cache, v_cache = (paged_cache(dtype(spec.dtype_kv), spec.kv_layout, num_pages, spec.head_dim) for _ in range(2))
    seq_lens = int32(lens)
    outs = fij.flatten_kv_cache(k_cache, v_cache, seq_lens, table, out_size=out_size, out_dtype=out_dt,
                                kv_layout=spec.kv_layout)
    synchronize()
    refs = flatten_kv_cache_ref(k_cache, v_cache, seq_lens, table, out_size, "shd", 1.0, 1.0, out_dt, spec.kv_layout)
    for out, ref, what in zip(outs, refs, ("k_out", "v_out")):
        expect_equal(out, ref, what)


def exercise_prefill(spec, matrix=()) -> None:
    """Paged (BatchPrefillWithPagedKVCacheWrapper over the spec's page table) or ragged K/V;
    causal, custom (random bools) or no mask; RoPE, soft cap and sinks as the spec says."""
    shapes = [(1, 16), (7, 40), (20, 100)]  # (qo_len, kv_len)
    hq, dqk, dvo = 4 * KV_HEADS, spec.head_dim_qk, spec.head_dim_vo
    q_dt, kv_dt, o_dt = dtype(spec.dtype_q), dtype(spec.dtype_kv), dtype(spec.dtype_o)
    qo_indptr = offsets(m for m, _ in shapes)
    q = randn((int(qo_indptr[-1]), hq, dqk), q_dt)
    mask = {}
    if spec.mask == "custom":
        mask["custom_mask"] = torch.cat([torch.rand(m * n) < 0.5 for m, n in shapes]).to(DEVICE)
    rope = "ROPE_LLAMA" if spec.pos_encoding == "rope_llama" else "NONE"
    cap = SOFT_CAP if spec.soft_cap else None
    options = dict(causal=spec.mask == "causal", pos_encoding_mode=rope, logits_soft_cap=cap)
    sinks = randn(hq, torch.float32) if spec.sinks else None
    heads = dict(num_qo_heads=hq, num_kv_heads=KV_HEADS, head_dim_qk=dqk, head_dim_vo=dvo)
    dtypes = dict(q_data_type=q_dt, kv_data_type=kv_dt, o_data_type=o_dt)
    lens = [n for _, n in shapes]
    if spec.kv_source == "ragged":
        k, v = randn((sum(lens), KV_HEADS, dqk), kv_dt), randn((sum(lens), KV_HEADS, dvo), kv_dt)
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(workspace(DEVICE), "NHD")
        wrapper.plan(qo_indptr, offsets(lens), **heads, **dtypes, **options, **mask)
        kv_args, ref_kv = (k, v), dict(kv_indptr=offsets(lens))
    else:
        table, num_pages = page_table(spec.page_table, lens)
        k = paged_cache(kv_dt, spec.kv_layout, num_pages, dqk)
        v = paged_cache(kv_dt, spec.kv_layout, num_pages, dvo)
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout)
        wrapper.plan(qo_indptr, **plan_table_args(table, "paged_kv_"), page_size=PAGE, **heads, **dtypes, **options,
                     **mask)
        kv_args, ref_kv = ((k, v),), dict(page_table=table, kv_layout=spec.kv_layout)
    out, lse = wrapper.run(q, *kv_args, out=nan_like((q.shape[0], hq, dvo), o_dt), return_lse=True, sinks=sinks)
    synchronize()
    ref_out, ref_lse = prefill_ref(q, qo_indptr, k, v, **ref_kv, **options, **mask, sinks=sinks)
    tol = max(PREFILL_TOL[q_dt], PREFILL_TOL[o_dt]) * (2.5 if kv_dt.itemsize == 1 else 1.0)
    expect_close(out, ref_out, tol, tol, "out")
    expect_close(lse, ref_lse, 1e-2, 1e-2, "lse")


def exercise_prefill_sm90(spec, matrix=()) -> None:
    """The Hopper prefill kernel (backend="fa3", ragged K/V or the paged cache on the CSR table):
    the spec's dtype, head_dim, mask (a custom one of random bits), K/V source and layout, soft
    cap, ALiBi, key tile and query tile (pinned, so that the spec's module is the one loaded),
    FP8 attention (the spec's fp8: e4m3 q, K and V, the spec's dtype out). Its code runs on sm_90
    only: on another GPU the module is loaded from the cache (its presence is what an image for
    several archs must show) and not run."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        jit.get_module(spec)
        return
    shapes = [(1, 16), (7, 40), (200, 300)]  # (qo_len, kv_len)
    hq, d, dv, dt = 4 * KV_HEADS, spec.head_dim, spec.head_dim_vo, dtype(spec.dtype_q)
    causal = spec.mask == "causal"
    cap = dict(logits_soft_cap=30.0) if spec.soft_cap else {}
    if spec.alibi:
        cap["pos_encoding_mode"] = "ALIBI"
    lens = [n for _, n in shapes]
    if spec.mask == "custom":  # random bits, each request's qo_len x kv_len one after another
        bits = torch.rand(sum(m * n for m, n in shapes), generator=torch.Generator().manual_seed(5)) < 0.7
        cap["custom_mask"] = bits.to(DEVICE)
    qo_indptr, kv_indptr = offsets(m for m, _ in shapes), offsets(lens)
    fp8 = spec.fp8  # (q, K and V in e4m3; the reference reads their values, exact in dt)
    in_dt, tol = (torch.float8_e4m3fn, FP8_ATTENTION_TOL) if fp8 else (dt, PREFILL_TOL[dt])
    q = randn((int(qo_indptr[-1]), hq, d), dt).to(in_dt)
    if spec.kv_source == "ragged":
        k = randn((int(kv_indptr[-1]), KV_HEADS, d), dt).to(in_dt)
        v = randn((int(kv_indptr[-1]), KV_HEADS, dv), dt).to(in_dt)
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(workspace(DEVICE), "NHD", backend="fa3")
        wrapper._force_key_tile = spec.key_tile
        wrapper._force_query_tile = spec.query_tile if spec.query_tile != 128 else None
        dtypes = dict(q_data_type=in_dt, kv_data_type=in_dt, o_data_type=dt)
        wrapper.plan(qo_indptr, kv_indptr, hq, KV_HEADS, d, head_dim_vo=dv, causal=causal, **dtypes, **cap)
        kv_args, ref_kv = (k, v), dict(kv_indptr=kv_indptr)
    else:  # the CSR page table, pages of PAGE tokens
        table, num_pages = page_table("csr", lens)
        k, v = paged_cache(dt, spec.kv_layout, num_pages, d), paged_cache(dt, spec.kv_layout, num_pages, dv)
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout, backend="fa3")
        wrapper._force_key_tile = spec.key_tile
        wrapper._force_query_tile = spec.query_tile if spec.query_tile != 128 else None
        wrapper.plan(qo_indptr, **plan_table_args(table, "paged_kv_"), num_qo_heads=hq, num_kv_heads=KV_HEADS,
                     head_dim_qk=d, head_dim_vo=dv, page_size=PAGE, causal=causal, q_data_type=dt, **cap)
        kv_args, ref_kv = ((k, v),), dict(page_table=table, kv_layout=spec.kv_layout)
    out, lse = wrapper.run(q, *kv_args, out=nan_like((q.shape[0], hq, dv), dt), return_lse=True)
    synchronize()
    ref_out, ref_lse = prefill_ref(q.to(dt), qo_indptr, k.to(dt), v.to(dt), **ref_kv, causal=causal, **cap)
    expect_close(out, ref_out, tol, tol, "out")
    expect_close(lse, ref_lse, 1e-2, 1e-2, "lse")


def pod_inputs(spec, shapes, d_lens, q_dt, kv_dt) -> tuple:
    """A POD exerciser's inputs: the query heads that give the spec's group tile, one paged cache
    (K and V) whose table (the spec's layout) holds the decodes' pages, then the prefill
    requests' (`shapes`: (qo_len, kv_len)), cut into the two sides' tables, and q of each side:
    (hq, decodes, k_cache, v_cache, d_table, p_table, qo_indptr, q_p, q_d)."""
    d = spec.head_dim
    hq = next(g * KV_HEADS for g in (spec.group_tile * m for m in (1, 2, 4))
              if group_tile(g * KV_HEADS, KV_HEADS, d) == spec.group_tile)
    layout = spec.page_table if spec.prefill_kv == "paged" else "csr"
    table, num_pages = page_table(layout, d_lens + [n for _, n in shapes])  # decodes first, then the prefills
    k_cache, v_cache = (paged_cache(kv_dt, spec.kv_layout, num_pages, d) for _ in range(2))
    nd = len(d_lens)
    if layout == "csr":
        indptr, ids, last = table.tensors
        d_table = fij.csr_page_table(indptr[:nd + 1] - indptr[0], ids[:int(indptr[nd])], last[:nd])
        p_table = fij.csr_page_table(indptr[nd:] - indptr[nd], ids[int(indptr[nd]):], last[nd:])
    else:  # each side the rows of its requests
        rows, lens = table.tensors
        separate = layout == "block_table_kv_separate"
        d_table = fij.block_page_table(rows[:nd], lens[:nd], kv_separate=separate)
        p_table = fij.block_page_table(rows[nd:], lens[nd:], kv_separate=separate)
    qo_indptr = offsets(m for m, _ in shapes)
    return (hq, nd, k_cache, v_cache, d_table, p_table, qo_indptr, randn((int(qo_indptr[-1]), hq, d), q_dt),
            randn((nd, hq, d), q_dt))


def pod_tables(table: PageTable) -> tuple:
    """A side's CSR arguments to batch POD's plan(): the table's, or three None (block tables)."""
    return table.tensors if table.layout == "csr" else (None, None, None)


def pod_blocks(p_table: PageTable, d_table: PageTable) -> dict:
    """Batch POD's block-table keywords for block-table sides (CSR: none)."""
    if p_table.layout == "csr":
        return {}
    return dict(block_tables_p=p_table.tensors[0], seq_lens_p=p_table.tensors[1], block_tables_d=d_table.tensors[0],
                seq_lens_d=d_table.tensors[1])


def exercise_pod(spec, matrix=()) -> None:
    """POD: PODWithPagedKVCacheWrapper (prefill_kv ragged: one prefill request on contiguous
    K/V) or BatchPODWithPagedKVCacheWrapper (paged: three prefill requests on the cache the
    decodes read, other pages), beside three decodes; the mask as the spec says. Both
    sides' outputs and LSEs against their references."""
    if spec.page_table != "csr" and spec.prefill_kv == "ragged":
        raise CheckFailed(f"{spec.name}: the single-prefill POD wrapper takes a CSR page table (FlashInfer's), not "
                          f"{spec.page_table}")
    d = spec.head_dim
    q_dt, kv_dt = dtype(spec.dtype_q), dtype(spec.dtype_kv)
    shapes = [(7, 40)] if spec.prefill_kv == "ragged" else [(1, 16), (7, 40), (20, 100)]  # (qo_len, kv_len)
    d_lens = [16, 37, 100]
    hq, nd, k_cache, v_cache, d_table, p_table, qo_indptr, q_p, q_d = pod_inputs(spec, shapes, d_lens, q_dt, kv_dt)
    mask = {}
    if spec.mask == "custom":
        mask["custom_mask"] = torch.cat([torch.rand(m * n) < 0.5 for m, n in shapes]).to(DEVICE)
    causal = spec.mask == "causal"
    if spec.prefill_kv == "ragged":
        (m, n), = shapes
        k_p, v_p = randn((n, KV_HEADS, d), q_dt), randn((n, KV_HEADS, d), q_dt)
        pod = fij.PODWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout)
        pod.plan(*d_table.tensors, hq, KV_HEADS, d, PAGE, q_data_type=q_dt, kv_data_type=kv_dt)
        custom = {"custom_mask_p": mask["custom_mask"].view(m, n)} if mask else {}
        (out_p, out_d), (lse_p, lse_d) = pod.run(q_p, k_p, v_p, q_d, (k_cache, v_cache), causal_p=causal,
                                                 return_lse_p=True, return_lse_d=True, kv_layout_d=spec.kv_layout,
                                                 **custom)
        ref_p = prefill_ref(q_p, qo_indptr, k_p, v_p, kv_indptr=offsets([n]), causal=causal, **mask)
    else:
        pod = fij.BatchPODWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout)
        pod.plan(qo_indptr, *pod_tables(p_table), offsets([1] * nd), *pod_tables(d_table), hq, KV_HEADS, d, PAGE,
                 q_data_type=q_dt, kv_data_type=kv_dt, causal=causal, **pod_blocks(p_table, d_table))
        custom = {"custom_mask_p": mask["custom_mask"]} if mask else {}
        (out_p, out_d), (lse_p, lse_d) = pod.run(q_p, (k_cache, v_cache), q_d, (k_cache, v_cache), causal_p=causal,
                                                 return_lse=True, **custom)
        ref_p = prefill_ref(q_p, qo_indptr, k_cache, v_cache, page_table=p_table, kv_layout=spec.kv_layout,
                            causal=causal, **mask)
    synchronize()
    ref_d = decode_ref(q_d, k_cache, v_cache, d_table, d_lens, spec.kv_layout)
    tol = PREFILL_TOL[q_dt] * (2.5 if kv_dt.itemsize == 1 else 1.0)
    expect_close(out_p, ref_p[0], tol, tol, "out_p")
    expect_close(lse_p, ref_p[1], 1e-2, 1e-2, "lse_p")
    expect_rows(out_d, ref_d[0], DECODE_TOL[q_dt] * (2.5 if kv_dt.itemsize == 1 else 1.0), "out_d")
    expect_close(lse_d, ref_d[1], 0.0, 1e-2, "lse_d")


def exercise_pod_sm90(spec, matrix=()) -> None:
    """POD on Hopper: BatchPODWithPagedKVCacheWrapper with prefill_backend="fa3", two prefill
    requests over the cache the three decodes read (other pages), the spec's head_dim, mask and
    key tile (pinned); both sides' outputs and LSEs against their references. sm_90 only: on
    another GPU the module is loaded from the cache and not run."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        jit.get_module(spec)
        return
    d, dt = spec.head_dim, dtype(spec.dtype_q)
    shapes, d_lens = [(200, 300), (130, 500)], [16, 37, 100]
    hq, nd, k_cache, v_cache, d_table, p_table, qo_indptr, q_p, q_d = pod_inputs(spec, shapes, d_lens, dt, dt)
    causal = spec.mask == "causal"
    pod = fij.BatchPODWithPagedKVCacheWrapper(workspace(DEVICE), spec.kv_layout)
    pod.prefill_backend = "fa3"
    pod._prefill._force_key_tile = spec.key_tile
    pod.plan(qo_indptr, *pod_tables(p_table), offsets([1] * nd), *pod_tables(d_table), hq, KV_HEADS, d, PAGE,
             q_data_type=dt, kv_data_type=dt, causal=causal, **pod_blocks(p_table, d_table))
    (out_p, out_d), (lse_p, lse_d) = pod.run(q_p, (k_cache, v_cache), q_d, (k_cache, v_cache), causal_p=causal,
                                             return_lse=True)
    synchronize()
    ref_p = prefill_ref(q_p, qo_indptr, k_cache, v_cache, page_table=p_table, kv_layout=spec.kv_layout, causal=causal)
    ref_d = decode_ref(q_d, k_cache, v_cache, d_table, d_lens, spec.kv_layout)
    expect_close(out_p, ref_p[0], PREFILL_TOL[dt], PREFILL_TOL[dt], "out_p")
    expect_close(lse_p, ref_p[1], 1e-2, 1e-2, "lse_p")
    expect_rows(out_d, ref_d[0], DECODE_TOL[dt], "out_d")
    expect_close(lse_d, ref_d[1], 0.0, 1e-2, "lse_d")


def planned_by(cls: type[Spec], usable=lambda spec: True):
    """The exerciser of a module that plan() of `cls`'s wrapper loads (no call of its own):
    `cls`'s exerciser on the matrix's first `cls` spec that `usable` accepts."""
    def exercise(spec, matrix) -> None:
        partner = next((s for s in matrix if isinstance(s, cls) and usable(s)), None)
        if partner is None:
            raise CheckFailed(f"{spec.name} is loaded by plan() of a {cls.FAMILY} wrapper, and the matrix has no "
                              f"{cls.FAMILY} module it could plan for")
        EXERCISERS[partner.FAMILY](partner, matrix)
    return exercise


EXERCISERS = {
    "append": exercise_append,
    "batch_indices": exercise_batch_indices,
    "decode": exercise_decode,
    "merge": exercise_merge,
    "rope": exercise_rope,
    "flatten": exercise_flatten,
    "prefill": exercise_prefill,
    "prefill_sm90": exercise_prefill_sm90,
    "pod": exercise_pod,
    "pod_sm90": exercise_pod_sm90,
    "decode_plan": planned_by(DecodeSpec),  # the C++ planner: every plan()
    # plan() sorts each request's full pages only where no term depends on a token's position
    "page_order": planned_by(DecodeSpec, lambda s: not s.rope and s.q_tokens == 1),
    "prefill_plan": planned_by(PrefillSpec),
}


# --- the run --------------------------------------------------------------------------------------
def loaded_modules() -> dict[Spec, Path]:
    """spec -> entry folder of every module this process loaded: jit's registry of loaded
    libraries (one per namespace; the package has no public listing of it)."""
    return {module.spec: module.path for module in jit._loaded.values()}


def run_entry(spec: Spec, matrix: list[Spec]) -> dict:
    torch.manual_seed(zlib.crc32(spec.name.encode()))
    start = time.perf_counter()
    error = None
    try:
        exercise = EXERCISERS.get(spec.FAMILY)
        if exercise is None:
            raise CheckFailed(f"no exerciser for family {spec.FAMILY!r}: add one to EXERCISERS in "
                              f"{Path(__file__).name}")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="flashinfer_jit:", category=RuntimeWarning)
            exercise(spec, matrix)
        synchronize()
        if spec not in loaded_modules():
            raise CheckFailed("ran, but its module was never loaded (the calls took other modules)")
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the other entries still run
        error = f"{type(exc).__name__}: {exc}"
    path = loaded_modules().get(spec)
    return {"name": spec.name, "family": spec.FAMILY, "line": spec_line(spec), "ok": error is None,
            "seconds": round(time.perf_counter() - start, 3), "module_path": str(path) if path else None,
            "error": error}


def outside_spec(matrix: list[Spec]) -> DecodeSpec:
    """Batch decode at a head_dim the matrix lacks (its first decode module's other fields)."""
    base = next((s for s in matrix if isinstance(s, DecodeSpec)), DecodeSpec("bfloat16", "bfloat16", 128, 4))
    for head_dim in HEAD_DIMS:
        spec = dataclasses.replace(base, head_dim=head_dim)
        if spec not in matrix:
            return spec.validate()
    raise CheckFailed(f"the matrix has {base.name} at every head_dim; nothing outside it to ask for")


def check_outside(matrix: list[Spec]) -> dict:
    """A configuration outside the matrix fails at once: JitDisabledError naming its matrix
    line and the `flashinfer-jit aot` command that builds it."""
    spec = outside_spec(matrix)
    line = spec_line(spec)
    error = None
    try:
        exercise_decode(spec, matrix)
        error = "it ran: the cache holds a module the matrix does not list"
    except JitDisabledError as exc:
        missing = [want for want in (line, "flashinfer-jit aot") if want not in str(exc)]
        if missing or exc.matrix_line != line:
            error = f"its JitDisabledError does not name {missing or [line]}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        error = f"expected JitDisabledError, got {type(exc).__name__}: {exc}"
    return {"name": spec.name, "line": line, "ok": error is None, "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", required=True, type=Path, help="the AOT matrix file the cache was built from")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("deploy_check: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    if not env.jit_disabled():
        print("deploy_check: FLASHINFER_JIT_DISABLE_JIT was not set; set for this run (a deployment check never "
              "compiles)")
        os.environ["FLASHINFER_JIT_DISABLE_JIT"] = "1"
    matrix = parse_matrix(args.matrix)
    print(f"deploy_check: {len(matrix)} modules of {args.matrix}; cache path "
          f"{os.environ.get('FLASHINFER_JIT_CACHE_PATH', '(unset)')}; nvcc {toolchain.find_nvcc() or 'none'}")
    entries = []
    for spec in matrix:
        entries.append(run_entry(spec, matrix))
        e = entries[-1]
        print(f"  {e['name']:<56} {'ok' if e['ok'] else 'FAILED':<6} {e['seconds']:7.2f} s")
        if e["error"]:
            print("      " + e["error"].replace("\n", "\n      "))
    loaded = loaded_modules()
    never = [spec.name for spec in matrix if spec not in loaded]
    outside = check_outside(matrix)
    print(f"  outside the matrix: {outside['name']:<36} {'ok' if outside['ok'] else 'FAILED'}")
    if outside["error"]:
        print("      " + outside["error"].replace("\n", "\n      "))
    passed = sum(e["ok"] for e in entries)
    ok = passed == len(entries) and not never and outside["ok"]
    print(f"deploy_check: {passed}/{len(entries)} entries ok; never loaded: {', '.join(never) or 'none'}; "
          f"outside the matrix: {'ok' if outside['ok'] else 'FAILED'} -> {'PASS' if ok else 'FAIL'}")
    if args.json:
        report = {"matrix": str(args.matrix), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "nvcc": toolchain.find_nvcc(), "cache_path": os.environ.get("FLASHINFER_JIT_CACHE_PATH"),
                  "cache_dir": str(env.cache_root()), "entries": entries, "never_loaded": never,
                  "loaded_outside_matrix": sorted(s.name for s in loaded if s not in matrix), "outside": outside,
                  "ok": ok}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
