"""Batch decode (BatchDecodeWithPagedKVCacheWrapper), single_decode_with_kv_cache and
merge_state(s) against the float64 reference (flashinfer_jit/reference/decode.py).

The option grid (dtypes, head dims, GQA/MQA, page sizes, KV layouts, page tables, cache
forms, RoPE, window, soft cap, sm_scale, LSE, split-KV, tensor cores) is covered pairwise
by CASES, a fixed list checked by test_cases_cover_every_pair_of_options, so each option
meets every other at least once without the full product; CASES needs only a few compiled
modules, all listed in scripts/matrices/tests (checked on the CPU too).

Every GPU test uses fresh random data; caches hold random values, and every page no
request uses holds NaN (a read through a wrong page id shows). Outputs are NaN-poisoned
(`out=`/`lse=` passed filled with NaN, inside sentinel rows that must stay untouched).
Errors are relative norms per request, so a long request's small output is not hidden
by short ones; fp8 caches are compared with the reference on the same fp8 values.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from kv_helpers import (
    DEV,
    Paged,
    assert_sentinels,
    assert_tests_matrix_has,
    capture_graph,
    dtype_of,
    grid_case,
    make_page_table,
    on_host,
    poisoned,
    randn,
    replay_poisoned,
)

import flashinfer_jit as fij
from flashinfer_jit.decode import wrapper as decode_module
from flashinfer_jit.decode.spec import group_tile
from flashinfer_jit.pipeline.jit import get_module
from flashinfer_jit.reference.decode import (
    decode_ref,
    merge_state_ref,
    merge_states_ref,
    ordered_pages_ref,
    request_pages_ref,
)
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table
from flashinfer_jit.specs import DecodeSpec, MergeSpec, PageOrderSpec

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}  # relative norm per request
LSE_TOL = 1e-2  # absolute, base 2
MERGE_LSE_TOL = 1e-4
SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float32": "f32"}
TABLE_TAG = {"csr": "csr", "block_table": "bt", "block_table_kv_separate": "btkv"}


class Case(NamedTuple):
    q_dtype: str
    kv: str               # "same" (= q_dtype), or an fp8 cache dtype
    head_dim: int
    heads: tuple          # (num_qo_heads, num_kv_heads)
    page_size: int
    kv_layout: str
    page_table: str
    cache_form: str       # "tuple" (k, v); "single" [P, 2, ...]; "halves": K, V = halves of [..., 2*D]
    pos_encoding: str
    window_left: int
    soft_cap: float | None
    sm_scale: float | None
    return_lse: bool
    split: str            # "auto"; "no_split" (disable_split_kv=True); "fixed64" (fixed_split_size=64)
    tensor_cores: bool    # use_tensor_cores (fixed_split_size needs True, as in FlashInfer)

    @property
    def kv_dtype(self) -> str:
        return self.q_dtype if self.kv == "same" else self.kv


OPTIONS = {
    "q_dtype": ("float16", "bfloat16"),
    "kv": ("same", "float8_e4m3fn", "float8_e5m2"),
    "head_dim": (64, 128, 256),
    "heads": ((8, 8), (16, 8), (32, 8), (64, 8), (32, 1), (64, 1)),
    "page_size": (1, 8, 16, 32, 64),
    "kv_layout": ("NHD", "HND"),
    "page_table": ("csr", "block_table", "block_table_kv_separate"),
    "cache_form": ("tuple", "single", "halves"),
    "pos_encoding": ("NONE", "ROPE_LLAMA"),
    "window_left": (-1, 37),
    "soft_cap": (None, 30.0),
    "sm_scale": (None, 0.07),
    "return_lse": (False, True),
    "split": ("auto", "no_split", "fixed64"),
    "tensor_cores": (False, True),
}
# Beyond pairs: every page size x KV layout x page table, and every KV layout x page
# table x cache form (where the address arithmetic of the three meets).
TRIPLES = (("page_size", "kv_layout", "page_table"), ("kv_layout", "page_table", "cache_form"))

# A covering array of OPTIONS and TRIPLES, generated greedily with a penalty on each new
# compiled module: 41 cases on 18 DecodeSpecs (19 with the tests below).
CASES = [
    Case("float16", "same", 128, (16, 8), 16, "HND", "block_table_kv_separate", "tuple", "NONE", -1, None, 0.07, True, "fixed64", True),
    Case("bfloat16", "float8_e4m3fn", 64, (32, 1), 32, "NHD", "block_table", "single", "ROPE_LLAMA", 37, None, None, False, "auto", False),
    Case("bfloat16", "float8_e5m2", 256, (8, 8), 8, "HND", "csr", "tuple", "NONE", 37, 30.0, None, True, "no_split", False),
    Case("float16", "float8_e5m2", 64, (32, 8), 1, "NHD", "block_table", "halves", "ROPE_LLAMA", -1, 30.0, None, True, "fixed64", True),
    Case("float16", "float8_e4m3fn", 256, (64, 1), 64, "NHD", "csr", "halves", "ROPE_LLAMA", 37, 30.0, 0.07, True, "auto", False),
    Case("bfloat16", "same", 128, (32, 8), 8, "NHD", "csr", "tuple", "NONE", 37, None, 0.07, False, "no_split", True),
    Case("bfloat16", "same", 64, (64, 8), 8, "HND", "block_table_kv_separate", "single", "NONE", -1, 30.0, 0.07, False, "auto", False),
    Case("float16", "float8_e5m2", 128, (64, 1), 16, "NHD", "block_table_kv_separate", "single", "ROPE_LLAMA", -1, None, None, False, "no_split", False),
    Case("bfloat16", "same", 256, (32, 1), 32, "HND", "block_table", "halves", "ROPE_LLAMA", -1, 30.0, 0.07, False, "fixed64", True),
    Case("bfloat16", "same", 64, (32, 1), 64, "HND", "block_table_kv_separate", "tuple", "NONE", -1, 30.0, 0.07, False, "auto", True),
    Case("float16", "float8_e4m3fn", 64, (16, 8), 1, "HND", "csr", "single", "NONE", 37, 30.0, 0.07, False, "no_split", True),
    Case("float16", "float8_e4m3fn", 256, (64, 8), 32, "NHD", "csr", "halves", "ROPE_LLAMA", 37, 30.0, None, False, "no_split", True),
    Case("bfloat16", "float8_e4m3fn", 128, (8, 8), 16, "NHD", "block_table_kv_separate", "halves", "ROPE_LLAMA", 37, None, 0.07, False, "fixed64", True),
    Case("bfloat16", "float8_e4m3fn", 128, (16, 8), 1, "NHD", "block_table", "tuple", "ROPE_LLAMA", -1, 30.0, None, False, "auto", False),
    Case("bfloat16", "same", 128, (32, 8), 32, "NHD", "block_table", "halves", "NONE", 37, None, None, True, "no_split", True),
    Case("float16", "float8_e5m2", 128, (64, 8), 8, "NHD", "block_table_kv_separate", "halves", "ROPE_LLAMA", 37, None, 0.07, False, "fixed64", True),
    Case("float16", "float8_e5m2", 128, (32, 1), 1, "NHD", "block_table_kv_separate", "tuple", "ROPE_LLAMA", -1, None, None, False, "fixed64", True),
    Case("bfloat16", "same", 64, (64, 1), 16, "HND", "block_table_kv_separate", "tuple", "NONE", 37, 30.0, 0.07, True, "no_split", True),
    Case("float16", "float8_e5m2", 64, (32, 8), 64, "NHD", "block_table", "halves", "ROPE_LLAMA", -1, 30.0, None, False, "auto", False),
    Case("float16", "same", 256, (8, 8), 1, "NHD", "csr", "single", "ROPE_LLAMA", -1, None, 0.07, True, "auto", True),
    Case("bfloat16", "float8_e4m3fn", 128, (8, 8), 32, "NHD", "block_table_kv_separate", "single", "ROPE_LLAMA", -1, None, None, False, "fixed64", True),
    Case("bfloat16", "same", 128, (32, 8), 8, "HND", "csr", "halves", "NONE", 37, None, None, False, "auto", False),
    Case("bfloat16", "float8_e4m3fn", 64, (64, 8), 16, "NHD", "block_table", "tuple", "ROPE_LLAMA", -1, None, None, True, "auto", False),
    Case("bfloat16", "same", 128, (32, 8), 64, "HND", "csr", "tuple", "NONE", 37, None, 0.07, False, "fixed64", True),
    Case("float16", "same", 128, (16, 8), 32, "HND", "block_table_kv_separate", "tuple", "NONE", -1, None, 0.07, False, "fixed64", True),
    Case("bfloat16", "float8_e4m3fn", 128, (8, 8), 64, "NHD", "block_table_kv_separate", "single", "ROPE_LLAMA", -1, None, None, True, "no_split", False),
    Case("float16", "same", 128, (16, 8), 64, "HND", "block_table_kv_separate", "tuple", "NONE", -1, None, None, False, "fixed64", True),
    Case("bfloat16", "same", 128, (32, 8), 16, "HND", "csr", "single", "NONE", 37, None, 0.07, False, "no_split", True),
    Case("float16", "float8_e5m2", 256, (16, 8), 32, "HND", "csr", "halves", "ROPE_LLAMA", 37, None, None, True, "no_split", False),
    Case("bfloat16", "float8_e4m3fn", 256, (32, 8), 1, "HND", "block_table_kv_separate", "halves", "NONE", 37, None, None, True, "no_split", True),
    Case("float16", "float8_e4m3fn", 256, (32, 1), 16, "NHD", "csr", "halves", "ROPE_LLAMA", -1, 30.0, 0.07, True, "no_split", False),
    Case("bfloat16", "same", 256, (32, 1), 8, "HND", "block_table", "tuple", "ROPE_LLAMA", -1, 30.0, 0.07, False, "no_split", True),
    Case("bfloat16", "same", 256, (64, 1), 16, "HND", "block_table", "single", "ROPE_LLAMA", -1, 30.0, 0.07, False, "auto", True),
    Case("float16", "float8_e4m3fn", 64, (8, 8), 8, "NHD", "block_table", "halves", "NONE", 37, None, 0.07, False, "no_split", True),
    Case("bfloat16", "same", 64, (64, 1), 1, "HND", "block_table_kv_separate", "halves", "NONE", -1, 30.0, 0.07, False, "fixed64", True),
    Case("bfloat16", "float8_e4m3fn", 64, (64, 1), 32, "NHD", "block_table", "tuple", "ROPE_LLAMA", 37, None, None, True, "auto", False),
    Case("bfloat16", "same", 256, (64, 1), 1, "HND", "block_table", "tuple", "ROPE_LLAMA", 37, 30.0, 0.07, True, "auto", False),
    Case("bfloat16", "float8_e4m3fn", 64, (64, 8), 1, "NHD", "block_table", "single", "ROPE_LLAMA", 37, None, None, True, "no_split", True),
    Case("float16", "same", 128, (16, 8), 8, "HND", "block_table_kv_separate", "halves", "NONE", 37, None, 0.07, True, "no_split", False),
    Case("bfloat16", "same", 256, (64, 8), 64, "HND", "block_table", "halves", "ROPE_LLAMA", -1, 30.0, None, False, "auto", False),
    Case("bfloat16", "same", 64, (64, 1), 8, "HND", "block_table_kv_separate", "single", "NONE", -1, 30.0, None, True, "auto", True),
]

# The configurations of the tests beyond the grid: (q dtype, kv dtype, head_dim, heads,
# page table, KV layout), no RoPE, no soft cap.
LLAMA_HEADS = (32, 8)
SKEWED_DTYPES = ("float16", "bfloat16")
GRAPH_TABLES = ("csr", "block_table")
SINGLE_LAYOUTS = ("NHD", "HND")  # single decode is assumed to run as one CSR page of kv_len slots
TAIL_CASES = [("bfloat16", 128, "NHD", "csr"), ("float8_e4m3fn", 256, "HND", "block_table_kv_separate")]
MERGE_DTYPES = ("float16", "bfloat16", "float32")
MERGE_HEAD_DIMS = (64, 128, 256)


def decode_spec(q_dtype, kv_dtype, head_dim, heads, page_table, kv_layout, rope=False, soft_cap=False):
    return DecodeSpec(q_dtype, kv_dtype, head_dim, group_tile(*heads, head_dim), page_table, kv_layout, rope, soft_cap)


def case_spec(case: Case) -> DecodeSpec:
    return decode_spec(case.q_dtype, case.kv_dtype, case.head_dim, case.heads, case.page_table,
                       case.kv_layout, case.pos_encoding == "ROPE_LLAMA", case.soft_cap is not None)


def specs_needed() -> set:
    """Every DecodeSpec / MergeSpec the GPU tests of this file load."""
    specs = {case_spec(c) for c in CASES}
    specs |= {decode_spec(d, d, 128, LLAMA_HEADS, "csr", "NHD") for d in SKEWED_DTYPES}
    specs |= {decode_spec("bfloat16", "bfloat16", 128, LLAMA_HEADS, t, "NHD") for t in GRAPH_TABLES}
    specs |= {decode_spec("bfloat16", "bfloat16", 128, LLAMA_HEADS, "csr", lay) for lay in SINGLE_LAYOUTS}
    specs |= {decode_spec("bfloat16", kv, hd, LLAMA_HEADS, t, lay) for kv, hd, lay, t in TAIL_CASES}
    specs |= {_pair_spec(c) for c in PAIR_CASES}
    specs |= {_cluster_spec(c) for c in CLUSTER_CASES}
    specs |= {decode_spec(d, d, 128, (hq, 8), t, lay, rope=pe == "ROPE_LLAMA") for d, hq, t, lay, pe in PDL_CASES}
    specs |= {decode_spec("bfloat16", kv, 128, LLAMA_HEADS, "csr", "NHD") for kv in ("bfloat16", "float8_e4m3fn")}
    # split-KV's merge runs in the output dtype (= q dtype)
    specs |= {MergeSpec(c.q_dtype, c.head_dim) for c in CASES}
    specs |= {MergeSpec(d, hd) for d in MERGE_DTYPES for hd in MERGE_HEAD_DIMS}
    specs |= {decode_spec("bfloat16", "bfloat16", 128, LLAMA_HEADS, t, "NHD") for t, _ in ORDER_CASES}
    specs |= {decode_spec(q, kv, 128, h, t, lay, soft_cap=cap is not None) for q, kv, h, t, lay, cap, _ in GROWING_CASES}
    specs |= {_multi_spec(c) for c in MULTI_CASES}
    specs |= {DecodeSpec(q, kv, 128, group_tile(*h, 128, n), t, lay, False, cap is not None, n)
              for q, kv, h, t, lay, cap, n, _, _ in MULTI_CLUSTER_CASES}
    specs.add(DecodeSpec("bfloat16", "bfloat16", 128, 4, q_tokens=4))  # the multi-token CUDA-graph replay
    specs.add(PageOrderSpec())  # plan()'s page reordering
    return specs


def case_id(i: int, c: Case) -> str:
    parts = [f"{i:02d}", SHORT[c.q_dtype], SHORT[c.kv_dtype], f"hd{c.head_dim}", f"{c.heads[0]}x{c.heads[1]}",
             f"p{c.page_size}", c.kv_layout, TABLE_TAG[c.page_table], c.cache_form]
    parts += ["rope"] * (c.pos_encoding == "ROPE_LLAMA") + [f"w{c.window_left}"] * (c.window_left >= 0)
    parts += ["cap"] * (c.soft_cap is not None) + ["sm"] * (c.sm_scale is not None) + ["lse"] * c.return_lse
    parts += [c.split] * (c.split != "auto") + ["tc"] * c.tensor_cores
    return "-".join(parts)


# --- inputs --------------------------------------------------------------------------------------
def make_cache(form: str, kv_layout: str, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """(what run() gets, k view, v view), filled with random values."""
    page = (page_size, num_kv_heads) if kv_layout == "NHD" else (num_kv_heads, page_size)
    if form == "tuple":
        k = randn((num_pages, *page, head_dim), dtype, gen)
        v = randn((num_pages, *page, head_dim), dtype, gen)
        return (k, v), k, v
    if form == "single":
        kv = randn((num_pages, 2, *page, head_dim), dtype, gen)
        return kv, kv[:, 0], kv[:, 1]
    assert form == "halves"  # MLA-style: K and V are strided slices of one buffer, no copy
    buf = randn((num_pages, *page, 2 * head_dim), dtype, gen)
    k, v = buf[..., :head_dim], buf[..., head_dim:]
    return (k, v), k, v


def nan_pages(cache: torch.Tensor, pages) -> None:
    if not pages:
        return
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    if cache.element_size() == 1:  # 0x7F is NaN in e4m3fn and in e5m2
        cache.view(torch.uint8).index_fill_(0, index, 0x7F)
    else:
        cache.index_fill_(0, index, float("nan"))


def nan_past_lengths(cache: torch.Tensor, table: PageTable, lens, page_size: int, kv_layout: str, which: int):
    """NaN into every slot at or past each request's length in its last page (`which`:
    0 for the K cache, 1 for the V cache)."""
    host = on_host(table)
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    nan = 0x7F if cache.element_size() == 1 else float("nan")
    for b, n in enumerate(lens):
        if n % page_size == 0:
            continue
        pages = request_pages_ref(host, b, -(-n // page_size))[which]
        first = n % page_size
        if kv_layout == "NHD":
            raw[pages[-1], first:] = nan
        else:
            raw[pages[-1], :, first:] = nan


def check_decode(out, lse, ref_out, ref_lse, lens, dtype: torch.dtype) -> None:
    """Per request: relative error of out within TOL; length-0 requests exactly zero with
    LSE -inf; no NaN anywhere."""
    out, ref = out.double().cpu(), ref_out.double().cpu()
    assert not torch.isnan(out).any(), f"NaN in out, requests {sorted(set(torch.isnan(out).nonzero()[:, 0].tolist()))}"
    tol, worst = TOL[dtype], (-1.0, None)
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((out[b] == 0).all()), f"request {b} has length 0 but its output is not zero"
            continue
        err = float((out[b] - ref[b]).norm() / ref[b].norm())
        assert not math.isnan(err), f"request {b} (kv_len {n}): NaN error (the reference read a poisoned slot?)"
        worst = max(worst, (err, b))
    if worst[1] is not None:
        err, b = worst
        assert err < tol, f"request {b} (kv_len {lens[b]}): relative error {err:.2e} > {tol:.0e}"
    if lse is None:
        return
    lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
    assert not torch.isnan(lse).any(), "NaN in lse"
    for b, n in enumerate(lens):
        if n == 0:
            assert bool(torch.isneginf(lse[b]).all()), f"request {b} has length 0 but its lse is not -inf"
        else:
            diff = float((lse[b] - ref_lse[b]).abs().max())
            assert diff < LSE_TOL, f"request {b} (kv_len {n}): lse off by {diff:.2e} > {LSE_TOL}"


# --- the pairwise grid ---------------------------------------------------------------------------
MAX_LENS = (96, 700, 2048, 4500)  # RoPE cases stay <= 2048: fp32 angles (pos * freq) lose digits beyond
TOKEN_BUDGET = 50_000  # tokens per case, to bound memory and the reference's time


def case_lengths(index: int, case: Case, rnd: random.Random) -> list[int]:
    max_len = MAX_LENS[index % (3 if case.pos_encoding == "ROPE_LLAMA" else 4)]
    batch = {0: 1, 1: 33}.get(index % 8, rnd.randint(2, 33))
    batch = max(1, min(batch, TOKEN_BUDGET // max_len))
    if batch == 1:
        return [rnd.randint(max_len // 2, max_len)]
    ps = case.page_size
    lens = []
    for _ in range(batch):
        r = rnd.random()
        if r < 0.12:
            lens.append(0)
        elif r < 0.25:  # on and around page boundaries, a single token
            lens.append(rnd.choice([1, ps, ps + 1, 2 * ps, 2 * ps - 1]))
        else:
            lens.append(rnd.randint(1, max_len))
    if batch >= 3 and 0 not in lens:
        lens[rnd.randrange(batch)] = 0
    return lens


def _split_kwargs(split: str) -> dict:
    return {"auto": {}, "no_split": {"disable_split_kv": True}, "fixed64": {"fixed_split_size": 64}}[split]


@pytest.mark.gpu
@pytest.mark.parametrize("index", [pytest.param(i, id=case_id(i, c)) for i, c in enumerate(CASES)])
def test_batch_decode(index, workspace):
    case, rnd, gen = grid_case(CASES, index, 1000)
    q_dtype, kv_dtype = dtype_of(case.q_dtype), dtype_of(case.kv_dtype)
    hq, hk = case.heads
    d, ps = case.head_dim, case.page_size
    lens = case_lengths(index, case, rnd)
    batch = len(lens)
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(case.page_table, lens, ps, num_pages, rnd, host_indptr=index % 3 == 0)
    cache, k_cache, v_cache = make_cache(case.cache_form, case.kv_layout, num_pages, ps, hk, d, kv_dtype, gen)
    nan_pages(k_cache, paged.k_unused)
    nan_pages(v_cache, paged.v_unused)
    # larger logits where the soft cap is on, so that tanh bends them
    q = randn((batch, hq, d), q_dtype, gen, 4.0 if case.soft_cap else 1.0)
    fp8 = kv_dtype.itemsize == 1
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else dict(k_scale=0.8, v_scale=1.5) if index % 5 == 2 else {}
    if index % 4 == 1:
        scales["q_scale"] = 1.25
    rope = {}
    if case.pos_encoding == "ROPE_LLAMA" and index % 2:
        rope = dict(rope_scale=2.0, rope_theta=5e4)
    # dtypes as strings and as torch dtypes; kv_data_type=None means "as q"
    as_str = index % 2 == 0
    q_arg = case.q_dtype if as_str else q_dtype
    kv_arg = None if case.kv == "same" and index % 4 == 3 else (case.kv_dtype if as_str else kv_dtype)

    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, case.kv_layout, use_tensor_cores=case.tensor_cores)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 pos_encoding_mode=case.pos_encoding, window_left=case.window_left,
                 logits_soft_cap=case.soft_cap, q_data_type=q_arg, kv_data_type=kv_arg,
                 sm_scale=case.sm_scale, **rope, **_split_kwargs(case.split))
    out_buf, out = poisoned((batch, hq, d), q_dtype)
    lse_buf, lse = poisoned((batch, hq), torch.float32) if case.return_lse else (None, None)
    result = wrapper.run(q, cache, out=out, lse=lse, return_lse=case.return_lse, **scales)
    torch.cuda.synchronize()
    if case.return_lse:
        result, result_lse = result
        assert result_lse.data_ptr() == lse.data_ptr(), "lse= was not written in place"
        assert_sentinels(lse_buf, "lse")
    assert result.data_ptr() == out.data_ptr() and result.shape == (batch, hq, d) and result.dtype == q_dtype
    assert_sentinels(out_buf, "out")

    ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, case.kv_layout, case.sm_scale,
                                  case.window_left, case.soft_cap, case.pos_encoding,
                                  rope.get("rope_scale"), rope.get("rope_theta"), **scales)
    check_decode(out, lse, ref_out, ref_lse, lens, q_dtype)


# --- beyond the grid -----------------------------------------------------------------------------
def _llama_inputs(lens, dtype_name, gen, rnd, page_table="csr", kv_layout="NHD", head_dim=128,
                  kv_dtype_name=None, page_size=16, host_indptr=True):
    hq, hk = LLAMA_HEADS
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    paged = make_page_table(page_table, lens, page_size, num_pages, rnd, host_indptr=host_indptr)
    _, k, v = make_cache("tuple", kv_layout, num_pages, page_size, hk, head_dim,
                         dtype_of(kv_dtype_name or dtype_name), gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    q = randn((len(lens), hq, head_dim), dtype_of(dtype_name), gen)
    return paged, k, v, q


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SKEWED_DTYPES)
@pytest.mark.parametrize("split", ["auto", "fixed64"])
def test_batch_decode_skewed_lengths(dtype, split, workspace):
    """Most requests short, three ~32k long (and one empty): split-KV must split the long
    ones (auto: batch x kv_heads leaves the GPU mostly idle otherwise)."""
    rnd = random.Random(7)
    gen = torch.Generator(device=DEV).manual_seed(7)
    lens = [rnd.randint(1, 300) for _ in range(36)] + [32768, 32768 - 5, 32000 + 7, 0, 1]
    rnd.shuffle(lens)
    paged, k, v, q = _llama_inputs(lens, dtype, gen, rnd)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=split == "fixed64")
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=128,
                 page_size=16, q_data_type=dtype_of(dtype), **_split_kwargs(split))
    out, lse = wrapper.run(q, (k, v), return_lse=True)  # out/lse allocated by run()
    assert out.dtype == dtype_of(dtype) and lse.dtype == torch.float32 and lse.shape == (len(lens), LLAMA_HEADS[0])
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens)
    check_decode(out, lse, ref_out, ref_lse, lens, dtype_of(dtype))


@pytest.mark.gpu
def test_batch_decode_merges_thousands_of_partials():
    """fixed_split_size=8 over 32k tokens: 4096 partial states of one request, more than
    the tensor-core kernel's in-kernel merge keeps weights for in shared memory (3070 at
    32 heads x 128 dims): both of its loops run, against the reference."""
    rnd = random.Random(5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = [32768, 100, 0]
    paged, k, v, q = _llama_inputs(lens, "bfloat16", gen, rnd)
    workspace = torch.empty(160 << 20, dtype=torch.uint8, device=DEV)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=128,
                 page_size=16, q_data_type=torch.bfloat16, fixed_split_size=8)
    out_buf, out = poisoned((len(lens), LLAMA_HEADS[0], 128), torch.bfloat16)
    lse_buf, lse = poisoned((len(lens), LLAMA_HEADS[0]), torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse)
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens)
    check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,batch,kv_len,chunks,pairs", [
    ("bfloat16", 80, 16384, 4, 1),  # 1.2 waves of 528 blocks on 132 SMs -> 4.8
    ("float8_e4m3fn", 160, 16384, 2, 2),  # 2.4 waves of 8 MB paired blocks (264 at once) -> 4.8
    ("bfloat16", 16, 512, 1, 1),  # 128 blocks cover the SMs: whole (decode.py _FULL_GRID_MIN_TENTHS)
    ("bfloat16", 12, 2048, 2, 1),  # 96 blocks: two chunks, not the target's three
    ("float8_e4m3fn", 16, 4096, 2, 1),  # 128 blocks, 4096 tokens: in two
])
def test_batch_decode_wave_split_large_batch(kv_dtype, batch, kv_len, chunks, pairs, workspace):
    """A uniform batch that plan() splits by its grid's waves (decode.py
    _WAVE_SPLIT_MIN_BYTES), or whose unsplit grid covers the SMs (_FULL_GRID_MIN_TENTHS),
    matches the reference; NaN-poisoned out and LSE, every row written. (The chunk counts
    hold on 132 SMs, where the rules were measured.)"""
    rnd = random.Random(31)
    gen = torch.Generator(device=DEV).manual_seed(31)
    lens = [kv_len] * batch
    paged, k, v, q = _llama_inputs(lens, "bfloat16", gen, rnd, kv_dtype_name=kv_dtype)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=128,
                 page_size=16, q_data_type=torch.bfloat16, kv_data_type=dtype_of(kv_dtype))
    if torch.cuda.get_device_properties(DEV).multi_processor_count == 132:
        assert wrapper._plan.args[8] == batch * chunks and wrapper._plan.kv_heads_per_block == pairs
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype.startswith("float8") else {}
    out_buf, out = poisoned((batch, LLAMA_HEADS[0], 128), torch.bfloat16)
    lse_buf, lse = poisoned((batch, LLAMA_HEADS[0]), torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse, **scales)
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, **scales)
    check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page_table", GRAPH_TABLES)
def test_batch_decode_cuda_graph_replay(page_table, workspace):
    """run() captured once (batch 16), replayed after plan() with new lengths at batch 16,
    then at batch 9 with q padded to 16 rows: the live rows match the reference."""
    capacity, hq, hk, d, ps, pool = 16, *LLAMA_HEADS, 128, 16, 4096
    dtype = torch.bfloat16
    rnd = random.Random(11)
    gen = torch.Generator(device=DEV).manual_seed(11)
    _, k, v = make_cache("tuple", "NHD", pool, ps, hk, d, dtype, gen)
    indptr_buf = torch.zeros(capacity + 1, dtype=torch.int32, device=DEV)
    indices_buf = torch.zeros(pool, dtype=torch.int32, device=DEV)
    last_buf = torch.zeros(capacity, dtype=torch.int32, device=DEV)
    max_pages = 512
    bt_buf = torch.zeros(capacity, max_pages, dtype=torch.int32, device=DEV)
    seq_buf = torch.zeros(capacity, dtype=torch.int32, device=DEV)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
        paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf)
    q_buf = randn((capacity, hq, d), dtype, gen)
    out_buf = torch.full((capacity, hq, d), float("nan"), dtype=dtype, device=DEV)
    lse_buf = torch.full((capacity, hq), float("nan"), dtype=torch.float32, device=DEV)
    rounds = [
        [rnd.randint(1, 1500) for _ in range(16)],
        [0, 8000] + [rnd.randint(1, 200) for _ in range(14)],  # a long one: a different split
        [3000, 0, 1, 16, 17] + [rnd.randint(1, 900) for _ in range(4)],  # batch 9 < 16
    ]
    graph = None
    for lens in rounds:
        batch = len(lens)
        paged = make_page_table(page_table, lens, ps, pool, rnd, host_indptr=True)
        if page_table == "csr":
            args = paged.plan_args
        else:  # the block table lives in fixed buffers, updated in place between plans
            bt, seq = paged.plan_args["block_tables"], paged.plan_args["seq_lens"]
            assert bt.shape[1] <= max_pages
            bt_buf.zero_()
            bt_buf[:batch, : bt.shape[1]] = bt
            seq_buf[:batch] = seq
            args = dict(indptr=None, indices=None, last_page_len=None, block_tables=bt_buf[:batch],
                        seq_lens=seq_buf[:batch])
            paged = paged._replace(table=block_page_table(bt_buf[:batch], seq_buf[:batch]))
        wrapper.plan(**args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, q_data_type=dtype)
        q_buf.copy_(randn(q_buf.shape, dtype, gen))  # rows past `batch` are padding
        graph = replay_poisoned(graph, lambda: wrapper.run(q_buf, (k, v), out=out_buf, lse=lse_buf, return_lse=True),
                                out_buf, lse_buf)
        assert wrapper._page_order.graph_orders, "the captured run() should read the pages in page-id order"
        ref_out, ref_lse = decode_ref(q_buf[:batch], k, v, paged.table, lens)
        check_decode(out_buf[:batch], lse_buf[:batch], ref_out, ref_lse, lens, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity,hk,rounds", [
    (1, 8, [[5000], [40000], [0], [100], [17], [32768]]),  # 40000: over an eager plan's 2 MB a block
    (2, 4, [[3000, 20000], [0, 700], [9000]]),             # 2 x 4 KV heads x 8: 64 blocks; then batch 1 < 2
], ids=["cap1-8kv", "cap2-4kv"])
def test_batch_decode_cuda_graph_cluster_split(capacity, hk, rounds, workspace, monkeypatch):
    """A CUDA-graph wrapper small enough for 8-warp clusters (sm_90+: capacity x KV heads x
    8 blocks within half the SMs, bf16 at head_dim 128) takes them at capture whatever the
    lengths; replays after plan() with other lengths, an empty request and a smaller batch
    match the reference, and every live output row is written (NaN-poisoned). (On any
    GPU's DRAM peak: on an H200 plan() keeps such wrappers on the split instead.)"""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    _long_clusters_on_any_gpu(monkeypatch)
    hq, d, ps, pool, dtype = 4 * hk, 128, 16, 4096, torch.bfloat16
    rnd = random.Random(29 + capacity)
    gen = torch.Generator(device=DEV).manual_seed(29 + capacity)
    _, k, v = make_cache("tuple", "NHD", pool, ps, hk, d, dtype, gen)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
        paged_kv_indices_buffer=torch.zeros(pool, dtype=torch.int32, device=DEV),
        paged_kv_last_page_len_buffer=torch.zeros(capacity, dtype=torch.int32, device=DEV))
    q_buf = randn((capacity, hq, d), dtype, gen)
    out_buf = torch.full((capacity, hq, d), float("nan"), dtype=dtype, device=DEV)
    lse_buf = torch.full((capacity, hq), float("nan"), dtype=torch.float32, device=DEV)
    graph = None
    for lens in rounds:
        batch = len(lens)
        paged = make_page_table("csr", lens, ps, pool, rnd, host_indptr=True)
        wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, q_data_type=dtype)
        assert (wrapper._plan.cluster, wrapper._plan.cluster_warps) == (8, 8)
        q_buf.copy_(randn(q_buf.shape, dtype, gen))
        graph = replay_poisoned(graph, lambda: wrapper.run(q_buf, (k, v), out=out_buf, lse=lse_buf, return_lse=True),
                                out_buf, lse_buf)
        assert not out_buf[:batch].isnan().any() and not lse_buf[:batch].isnan().any(), lens
        ref_out, ref_lse = decode_ref(q_buf[:batch], k, v, paged.table, lens)
        check_decode(out_buf[:batch], lse_buf[:batch], ref_out, ref_lse, lens, dtype)


@pytest.mark.gpu
def test_batch_decode_cuda_graph_paired_kv_heads_large_batch(workspace):
    """A CUDA-graph wrapper over an fp8 NHD cache, whose blocks pair KV heads, at a
    capacity of 192 requests (more merge counters than the smallest allocation): replays
    after plans at 192 and at 150 requests match the reference."""
    capacity, (hq, hk), d, ps = 192, LLAMA_HEADS, 128, 16
    rnd = random.Random(21)
    gen = torch.Generator(device=DEV).manual_seed(21)
    rounds = [[rnd.randint(1, 400) for _ in range(capacity)],
              [0, 3000] + [rnd.randint(1, 300) for _ in range(148)]]
    pool = max(sum(-(-n // ps) for n in lens) for lens in rounds) + 8
    _, k, v = make_cache("tuple", "NHD", pool, ps, hk, d, torch.float8_e4m3fn, gen)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
        paged_kv_indices_buffer=torch.zeros(pool, dtype=torch.int32, device=DEV),
        paged_kv_last_page_len_buffer=torch.zeros(capacity, dtype=torch.int32, device=DEV))
    q_buf = randn((capacity, hq, d), torch.bfloat16, gen)
    out_buf = torch.full((capacity, hq, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    scales = dict(k_scale=0.5, v_scale=2.0)
    graph = None
    for lens in rounds:
        paged = make_page_table("csr", lens, ps, pool, rnd, host_indptr=True)
        wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                     q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
        assert wrapper._plan.kv_heads_per_block == 2
        q_buf.copy_(randn(q_buf.shape, torch.bfloat16, gen))
        graph = replay_poisoned(graph, lambda: wrapper.run(q_buf, (k, v), out=out_buf, **scales), out_buf)
        batch = len(lens)
        ref_out, _ = decode_ref(q_buf[:batch], k, v, paged.table, lens, **scales)
        check_decode(out_buf[:batch], None, ref_out, None, lens, torch.bfloat16)


PDL_CASES = [  # (q/kv dtype, num_qo_heads, page_table, kv_layout, pos_encoding_mode): the tensor-core
    # kernel (groups of 4 and 2) and the CUDA-core kernel (in-kernel RoPE); both merge their splits in the kernel
    ("bfloat16", 32, "csr", "NHD", "NONE"), ("float16", 16, "block_table_kv_separate", "HND", "NONE"),
    ("float16", 8, "csr", "NHD", "ROPE_LLAMA")]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("enable_pdl", [True, False], ids=["pdl", "no_pdl"])
@pytest.mark.parametrize("dtype,num_qo_heads,page_table,kv_layout,pos_encoding_mode", PDL_CASES)
def test_batch_decode_chained_runs(dtype, num_qo_heads, page_table, kv_layout, pos_encoding_mode, enable_pdl, graph,
                                   workspace):
    """Six run()s back to back, each taking the previous output as its q, split into 64-token
    chunks so that they share the partial states and merge counters: with programmatic
    dependent launch a run may start while the previous one finishes, and must still read
    that run's finished output and not clobber the partials it is merging. Outputs are
    NaN-poisoned; each step is checked against the reference from the q it was given."""
    hk, d, ps, steps = 8, 128, 16, 6
    rnd = random.Random(13)
    gen = torch.Generator(device=DEV).manual_seed(13)
    lens = [rnd.randint(300, 2500) for _ in range(5)] + [0, 7]
    num_pages = sum(-(-n // ps) for n in lens) + 3
    paged = make_page_table(page_table, lens, ps, num_pages, rnd, host_indptr=True)
    _, k, v = make_cache("tuple", kv_layout, num_pages, ps, hk, d, dtype_of(dtype), gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=num_qo_heads, num_kv_heads=hk, head_dim=d, page_size=ps,
                 q_data_type=dtype_of(dtype), fixed_split_size=64, pos_encoding_mode=pos_encoding_mode)
    qs = [randn((len(lens), num_qo_heads, d), dtype_of(dtype), gen)]
    qs += [torch.full_like(qs[0], float("nan")) for _ in range(steps)]  # qs[i + 1] = run(qs[i])
    # rows of empty requests come out zero, and a zero q is a fine input for the next step

    def chain():
        for i in range(steps):
            wrapper.run(qs[i], (k, v), out=qs[i + 1], enable_pdl=enable_pdl)

    if graph:
        chain()  # warm-up outside the capture (module load)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        for t in qs[1:]:
            t.fill_(float("nan"))
        g.replay()
    else:
        chain()
    torch.cuda.synchronize()
    for i in range(steps):
        ref_out, _ = decode_ref(qs[i], k, v, paged.table, lens, kv_layout, pos_encoding_mode=pos_encoding_mode)
        check_decode(qs[i + 1], None, ref_out, None, lens, dtype_of(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_batch_decode_reads_the_cache_the_kernel_before_wrote(kv_dtype, graph, workspace):
    """A small grid under programmatic dependent launch prefetches its K/V into L2 before
    the kernel before it has finished: each run() follows kernels that rewrite the whole
    cache (and q), and must read their values, never older ones."""
    hq, hk, d, ps, steps = 32, 8, 128, 16, 4
    rnd = random.Random(29)
    gen = torch.Generator(device=DEV).manual_seed(29)
    lens = [2000]  # b=1: 16 chunks of 128 tokens, 8 MB or less, prefetched
    num_pages = -(-lens[0] // ps) + 3
    paged = make_page_table("csr", lens, ps, num_pages, rnd, host_indptr=True)
    _, k, v = make_cache("tuple", "NHD", num_pages, ps, hk, d, dtype_of(kv_dtype), gen)
    fresh = [(randn(k.shape, torch.bfloat16, gen).to(k.dtype), randn(v.shape, torch.bfloat16, gen).to(v.dtype),
              randn((1, hq, d), torch.bfloat16, gen)) for _ in range(steps)]
    q = torch.empty(1, hq, d, dtype=torch.bfloat16, device=DEV)
    outs = [torch.full_like(q, float("nan")) for _ in range(steps)]
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 q_data_type="bfloat16", kv_data_type=kv_dtype)

    def steps_():
        for i, (k_new, v_new, q_new) in enumerate(fresh):
            k.copy_(k_new)
            v.copy_(v_new)
            q.copy_(q_new)
            wrapper.run(q, (k, v), out=outs[i], enable_pdl=True)

    if graph:
        steps_()  # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            steps_()
        for t in outs:
            t.fill_(float("nan"))
        k.zero_()
        g.replay()
    else:
        steps_()
    torch.cuda.synchronize()
    for i, (k_new, v_new, q_new) in enumerate(fresh):
        ref_out, _ = decode_ref(q_new, k_new, v_new, paged.table, lens)
        check_decode(outs[i], None, ref_out, None, lens, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,num_qo_heads,page_table,kv_layout,pos_encoding_mode", PDL_CASES)
def test_batch_decode_repeated_runs(dtype, num_qo_heads, page_table, kv_layout, pos_encoding_mode, workspace):
    """run() after the first of a plan takes the fast path (the launch the op prepared,
    replayed with new pointers through the module's C entry point): new q, cache, out and
    lse tensors at every call, k/v scales, window_left, LSE on and off, split requests
    (merged in the kernel by the last block of each, CUDA-core kernel too); each call against
    the reference, outputs NaN-poisoned, then a q of another layout (full checks again)."""
    hk, d, ps = 8, 128, 16
    rnd = random.Random(17)
    gen = torch.Generator(device=DEV).manual_seed(17)
    lens = [rnd.randint(1, 3000) for _ in range(6)] + [0, 2048]
    num_pages = sum(-(-n // ps) for n in lens) + 3
    paged = make_page_table(page_table, lens, ps, num_pages, rnd, host_indptr=True)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=num_qo_heads, num_kv_heads=hk, head_dim=d, page_size=ps,
                 q_data_type=dtype_of(dtype), fixed_split_size=256, pos_encoding_mode=pos_encoding_mode)
    calls = [dict(), dict(k_scale=0.7, v_scale=1.5, return_lse=True), dict(window_left=300, return_lse=True),
             dict(), dict(k_scale=1.3)]
    for i, kwargs in enumerate(calls):
        _, k, v = make_cache("tuple", kv_layout, num_pages, ps, hk, d, dtype_of(dtype), gen)
        nan_pages(k, paged.k_unused)
        nan_pages(v, paged.v_unused)
        q = randn((len(lens), num_qo_heads, d), dtype_of(dtype), gen)
        out_buf, out = poisoned(q.shape, q.dtype)
        lse = torch.full((len(lens), num_qo_heads), float("nan"), device=DEV) if kwargs.get("return_lse") else None
        result = wrapper.run(q, (k, v), out=out, lse=lse, **kwargs)
        if i > 0:
            assert wrapper._plan.fast is not None, "the second and later runs should take the fast path"
        ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, kv_layout, k_scale=kwargs.get("k_scale", 1.0),
                                      v_scale=kwargs.get("v_scale", 1.0), window_left=kwargs.get("window_left", -1),
                                      pos_encoding_mode=pos_encoding_mode)
        assert_sentinels(out_buf, "out")
        if kwargs.get("return_lse"):
            assert result[1] is lse
        check_decode(out, lse, ref_out, ref_lse, lens, dtype_of(dtype))
    # q as a strided view (another signature): checked in full, then through the op again
    q_wide = randn((len(lens), num_qo_heads, 2 * d), dtype_of(dtype), gen)[..., :d]
    out = wrapper.run(q_wide, (k, v))
    ref_out, _ = decode_ref(q_wide, k, v, paged.table, lens, kv_layout, pos_encoding_mode=pos_encoding_mode)
    check_decode(out, None, ref_out, None, lens, dtype_of(dtype))


@pytest.mark.gpu
def test_batch_decode_replan_keeps_the_fast_path(workspace):
    """A plan() whose launch is the previous plan's (same batch, work-item count and page-id
    buffer; other lengths) lets its first run() take the fast path; one with another
    item count goes through the op again. Every run against the reference."""
    (hq, hk), d, ps, pool = LLAMA_HEADS, 128, 16, 512
    gen = torch.Generator(device=DEV).manual_seed(31)
    rnd = random.Random(31)
    _, k, v = make_cache("tuple", "NHD", pool, ps, hk, d, torch.bfloat16, gen)
    ids_buf = torch.empty(pool, dtype=torch.int32, device=DEV)  # the engine's persistent page-id buffer
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    # fixed 256-token chunks: 2 + 4 + 1 items, 2 + 4 + 1 again, then 2 + 1 + 1
    for lens, fast_first in (([300, 1000, 50], False), ([500, 800, 200], True), ([400, 100, 20], False)):
        pages = [-(-n // ps) for n in lens]
        indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
        ids_buf[: int(indptr[-1])] = torch.tensor(rnd.sample(range(pool), int(indptr[-1])), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, pages)], dtype=torch.int32)
        indices = ids_buf[: int(indptr[-1])]
        wrapper.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16, fixed_split_size=256)
        assert (wrapper._plan.fast is not None) == fast_first
        for _ in range(2):
            q = randn((len(lens), hq, d), torch.bfloat16, gen)
            out_buf, out = poisoned(q.shape, q.dtype)
            wrapper.run(q, (k, v), out=out)
            assert wrapper._plan.fast is not None
            assert_sentinels(out_buf, "out")
            table = csr_page_table(indptr.to(DEV), indices.clone(), last.to(DEV))
            ref_out, _ = decode_ref(q, k, v, table, lens)
            check_decode(out, None, ref_out, None, lens, torch.bfloat16)


# plan()'s page reordering (sort_pages): (page table, page size), each with a request longer
# than one sorted segment
ORDER_CASES = [("csr", 16), ("csr", 1), ("block_table", 16), ("block_table_kv_separate", 16),
               ("block_table_kv_separate", 1), ("csr", 5)]


def _ordered_table(plan, paged: Paged) -> PageTable:
    """The plan's reordered page table, in the layout of `paged`."""
    tables = plan.args[0]
    if paged.table.layout == "csr":
        return csr_page_table(*tables)
    return block_page_table(tables[0], tables[1][: paged.table.batch_size],
                            kv_separate=paged.table.layout == "block_table_kv_separate")


def _check_order(wrapper, paged: Paged, lens, page_size: int, segment: int) -> None:
    """The plan's page ids of every request as the reference ordering has them."""
    want = ordered_pages_ref(paged.table, lens, page_size, segment)
    got = _ordered_table(wrapper._plan, paged)
    host = on_host(got)
    for b, n in enumerate(lens):
        assert request_pages_ref(host, b, -(-n // page_size)) == want[b], f"request {b} (kv_len {n}): pages not in order"


@pytest.mark.gpu
@pytest.mark.parametrize("page_table,page_size", ORDER_CASES)
def test_batch_decode_orders_pages(page_table, page_size, workspace):
    """plan() reorders each request's full pages by page id (the last page kept last, K
    and V ids together), exactly as the reference ordering, a segment (4096 pages) at a time;
    run() on it matches the float64 reference of the pages as given (NaN-poisoned
    outputs); sort_pages=False keeps the ids as given; a run() with a window reads the
    pages as given; RoPE and window plans do not reorder."""
    (hq, hk), d, ps = LLAMA_HEADS, 128, page_size
    rnd = random.Random(41 + page_size)
    gen = torch.Generator(device=DEV).manual_seed(41 + page_size)
    segment = int(get_module(PageOrderSpec()).segment())
    long = (segment + 100) * ps + 7  # two sorted segments
    lens = [0, 1, ps, ps + 1, 2 * ps + 3, 3 * ps, 40 * ps + 1, long, rnd.randint(1, 300 * ps)]
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(page_table, lens, ps, num_pages, rnd, host_indptr=True)
    _, k, v = make_cache("tuple", "NHD", num_pages, ps, hk, d, torch.bfloat16, gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    nan_past_lengths(k, paged.table, lens, ps, "NHD", 0)
    nan_past_lengths(v, paged.table, lens, ps, "NHD", 1)
    plan = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, q_data_type=torch.bfloat16)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, **plan)
    assert wrapper._plan.unordered is not None, "plan() should reorder the pages"
    torch.cuda.synchronize()
    _check_order(wrapper, paged, lens, ps, segment)
    q = randn((len(lens), hq, d), torch.bfloat16, gen)
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens)
    outs = []
    for call in range(2):  # the op, then the fast path
        out_buf, out = poisoned(q.shape, q.dtype)
        lse_buf, lse = poisoned((len(lens), hq), torch.float32)
        wrapper.run(q, (k, v), out=out, lse=lse)
        assert_sentinels(out_buf, "out")
        assert_sentinels(lse_buf, "lse")
        check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)
        outs.append(out.clone())
    assert wrapper._plan.fast is not None
    assert torch.equal(outs[0], outs[1]), "the fast path should repeat the op's result bit for bit"
    # a window given to run() only: the pages as given
    out_buf, out = poisoned(q.shape, q.dtype)
    wrapper.run(q, (k, v), out=out, window_left=37)
    ref_w, _ = decode_ref(q, k, v, paged.table, lens, window_left=37)
    check_decode(out, None, ref_w, None, lens, torch.bfloat16)
    # sort_pages=False: the ids as given, the same attention
    wrapper.plan(**paged.plan_args, **plan, sort_pages=False)
    assert wrapper._plan.unordered is None
    out_buf, out = poisoned(q.shape, q.dtype)
    wrapper.run(q, (k, v), out=out)
    check_decode(out, None, ref_out, None, lens, torch.bfloat16)
    # positions matter: no reordering
    wrapper.plan(**paged.plan_args, **plan, window_left=100)
    assert wrapper._plan.unordered is None, "a window plan should keep the pages as given"
    out_buf, out = poisoned(q.shape, q.dtype)
    wrapper.run(q, (k, v), out=out)
    ref_w, _ = decode_ref(q, k, v, paged.table, lens, window_left=100)
    check_decode(out, None, ref_w, None, lens, torch.bfloat16)
    # (RoPE's module, CUDA cores, is not among this test's: its configuration says it)
    # the kernel's other shapes (1, 2 or 4 keys a thread): the page tables alone
    for more in ([0, 3 * ps, 900 * ps + 5], [1500 * ps + 3, 20 * ps, 1], [3000 * ps, 2 * ps]):
        more_paged = make_page_table(page_table, more, ps, sum(-(-n // ps) for n in more) + 5, rnd, host_indptr=True)
        wrapper.plan(**more_paged.plan_args, **plan)
        torch.cuda.synchronize()
        _check_order(wrapper, more_paged, more, ps, segment)
    rope_config = wrapper._configure(hq, hk, d, ps, "ROPE_LLAMA", -1, None, torch.bfloat16, None, None, None, None,
                                     None, None, False, True, 1, None)
    assert not rope_config.orders_pages
    tensor_cores = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    multi_config = tensor_cores._configure(hq, hk, d, ps, "NONE", -1, None, torch.bfloat16, None, None, None, None,
                                           None, None, False, True, 4, None)
    assert not multi_config.orders_pages  # causal limits among the query tokens are positions


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [5, 12])
@pytest.mark.parametrize("kv_dtype,head_dim,kv_layout,page_table", [
    ("bfloat16", 128, "NHD", "csr"), ("float8_e4m3fn", 256, "HND", "block_table_kv_separate")])
def test_batch_decode_page_size_not_a_power_of_two(kv_dtype, head_dim, kv_layout, page_table, page_size, workspace):
    """Page sizes that are not powers of two take the division path of the tensor-core
    kernel's page lookup (powers of two shift)."""
    rnd = random.Random(page_size)
    gen = torch.Generator(device=DEV).manual_seed(page_size)
    lens = [1, page_size, page_size + 1, 0, 700, 2049]
    paged, k, v, q = _llama_inputs(lens, "bfloat16", gen, rnd, page_table, kv_layout, head_dim, kv_dtype,
                                   page_size=page_size)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=head_dim,
                 page_size=page_size, q_data_type=torch.bfloat16, kv_data_type=dtype_of(kv_dtype), fixed_split_size=96)
    out_buf, out = poisoned(q.shape, q.dtype)
    lse_buf, lse = poisoned((len(lens), LLAMA_HEADS[0]), torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse)
    assert_sentinels(out_buf, "out")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, kv_layout)
    check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,head_dim,kv_layout,page_table", TAIL_CASES)
def test_batch_decode_ignores_slots_past_kv_len(kv_dtype, head_dim, kv_layout, page_table, workspace):
    """Slots at or past a request's length in its last page hold NaN (stale or never
    written memory, e.g. a torch.empty fp8 cache): they must not reach the output."""
    rnd = random.Random(5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = [1, 15, 16, 17, 0, 100, 33, 250]
    paged, k, v, q = _llama_inputs(lens, "bfloat16", gen, rnd, page_table, kv_layout, head_dim, kv_dtype)
    for which, cache in enumerate((k, v)):
        nan_past_lengths(cache, paged.table, lens, 16, kv_layout, which)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=head_dim,
                 page_size=16, q_data_type=torch.bfloat16, kv_data_type=dtype_of(kv_dtype))
    _, out = poisoned(q.shape, q.dtype)
    _, lse = poisoned(q.shape[:2], torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse, return_lse=True)
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, kv_layout)
    check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)


# Blocks that take pairs of KV heads (rows of <= 128 bytes in an NHD cache, group = one
# tile, an even number of KV heads), and configurations of the same modules that do not
# pair: (q dtype, kv dtype, head_dim, heads, page table, cache form, split, soft cap,
# window_left, paired).
PAIR_CASES = [
    ("bfloat16", "float8_e4m3fn", 128, (32, 8), "csr", "tuple", "auto", None, -1, True),
    ("bfloat16", "float8_e4m3fn", 128, (12, 3), "csr", "tuple", "fixed64", None, 37, False),  # odd KV heads
    ("bfloat16", "float8_e4m3fn", 128, (32, 4), "csr", "single", "fixed64", None, -1, True),  # group 8
    ("bfloat16", "float8_e4m3fn", 128, (64, 2), "csr", "halves", "fixed64", None, -1, False),  # 16-head tiles
    ("float16", "float8_e5m2", 128, (64, 8), "block_table_kv_separate", "halves", "fixed64", 30.0, 37, True),
    ("float16", "float16", 64, (16, 4), "block_table", "single", "fixed64", None, -1, True),
    ("bfloat16", "float8_e4m3fn", 128, (32, 32), "csr", "tuple", "auto", None, -1, True),  # MHA: 1-head tiles
    ("float16", "float16", 64, (16, 8), "block_table", "single", "fixed64", None, -1, True),  # 2-head tiles
]


def _pair_spec(c) -> DecodeSpec:
    return decode_spec(c[0], c[1], c[2], c[3], c[4], "NHD", soft_cap=c[7] is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"{SHORT[c[1]]}-hd{c[2]}-{c[3][0]}x{c[3][1]}-{c[4]}-{c[6]}")
def test_batch_decode_paired_kv_heads(case, workspace):
    """The tensor-core kernel's blocks of two adjacent KV heads (warps 0-3 on one, 4-7 on
    the other; their query heads written as one block), split and merged in the kernel,
    next to one-head blocks of the same modules and of a 16-head-tile module."""
    q_name, kv_name, d, (hq, hk), page_table, form, split, soft_cap, window_left, paired = case
    spec = _pair_spec(case)
    assert spec.pairs_kv_heads == (spec.group_tile <= 8)
    rnd = random.Random(hq * 7 + hk)
    gen = torch.Generator(device=DEV).manual_seed(hq * 7 + hk)
    # 40 requests: with >= 2 KV-head pairs and the splits below, the paired grid gives
    # every SM a block, so plan() pairs (see DecodeWrapper._pairing)
    lens = [0, 1, 17, 300, 2100, 64, 1000, 33] + [rnd.randint(1, 200) for _ in range(32)]
    ps = 16
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(page_table, lens, ps, num_pages, rnd)
    cache, k, v = make_cache(form, "NHD", num_pages, ps, hk, d, dtype_of(kv_name), gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    q = randn((len(lens), hq, d), dtype_of(q_name), gen, 4.0 if soft_cap else 1.0)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_name.startswith("float8") else {}
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 window_left=window_left, logits_soft_cap=soft_cap, q_data_type=q_name, kv_data_type=kv_name,
                 **_split_kwargs(split))
    # pairs where the paired grid gives every SM a block: 8 requests x >= 4 chunks x 4 pairs
    assert wrapper._plan.kv_heads_per_block == (2 if paired else 1)
    out_buf, out = poisoned(q.shape, q.dtype)
    lse_buf, lse = poisoned((len(lens), hq), torch.float32)
    wrapper.run(q, cache, out=out, lse=lse, **scales)
    torch.cuda.synchronize()
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, "NHD", None, window_left, soft_cap, **scales)
    check_decode(out, lse, ref_out, ref_lse, lens, dtype_of(q_name))


# The cluster split (sm_90+: one request over a thread-block cluster, merged in distributed
# shared memory): (q dtype, kv dtype, head_dim, heads, page table, KV layout, cache form,
# soft cap, window_left, kv_len, warps per block[, page size: 16]), on modules other tests
# build (but one); lengths where plan() takes it (clusters of 8; blocks of 4 warps to 64 KB
# of K and V a block (fp8 32 KB), of 8 warps to 512 KB (fp8 128 KB), and at head_dim 128 of
# a 16-bit cache to 2 MB). (64, 2) is 16-head tiles; 700, 900, 1000 and 1100 tokens leave the
# last chunk short; a window of 700 in 3000 tokens leaves most blocks empty. From 512 KB
# (over 8192 tokens) the 8-warp blocks take their page ids from registers (up to 64
# tiles, 32768 tokens: both registers of a lane) where a warp's tokens of a tile lie in one
# page, and read them otherwise (pages of 1 token, K and V page ids apart, a window's
# first block).
CLUSTER_CASES = [
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", "tuple", None, -1, 1024, 4),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", "tuple", None, -1, 700, 4),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "HND", "single", None, 300, 900, 4),
    ("bfloat16", "float8_e4m3fn", 256, (32, 8), "block_table_kv_separate", "HND", "tuple", None, -1, 1000, 8),
    ("bfloat16", "bfloat16", 64, (64, 8), "block_table_kv_separate", "HND", "halves", 30.0, -1, 1100, 4),
    ("float16", "float16", 64, (32, 8), "block_table", "NHD", "tuple", None, -1, 2048, 4),
    ("bfloat16", "float8_e4m3fn", 128, (64, 2), "csr", "NHD", "halves", None, 37, 1100, 8),
    ("float16", "float8_e5m2", 128, (64, 8), "block_table_kv_separate", "NHD", "single", 30.0, -1, 2000, 8),
    ("float16", "float8_e5m2", 128, (64, 8), "block_table_kv_separate", "NHD", "single", 30.0, -1, 1000, 4),
    ("bfloat16", "float8_e4m3fn", 128, (64, 2), "csr", "NHD", "halves", None, 37, 512, 4),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", "tuple", None, -1, 2048, 8),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "HND", "single", None, 700, 3000, 8),
    ("bfloat16", "float8_e4m3fn", 256, (32, 8), "block_table_kv_separate", "HND", "tuple", None, -1, 2000, 8),
    ("bfloat16", "bfloat16", 64, (64, 8), "block_table_kv_separate", "HND", "halves", 30.0, -1, 5000, 8),
    ("bfloat16", "float8_e4m3fn", 128, (64, 2), "csr", "NHD", "halves", None, -1, 4000, 8),
    ("float16", "float8_e5m2", 128, (64, 8), "block_table_kv_separate", "NHD", "single", 30.0, -1, 4000, 8),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", "tuple", None, -1, 32768, 8),
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "HND", "single", None, 9000, 30000, 8),
    ("bfloat16", "bfloat16", 128, (32, 8), "block_table", "NHD", "tuple", None, -1, 20000, 8, 8),
    ("float16", "float16", 128, (32, 8), "csr", "NHD", "halves", None, -1, 12000, 8, 1),
    ("bfloat16", "bfloat16", 128, (64, 8), "block_table_kv_separate", "NHD", "tuple", 30.0, -1, 24000, 8),
    # 1- and 2-head tiles (MHA, GQA-2)
    ("bfloat16", "bfloat16", 128, (8, 8), "csr", "NHD", "tuple", None, -1, 1024, 4),
    ("bfloat16", "bfloat16", 128, (8, 8), "csr", "NHD", "tuple", None, -1, 32768, 8),
    ("bfloat16", "float8_e4m3fn", 128, (16, 8), "csr", "NHD", "tuple", None, 300, 4000, 8),
]


def _long_clusters_on_any_gpu(monkeypatch) -> None:
    """plan() as on the H100: 8-warp clusters up to 2 MB a block whatever this GPU's DRAM
    peak (on an H200 plan() takes the split for blocks over 512 KB), so their kernel stays
    tested on every GPU."""
    monkeypatch.setattr(decode_module, "_peak_dram_bytes_per_s", lambda device: None)


def _cluster_spec(c) -> DecodeSpec:
    return decode_spec(c[0], c[1], c[2], c[3], c[4], c[5], soft_cap=c[7] is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CLUSTER_CASES,
                         ids=lambda c: f"{SHORT[c[1]]}-hd{c[2]}-{c[3][0]}x{c[3][1]}-{TABLE_TAG[c[4]]}-{c[5]}-{c[9]}-w{c[10]}"
                                       + (f"-p{c[11]}" if len(c) > 11 else ""))
def test_batch_decode_cluster_split(case, workspace, monkeypatch):
    """b=1 split over a thread-block cluster (plan()'s choice on sm_90+), against the
    reference; bit-identical over repeated runs (the merge sums in rank order); and the
    same request planned without clusters (FLASHINFER_JIT_DECODE_CLUSTERS=0: partial
    states and the last-block merge) agrees with it."""
    q_name, kv_name, d, (hq, hk), page_table, kv_layout, form, soft_cap, window_left, kv_len, warps = case[:11]
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    _long_clusters_on_any_gpu(monkeypatch)
    rnd = random.Random(kv_len + hq)
    gen = torch.Generator(device=DEV).manual_seed(kv_len + hq)
    lens, ps = [kv_len], case[11] if len(case) > 11 else 16
    num_pages = -(-kv_len // ps) + 5
    paged = make_page_table(page_table, lens, ps, num_pages, rnd)
    cache, k, v = make_cache(form, kv_layout, num_pages, ps, hk, d, dtype_of(kv_name), gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    nan_past_lengths(k, paged.table, lens, ps, kv_layout, 0)
    nan_past_lengths(v, paged.table, lens, ps, kv_layout, 1)
    q = randn((1, hq, d), dtype_of(q_name), gen, 4.0 if soft_cap else 1.0)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_name.startswith("float8") else {}
    plan_kwargs = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, window_left=window_left,
                       logits_soft_cap=soft_cap, q_data_type=q_name, kv_data_type=kv_name)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, **plan_kwargs)
    assert wrapper._plan.cluster == 8 and wrapper._plan.cluster_warps == warps
    outs = []
    for _ in range(3):
        out_buf, out = poisoned(q.shape, q.dtype)
        lse_buf, lse = poisoned((1, hq), torch.float32)
        wrapper.run(q, cache, out=out, lse=lse, **scales)
        torch.cuda.synchronize()
        assert_sentinels(out_buf, "out")
        assert_sentinels(lse_buf, "lse")
        outs.append((out.clone(), lse.clone()))
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, kv_layout, None, window_left, soft_cap, **scales)
    check_decode(outs[0][0], outs[0][1], ref_out, ref_lse, lens, dtype_of(q_name))
    for o, s in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1]), "cluster split not deterministic"
    monkeypatch.setenv("FLASHINFER_JIT_DECODE_CLUSTERS", "0")
    plain = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    plain.plan(**paged.plan_args, **plan_kwargs)
    assert plain._plan.cluster == 1
    out2, lse2 = plain.run(q, cache, return_lse=True, **scales)
    check_decode(out2, lse2, outs[0][0], outs[0][1], lens, dtype_of(q_name))


# Logits that climb, in steps below and above the kernel's lazy-rescaling threshold (the
# tensor-core kernels move a head's running max only when a key exceeds it by more than 8,
# in log2 units), with spikes and an attention sink: (q dtype, KV dtype, heads, page table,
# layout, soft cap, lengths). Every spec is one the tests above load already.
GROWING_CASES = [
    ("bfloat16", "bfloat16", (32, 8), "csr", "NHD", None, [32768]),  # the 8-warp cluster kernel
    ("bfloat16", "bfloat16", (32, 8), "csr", "NHD", None, [3000, 2048, 517, 4096, 1, 0]),  # split, partials
    ("float16", "float16", (32, 8), "csr", "NHD", None, [9000, 1500]),  # P in fp16
    ("bfloat16", "float8_e4m3fn", (32, 8), "csr", "NHD", None, [6000]),  # fp8 K/V, P in fp16
    ("bfloat16", "bfloat16", (64, 8), "block_table_kv_separate", "NHD", 30.0, [5000, 300]),  # soft cap, 8-head tiles
]


def _growing_logits(n: int, sink: bool, gen: torch.Generator) -> torch.Tensor:
    """Target logits (natural units, q k sm_scale) of n tokens: unit noise on a staircase of
    ten steps of 3 (4.3 in log2: below the threshold) and, every ~700 tokens, a spike of
    +9 (13 in log2: above it); or an attention sink, token 0 at +20 over decreasing noise."""
    t = torch.arange(n, device=DEV, dtype=torch.float32)
    noise = torch.randn(n, generator=gen, device=DEV)
    if sink:
        s = noise - 4.0 * t / max(n, 1)
        s[0] += 20.0
        return s
    s = noise + 3.0 * torch.floor(10.0 * t / max(n, 1))
    s[(t.long() * 7919 + 13) % 700 == 0] += 9.0
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("case", GROWING_CASES,
                         ids=lambda c: f"{SHORT[c[0]]}-{SHORT[c[1]]}-{c[2][0]}x{c[2][1]}-{TABLE_TAG[c[3]]}"
                                       + ("-cap" if c[5] else "") + f"-b{len(c[6])}")
def test_batch_decode_growing_logits(case, workspace, monkeypatch):
    """Logits whose running max keeps moving, by less and by more than the lazy-rescaling
    threshold, and a sink the max never leaves: against the float64 reference (outputs
    and LSEs), NaN-poisoned outputs. Each KV head's keys are noise plus a multiple of one
    unit direction u, and its query heads point along u, so q k sm_scale follows the
    schedule (the reference reads the same rounded K)."""
    q_name, kv_name, (hq, hk), page_table, kv_layout, soft_cap, lens = case
    _long_clusters_on_any_gpu(monkeypatch)
    rnd = random.Random(len(lens) + hq)
    gen = torch.Generator(device=DEV).manual_seed(17 + len(lens))
    d, ps = 128, 16
    num_pages = sum(-(-n // ps) for n in lens) + 3
    paged = make_page_table(page_table, lens, ps, num_pages, rnd)
    _, k, v = make_cache("tuple", kv_layout, num_pages, ps, hk, d, dtype_of(kv_name), gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    u = torch.nn.functional.normalize(torch.randn(hk, d, generator=gen, device=DEV), dim=-1)  # [hk, d]
    host = on_host(paged.table)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k_pages = torch.tensor(request_pages_ref(host, b, -(-n // ps))[0], device=DEV)
        pos = torch.arange(n, device=DEV)
        page, slot = k_pages[pos // ps], pos % ps
        target = torch.stack([_growing_logits(n, (b + h) % 3 == 2, gen) for h in range(hk)], dim=1)  # [n, hk]
        noise = 0.5 * torch.randn(n, hk, d, generator=gen, device=DEV)
        keys = noise + (target - (noise * u).sum(-1)).unsqueeze(-1) * u  # k . u = target
        if kv_layout == "NHD":
            k[page, slot] = keys.to(k.dtype)
        else:
            k[page, :, slot] = keys.to(k.dtype)
    group = hq // hk
    q = (math.sqrt(d) * u.repeat_interleave(group, 0) + 0.05 * torch.randn(hq, d, generator=gen, device=DEV))
    q = q.unsqueeze(0).expand(len(lens), hq, d).to(dtype_of(q_name)).contiguous()
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 logits_soft_cap=soft_cap, q_data_type=q_name, kv_data_type=kv_name)
    out_buf, out = poisoned(q.shape, q.dtype)
    lse_buf, lse = poisoned(q.shape[:2], torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse)
    torch.cuda.synchronize()
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, kv_layout, None, -1, soft_cap)
    assert float(ref_lse.max()) > 30.0, "the schedule did not reach large logits (log2 units)"
    check_decode(out, lse, ref_out, ref_lse, lens, dtype_of(q_name))


@pytest.mark.gpu
def test_batch_decode_all_requests_empty(workspace):
    """A batch of padding only (a CUDA-graph batch with no live request): zeros, -inf."""
    rnd = random.Random(3)
    gen = torch.Generator(device=DEV).manual_seed(3)
    lens = [0, 0, 0, 0]
    paged, k, v, q = _llama_inputs(lens, "bfloat16", gen, rnd, host_indptr=False)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, num_qo_heads=LLAMA_HEADS[0], num_kv_heads=LLAMA_HEADS[1], head_dim=128,
                 page_size=16, q_data_type="bfloat16")
    _, out = poisoned(q.shape, q.dtype)
    _, lse = poisoned(q.shape[:2], torch.float32)
    wrapper.run(q, (k, v), out=out, lse=lse, return_lse=True)
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens)
    check_decode(out, lse, ref_out, ref_lse, lens, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_layout,return_lse,options", [
    ("NHD", False, {}),
    ("HND", True, {}),
    ("NHD", True, dict(window_left=100, sm_scale=0.05)),
])
def test_single_decode(kv_layout, return_lse, options):
    gen = torch.Generator(device=DEV).manual_seed(13)
    (hq, hk), d, kv_len, dtype = LLAMA_HEADS, 128, 3001, torch.bfloat16
    q = randn((hq, d), dtype, gen)
    shape = (kv_len, hk, d) if kv_layout == "NHD" else (hk, kv_len, d)
    k, v = randn(shape, dtype, gen), randn(shape, dtype, gen)
    result = fij.single_decode_with_kv_cache(q, k, v, kv_layout=kv_layout, return_lse=return_lse, **options)
    out, lse = result if return_lse else (result, None)
    assert out.shape == (hq, d) and out.dtype == dtype
    # the reference sees one request on a single page of kv_len slots
    table = csr_page_table(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                           torch.tensor([kv_len], dtype=torch.int32))
    ref_out, ref_lse = decode_ref(q[None], k[None], v[None], table, [kv_len], kv_layout,
                                  options.get("sm_scale"), options.get("window_left", -1))
    if lse is not None:
        assert lse.shape == (hq,) and lse.dtype == torch.float32
        lse = lse[None]
    check_decode(out[None], lse, ref_out, ref_lse, [kv_len], dtype)


# --- merge_state / merge_states ------------------------------------------------------------------
def _states(shape_v, dtype, gen):
    """Random partial states with LSEs spread over a wide range."""
    v = randn(shape_v, dtype_of(dtype), gen)
    s = torch.randn(shape_v[:-1], generator=gen, device=DEV) * 6
    return v, s


def _check_merge(v, s, ref_v, ref_s, dtype: str, empty: torch.Tensor) -> None:
    """`empty` [n, H]: every input state of that row and head has LSE -inf: the merged v
    must be zeros and its LSE -inf; elsewhere v within TOL, LSE within MERGE_LSE_TOL."""
    assert v.dtype == dtype_of(dtype) and s.dtype == torch.float32
    v64, s64 = v.double().cpu(), s.double().cpu()
    assert not torch.isnan(v64).any() and not torch.isnan(s64).any(), "NaN in the merged state"
    ref_v, ref_s, empty = ref_v.double().cpu(), ref_s.double().cpu(), empty.cpu()
    live = ~empty
    err = float((v64[live] - ref_v[live]).norm() / ref_v[live].norm())
    assert err < TOL[dtype_of(dtype)], f"relative error {err:.2e}"
    assert float((s64[live] - ref_s[live]).abs().max()) < MERGE_LSE_TOL
    assert bool((v64[empty] == 0).all()), "merging only empty states must give zeros"
    assert bool(torch.isneginf(s64[empty]).all()), "merging only empty states must give lse -inf"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MERGE_DTYPES)
@pytest.mark.parametrize("head_dim", MERGE_HEAD_DIMS)
def test_merge_state(dtype, head_dim):
    """Rows 0-9: a empty (-inf; its v is finite garbage with weight 0), rows 10-19: b empty,
    rows 20-29: both empty (v zeros, as decode writes them): zeros and -inf."""
    gen = torch.Generator(device=DEV).manual_seed(head_dim)
    n, heads = 300, 8
    v_a, s_a = _states((n, heads, head_dim), dtype, gen)
    v_b, s_b = _states((n, heads, head_dim), dtype, gen)
    s_a[0:10] = -math.inf
    s_b[10:20] = -math.inf
    s_a[20:30] = s_b[20:30] = -math.inf
    v_a[20:30] = v_b[20:30] = 0
    v, s = fij.merge_state(v_a, s_a, v_b, s_b)
    ref_v, ref_s = merge_state_ref(v_a, s_a, v_b, s_b)
    assert v.shape == (n, heads, head_dim) and s.shape == (n, heads)
    _check_merge(v, s, ref_v, ref_s, dtype, torch.isneginf(s_a) & torch.isneginf(s_b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MERGE_DTYPES)
@pytest.mark.parametrize("num_states", [1, 3, 16])
def test_merge_states(dtype, num_states):
    gen = torch.Generator(device=DEV).manual_seed(num_states)
    n, heads, head_dim = 257, 4, 128
    v, s = _states((n, num_states, heads, head_dim), dtype, gen)
    s[0:5, 0] = -math.inf  # some states empty (with one state: all of them, v garbage)
    s[5:9] = -math.inf  # every state empty: zeros, -inf
    v[5:9] = 0
    v_out, s_out = fij.merge_states(v, s)
    ref_v, ref_s = merge_states_ref(v, s)
    assert v_out.shape == (n, heads, head_dim) and s_out.shape == (n, heads)
    _check_merge(v_out, s_out, ref_v, ref_s, dtype, torch.isneginf(s).all(dim=1))


# --- on the CPU: the grid's coverage, the AOT matrix ---------------------------------------------
def test_cases_cover_every_pair_of_options():
    names = list(OPTIONS)
    seen = {(a, b): set() for a, b in itertools.combinations(names, 2)}
    seen.update({t: set() for t in TRIPLES})
    for case in CASES:
        assert all(getattr(case, n) in OPTIONS[n] for n in names), case
        assert case.split != "fixed64" or case.tensor_cores, "fixed_split_size needs use_tensor_cores=True"
        for key, values in seen.items():
            values.add(tuple(getattr(case, n) for n in key))
    for key, values in seen.items():
        wanted = set(itertools.product(*(OPTIONS[n] for n in key)))
        if key == ("split", "tensor_cores"):
            wanted.discard(("fixed64", False))
        assert not wanted - values, f"{key}: no case has {sorted(wanted - values, key=repr)[:5]}"


def test_tests_matrix_has_every_decode_module():
    # at most 48 decode modules, 7 of them multi-token (q_len_per_req) modules
    assert_tests_matrix_has(specs_needed(), DecodeSpec, 48, "decode")


# --- argument checks (no GPU: they fire before any build or launch) ------------------------------
PLAN = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def _wrapper(device: str = "cpu", **kwargs):
    workspace = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    return fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)


def _csr(batch: int, device: str = "cpu", pages_each: int = 2):
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_each
    indices = torch.arange(batch * pages_each, dtype=torch.int32, device=device)
    last = torch.full((batch,), 5, dtype=torch.int32, device=device)
    return indptr, indices, last


def _cache(num_pages: int, dtype=torch.float16, device: str = "cpu", head_dim: int = 128):
    return (torch.randn(num_pages, 16, 8, head_dim, device=device).to(dtype),
            torch.randn(num_pages, 16, 8, head_dim, device=device).to(dtype))


def test_plan_rejects_unsupported_head_dim():
    with pytest.raises(ValueError) as info:
        _wrapper().plan(*_csr(2), **(PLAN | dict(head_dim=96)))
    message = str(info.value)
    assert "head_dim" in message and "96" in message
    assert all(str(d) in message for d in (64, 128, 256)), f"supported head dims not listed: {message}"


def test_plan_rejects_heads_not_a_multiple():
    with pytest.raises(ValueError, match="num_qo_heads|num_kv_heads"):
        _wrapper().plan(*_csr(2), **(PLAN | dict(num_qo_heads=12)))


def test_plan_rejects_sort_pages_not_a_bool():
    with pytest.raises(ValueError, match="sort_pages"):
        _wrapper().plan(*_csr(2), **PLAN, sort_pages=1)


def test_page_order_module_matches_its_ctypes_mirror():
    """The page-order module builds and loads without a GPU; its params struct has the
    size of its ctypes mirror (flashinfer_jit/runtime/page_order.py)."""
    import ctypes

    from flashinfer_jit.runtime.page_order import PageOrderParams

    module = get_module(PageOrderSpec())
    assert int(module.params_bytes()) == ctypes.sizeof(PageOrderParams)
    assert int(module.segment()) >= 256


def test_plan_rejects_unknown_pos_encoding_mode():
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        _wrapper().plan(*_csr(2), **PLAN, pos_encoding_mode="ROPE_NEOX_SOMETHING")


def test_run_before_plan_is_an_error():
    q = torch.randn(2, 32, 128, dtype=torch.float16)
    with pytest.raises((RuntimeError, ValueError), match="plan"):
        _wrapper().run(q, _cache(4))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _planned(device: str, batch: int = 3, **plan_kwargs):
    """A wrapper planned for `batch` requests (fp16, 32/8 heads, head_dim 128, page 16).
    On the CPU, plan() may need CUDA tensors: then the check is left to the gpu variant."""
    try:
        wrapper = _wrapper(device)
        wrapper.plan(*_csr(batch, device), **PLAN, **plan_kwargs)
    except Exception as exc:  # noqa: BLE001
        if device == "cpu":
            pytest.skip(f"plan() with CPU tensors raised {type(exc).__name__}: {exc}; the gpu variant checks this")
        raise
    return wrapper


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 32, 64), (3, 16, 128), (3, 32 * 128), (1, 3, 32, 128)])
def test_run_rejects_q_of_the_wrong_shape(device, shape):
    wrapper = _planned(device)
    q = torch.randn(*shape, device=device).to(torch.float16)
    with pytest.raises(ValueError, match=r"\bq\b"):
        wrapper.run(q, _cache(6, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_run_rejects_a_batch_size_other_than_planned(device):
    wrapper = _planned(device, batch=3)
    q = torch.randn(4, 32, 128, device=device).to(torch.float16)
    with pytest.raises(ValueError, match="batch|plan"):
        wrapper.run(q, _cache(8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_run_rejects_a_kv_dtype_other_than_planned(device):
    wrapper = _planned(device, q_data_type=torch.float16, kv_data_type=torch.float16)
    q = torch.randn(3, 32, 128, device=device).to(torch.float16)
    with pytest.raises((TypeError, ValueError), match=r"(?i)cache|\bkv"):
        wrapper.run(q, _cache(6, torch.float8_e4m3fn, device))


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_wrapper_rejects_a_batch_above_capacity(device):
    """The first plan()'s batch is the capacity: a later plan() or a run() with more
    requests is an error before anything launches."""
    capacity = 4
    try:
        wrapper = _wrapper(device, use_cuda_graph=True,
                           paged_kv_indptr_buffer=torch.zeros(capacity + 1, dtype=torch.int32, device=device),
                           paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32, device=device),
                           paged_kv_last_page_len_buffer=torch.zeros(capacity, dtype=torch.int32, device=device))
        wrapper.plan(*_csr(capacity, device), **PLAN)
    except Exception as exc:  # noqa: BLE001
        if device == "cpu":
            pytest.skip(f"a CUDA-graph wrapper on CPU tensors raised {type(exc).__name__}: {exc}")
        raise
    q = torch.randn(capacity + 1, 32, 128, device=device).to(torch.float16)
    with pytest.raises(ValueError, match="batch|capacity|captured"):
        wrapper.run(q, _cache(2 * capacity, device=device))
    with pytest.raises(ValueError, match="batch|capacity|captured"):
        wrapper.plan(*_csr(capacity + 1, device), **PLAN)


# The op's own TORCH_CHECKs, reached only by going around the Python checks: each raises
# RuntimeError with its numbers in the message. A module linked with a private
# libstdc++ (a compiler with only libstdc++.a, like the H100 machine's /opt/gcc) crashed
# here with SIGSEGV while formatting the number; a subprocess keeps that from ending pytest.
OP_CHECKS = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_decode import _cache, _planned
    for field, value in (("kv_heads_per_block", 3), ("cluster", 3)):
        wrapper = _planned("cuda")
        setattr(wrapper._plan, field, value)
        try:
            wrapper.run(torch.randn(3, 32, 128, device="cuda").to(torch.float16), _cache(6, device="cuda"))
            print(field, "RETURNED")
        except RuntimeError as exc:
            print(field, "RAISED", str(exc).splitlines()[0])
""")


@pytest.mark.gpu
def test_op_check_failures_raise_instead_of_crashing():
    proc = subprocess.run([sys.executable, "-c", OP_CHECKS.format(tests=str(Path(__file__).parent))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "kv_heads_per_block RAISED kv_heads_per_block: expected 1 or 2, got 3" in proc.stdout, proc.stdout
    assert "cluster RAISED cluster_size: expected 1" in proc.stdout, proc.stdout


# --- multi-token decode (plan(q_len_per_req=N)) ----------------------------------------------------
# (q, kv, head_dim, heads, page table, KV layout, soft cap, N, page size, window_left, split)
MULTI_CASES = [
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", None, 4, 16, -1, "auto"),  # 4 tokens x 4 heads: 16 rows
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", None, 4, 16, -1, "fixed64"),  # split, merged in the kernel
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", None, 4, 16, 37, "auto"),  # a window per token
    ("bfloat16", "bfloat16", 128, (32, 8), "csr", "NHD", None, 2, 16, -1, "auto"),  # 8 rows
    ("float16", "float8_e4m3fn", 128, (32, 16), "block_table_kv_separate", "NHD", 30.0, 3, 16, -1, "fixed64"),
    ("bfloat16", "bfloat16", 128, (64, 8), "block_table", "HND", None, 4, 7, -1, "auto"),  # 2 tiles a KV head
    ("float16", "float16", 128, (8, 8), "csr", "NHD", None, 16, 16, -1, "auto"),  # MHA: 16 tokens x 1 head
    ("bfloat16", "bfloat16", 256, (16, 8), "csr", "HND", None, 4, 16, -1, "fixed64"),  # 8 rows at head_dim 256
    ("float16", "float16", 64, (32, 8), "csr", "NHD", None, 5, 16, -1, "auto"),  # 5 x 2 heads: 10 of 16 rows
]


def _multi_spec(c) -> DecodeSpec:
    q, kv, hd, heads, table, layout, cap, n = c[:8]
    return DecodeSpec(q, kv, hd, group_tile(*heads, hd, n), table, layout, False, cap is not None, n)


def _visible_keys(lens, n_tok: int, window_left: int = -1) -> list[int]:
    """Keys each query row of a multi-token batch sees (0: zeros and -inf expected)."""
    rows = []
    for n in lens:
        for t in range(n_tok):
            pos = n - n_tok + t
            seen = max(0, pos + 1) if n else 0
            rows.append(min(seen, window_left + 1) if window_left >= 0 else seen)
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("case", MULTI_CASES,
                         ids=lambda c: f"{SHORT[c[0]]}-{SHORT[c[1]]}-hd{c[2]}-{c[3][0]}x{c[3][1]}-{TABLE_TAG[c[4]]}-"
                                       f"{c[5]}-q{c[7]}-p{c[8]}" + ("-cap" if c[6] else "") +
                                       (f"-w{c[9]}" if c[9] >= 0 else "") + (f"-{c[10]}" if c[10] != "auto" else ""))
def test_batch_decode_multi_token(case, workspace):
    """N query tokens a request, causal among themselves, against the float64 reference:
    random lengths (two of exactly N, whose first token sees one key, one of N + 1: plan()
    takes no request under N tokens), NaN-poisoned outputs, unused pages NaN."""
    q_name, kv_name, d, (hq, hk), table_layout, kv_layout, cap, n_tok, ps, window, split = case
    seed = sum(map(ord, str(case)))
    rnd = random.Random(seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    lens = [rnd.randint(n_tok, 700) for _ in range(9)] + [n_tok, n_tok + 1, n_tok, 1537]
    rnd.shuffle(lens)
    batch = len(lens)
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(table_layout, lens, ps, num_pages, rnd)
    cache, k_cache, v_cache = make_cache("tuple", kv_layout, num_pages, ps, hk, d, kv_dtype, gen)
    nan_pages(k_cache, paged.k_unused)
    nan_pages(v_cache, paged.v_unused)
    q = randn((batch * n_tok, hq, d), q_dtype, gen, 4.0 if cap else 1.0)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype.itemsize == 1 else {}
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_tensor_cores=True)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, window_left=window,
                 logits_soft_cap=cap, q_data_type=q_dtype, kv_data_type=kv_dtype, q_len_per_req=n_tok,
                 **_split_kwargs(split))
    assert wrapper._plan.spec == _multi_spec(case)
    out_buf, out = poisoned((batch * n_tok, hq, d), q_dtype)
    lse_buf, lse = poisoned((batch * n_tok, hq), torch.float32)
    for _ in range(2):  # the op, then run()'s fast path
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        result, result_lse = wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **scales)
        torch.cuda.synchronize()
        assert result.data_ptr() == out.data_ptr() and result_lse.data_ptr() == lse.data_ptr()
        assert_sentinels(out_buf, "out")
        assert_sentinels(lse_buf, "lse")
        ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, kv_layout, None, window, cap,
                                      q_len_per_req=n_tok, **scales)
        check_decode(out, lse, ref_out, ref_lse, _visible_keys(lens, n_tok, window), q_dtype)


@pytest.mark.gpu
def test_batch_decode_multi_token_cuda_graph_replay(workspace):
    """A run() of 4 tokens a request captured at capacity 8, replayed after plans of fewer
    requests and other lengths (the unused rows of q stay as they are)."""
    hq, hk, d, ps, n_tok = 32, 8, 128, 16, 4
    rnd = random.Random(44)
    gen = torch.Generator(device=DEV).manual_seed(44)
    capacity, num_pages = 8, 8 * 140 + 8
    k_cache = randn((num_pages, ps, hk, d), torch.bfloat16, gen)
    v_cache = randn((num_pages, ps, hk, d), torch.bfloat16, gen)
    indptr_buf = torch.zeros(capacity + 1, dtype=torch.int32, device=DEV)
    indices_buf = torch.zeros(num_pages, dtype=torch.int32, device=DEV)
    last_buf = torch.zeros(capacity, dtype=torch.int32, device=DEV)
    wrapper = fij.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace, indptr_buf, indices_buf, last_buf, "NHD",
                                                              use_tensor_cores=True)
    q = randn((capacity * n_tok, hq, d), torch.bfloat16, gen)
    out = torch.full_like(q, float("nan"))
    graph = None
    for lens in ([rnd.randint(4, 2000) for _ in range(capacity)], [5, 1200, 4, 4, 2222], [3000, 17]):
        paged = make_page_table("csr", lens, ps, num_pages, rnd)
        wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                     q_data_type=torch.bfloat16, q_len_per_req=n_tok)
        q.copy_(randn(q.shape, torch.bfloat16, gen))
        out.fill_(float("nan"))
        if graph is None:
            graph, _ = capture_graph(lambda: wrapper.run(q, (k_cache, v_cache), out=out))
        graph.replay()
        torch.cuda.synchronize()
        rows = len(lens) * n_tok
        ref_out, _ = decode_ref(q[:rows], k_cache, v_cache, paged.table, lens, "NHD", q_len_per_req=n_tok)
        check_decode(out[:rows], None, ref_out, None, _visible_keys(lens, n_tok), torch.bfloat16)


def test_multi_token_plan_rejects_what_it_cannot_run():
    """q_len_per_req: an int in 1..16 (8 at head_dim 256), without in-kernel RoPE; run()
    with another value than planned, or q of the wrong row count: errors before any launch."""
    w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), "NHD", use_tensor_cores=True)
    table = dict(indptr=torch.tensor([0, 2], dtype=torch.int32), indices=torch.tensor([0, 1], dtype=torch.int32),
                 last_page_len=torch.tensor([3], dtype=torch.int32))
    base = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=torch.bfloat16)
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="q_len_per_req"):
            w.plan(**table, **base, q_len_per_req=bad)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        w.plan(**table, **base, q_len_per_req=4, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="at most 8 tokens at head_dim 256"):
        w.plan(**table, **(base | dict(head_dim=256)), q_len_per_req=9)
    assert group_tile(32, 8, 128, 4) == 4 and group_tile(64, 8, 128, 4) == 4 and group_tile(32, 8, 64, 5) == 2
    assert group_tile(8, 8, 128, 16) == 1 and group_tile(16, 8, 256, 4) == 2
    spec = DecodeSpec("bfloat16", "bfloat16", 128, 4, q_tokens=4)
    assert spec.name.endswith("_q4") and "_q" not in DecodeSpec("bfloat16", "bfloat16", 128, 4).name
    assert not spec.pairs_kv_heads
    with pytest.raises(ValueError, match="rows exceed"):
        DecodeSpec("bfloat16", "bfloat16", 128, 8, q_tokens=4).validate()
    with pytest.raises(ValueError, match="RoPE"):
        DecodeSpec("bfloat16", "bfloat16", 128, 4, rope=True, q_tokens=2).validate()


# --- FlashInfer's test_tensor_core_decode_rejects_mismatched_q_len, case by case (CPU: each check
# fires in plan() or run() before any build or launch; the whole test on the GPU is
# tests/test_flashinfer_api.py test_flashinfer_tensor_core_decode_rejects_mismatched_q_len)
FI_BATCH, FI_PS = 4, 16
FI_PLAN = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=FI_PS, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)


def _fi_table(last: int = FI_PS, batch: int = FI_BATCH) -> tuple:
    """FlashInfer's table: one page a request, `last` tokens on it."""
    return (torch.arange(batch + 1, dtype=torch.int32), torch.arange(batch, dtype=torch.int32),
            torch.full((batch,), last, dtype=torch.int32))


def _fi_wrapper(**kwargs):
    return fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), "NHD", **kwargs)


def _fi_graph_wrapper():
    buf = lambda n: torch.empty(n, dtype=torch.int32)  # noqa: E731
    return _fi_wrapper(use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=buf(FI_BATCH + 1),
                       paged_kv_indices_buffer=buf(FI_BATCH), paged_kv_last_page_len_buffer=buf(FI_BATCH))


def _native(monkeypatch, flag: str) -> None:
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", flag)


NATIVE = pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "numpy"])


def test_fi_q_of_another_q_len_is_a_value_error():
    """Its first check: q of 3 tokens a request against a plan of 2."""
    w = _fi_wrapper(use_tensor_cores=True)
    w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    k, v = (torch.zeros(FI_BATCH, FI_PS, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="q_len_per_req"):
        w.run(torch.zeros(FI_BATCH * 3, 8, 128, dtype=torch.bfloat16), (k, v))


def test_fi_multi_token_plan_needs_use_tensor_cores():
    """FlashInfer's CUDA-core decode is single-token: q_len_per_req > 1 with
    use_tensor_cores=False is a ValueError naming use_tensor_cores. One token a request
    still ignores the flag (the spec picks the kernel)."""
    with pytest.raises(ValueError, match="use_tensor_cores"):
        _fi_wrapper().plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    with pytest.raises(ValueError, match="use_tensor_cores=True"):
        fij.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(1 << 20, dtype=torch.uint8), *(torch.zeros(n, dtype=torch.int32) for n in (5, 4, 4))
        ).plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    one = [_fi_wrapper(use_tensor_cores=flag) for flag in (False, True)]
    for w in one:
        w.plan(*_fi_table(), **FI_PLAN)
    assert one[0]._plan.spec == one[1]._plan.spec and one[0]._plan.config.tensor_cores
    w = _fi_wrapper(use_tensor_cores=True)
    w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    assert w._plan.spec.q_tokens == 2


def test_fi_decode_backend_fa3_is_not_implemented_at_plan():
    """backend='fa3': the decode wrapper takes it, and plan() raises NotImplementedError
    naming fa2 (one token a request or more, every time). Prefill's fa3 (the Hopper path) on
    a CPU workspace is a ValueError from plan(); other backends stay a ValueError."""
    w = _fi_wrapper(use_tensor_cores=True, backend="fa3")
    for n in (2, 2, 1):
        with pytest.raises(NotImplementedError, match="fa2"):
            w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=n)
    assert w._plan is None
    with pytest.raises(ValueError, match="backend"):
        _fi_wrapper(backend="trtllm-gen")
    with pytest.raises(ValueError, match="fa3"):
        fij.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), backend="fa3").plan(
            torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32), 8, 2, 128)


@NATIVE
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fi_multi_token_plan_rejects_an_empty_kv_range(native, graph, monkeypatch):
    """A request of kv_len < q_len_per_req (its first token would see no key) is a
    ValueError at plan() naming the request and its lengths, on the C++ planner's path
    (which reports it: the numpy path then raises) and on the numpy path alike; kv_len ==
    q_len_per_req plans. One token a request keeps its empty requests."""
    _native(monkeypatch, native)
    w = _fi_graph_wrapper() if graph else _fi_wrapper(use_tensor_cores=True)
    with pytest.raises(ValueError, match="empty KV range") as info:
        w.plan(*_fi_table(last=1), **FI_PLAN, q_len_per_req=2)
    assert "request 0 has kv_len 1 < q_len_per_req 2" in str(info.value)
    # a rejected first plan fixes no capacity (a CUDA-graph wrapper's is its constructor buffers')
    assert w._plan is None and w._capacity == (FI_BATCH if graph else None)
    indptr, indices, _ = _fi_table()
    last = torch.tensor([16, 3, 16, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"request 1 has kv_len 3 < q_len_per_req 4.*\(2 of 4 do not\)"):
        w.plan(indptr, indices, last, **FI_PLAN, q_len_per_req=4)
    w.plan(indptr, indices, last, **FI_PLAN, q_len_per_req=2)  # the shortest request is exactly 2 tokens
    assert (w._plan.config.native is not False) == (native == "1")
    with pytest.raises(ValueError, match="request 3 has kv_len 1"):  # the wrapper's next plan checks too
        w.plan(indptr, indices, torch.tensor([16, 3, 16, 1], dtype=torch.int32), **FI_PLAN, q_len_per_req=2)
    table = dict(block_tables=torch.arange(FI_BATCH, dtype=torch.int32).view(FI_BATCH, 1),
                 seq_lens=torch.tensor([16, 5, 1, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="request 2 has kv_len 1 < q_len_per_req 2"):
        _fi_wrapper(use_tensor_cores=True).plan(**table, **FI_PLAN, q_len_per_req=2)
    empty = _fi_wrapper()
    empty.plan(indptr, indices, last, **FI_PLAN)
    empty.plan(torch.tensor([0, 1, 1], dtype=torch.int32), indices, last[:2], **FI_PLAN)  # a request of no tokens


@NATIVE
def test_fi_cuda_graph_q_len_is_frozen(native, monkeypatch):
    """A CUDA-graph wrapper keeps the q_len_per_req of its first plan (its captured run()
    launches that kernel): the same value re-plans, another is a ValueError naming frozen
    that leaves the plan as it was."""
    _native(monkeypatch, native)
    w = _fi_graph_wrapper()
    w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    first = w._plan
    w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)  # same value re-plans fine
    for n in (3, 1, 4):
        with pytest.raises(ValueError, match="frozen") as info:
            w.plan(*_fi_table(), **FI_PLAN, q_len_per_req=n)
        assert f"q_len_per_req={n}" in str(info.value) and "(2)" in str(info.value)
    assert w._plan.config is first.config and w._plan.config.q_tokens == 2
    w.plan(*_fi_table(last=7, batch=3), **FI_PLAN, q_len_per_req=2)  # fewer, shorter requests: still fine
    eager = _fi_wrapper(use_tensor_cores=True)  # an eager wrapper re-plans any q_len_per_req
    for n in (2, 3, 1):
        eager.plan(*_fi_table(), **FI_PLAN, q_len_per_req=n)
        assert eager._plan.config.q_tokens == n


def test_fi_fast_decode_plan_needs_a_prior_plan():
    """fast_decode_plan re-plans a planned wrapper, as FlashInfer's: on one never planned it
    is a ValueError naming the prior plan. After a plan() it takes q_len_per_req."""
    unplanned = _fi_wrapper(use_tensor_cores=True)
    with pytest.raises(ValueError, match="prior plan"):
        fij.decode.fast_decode_plan(unplanned, *_fi_table(), **FI_PLAN, q_len_per_req=2)
    assert unplanned._plan is None
    unplanned.plan(*_fi_table(), **FI_PLAN, q_len_per_req=2)
    fij.decode.fast_decode_plan(unplanned, *_fi_table(last=9), **FI_PLAN, q_len_per_req=2)
    assert unplanned._plan.config.q_tokens == 2
    fij.decode.fast_decode_plan(unplanned, *_fi_table(), **FI_PLAN)
    assert unplanned._plan.config.q_tokens == 1


# (q, kv, heads, page table, KV layout, soft cap, N, lengths, expected warps a cluster block)
MULTI_CLUSTER_CASES = [
    ("bfloat16", "bfloat16", (32, 8), "csr", "NHD", None, 4, [1000], 4),  # 125 tokens (64 KB) a block
    ("bfloat16", "bfloat16", (32, 8), "csr", "NHD", None, 4, [5000], 8),  # 8-warp blocks
    ("bfloat16", "bfloat16", (32, 8), "csr", "NHD", None, 4, [32768], 8),  # 2 MB a block
    ("bfloat16", "bfloat16", (64, 8), "block_table", "HND", None, 4, [1000], 4),  # two tiles a KV head
    ("float16", "float8_e4m3fn", (32, 16), "block_table_kv_separate", "NHD", 30.0, 3, [1001], 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MULTI_CLUSTER_CASES,
                         ids=lambda c: f"{SHORT[c[1]]}-{c[2][0]}x{c[2][1]}-{TABLE_TAG[c[3]]}-{c[4]}-q{c[6]}-{c[7][0]}")
def test_batch_decode_multi_token_cluster_split(case, workspace, monkeypatch):
    """Small multi-token batches split over thread-block clusters (merged through
    distributed shared memory), against the float64 reference."""
    _long_clusters_on_any_gpu(monkeypatch)
    q_name, kv_name, (hq, hk), table_layout, kv_layout, cap, n_tok, lens, warps = case
    d, ps = 128, 16
    rnd = random.Random(len(lens) * 31 + lens[0])
    gen = torch.Generator(device=DEV).manual_seed(lens[0])
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(table_layout, lens, ps, num_pages, rnd)
    cache, k_cache, v_cache = make_cache("tuple", kv_layout, num_pages, ps, hk, d, kv_dtype, gen)
    nan_pages(k_cache, paged.k_unused)
    nan_pages(v_cache, paged.v_unused)
    q = randn((len(lens) * n_tok, hq, d), q_dtype, gen, 4.0 if cap else 1.0)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_tensor_cores=True)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, logits_soft_cap=cap,
                 q_data_type=q_dtype, kv_data_type=kv_dtype, q_len_per_req=n_tok)
    assert (wrapper._plan.cluster, wrapper._plan.cluster_warps) == (8, warps)
    out_buf, out = poisoned(q.shape, q_dtype)
    lse_buf, lse = poisoned(q.shape[:2], torch.float32)
    wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, kv_layout, logits_soft_cap=cap,
                                  q_len_per_req=n_tok)
    check_decode(out, lse, ref_out, ref_lse, _visible_keys(lens, n_tok), q_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_deprecated_data_type_fills_only_what_is_unset(device):
    """FlashInfer's rule (its decode plan and its tests' `plan(data_type=kv_dtype,
    q_data_type=q_dtype)`): data_type fills q_data_type and kv_data_type where they are None,
    so beside q_data_type's default ("float16") it sets the cache's dtype only."""
    wrapper = _planned(device, data_type=torch.float8_e4m3fn, q_data_type=torch.float16)
    q = torch.randn(3, 32, 128, device=device).to(torch.float16)
    with pytest.raises((TypeError, ValueError), match=r"(?i)cache|\bkv"):
        wrapper.run(q, _cache(6, torch.float16, device))   # planned for an fp8 cache
    with pytest.raises(ValueError, match="bfloat16 cache needs q of the same dtype, got float16"):
        _wrapper(device).plan(*_csr(3, device), **PLAN, data_type=torch.bfloat16)   # q stays float16
    wrapper = _planned(device, data_type=torch.bfloat16, q_data_type=None)
    with pytest.raises((TypeError, ValueError), match=r"(?i)cache|\bkv"):
        wrapper.run(q.to(torch.bfloat16), _cache(6, torch.float16, device))   # both bfloat16


@pytest.mark.parametrize("flag", [False, True])
def test_use_tensor_cores_reads_back(flag):
    """FlashInfer's wrapper exposes the constructor's flag (its decode tests read it)."""
    assert _wrapper("cpu", use_tensor_cores=flag).use_tensor_cores is flag
