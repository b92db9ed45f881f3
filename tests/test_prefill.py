"""Batch prefill (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
single_prefill_with_kv_cache) against the float64 reference (flashinfer_jit/reference/prefill.py,
docs/prefill.md).

The option grid (q / K/V / output dtypes, head dims, GQA/MQA, paged or ragged K/V, page tables,
KV layouts, page sizes, cache forms, masks, RoPE, window, soft cap, sm_scale, sinks, LSE,
split-KV, strided q) is covered pairwise by CASES, a fixed list checked on the CPU by
test_cases_cover_every_pair_of_options, so each option value meets every other at least once
without the full product. CASES and the tests beyond it need few compiled modules (PrefillSpec,
~40 s of nvcc each), all listed in scripts/matrices/tests (checked on the CPU too:
test_tests_matrix_has_every_prefill_module).

Every GPU test uses fresh random data. Paged caches start as NaN and only the slots of each
request's tokens are written, so a read through a wrong page id, of an unused page or of a
slot past a request's length shows as NaN. Outputs are NaN-poisoned (`out=`/`lse=` passed
filled with NaN, inside SENTINEL rows that must stay untouched). Outputs are compared row by
row with |out - ref| <= tol * (1 + |ref|) (tol by dtype, looser for fp8 K/V), LSEs (base 2)
with |lse - ref| <= LSE_TOL * max(1, |ref|); rows that see no key must be exactly zero with
LSE -inf (without sinks). fp8 caches are compared with the reference on the same fp8 values.

The CPU tests at the end check plan()'s argument validation: it raises a ValueError/TypeError
naming the argument before anything touches the GPU (a CPU workspace is enough).
"""

from __future__ import annotations

import inspect
import itertools
import random
from typing import NamedTuple

import kv_helpers
import numpy as np
import pytest
import torch
from kv_helpers import (
    DEV,
    Paged,
    assert_sentinels,
    assert_tests_matrix_has,
    dtype_of,
    grid_case,
    on_host,
    poisoned,
    randn,
    replay_poisoned,
)

import flashinfer_jit as fij
from flashinfer_jit.decode.spec import group_tile
from flashinfer_jit.prefill.spec import PrefillSpec
from flashinfer_jit.reference.common import request_pages_ref
from flashinfer_jit.reference.prefill import prefill_ref, segment_packbits_ref
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table
from flashinfer_jit.specs import DecodeSpec, MergeSpec

# |out - ref| <= tol * (1 + |ref|), tol of the coarser of q's and the output's dtype
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
FP8_FACTOR = 2.5  # fp8 K/V: the kernel may round P (or q) more coarsely
LSE_TOL = 1e-2  # base 2, relative to max(1, |lse|)
SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
TABLE_TAG = {"ragged": "ragged", "csr": "csr", "block_table": "bt", "block_table_kv_separate": "btkv"}
FP8_NAN = 0x7F  # NaN in e4m3fn and in e5m2


# --- the pairwise grid -----------------------------------------------------------------------------
class Case(NamedTuple):
    q_dtype: str
    kv: str               # "same" (= q_dtype), or an fp8 cache dtype (paged only)
    o_dtype: str          # "same" (o_data_type None or q's), "other" (fp16 <-> bf16)
    dims: tuple           # (head_dim_qk, head_dim_vo)
    heads: tuple          # (num_qo_heads, num_kv_heads)
    source: str           # "ragged" or the page table: "csr", "block_table", "block_table_kv_separate"
    kv_layout: str | None  # NHD / HND; None for ragged
    page_size: int | None  # None for ragged
    form: str             # "tuple" (k, v); "single" [P, 2, ...] (paged); "halves": K, V slices of one buffer
    mask: str             # "none", "causal", "custom" (bool custom_mask), "packed" (packed_custom_mask + mask_indptr)
    pos_encoding: str     # "NONE", "ROPE_LLAMA"
    window: str           # "off"; "plan" (plan(window_left=37)); "run" (run(window_left=100) overrides plan's)
    soft_cap: float | None
    sm_scale: float | None
    sinks: bool           # run(sinks=float32 [num_qo_heads])
    return_lse: bool
    split: str            # "auto"; "fixed" (fixed_split_size=64); "none" (disable_split_kv=True)
    q_view: str           # "contiguous"; "strided" (q a slice of a wider buffer)

    @property
    def kv_dtype(self) -> str:
        return self.q_dtype if self.kv == "same" else self.kv

    @property
    def out_dtype(self) -> str:
        if self.o_dtype == "same":
            return self.q_dtype
        return "bfloat16" if self.q_dtype == "float16" else "float16"

    @property
    def paged(self) -> bool:
        return self.source != "ragged"


OPTIONS = {
    "q_dtype": ("float16", "bfloat16"),
    "kv": ("same", "float8_e4m3fn", "float8_e5m2"),
    "o_dtype": ("same", "other"),
    "dims": ((64, 64), (128, 128), (256, 256), (192, 128)),
    "heads": ((32, 32), (32, 16), (32, 8), (64, 8), (32, 1), (64, 1)),
    "source": ("ragged", "csr", "block_table", "block_table_kv_separate"),
    "kv_layout": ("NHD", "HND"),
    "page_size": (1, 7, 16, 64),
    "form": ("tuple", "single", "halves"),
    "mask": ("none", "causal", "custom", "packed"),
    "pos_encoding": ("NONE", "ROPE_LLAMA"),
    "window": ("off", "plan", "run"),
    "soft_cap": (None, 8.0),
    "sm_scale": (None, 0.07),
    "sinks": (False, True),
    "return_lse": (False, True),
    "split": ("auto", "fixed", "none"),
    "q_view": ("contiguous", "strided"),
}
PAGED_ONLY = ("kv_layout", "page_size")  # None in ragged cases: no pair to cover there


def compatible(values: dict) -> bool:
    """Whether option values (some of a case's, or all) can meet in one case."""
    if values.get("source") == "ragged":
        if values.get("kv", "same") != "same" or values.get("form") == "single":
            return False  # fp8 K/V and the [P, 2, ...] cache are paged only
        if any(name in values for name in PAGED_ONLY):
            return False
    if values.get("dims") == (192, 128):
        # in-kernel RoPE rotates every head dim (not DeepSeek's semantics); K and V differ in width
        if values.get("pos_encoding") == "ROPE_LLAMA" or values.get("form") == "single":
            return False
    return True


def case_values(case: Case) -> dict:
    return {name: getattr(case, name) for name in OPTIONS
            if not (name in PAGED_ONLY and getattr(case, name) is None)}


# A covering array of OPTIONS, generated greedily (fixed seed) with a cost on each new compiled
# module (reusing the modules of the tests beyond the grid where it can).
CASES = [
    Case('bfloat16', 'float8_e4m3fn', 'same', (64, 64), (32, 1), 'block_table_kv_separate', 'NHD', 64, 'single', 'causal', 'ROPE_LLAMA', 'run', 8.0, None, True, False, 'auto', 'strided'),
    Case('bfloat16', 'float8_e4m3fn', 'same', (64, 64), (32, 16), 'block_table_kv_separate', 'NHD', 1, 'tuple', 'causal', 'ROPE_LLAMA', 'run', 8.0, 0.07, True, False, 'none', 'contiguous'),
    Case('bfloat16', 'float8_e4m3fn', 'other', (128, 128), (32, 1), 'csr', 'HND', 64, 'single', 'packed', 'ROPE_LLAMA', 'plan', 8.0, None, True, False, 'none', 'contiguous'),
    Case('bfloat16', 'float8_e4m3fn', 'other', (128, 128), (64, 8), 'csr', 'HND', 16, 'tuple', 'packed', 'ROPE_LLAMA', 'run', 8.0, 0.07, True, True, 'auto', 'contiguous'),
    Case('bfloat16', 'float8_e4m3fn', 'same', (192, 128), (32, 8), 'block_table', 'HND', 16, 'tuple', 'none', 'NONE', 'run', None, 0.07, False, False, 'auto', 'strided'),
    Case('bfloat16', 'float8_e5m2', 'other', (256, 256), (32, 8), 'block_table', 'NHD', 1, 'tuple', 'packed', 'NONE', 'run', 8.0, None, True, False, 'fixed', 'strided'),
    Case('bfloat16', 'float8_e5m2', 'other', (256, 256), (32, 8), 'block_table', 'NHD', 7, 'halves', 'packed', 'NONE', 'run', 8.0, 0.07, True, True, 'none', 'contiguous'),
    Case('bfloat16', 'same', 'same', (128, 128), (32, 8), 'csr', 'NHD', 1, 'halves', 'custom', 'NONE', 'off', None, 0.07, False, False, 'auto', 'contiguous'),
    Case('bfloat16', 'same', 'same', (128, 128), (64, 8), 'csr', 'NHD', 7, 'tuple', 'none', 'NONE', 'off', None, 0.07, False, False, 'auto', 'strided'),
    Case('bfloat16', 'same', 'same', (128, 128), (64, 1), 'csr', 'NHD', 1, 'single', 'none', 'NONE', 'plan', None, None, False, True, 'auto', 'contiguous'),
    Case('bfloat16', 'same', 'same', (128, 128), (32, 32), 'csr', 'NHD', 16, 'halves', 'packed', 'NONE', 'run', None, 0.07, False, True, 'fixed', 'strided'),
    Case('float16', 'float8_e4m3fn', 'other', (64, 64), (32, 32), 'block_table', 'NHD', 64, 'tuple', 'custom', 'ROPE_LLAMA', 'off', None, 0.07, True, True, 'auto', 'contiguous'),
    Case('float16', 'float8_e4m3fn', 'other', (64, 64), (64, 8), 'block_table', 'NHD', 7, 'single', 'packed', 'ROPE_LLAMA', 'off', None, None, True, True, 'none', 'contiguous'),
    Case('float16', 'float8_e4m3fn', 'other', (64, 64), (64, 1), 'block_table', 'NHD', 64, 'tuple', 'packed', 'ROPE_LLAMA', 'off', None, None, True, True, 'fixed', 'strided'),
    Case('float16', 'float8_e4m3fn', 'other', (192, 128), (32, 32), 'csr', 'NHD', 7, 'tuple', 'causal', 'NONE', 'plan', 8.0, 0.07, True, True, 'fixed', 'strided'),
    Case('float16', 'float8_e4m3fn', 'other', (256, 256), (32, 8), 'block_table', 'HND', 64, 'single', 'causal', 'ROPE_LLAMA', 'run', None, None, True, True, 'none', 'contiguous'),
    Case('float16', 'float8_e4m3fn', 'other', (256, 256), (32, 16), 'block_table', 'HND', 16, 'tuple', 'causal', 'ROPE_LLAMA', 'plan', None, None, True, True, 'fixed', 'contiguous'),
    Case('float16', 'float8_e4m3fn', 'other', (256, 256), (64, 1), 'block_table', 'HND', 1, 'halves', 'causal', 'ROPE_LLAMA', 'off', None, 0.07, True, False, 'none', 'contiguous'),
    Case('float16', 'float8_e5m2', 'other', (64, 64), (32, 32), 'csr', 'HND', 16, 'tuple', 'none', 'NONE', 'off', 8.0, None, True, False, 'none', 'contiguous'),
    Case('float16', 'float8_e5m2', 'other', (128, 128), (64, 1), 'block_table', 'HND', 16, 'tuple', 'causal', 'NONE', 'plan', None, None, False, False, 'auto', 'contiguous'),
    Case('float16', 'float8_e5m2', 'other', (128, 128), (32, 8), 'block_table_kv_separate', 'HND', 16, 'halves', 'custom', 'ROPE_LLAMA', 'off', None, 0.07, True, False, 'none', 'strided'),
    Case('float16', 'float8_e5m2', 'other', (128, 128), (32, 32), 'block_table_kv_separate', 'HND', 1, 'single', 'packed', 'ROPE_LLAMA', 'plan', None, 0.07, True, False, 'fixed', 'contiguous'),
    Case('float16', 'float8_e5m2', 'other', (192, 128), (64, 1), 'block_table_kv_separate', 'HND', 7, 'halves', 'custom', 'NONE', 'run', 8.0, 0.07, False, False, 'fixed', 'strided'),
    Case('float16', 'float8_e5m2', 'other', (192, 128), (64, 8), 'block_table_kv_separate', 'HND', 64, 'tuple', 'custom', 'NONE', 'plan', 8.0, 0.07, False, True, 'auto', 'contiguous'),
    Case('float16', 'float8_e5m2', 'other', (192, 128), (32, 1), 'block_table_kv_separate', 'HND', 7, 'tuple', 'custom', 'NONE', 'off', 8.0, 0.07, False, True, 'none', 'strided'),
    Case('float16', 'float8_e5m2', 'same', (256, 256), (32, 16), 'csr', 'NHD', 7, 'single', 'custom', 'ROPE_LLAMA', 'run', 8.0, 0.07, False, False, 'auto', 'strided'),
    Case('float16', 'float8_e5m2', 'same', (256, 256), (64, 8), 'csr', 'NHD', 1, 'halves', 'custom', 'ROPE_LLAMA', 'plan', 8.0, 0.07, False, False, 'auto', 'contiguous'),
    Case('float16', 'same', 'same', (128, 128), (32, 16), 'block_table_kv_separate', 'HND', 64, 'halves', 'none', 'NONE', 'plan', 8.0, 0.07, True, True, 'fixed', 'strided'),
    Case('float16', 'same', 'other', (192, 128), (32, 1), 'block_table', 'NHD', 1, 'halves', 'custom', 'NONE', 'run', 8.0, None, True, True, 'auto', 'contiguous'),
    Case('float16', 'same', 'same', (256, 256), (32, 1), 'block_table_kv_separate', 'NHD', 16, 'single', 'none', 'NONE', 'plan', None, 0.07, True, True, 'fixed', 'strided'),
    Case('bfloat16', 'same', 'same', (128, 128), (64, 8), 'ragged', None, None, 'halves', 'causal', 'NONE', 'run', None, None, False, False, 'fixed', 'strided'),
    Case('bfloat16', 'same', 'same', (128, 128), (32, 1), 'ragged', None, None, 'tuple', 'custom', 'NONE', 'plan', None, None, False, True, 'fixed', 'contiguous'),
    Case('bfloat16', 'same', 'same', (128, 128), (32, 16), 'ragged', None, None, 'halves', 'packed', 'NONE', 'plan', None, None, False, False, 'none', 'strided'),
    Case('bfloat16', 'same', 'same', (192, 128), (32, 16), 'ragged', None, None, 'halves', 'packed', 'NONE', 'off', 8.0, 0.07, True, False, 'auto', 'strided'),
    Case('bfloat16', 'same', 'other', (256, 256), (64, 1), 'ragged', None, None, 'tuple', 'custom', 'ROPE_LLAMA', 'plan', None, None, False, False, 'none', 'strided'),
    Case('bfloat16', 'same', 'other', (256, 256), (32, 32), 'ragged', None, None, 'tuple', 'packed', 'ROPE_LLAMA', 'off', None, None, False, False, 'fixed', 'contiguous'),
    Case('float16', 'same', 'other', (64, 64), (32, 8), 'ragged', None, None, 'halves', 'none', 'ROPE_LLAMA', 'plan', None, 0.07, False, False, 'auto', 'contiguous'),
]


def _mask_kind(mask: str) -> str:
    return "custom" if mask in ("custom", "packed") else mask


def prefill_spec(q_dtype, kv_dtype=None, o_dtype=None, dims=(128, 128), source="csr", kv_layout="NHD", mask="none",
                 pos_encoding="NONE", soft_cap=False, sinks=False) -> PrefillSpec:
    """The module a plan()/run() with these arguments loads (the wrapper's mapping)."""
    ragged = source == "ragged"
    return PrefillSpec(
        dtype_q=q_dtype, dtype_kv=kv_dtype or q_dtype, dtype_o=o_dtype or q_dtype, head_dim_qk=dims[0],
        head_dim_vo=dims[1], kv_source="ragged" if ragged else "paged", page_table="csr" if ragged else source,
        kv_layout="NHD" if ragged else kv_layout, mask=_mask_kind(mask),
        pos_encoding="rope_llama" if pos_encoding == "ROPE_LLAMA" else "none", soft_cap=bool(soft_cap),
        sinks=bool(sinks)).validate()


def case_spec(case: Case) -> PrefillSpec:
    return prefill_spec(case.q_dtype, case.kv_dtype, case.out_dtype, case.dims, case.source, case.kv_layout,
                        case.mask, case.pos_encoding, case.soft_cap, case.sinks)


# The tests beyond the grid: bf16, head_dim 128, Llama-like 32/8 heads (the long ones fewer),
# CSR NHD pages or ragged K/V, no RoPE, no soft cap, no sinks.
BF16 = "bfloat16"
LLAMA = (32, 8)
BASE_MASKS = ("none", "causal", "custom")


def base_spec(source: str = "csr", mask: str = "none") -> PrefillSpec:
    return prefill_spec(BF16, dims=(128, 128), source=source, mask=mask)


def specs_needed() -> set:
    """Every module the GPU tests of this file load (prefill, and the decode and merge
    modules of the comparisons)."""
    specs = {case_spec(c) for c in CASES}
    specs |= {base_spec(source, mask) for source in ("csr", "ragged") for mask in BASE_MASKS}
    specs |= {prefill_spec(BF16, dims=(d, d), source=source) for d in QREG_DIMS for source in ("csr", "ragged")}
    specs |= {prefill_spec(BF16, dims=(256, 256), source=source, mask=mask)
              for source in ("csr", "ragged") for mask in ("none", "causal")}  # test_head_dim_256_wide_tile
    # qo_len 1 against batch decode (its module: bf16, head_dim 128, GQA-4 tiles, CSR, NHD)
    specs.add(DecodeSpec(BF16, BF16, 128, group_tile(*LLAMA, 128), "csr", "NHD", False, False))
    specs.add(MergeSpec(BF16, 128))  # merge_state of two prefill halves
    return specs


def case_id(i: int, c: Case) -> str:
    parts = [f"{i:02d}", SHORT[c.q_dtype], SHORT[c.kv_dtype], SHORT[c.out_dtype], f"hd{c.dims[0]}x{c.dims[1]}",
             f"{c.heads[0]}x{c.heads[1]}", TABLE_TAG[c.source]]
    if c.paged:
        parts += [c.kv_layout, f"p{c.page_size}"]
    parts += [c.form] * (c.form != "tuple") + [c.mask] * (c.mask != "none")
    parts += ["rope"] * (c.pos_encoding == "ROPE_LLAMA") + [f"w{c.window}"] * (c.window != "off")
    parts += ["cap"] * (c.soft_cap is not None) + ["sm"] * (c.sm_scale is not None) + ["sinks"] * c.sinks
    parts += ["lse"] * c.return_lse + [c.split] * (c.split != "auto") + ["qs"] * (c.q_view == "strided")
    return "-".join(parts)


# --- inputs ----------------------------------------------------------------------------------------
def indptr_of(lens, device=DEV) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32, device=device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers (fp8 as uint8, 16-bit as int16): for index writes of
    any dtype, and for NaN bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def nan_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=DEV)
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(FP8_NAN)
    else:
        t.fill_(float("nan"))
    return t


def make_rows(kv_lens, num_kv_heads: int, dims: tuple, dtype: torch.dtype, gen, form: str = "tuple"):
    """Ragged K/V rows [kv_tokens, Hk, D] with random values; form "halves": K and V are
    slices of one [kv_tokens, Hk, Dqk + Dvo] buffer (strided views)."""
    total, (dqk, dvo) = sum(kv_lens), dims
    if form == "halves":
        buf = randn((total, num_kv_heads, dqk + dvo), dtype, gen)
        return buf[..., :dqk], buf[..., dqk:]
    return randn((total, num_kv_heads, dqk), dtype, gen), randn((total, num_kv_heads, dvo), dtype, gen)


def make_q(tokens: int, num_qo_heads: int, head_dim: int, dtype: torch.dtype, gen, scale: float = 1.0,
           strided: bool = False) -> torch.Tensor:
    if strided:  # q as the engine's slice of a wider buffer: token stride (Hq + 1) * D
        return randn((tokens, num_qo_heads + 1, head_dim), dtype, gen, scale)[:, 1:]
    return randn((tokens, num_qo_heads, head_dim), dtype, gen, scale)


def make_page_table(layout: str, lens, page_size: int, num_pages: int, rnd: random.Random,
                    host_indptr: bool = False) -> Paged:
    """kv_helpers.make_page_table with the prefill plan()'s argument names (paged_kv_indptr, ...)."""
    return kv_helpers.make_page_table(layout, lens, page_size, num_pages, rnd, host_indptr, csr_prefix="paged_kv_")


class KV(NamedTuple):
    run_args: tuple       # what run() takes after q: (paged_kv_cache,) or (k, v)
    k: torch.Tensor       # the K cache view (paged) or K rows (ragged), for the reference
    v: torch.Tensor
    table: PageTable | None
    plan_args: dict       # paged: the page-table arguments; ragged: {"kv_indptr": ...}
    kv_layout: str


def write_rows(cache: torch.Tensor, table: PageTable, lens, page_size: int, kv_layout: str, rows: torch.Tensor,
               which: int) -> None:
    """Token j of request b (rows in request order) into slot j % page_size of its logical
    page j // page_size (`which`: 0 through the K page ids, 1 through the V page ids)."""
    host = on_host(table)
    page_ids, slots = [], []
    for b, n in enumerate(lens):
        if n == 0:
            continue
        ids = torch.tensor(request_pages_ref(host, b, -(-n // page_size))[which], dtype=torch.long)
        j = torch.arange(n)
        page_ids.append(ids[j // page_size])
        slots.append(j % page_size)
    if not page_ids:
        return
    page_ids, slots = torch.cat(page_ids).to(DEV), torch.cat(slots).to(DEV)
    src = _raw(rows.to(cache.dtype).contiguous())
    if kv_layout == "NHD":
        _raw(cache)[page_ids, slots] = src
    else:
        _raw(cache)[page_ids, :, slots] = src


def paged_kv(k_rows, v_rows, kv_lens, page_size: int, table_layout: str = "csr", kv_layout: str = "NHD",
             form: str = "tuple", rnd: random.Random | None = None, dtype: torch.dtype | None = None,
             host_indptr: bool = False, spare_pages: int = 3) -> KV:
    """A paged cache holding the ragged rows (converted to `dtype`, e.g. fp8), on random pages;
    everything else (unused pages, slots past a request's length) NaN. form: "tuple" (k, v);
    "single" one [P, 2, ...] tensor; "halves" K and V slices of one [..., Dqk + Dvo] buffer."""
    rnd = rnd or random.Random(0)
    dtype = dtype or k_rows.dtype
    hk, dqk, dvo = k_rows.shape[1], k_rows.shape[2], v_rows.shape[2]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + spare_pages
    page = (page_size, hk) if kv_layout == "NHD" else (hk, page_size)
    if form == "single":
        assert dqk == dvo
        buf = nan_tensor((num_pages, 2, *page, dqk), dtype)
        k, v, arg = buf[:, 0], buf[:, 1], buf
    elif form == "halves":
        buf = nan_tensor((num_pages, *page, dqk + dvo), dtype)
        k, v = buf[..., :dqk], buf[..., dqk:]
        arg = (k, v)
    else:
        k, v = nan_tensor((num_pages, *page, dqk), dtype), nan_tensor((num_pages, *page, dvo), dtype)
        arg = (k, v)
    paged = make_page_table(table_layout, kv_lens, page_size, num_pages, rnd, host_indptr)
    write_rows(k, paged.table, kv_lens, page_size, kv_layout, k_rows, 0)
    write_rows(v, paged.table, kv_lens, page_size, kv_layout, v_rows, 1)
    return KV((arg,), k, v, paged.table, paged.plan_args, kv_layout)


def ragged_kv(k_rows, v_rows, kv_lens, host_indptr: bool = False) -> KV:
    kv_indptr = indptr_of(kv_lens, "cpu" if host_indptr else DEV)
    return KV((k_rows, v_rows), k_rows, v_rows, None, dict(kv_indptr=kv_indptr), "NHD")


def reference(q, qo_indptr, kv: KV, **kwargs):
    """prefill_ref on the K/V as the kernel reads them (paged through the table, or ragged)."""
    if kv.table is not None:
        return prefill_ref(q, qo_indptr, kv.k, kv.v, page_table=kv.table, kv_layout=kv.kv_layout, **kwargs)
    return prefill_ref(q, qo_indptr, kv.k, kv.v, kv_indptr=kv.plan_args["kv_indptr"], **kwargs)


def reference_by_rows(q, shapes, k_rows, v_rows, causal: bool, rows: int = 512, **kwargs):
    """prefill_ref over ragged rows, a request and `rows` query rows at a time (bounded
    memory for long requests). With causal, the rows a..b of a request are the request
    (b - a rows, keys 0 .. kv_len - qo_len + b): the same positions, the same visible keys.
    Without causal only position-free options may be given (no window, no RoPE)."""
    assert causal or (kwargs.get("window_left", -1) < 0 and kwargs.get("pos_encoding_mode", "NONE") == "NONE")
    outs, lses = [], []
    q_start = kv_start = 0
    for m, n in shapes:
        for a in range(0, m, rows):
            b = min(m, a + rows)
            keys = (n - m + b if n else 0) if causal else n
            ks = slice(kv_start, kv_start + keys)
            out, lse = prefill_ref(q[q_start + a: q_start + b], indptr_of([b - a]), k_rows[ks], v_rows[ks],
                                   indptr_of([keys]), causal=causal, **kwargs)
            outs.append(out)
            lses.append(lse)
        q_start += m
        kv_start += n
    hq, dvo = q.shape[1], v_rows.shape[-1]
    if not outs:
        return (torch.zeros(0, hq, dvo, dtype=torch.float64, device=q.device),
                torch.zeros(0, hq, dtype=torch.float64, device=q.device))
    return torch.cat(outs), torch.cat(lses)


# --- outputs and checks ----------------------------------------------------------------------------
def tolerance(q_dtype, o_dtype=None, fp8: bool = False) -> float:
    tol = max(TOL[_as_torch(q_dtype)], TOL[_as_torch(o_dtype or q_dtype)])
    return tol * (FP8_FACTOR if fp8 else 1.0)


def _as_torch(dtype) -> torch.dtype:
    return dtype_of(dtype) if isinstance(dtype, str) else dtype


def _row_owner(shapes) -> list[int]:
    return [b for b, (m, _) in enumerate(shapes) for _ in range(m)]


def _where(rows, shapes) -> str:
    owner = _row_owner(shapes)
    reqs = sorted({owner[r] for r in rows})
    return f"rows {rows[:6]} of requests {[(b, shapes[b]) for b in reqs[:6]]} (request, (qo_len, kv_len))"


def check_out(out, ref, shapes, tol: float, what: str = "out", v_scale=None) -> None:
    """Row by row: no NaN, |out - ref| <= tol * (1 + |ref|) (both over v_scale)."""
    o, r = out.double(), ref.double().to(out.device)
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)}, expected {tuple(r.shape)}"
    if o.numel() == 0:
        return
    if v_scale:
        o, r = o / v_scale, r / v_scale
    nan_rows = torch.isnan(o).flatten(1).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"{what}: NaN in {_where(nan_rows, shapes)}"
    excess = ((o - r).abs() - tol * (1 + r.abs())).flatten(1).amax(1)
    bad = (excess > 0).nonzero().flatten().tolist()
    if bad:
        worst = max(bad, key=lambda i: float(excess[i]))
        err = float((o[worst] - r[worst]).abs().max())
        pytest.fail(f"{what}: {len(bad)} rows off; worst row {worst} off by {err:.3e} (> {tol:g} x (1 + |ref|)); "
                    f"{_where(bad, shapes)}")


def check_lse(lse, ref_lse, shapes, what: str = "lse") -> None:
    """No NaN; -inf exactly where the reference is -inf (rows that see no key, no sinks);
    elsewhere within LSE_TOL * max(1, |ref|)."""
    s, r = lse.double(), ref_lse.double().to(lse.device)
    assert s.shape == r.shape, f"{what}: shape {tuple(s.shape)}, expected {tuple(r.shape)}"
    if s.numel() == 0:
        return
    nan_rows = torch.isnan(s).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"{what}: NaN in {_where(nan_rows, shapes)}"
    empty = torch.isneginf(r)
    wrong = (torch.isneginf(s) != empty).any(1).nonzero().flatten().tolist()
    assert not wrong, f"{what}: -inf where the reference is finite or the other way round, {_where(wrong, shapes)}"
    excess = torch.where(empty, -1.0, (s - r).abs() - LSE_TOL * r.abs().clamp(min=1.0)).amax(1)
    bad = (excess > 0).nonzero().flatten().tolist()
    if bad:
        worst = max(bad, key=lambda i: float(excess[i]))
        err = float(torch.where(empty[worst], 0.0, (s[worst] - r[worst]).abs()).max())
        pytest.fail(f"{what}: {len(bad)} rows off; worst row {worst} off by {err:.3e}; {_where(bad, shapes)}")


def check_prefill(out, lse, ref_out, ref_lse, shapes, tol: float, v_scale=None, sinks: bool = False) -> None:
    check_out(out, ref_out, shapes, tol, v_scale=v_scale)
    if not sinks:  # rows that see no key: exactly zero (with sinks too, but their LSE is the sink's)
        empty = torch.isneginf(ref_lse.to(out.device))
        assert bool((out.double()[empty] == 0).all()), "rows that see no key must be exactly zero"
    if lse is not None:
        check_lse(lse, ref_lse, shapes)


def check_agree(out, lse, other_out, other_lse, shapes, tol: float, first: str, second: str) -> None:
    """One path's out and LSE against another's: check_out within tol and check_lse, named
    "<first> against <second>" and "<first> lse against <second>"."""
    check_out(out, other_out, shapes, tol, f"{first} against {second}")
    check_lse(lse, other_lse, shapes, f"{first} lse against {second}")


def check_two_paths(first, second, ref_out, ref_lse, shapes, tol: float, names: tuple[str, str]) -> None:
    """The (out, lse) of two paths, each against the reference (check_prefill, first's then
    second's), then first's against second's (check_agree, tol)."""
    for out, lse in (first, second):
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*first, *second, shapes, tol, *names)


def paged_wrapper(workspace, kv_layout: str = "NHD", **kwargs):
    return fij.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, **kwargs)


def ragged_wrapper(workspace, **kwargs):
    return fij.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", **kwargs)


def plan_kv(wrapper, qo_indptr, kv: KV, num_qo_heads: int, num_kv_heads: int, dims: tuple, page_size=None,
            **kwargs) -> None:
    """plan() of either wrapper, with FlashInfer's argument names."""
    if kv.table is not None:
        wrapper.plan(qo_indptr, **kv.plan_args, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                     head_dim_qk=dims[0], page_size=page_size, head_dim_vo=dims[1], **kwargs)
    else:
        wrapper.plan(qo_indptr, kv.plan_args["kv_indptr"], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                     head_dim_qk=dims[0], head_dim_vo=dims[1], **kwargs)


def run_poisoned(wrapper, q, kv: KV, head_dim_vo: int, out_dtype: torch.dtype, return_lse: bool = True, **kwargs):
    """run() into NaN-poisoned out= (and lse=) inside sentinel rows; checks that the result is
    written in place and nothing outside. -> (out, lse or None)."""
    out_buf, out = poisoned((q.shape[0], q.shape[1], head_dim_vo), out_dtype)
    lse_buf, lse = poisoned((q.shape[0], q.shape[1]), torch.float32) if return_lse else (None, None)
    result = wrapper.run(q, *kv.run_args, out=out, lse=lse, return_lse=return_lse, **kwargs)
    torch.cuda.synchronize()
    if return_lse:
        result, result_lse = result
        assert result_lse.data_ptr() == lse.data_ptr(), "lse= was not written in place"
        assert_sentinels(lse_buf, "lse")
    assert result.data_ptr() == out.data_ptr(), "out= was not written in place"
    assert_sentinels(out_buf, "out")
    return out, lse


# --- the grid ------------------------------------------------------------------------------------
def case_shapes(index: int, case: Case, rnd: random.Random) -> list[tuple[int, int]]:
    """(qo_len, kv_len) per request, kv_len >= qo_len: mixed random lengths with qo_len 1 and
    kv_len == qo_len among them, page boundaries, and (some cases) padding requests."""
    max_q, max_extra = ((24, 80), (96, 400), (200, 900))[index % 3]
    batch = (1, 4, 9, 2, 13)[index % 5]
    ps = case.page_size or 16
    if batch == 1:
        m = rnd.randint(max_q // 2, max_q)
        return [(m, m + rnd.randint(0, max_extra))]
    shapes = []
    for _ in range(batch):
        m = 1 if rnd.random() < 0.3 else rnd.randint(2, max_q)
        r = rnd.random()
        if r < 0.2:
            n = m
        elif r < 0.35:
            n = max(m, rnd.choice([ps, ps + 1, 2 * ps - 1, 3 * ps]))
        else:
            n = m + rnd.randint(1, max_extra)
        shapes.append((m, n))
    shapes[0] = (1, shapes[0][1])  # a decode-like row
    shapes[-1] = (shapes[-1][0], shapes[-1][0])  # kv_len == qo_len
    if index % 4 == 2 and batch >= 4:  # padding: no queries; queries but no keys
        shapes[1] = (0, rnd.randint(1, 50))
        shapes[2] = (rnd.randint(1, 9), 0)
    return shapes


def random_masks(shapes, gen: torch.Generator, all_false_rows: bool = True) -> list[torch.Tensor]:
    """Per request a random bool [qo_len, kv_len] mask of varied density; with
    all_false_rows, one row of each request sees no key."""
    masks = []
    for b, (m, n) in enumerate(shapes):
        density = (0.5, 0.1, 0.9)[b % 3]
        mask = torch.rand(m, n, generator=gen, device=DEV) < density
        if all_false_rows and m and n:
            mask[(7 * b) % m] = False
        masks.append(mask)
    return masks


def mask_args(masks, shapes, packed: bool) -> dict:
    """plan()'s (and prefill_ref's) custom-mask arguments: the flat bools, or the bits packed
    little-endian per request with mask_indptr in bytes (segment_packbits)."""
    flat = torch.cat([mk.reshape(-1) for mk in masks]) if masks else torch.zeros(0, dtype=torch.bool, device=DEV)
    if not packed:
        return dict(custom_mask=flat)
    packed_bits, byte_indptr = segment_packbits_ref(flat, indptr_of([m * n for m, n in shapes]), "little")
    return dict(packed_custom_mask=packed_bits, mask_indptr=byte_indptr)


def batch_params():
    """Every case; head_dim 256's twice, its 64-row tile (4 warps) and its 128-row tile (8
    warps of 16 rows) pinned, so both kernels see every option the case carries."""
    for i, c in enumerate(CASES):
        for tile in ((64, 128) if c.dims[0] >= 256 else (None,)):
            yield pytest.param(i, tile, id=case_id(i, c) + (f"-t{tile}" if tile else ""))


@pytest.mark.gpu
@pytest.mark.parametrize("index,tile", list(batch_params()))
def test_batch_prefill(index, tile, workspace):
    case, rnd, gen = grid_case(CASES, index, 500)
    q_dtype, kv_dtype, o_dtype = dtype_of(case.q_dtype), dtype_of(case.kv_dtype), dtype_of(case.out_dtype)
    fp8 = kv_dtype.itemsize == 1
    (hq, hk), dims = case.heads, case.dims
    shapes = case_shapes(index, case, rnd)
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    host = index % 2 == 0  # index tensors on the host or on the device
    if case.paged:
        k_rows, v_rows = make_rows(kv_lens, hk, dims, torch.float32, gen)
        kv = paged_kv(k_rows, v_rows, kv_lens, case.page_size, case.source, case.kv_layout, case.form, rnd,
                      kv_dtype, host_indptr=host)
    else:
        k_rows, v_rows = make_rows(kv_lens, hk, dims, q_dtype, gen, case.form)
        kv = ragged_kv(k_rows, v_rows, kv_lens, host_indptr=host)
    # larger logits where the soft cap is on, so that tanh bends them
    q = make_q(sum(qo_lens), hq, dims[0], q_dtype, gen, 4.0 if case.soft_cap else 1.0, case.q_view == "strided")
    qo_indptr = indptr_of(qo_lens, "cpu" if host else DEV)

    masks = {}
    if case.mask == "causal":
        masks = dict(causal=True)
    elif case.mask in ("custom", "packed"):
        masks = mask_args(random_masks(shapes, gen), shapes, case.mask == "packed")
    plan_masks = dict(masks)
    if case.mask in ("custom", "packed") and index % 2:
        plan_masks["causal"] = True  # a custom mask wins over causal
    plan_window, run_window = {"off": (-1, None), "plan": (37, None), "run": (-1 if index % 2 else 37, 100)}[case.window]
    window = plan_window if run_window is None else run_window
    rope = {}
    if case.pos_encoding == "ROPE_LLAMA" and index % 2:
        rope = dict(rope_scale=2.0, rope_theta=5e4)
    split = {"auto": {}, "fixed": dict(fixed_split_size=64), "none": dict(disable_split_kv=True)}[case.split]
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else dict(k_scale=0.8, v_scale=1.5) if index % 5 == 2 else {}
    if index % 4 == 1:
        scales["q_scale"] = 1.25
    sinks = (torch.randn(hq, generator=gen, device=DEV) * 2.0).float() if case.sinks else None
    # dtypes as strings or torch dtypes; kv_data_type / o_data_type None meaning "as q"
    as_str = index % 2 == 0
    q_arg = case.q_dtype if as_str else q_dtype
    kv_arg = None if case.kv == "same" and index % 4 == 3 else (case.kv_dtype if as_str else kv_dtype)
    o_arg = None if case.o_dtype == "same" and index % 3 == 0 else (case.out_dtype if as_str else o_dtype)

    wrapper = paged_wrapper(workspace, case.kv_layout) if case.paged else ragged_wrapper(workspace)
    wrapper._force_tile_rows = tile
    plan_kv(wrapper, qo_indptr, kv, hq, hk, dims, case.page_size, **plan_masks, pos_encoding_mode=case.pos_encoding,
            sm_scale=case.sm_scale, window_left=plan_window, logits_soft_cap=case.soft_cap, q_data_type=q_arg,
            kv_data_type=kv_arg, o_data_type=o_arg, **rope, **split)
    run_kwargs = dict(scales)
    if run_window is not None:
        run_kwargs["window_left"] = run_window
    if sinks is not None:
        run_kwargs["sinks"] = sinks
    if index % 6 == 5:  # out (and lse) allocated by run()
        result = wrapper.run(q, *kv.run_args, return_lse=case.return_lse, **run_kwargs)
        out, lse = result if case.return_lse else (result, None)
        torch.cuda.synchronize()
        assert out.shape == (q.shape[0], hq, dims[1]) and out.dtype == o_dtype
        assert lse is None or (lse.shape == (q.shape[0], hq) and lse.dtype == torch.float32)
    else:
        out, lse = run_poisoned(wrapper, q, kv, dims[1], o_dtype, case.return_lse, **run_kwargs)

    ref_out, ref_lse = reference(q, qo_indptr, kv, **masks, sm_scale=case.sm_scale, window_left=window,
                                 logits_soft_cap=case.soft_cap, pos_encoding_mode=case.pos_encoding, sinks=sinks,
                                 **rope, **scales)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(q_dtype, o_dtype, fp8), scales.get("v_scale"),
                  sinks is not None)


# --- beyond the grid: lengths --------------------------------------------------------------------
def base_inputs(shapes, gen, rnd, source: str = "csr", heads=LLAMA, page_size: int = 16, host_indptr: bool = True):
    """(q, qo_indptr, k_rows, v_rows, kv): bf16, head_dim 128, paged (CSR, NHD) or ragged."""
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, heads[1], (128, 128), torch.bfloat16, gen)
    if source == "ragged":
        kv = ragged_kv(k_rows, v_rows, kv_lens, host_indptr)
    else:
        kv = paged_kv(k_rows, v_rows, kv_lens, page_size, source, "NHD", "tuple", rnd, host_indptr=host_indptr)
    q = make_q(sum(qo_lens), heads[0], 128, torch.bfloat16, gen)
    return q, indptr_of(qo_lens, "cpu" if host_indptr else DEV), k_rows, v_rows, kv


def run_base(workspace, shapes, q, qo_indptr, kv, causal: bool, heads=LLAMA, page_size: int = 16, backend="auto",
             **plan_kwargs):
    wrapper = ragged_wrapper(workspace, backend=backend) if kv.table is None else paged_wrapper(workspace, backend=backend)
    plan_kv(wrapper, qo_indptr, kv, *heads, (128, 128), page_size, causal=causal, q_data_type=torch.bfloat16,
            **plan_kwargs)
    return wrapper, run_poisoned(wrapper, q, kv, 128, torch.bfloat16)


ODD = (1, 17, 37, 127, 577, 1025)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_odd_lengths(causal, workspace):
    """Lengths off every tile size: self-attention of each odd length, and chunks of odd
    lengths at the end of longer K/V."""
    rnd = random.Random(1)
    gen = torch.Generator(device=DEV).manual_seed(1)
    shapes = [(n, n) for n in ODD] + [(1, 1025), (17, 17 + 577), (127, 127 + 37), (577, 1025), (37, 37 + 1)]
    rnd.shuffle(shapes)
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, causal)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
def test_long_causal_16k(source, workspace):
    """One causal request of 16384 tokens (few heads, GQA-4), paged and ragged."""
    rnd = random.Random(2)
    gen = torch.Generator(device=DEV).manual_seed(2)
    shapes, heads = [(16384, 16384)], (8, 2)
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, source, heads)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, True, heads)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
def test_chunked_prefill(workspace):
    """Chunks of queries at the end of long K/V (chunked prefill), next to a decode row and a
    request with kv_len == qo_len."""
    rnd = random.Random(3)
    gen = torch.Generator(device=DEV).manual_seed(3)
    shapes = [(512, 8192), (300, 5000), (1, 3000), (128, 128), (64, 8192 - 7)]
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, True)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True, rows=256)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_many_small_requests(page_size, workspace):
    """256 requests of 1-16 query tokens on short K/V."""
    rnd = random.Random(4)
    gen = torch.Generator(device=DEV).manual_seed(4)
    shapes = []
    for _ in range(256):
        m = rnd.randint(1, 16)
        shapes.append((m, m + rnd.randint(0, 48)))
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, page_size=page_size)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, True, page_size=page_size)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


PADDING_BATCHES = {
    "mixed": [(0, 0), (5, 40), (0, 30), (7, 0), (0, 0), (1, 1), (3, 0), (16, 16), (0, 0)],
    "no_keys": [(3, 0), (0, 0), (2, 0), (1, 0)],
    "first_last": [(4, 0), (9, 20), (0, 7)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("batch", sorted(PADDING_BATCHES))
def test_padding_requests(batch, causal, source, workspace):
    """Requests with qo_len 0, kv_len 0 or both (padding of a CUDA-graph batch): rows without
    keys are zeros with LSE -inf, no NaN anywhere, nothing written outside out/lse."""
    rnd = random.Random(5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    shapes = PADDING_BATCHES[batch]
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, source)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, causal)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))
    no_keys = torch.tensor([n == 0 for m, n in shapes for _ in range(m)], dtype=torch.bool, device=DEV)
    assert bool((out[no_keys] == 0).all()) and bool(torch.isneginf(lse[no_keys]).all())


# --- beyond the grid: the unmasked 128-row tiles' own kernels (q in registers, no window) ----------
QREG_DIMS = (64, 256)  # PrefillTraits::kQRegSteps: bf16/f16 K/V, no mask, RoPE or soft cap


@pytest.mark.gpu
@pytest.mark.parametrize("window_left", [-1, 45], ids=["nowindow", "window"])
@pytest.mark.parametrize("source", ["csr", "ragged"])
@pytest.mark.parametrize("head_dim", QREG_DIMS)
def test_q_fragments_in_registers(head_dim, source, window_left, workspace):
    """The unmasked 128-row kernels that hold q's fragments in registers for the whole item
    (all of head_dim 64's k steps, 4 of head_dim 256's 16): requests of many K/V tiles, odd
    lengths, one with a single query token, padding, paged and ragged, and with a sliding
    window (its masked tiles read the same registers), against the reference."""
    _check_unmasked_128_row_tile(head_dim, source, window_left, workspace)


@pytest.mark.gpu
@pytest.mark.parametrize("window_left", [-1, 45], ids=["nowindow", "window"])
def test_ragged_kernel_without_window(window_left, workspace):
    """head_dim 128's ragged unmasked 128-row tile runs a kernel compiled without the sliding
    window's code when the plan has none (PrefillTraits::kNoWindowKernel), the general one
    with a window: both on the same requests as above, against the reference."""
    _check_unmasked_128_row_tile(128, "ragged", window_left, workspace)


def _check_unmasked_128_row_tile(head_dim, source, window_left, workspace):
    rnd = random.Random(11 + head_dim)
    gen = torch.Generator(device=DEV).manual_seed(11 + head_dim)
    shapes = [(300, 700), (37, 100), (128, 128), (1, 50), (0, 9), (200, 1500), (129, 1025), (5, 0)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    dims = (head_dim, head_dim)
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], dims, torch.bfloat16, gen)
    kv = ragged_kv(k_rows, v_rows, kv_lens) if source == "ragged" else paged_kv(k_rows, v_rows, kv_lens, 16, rnd=rnd)
    q = make_q(sum(qo_lens), LLAMA[0], head_dim, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens)
    wrapper = ragged_wrapper(workspace) if source == "ragged" else paged_wrapper(workspace)
    wrapper._force_tile_rows = 128
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, dims, 16, window_left=window_left, q_data_type=torch.bfloat16)
    out, lse = run_poisoned(wrapper, q, kv, head_dim, torch.bfloat16)
    ref_out, ref_lse = reference(q, qo_indptr, kv, window_left=window_left)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("layout", ["ragged", "csr16", "csr1"])
def test_head_dim_256_wide_tile(layout, causal, split, workspace):
    """head_dim 256's 128-row tile (8 warps, one block an SM; non-causal: one item a block,
    the item count not read, csrc/prefill/prefill.cuh kOneItemABlock): items of one K/V tile (64
    keys), of many, padding rows, empty requests, the chunks of a split (each chunk's tile
    merged by its last block), causal and not, pages of 16 (a page a warp) and of 1 (a
    lookup a row), MHA (csr1) and GQA-4, against the reference."""
    rnd = random.Random(21)
    gen = torch.Generator(device=DEV).manual_seed(21)
    heads = (8, 8) if layout == "csr1" else LLAMA
    shapes = [(64, 64), (300, 700), (37, 100), (1, 50), (0, 9), (129, 1025), (5, 0), (32, 96), (200, 264), (16, 64)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    dims = (256, 256)
    k_rows, v_rows = make_rows(kv_lens, heads[1], dims, torch.bfloat16, gen)
    page_size = 1 if layout == "csr1" else 16
    kv = ragged_kv(k_rows, v_rows, kv_lens) if layout == "ragged" else paged_kv(k_rows, v_rows, kv_lens, page_size, rnd=rnd)
    q = make_q(sum(qo_lens), heads[0], 256, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens)
    wrapper = ragged_wrapper(workspace) if layout == "ragged" else paged_wrapper(workspace)
    wrapper._force_tile_rows = 128
    plan_kv(wrapper, qo_indptr, kv, *heads, dims, page_size, causal=causal, q_data_type=torch.bfloat16,
            **(dict(fixed_split_size=128) if split else {}))
    if split:
        assert wrapper._plan.merge_rows > 0, "the plan should split"
    out, lse = run_poisoned(wrapper, q, kv, 256, torch.bfloat16)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("source", ["ragged", "paged"])
def test_causal_rows_that_see_no_key(source, tile, split, workspace):
    """Causal with kv_len < qo_len, FlashInfer's semantics: the mask stays bottom-right
    aligned, the first qo_len - kv_len rows see no key and give exact zeros and lse -inf
    (no error, no NaN); requests with some rows, whole tiles and all rows above the diagonal,
    beside ordinary ones, split into chunks and not."""
    rnd = random.Random(31 + tile)
    gen = torch.Generator(device=DEV).manual_seed(31 + tile)
    shapes = [(20, 5), (7, 7), (300, 64), (0, 3), (129, 1), (64, 2000), (5, 0), (200, 150)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    dims = (128, 128)
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], dims, torch.bfloat16, gen)
    kv = ragged_kv(k_rows, v_rows, kv_lens) if source == "ragged" else paged_kv(k_rows, v_rows, kv_lens, 16, rnd=rnd)
    q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens)
    wrapper = ragged_wrapper(workspace) if source == "ragged" else paged_wrapper(workspace)
    wrapper._force_tile_rows = tile
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, dims, 16, causal=True, q_data_type=torch.bfloat16,
            **(dict(fixed_split_size=64) if split else {}))
    out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))
    first = 0
    for m, n in shapes:  # (check_prefill: exact zeros and -inf where the reference is -inf)
        blind = max(0, m - n) if n > 0 else m
        assert bool(torch.isneginf(lse[first:first + blind]).all()), (m, n)
        first += m


# --- beyond the grid: the same attention by other paths --------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 8, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_paged_matches_ragged(causal, page_size, workspace):
    """The same K/V rows through the paged cache and as ragged tensors: the two agree, and
    each matches the reference. (Page sizes: 1, a lookup a row; 8, the page ids a lane
    shuffled to each row; 16, a page a warp: the three copy paths of csrc/prefill/prefill.cuh.)"""
    rnd = random.Random(6 + page_size)
    gen = torch.Generator(device=DEV).manual_seed(6 + page_size)
    shapes = [(1, 700), (37, 100), (128, 128), (200, 1500), (0, 9), (5, 0), (64, 65)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (128, 128), torch.bfloat16, gen)
    q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens)
    results = []
    for kv in (paged_kv(k_rows, v_rows, kv_lens, page_size, rnd=rnd), ragged_kv(k_rows, v_rows, kv_lens)):
        _, result = run_base(workspace, shapes, q, qo_indptr, kv, causal, page_size=page_size)
        results.append(result)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    paged_result, ragged_result = results
    check_two_paths(paged_result, ragged_result, ref_out, ref_lse, shapes, tolerance(BF16), ("paged", "ragged"))


def _ordered_ids(plan, table: PageTable) -> PageTable:
    """The page table a plan's run() reads (its reordered copy), in the layout of `table`."""
    index = plan.args[0]
    if table.layout == "csr":
        return csr_page_table(*index)
    return block_page_table(index[0], index[1][: table.batch_size], kv_separate=table.layout == "block_table_kv_separate")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_paged_plan_orders_pages(causal, workspace):
    """plan() writes a copy of the page table with each request's movable pages in page-id
    order (every page but the last; causal: only the pages of keys every query row sees,
    j <= kv_len - qo_len), exactly as the reference ordering (flashinfer_jit/runtime/page_order.py),
    for every page-table layout; run() on it matches the float64 reference of the pages as
    given (op, then fast path); a run() with a window reads the pages as given; RoPE,
    sort_pages=False and window plans keep the ids as given."""
    from flashinfer_jit.reference.decode import ordered_pages_ref

    rnd = random.Random(43)
    gen = torch.Generator(device=DEV).manual_seed(43)
    ps = 16
    # one page, a partial last page, a chunk at the end of a long request (most pages move),
    # queries as long as the keys (causal: none move), speculative verification, padding
    shapes = [(1, 1), (3, 40), (512, 4100), (700, 700), (4, 2049), (0, 300), (33, 33 + 16 * 5 - 1), (2, 0)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    for layout in ("block_table", "block_table_kv_separate", "csr"):  # (csr last: its run()s below)
        q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, layout, page_size=ps)
        wrapper = paged_wrapper(workspace, backend="fa2")  # (the mma.sync kernel's plan orders pages)
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), ps, causal=causal, q_data_type=torch.bfloat16)
        assert wrapper._plan.unordered is not None, f"{layout}: plan() should reorder the pages"
        torch.cuda.synchronize()
        want = ordered_pages_ref(on_host(kv.table), kv_lens, ps, 1 << 30, qo_lens if causal else None)
        got = on_host(_ordered_ids(wrapper._plan, kv.table))
        for b, n in enumerate(kv_lens):
            assert request_pages_ref(got, b, -(-n // ps)) == want[b], \
                f"{layout}, request {b} (shape {shapes[b]}): pages not as the reference orders them"
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    for _ in range(2):  # the op, then the fast path on the reordered ids
        out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
        check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))
    # a window given to run() only: the ids as given
    out_w, lse_w = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, window_left=37)
    ref_w, ref_w_lse = reference(q, qo_indptr, kv, causal=causal, window_left=37)
    check_prefill(out_w, lse_w, ref_w, ref_w_lse, shapes, tolerance(BF16))
    # RoPE, sort_pages=False, a window: the ids as given (plans only, but the last's run())
    for extra in (dict(pos_encoding_mode="ROPE_LLAMA"), dict(sort_pages=False), dict(window_left=50)):
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), ps, causal=causal, q_data_type=torch.bfloat16, **extra)
        assert wrapper._plan.unordered is None, f"{extra}: plan() should keep the pages as given"
    out3, lse3 = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
    ref_r, ref_r_lse = reference(q, qo_indptr, kv, causal=causal, window_left=50)
    check_prefill(out3, lse3, ref_r, ref_r_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_pairs_carry_their_first_page_ids(causal, split, workspace):
    """plan()'s page-order launch writes into each work pair the page ids of its chunk's first
    four pages (csrc/prefill/prefill_params.h kPrefillPairIdsAt), from the reordered table its run()
    reads, -1 past the request's pages; tables of separate K and V ids, and plans that keep
    the pages as given, leave -1 (the kernels then load the ids). run() matches the float64
    reference either way (page 16: the first tile's ids come with the pair; page 8: its 64 keys
    span 8 pages, loaded)."""
    from flashinfer_jit.prefill import wrapper as pf

    rnd = random.Random(53)
    gen = torch.Generator(device=DEV).manual_seed(53)
    shapes = [(1, 1), (3, 40), (64, 256), (4, 2049), (0, 300), (37, 37 + 16 * 5 - 1), (2, 0), (128, 1100)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    extra = dict(fixed_split_size=128) if split else dict(disable_split_kv=True)
    for ps in (16, 8):
        for layout in ("block_table", "block_table_kv_separate", "csr"):
            q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, layout, page_size=ps)
            for sort_pages in (True, False):
                wrapper = paged_wrapper(workspace)
                plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), ps, causal=causal, q_data_type=torch.bfloat16,
                        sort_pages=sort_pages, **extra)
                plan = wrapper._plan
                assert (plan.merge_rows > 0) == split, "the plan should split where fixed_split_size is given"
                work = plan.args[2].cpu()
                pairs = work[1: 1 + pf._PAIR_INTS * (int(work[0]) // LLAMA[1])].reshape(-1, pf._PAIR_INTS)
                ids = pairs[:, pf._PAIR_IDS_AT: pf._PAIR_IDS_AT + pf._PAIR_IDS]
                filled = sort_pages and layout != "block_table_kv_separate"
                assert (plan.unordered is not None) == sort_pages, f"{layout}: sort_pages={sort_pages}"
                if not filled:
                    assert (ids == -1).all(), f"{layout}, sort_pages={sort_pages}: the ids should stay -1"
                else:
                    table = on_host(_ordered_ids(plan, kv.table))
                    assert (pairs[:, 2] > 0).any() == split, "split plans have chunks that start past key 0"
                    wrong = []
                    for row, pair_ids in zip(pairs.tolist(), ids.tolist()):
                        b, kv_start = row[0], row[2]
                        pages = request_pages_ref(table, b, -(-kv_lens[b] // ps))[0]  # (K ids)
                        want = [pages[kv_start // ps + l] if kv_start // ps + l < len(pages) else -1
                                for l in range(pf._PAIR_IDS)]
                        if pair_ids != want:
                            wrong.append(f"request {b} at key {kv_start}: {pair_ids}, expected {want}")
                    assert not wrong, f"{layout}, page {ps}: {len(wrong)} of {pairs.shape[0]} pairs: " + "; ".join(wrong[:4])
                out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
                ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
                check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("window_left", [-1, 100])
def test_one_query_token_matches_decode(window_left, workspace):
    """Prefill with qo_len 1 per request and BatchDecodeWithPagedKVCacheWrapper on the same
    cache agree with each other and with the reference (a kv_len 0 request among them)."""
    rnd = random.Random(7)
    gen = torch.Generator(device=DEV).manual_seed(7)
    kv_lens = [0, 1, 15, 16, 17, 300, 2049, 777]
    shapes = [(1, n) for n in kv_lens]
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, host_indptr=False)
    _, (out, lse) = run_base(workspace, shapes, q, qo_indptr, kv, False, window_left=window_left)
    decode = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    decode.plan(kv.plan_args["paged_kv_indptr"], kv.plan_args["paged_kv_indices"],
                kv.plan_args["paged_kv_last_page_len"], LLAMA[0], LLAMA[1], 128, 16, window_left=window_left,
                q_data_type=torch.bfloat16)
    d_out, d_lse = decode.run(q, *kv.run_args, return_lse=True)
    ref_out, ref_lse = reference(q, qo_indptr, kv, window_left=window_left)
    check_two_paths((out, lse), (d_out, d_lse), ref_out, ref_lse, shapes, tolerance(BF16), ("prefill", "decode"))


@pytest.mark.gpu
def test_single_prefill(workspace):
    """single_prefill_with_kv_cache: one request, NHD and HND K/V, causal, custom mask,
    window, return_lse; against the reference."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    (hq, hk), m, n = LLAMA, 300, 1000
    q = make_q(m, hq, 128, torch.bfloat16, gen)
    k, v = make_rows([n], hk, (128, 128), torch.bfloat16, gen)
    shapes = [(m, n)]
    mask = random_masks(shapes, gen)[0]
    tol = tolerance(BF16)
    for kv_layout, kwargs in (("NHD", dict(causal=True)), ("HND", dict(causal=False, window_left=200)),
                              ("NHD", dict(custom_mask=mask)), ("HND", dict(causal=True, window_left=50))):
        k_in, v_in = (k, v) if kv_layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
        out, lse = fij.single_prefill_with_kv_cache(q, k_in, v_in, kv_layout=kv_layout, return_lse=True, **kwargs)
        assert out.shape == (m, hq, 128) and out.dtype == torch.bfloat16 and lse.shape == (m, hq)
        ref_kwargs = dict(kwargs, custom_mask=mask.reshape(-1)) if "custom_mask" in kwargs else kwargs
        ref_out, ref_lse = prefill_ref(q, indptr_of([m]), k, v, indptr_of([n]), **ref_kwargs)
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
        plain = fij.single_prefill_with_kv_cache(q, k_in, v_in, kv_layout=kv_layout, **kwargs)
        assert isinstance(plain, torch.Tensor)
        check_out(plain, ref_out, shapes, tol)


# --- custom masks --------------------------------------------------------------------------------
MASK_SHAPES = [(37, 100), (1, 50), (64, 64), (0, 20), (128, 300), (5, 0), (17, 17), (9, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
def test_custom_mask_bool_and_packed(source, workspace):
    """Random bit patterns, one row of each request all false and one request entirely
    false: the bool custom_mask and the packed form (little bit order, mask_indptr in bytes)
    give the same result bit for bit, the reference's; rows with no key are zeros, -inf."""
    rnd = random.Random(9)
    gen = torch.Generator(device=DEV).manual_seed(9)
    shapes = MASK_SHAPES
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, source)
    masks = random_masks(shapes, gen)
    masks[-1][:] = False  # a request that sees nothing
    results = []
    for packed in (False, True):
        args = mask_args(masks, shapes, packed)
        _, result = run_base(workspace, shapes, q, qo_indptr, kv, False, **args)
        ref_out, ref_lse = reference(q, qo_indptr, kv, **args)
        check_prefill(*result, ref_out, ref_lse, shapes, tolerance(BF16))
        results.append(result)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1]), \
        "the bool and the packed forms of one mask should give the same result"
    last = q.shape[0] - shapes[-1][0]
    assert bool((results[1][0][last:] == 0).all()) and bool(torch.isneginf(results[1][1][last:]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
def test_causal_as_custom_mask_matches_causal(source, workspace):
    """The bottom-right causal mask given as a custom mask gives causal's result."""
    rnd = random.Random(10)
    gen = torch.Generator(device=DEV).manual_seed(10)
    shapes = [(37, 100), (1, 50), (64, 64), (200, 700), (0, 5), (3, 0), (16, 17)]
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, source)
    masks = [torch.arange(n, device=DEV)[None, :] <= torch.arange(n - m, n, device=DEV)[:, None] if n else
             torch.zeros(m, 0, dtype=torch.bool, device=DEV) for m, n in shapes]
    _, (c_out, c_lse) = run_base(workspace, shapes, q, qo_indptr, kv, True)
    _, (m_out, m_lse) = run_base(workspace, shapes, q, qo_indptr, kv, False, **mask_args(masks, shapes, True))
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    tol = tolerance(BF16)
    check_prefill(c_out, c_lse, ref_out, ref_lse, shapes, tol)
    check_prefill(m_out, m_lse, ref_out, ref_lse, shapes, tol)
    check_agree(m_out, m_lse, c_out, c_lse, shapes, tol / 4, "custom", "causal")


# --- split-KV, determinism, several layers ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_split_kv_forced_and_disabled(causal, workspace):
    """fixed_split_size=256 (long requests split, and each split tile merged in the kernel by
    its last block) and disable_split_kv=True agree with each other and with the reference;
    each is deterministic (two runs bit for bit), and the merge counters are zero again after
    every run (the next launch counts from zero)."""
    rnd = random.Random(11)
    gen = torch.Generator(device=DEV).manual_seed(11)
    shapes = [(17, 5000), (1, 3000), (200, 2500), (64, 64), (300, 4100), (0, 600), (2, 0)]
    q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    tol = tolerance(BF16)
    results = []
    for split in (dict(fixed_split_size=256), dict(disable_split_kv=True)):
        wrapper, first = run_base(workspace, shapes, q, qo_indptr, kv, causal, backend="fa2", **split)  # (its split-kv)
        first = tuple(t.clone() for t in first)
        again = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
        if "fixed_split_size" in split:
            assert wrapper._plan.merge_rows > 0 and wrapper._split.counters is not None, "the plan should split"
            assert int(wrapper._split.counters.count_nonzero()) == 0, "merge counters left nonzero after a run"
        check_prefill(*first, ref_out, ref_lse, shapes, tol)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), f"{split}: not deterministic"
        results.append(first)
    check_agree(*results[0], *results[1], shapes, tol, "split", "unsplit")


@pytest.mark.gpu
def test_plan_once_run_per_layer(workspace):
    """One plan(), run() per layer on each layer's cache, q and scales (and a run() with a
    strided q and allocated outputs): every run against the reference."""
    rnd = random.Random(12)
    gen = torch.Generator(device=DEV).manual_seed(12)
    shapes = [(100, 900), (1, 17), (33, 33), (250, 600)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    num_pages = sum(-(-n // 16) for n in kv_lens) + 3
    paged = make_page_table("csr", kv_lens, 16, num_pages, rnd, host_indptr=True)
    qo_indptr = indptr_of(qo_lens, "cpu")
    wrapper = paged_wrapper(workspace)
    wrapper.plan(qo_indptr, **paged.plan_args, num_qo_heads=LLAMA[0], num_kv_heads=LLAMA[1], head_dim_qk=128,
                 page_size=16, causal=True, q_data_type=torch.bfloat16)
    tol = tolerance(BF16)
    for layer, scales in enumerate((dict(), dict(k_scale=0.7, v_scale=1.5), dict(q_scale=1.3), dict())):
        k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (128, 128), torch.bfloat16, gen)
        k = nan_tensor((num_pages, 16, LLAMA[1], 128), torch.bfloat16)
        v = nan_tensor((num_pages, 16, LLAMA[1], 128), torch.bfloat16)
        write_rows(k, paged.table, kv_lens, 16, "NHD", k_rows, 0)
        write_rows(v, paged.table, kv_lens, 16, "NHD", v_rows, 1)
        kv = KV(((k, v),), k, v, paged.table, paged.plan_args, "NHD")
        q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen, strided=layer == 3)
        if layer == 3:
            out, lse = wrapper.run(q, (k, v), return_lse=True)
        else:
            out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, **scales)
        ref_out, ref_lse = reference(q, qo_indptr, kv, causal=True, **scales)
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol, scales.get("v_scale"))


# --- CUDA graphs -------------------------------------------------------------------------------------
def _partition(total: int, parts: int, rnd: random.Random) -> list[int]:
    cuts = sorted(rnd.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["long", "short"])
def test_cuda_graph_replay_after_replan(workspace, first):
    """run() captured once (8 requests, 640 query tokens; or first 8 requests of 2 tokens,
    whose plan takes the 64-row tile, which the wrapper then holds), replayed after plan()
    with other lengths, fewer requests and fewer tokens (q stays the captured buffer; only
    its first qo_indptr[-1] rows are live): the live rows match the reference, the rows past
    them stay untouched; a plan() with more requests than the buffers hold is an error."""
    capacity, max_tokens, (hq, hk), ps, pool = 8, 640, LLAMA, 16, 2048
    rnd = random.Random(13)
    gen = torch.Generator(device=DEV).manual_seed(13)
    k = randn((pool, ps, hk, 128), torch.bfloat16, gen)
    v = randn((pool, ps, hk, 128), torch.bfloat16, gen)
    wrapper = paged_wrapper(
        workspace, "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
        paged_kv_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
        paged_kv_indices_buf=torch.zeros(pool, dtype=torch.int32, device=DEV),
        paged_kv_last_page_len_buf=torch.zeros(capacity, dtype=torch.int32, device=DEV))
    q_buf = randn((max_tokens, hq, 128), torch.bfloat16, gen)
    out_buf = torch.full((max_tokens, hq, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse_buf = torch.full((max_tokens, hq), float("nan"), dtype=torch.float32, device=DEV)
    first = _partition(max_tokens, capacity, rnd)
    rounds = [
        [(m, m + rnd.randint(0, 1500)) for m in first],
        [(1, 6000), (100, 100), (0, 50), (250, 2000), (49, 49 + 17)],  # a long one: another split
        [(0, 0), (200, 200), (17, 0)],  # padding, 217 tokens
        [(1, 1)],
    ]
    if first == "short":
        rounds.insert(0, [(2, 2 + rnd.randint(0, 1500)) for _ in range(capacity)])
    graph = None
    for shapes in rounds:
        qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
        rows = sum(qo_lens)
        paged = make_page_table("csr", kv_lens, ps, pool, rnd, host_indptr=True)
        qo_indptr = indptr_of(qo_lens, "cpu")
        wrapper.plan(qo_indptr, **paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim_qk=128, page_size=ps,
                     causal=True, q_data_type=torch.bfloat16)
        q_buf.copy_(randn(q_buf.shape, torch.bfloat16, gen))
        graph = replay_poisoned(graph, lambda: wrapper.run(q_buf, (k, v), out=out_buf, lse=lse_buf, return_lse=True),
                                out_buf, lse_buf)
        kv = KV(((k, v),), k, v, paged.table, paged.plan_args, "NHD")
        ref_out, ref_lse = reference(q_buf[:rows], qo_indptr, kv, causal=True)
        check_prefill(out_buf[:rows], lse_buf[:rows], ref_out, ref_lse, shapes, tolerance(BF16))
        assert bool(out_buf[rows:].isnan().all()) and bool(lse_buf[rows:].isnan().all()), \
            "rows past qo_indptr[-1] were written"
    too_many = [(1, 10)] * (capacity + 1)
    paged = make_page_table("csr", [n for _, n in too_many], ps, pool, rnd, host_indptr=True)
    with pytest.raises(ValueError, match="qo_indptr|batch|capacity|captured"):
        wrapper.plan(indptr_of([1] * (capacity + 1), "cpu"), **paged.plan_args, num_qo_heads=hq, num_kv_heads=hk,
                     head_dim_qk=128, page_size=ps, causal=True, q_data_type=torch.bfloat16)


# --- merge_state of two halves -------------------------------------------------------------------------
@pytest.mark.gpu
def test_merge_state_of_prefix_and_suffix(workspace):
    """Each request's K/V cut in two by hand: the shared prefix (every query sees all of it:
    mask none) and the suffix (causal, bottom-right aligned), planned on two wrappers that
    share the workspace, then run (as an engine does each layer: plan both, run both).
    merge_state of the two (out, lse) equals the full causal prefill and the reference; an
    empty prefix (lse -inf) merges to the suffix alone."""
    rnd = random.Random(14)
    gen = torch.Generator(device=DEV).manual_seed(14)
    # (qo_len, kv_len, prefix length <= kv_len - qo_len)
    cuts = [(100, 900, 333), (1, 300, 299), (64, 64, 0), (37, 537, 500), (16, 40, 24), (200, 1000, 512)]
    shapes = [(m, n) for m, n, _ in cuts]
    qo_lens = [m for m, _ in shapes]
    k_rows, v_rows = make_rows([n for _, n in shapes], LLAMA[1], (128, 128), torch.bfloat16, gen)
    q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    starts = list(itertools.accumulate([n for _, n in shapes], initial=0))
    pre = [torch.arange(s, s + p, device=DEV) for s, (_, _, p) in zip(starts, cuts)]
    suf = [torch.arange(s + p, s + n, device=DEV) for s, (_, n, p) in zip(starts, cuts)]
    pre, suf = torch.cat(pre), torch.cat(suf)
    prefix = paged_kv(k_rows[pre], v_rows[pre], [p for _, _, p in cuts], 16, rnd=rnd, host_indptr=True)
    suffix = paged_kv(k_rows[suf], v_rows[suf], [n - p for _, n, p in cuts], 16, rnd=rnd, host_indptr=True)
    wrappers = []
    for kv, causal in ((prefix, False), (suffix, True)):
        wrapper = paged_wrapper(workspace)
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), 16, causal=causal, q_data_type=torch.bfloat16)
        wrappers.append(wrapper)
    (p_out, p_lse), (s_out, s_lse) = [run_poisoned(w, q, kv, 128, torch.bfloat16)
                                      for w, kv in zip(wrappers, (prefix, suffix))]
    merged, merged_lse = fij.merge_state(p_out, p_lse, s_out, s_lse)
    full = paged_kv(k_rows, v_rows, [n for _, n in shapes], 16, rnd=rnd, host_indptr=True)
    _, (f_out, f_lse) = run_base(workspace, shapes, q, qo_indptr, full, True)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_two_paths((merged, merged_lse), (f_out, f_lse), ref_out, ref_lse, shapes, tolerance(BF16), ("merged", "full"))


# --- run() and graph misuse on the GPU -----------------------------------------------------------------
@pytest.mark.gpu
def test_run_rejects_what_the_plan_does_not_match(workspace):
    """run() with a q of another dtype, head count or head dim than planned, an out of
    another dtype, lse of another shape or sinks of another length: errors naming the
    argument, before any launch (out keeps its NaN)."""
    rnd = random.Random(15)
    gen = torch.Generator(device=DEV).manual_seed(15)
    shapes = [(5, 40), (3, 3)]
    q, qo_indptr, _, _, kv = base_inputs(shapes, gen, rnd)
    wrapper = paged_wrapper(workspace)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), 16, q_data_type=torch.bfloat16)
    rows, (hq, _) = q.shape[0], LLAMA
    out = torch.full((rows, hq, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    bad_runs = [
        (r"\bq\b", dict(q=q.to(torch.float16))),
        (r"\bq\b", dict(q=q[:, :16].contiguous())),
        (r"\bq\b", dict(q=randn((rows, hq, 64), torch.bfloat16, gen))),
        (r"\bout\b", dict(out=torch.empty(rows, hq, 128, dtype=torch.float16, device=DEV))),
        (r"\blse\b", dict(lse=torch.empty(rows, hq // 2, dtype=torch.float32, device=DEV), return_lse=True)),
        ("sinks", dict(sinks=torch.zeros(hq // 2, dtype=torch.float32, device=DEV))),
    ]
    for match, kwargs in bad_runs:
        kwargs = dict(dict(q=q) if "q" in kwargs else dict(q=q, out=out), **kwargs)  # a bad q: no out to blame
        with pytest.raises((ValueError, TypeError), match=match):
            wrapper.run(kwargs.pop("q"), *kv.run_args, **kwargs)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected run() wrote its output"


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
def test_run_quick_path_checks_what_the_op_recorded(source, workspace):
    """From the second run() of a signature, run() hands its tensors to fij_fastcall's
    prefill_run, which checks them in C++ against what the op recorded: its results equal
    the op's bit for bit; a q of another dtype, a q misaligned by one element (same shape and
    strides), an out of another shape or dtype still raise what the full checks raise,
    before any launch; another token count (a new signature) is recorded and runs right."""
    from flashinfer_jit.runtime import fastcall

    rnd = random.Random(21)
    gen = torch.Generator(device=DEV).manual_seed(21)
    shapes = [(37, 300), (5, 5), (64, 64)]
    q, qo_indptr, _, _, kv = base_inputs(shapes, gen, rnd, source)
    wrapper = paged_wrapper(workspace) if source == "csr" else ragged_wrapper(workspace)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), 16 if source == "csr" else None, causal=True,
            q_data_type=torch.bfloat16)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=True)
    outs = []
    for _ in range(3):  # the op, then the quick path twice
        out, _ = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, return_lse=False)
        outs.append(out)
    if fastcall.extension() is not None:
        assert wrapper._plan.quick is not None, "the second run() should record the quick path"
    check_out(outs[0], ref_out, shapes, tolerance(BF16))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), "the quick path should repeat the op"

    rows = q.shape[0]
    wide = torch.empty(rows * LLAMA[0] * 128 + 8, dtype=torch.bfloat16, device=DEV)
    misaligned = wide[1:1 + q.numel()].view_as(q)  # 2 bytes past a 16-byte boundary
    misaligned.copy_(q)
    out = torch.full((rows, LLAMA[0], 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    bad_runs = [
        (r"\bq\b", dict(q=q.to(torch.float16), out=out)),
        (r"\bq\b.*16 bytes", dict(q=misaligned, out=out)),
        (r"\bout\b", dict(q=q, out=torch.empty(rows, LLAMA[0], 64, dtype=torch.bfloat16, device=DEV))),
        (r"\bout\b", dict(q=q, out=torch.empty(rows, LLAMA[0], 128, dtype=torch.float16, device=DEV))),
    ]
    for match, kwargs in bad_runs:
        with pytest.raises((ValueError, TypeError), match=match):
            wrapper.run(kwargs.pop("q"), *kv.run_args, **kwargs)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected run() wrote its output"

    # a q with spare rows (more tokens than planned): a new signature, recorded and run
    q_more = torch.cat([q, randn((7, LLAMA[0], 128), torch.bfloat16, gen)])
    for _ in range(3):
        out_more = wrapper.run(q_more, *kv.run_args)
        torch.cuda.synchronize()
        assert torch.equal(out_more[:rows], outs[0])


# --- on the CPU: the grid's coverage, the AOT matrix, the API ----------------------------------------
def test_cases_cover_every_pair_of_options():
    names = list(OPTIONS)
    seen = set()
    for case in CASES:
        values = case_values(case)
        assert all(values[n] in OPTIONS[n] for n in values), case
        assert compatible(values), f"not a valid case: {case}"
        assert case.paged == (case.kv_layout is not None) == (case.page_size is not None), case
        case_spec(case)  # a module that exists
        seen |= {(a, values[a], b, values[b]) for a, b in itertools.combinations(names, 2)
                 if a in values and b in values}
    missing = [(a, x, b, y) for a, b in itertools.combinations(names, 2)
               for x in OPTIONS[a] for y in OPTIONS[b] if compatible({a: x, b: y}) and (a, x, b, y) not in seen]
    assert not missing, f"{len(missing)} pairs no case has, e.g. {missing[:5]}"


def test_tests_matrix_has_every_prefill_module():
    assert_tests_matrix_has(specs_needed(), PrefillSpec, 36, "prefill")


REQUIRED = inspect.Parameter.empty
# FlashInfer 0.5.3's parameters (name, default) in order
PAGED_INIT = [("float_workspace_buffer", REQUIRED), ("kv_layout", "NHD"), ("use_cuda_graph", False),
              ("qo_indptr_buf", None), ("paged_kv_indptr_buf", None), ("paged_kv_indices_buf", None),
              ("paged_kv_last_page_len_buf", None), ("custom_mask_buf", None), ("mask_indptr_buf", None),
              ("backend", "auto"), ("jit_args", None)]
RAGGED_INIT = [("float_workspace_buffer", REQUIRED), ("kv_layout", "NHD"), ("use_cuda_graph", False),
               ("qo_indptr_buf", None), ("kv_indptr_buf", None), ("custom_mask_buf", None), ("mask_indptr_buf", None),
               ("backend", "auto"), ("jit_args", None)]
PLAN_TAIL = [("custom_mask", None), ("packed_custom_mask", None), ("causal", False), ("pos_encoding_mode", "NONE"),
             ("use_fp16_qk_reduction", False)]
PAGED_PLAN = ([(n, REQUIRED) for n in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                                        "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size")]
              + [("head_dim_vo", None)] + PLAN_TAIL
              + [("sm_scale", None), ("window_left", -1), ("logits_soft_cap", None), ("rope_scale", None),
                 ("rope_theta", None), ("q_data_type", "float16"), ("kv_data_type", None), ("o_data_type", None),
                 ("non_blocking", True), ("prefix_len_ptr", None), ("token_pos_in_items_ptr", None),
                 ("token_pos_in_items_len", 0), ("max_item_len_ptr", None), ("seq_lens", None), ("seq_lens_q", None),
                 ("block_tables", None), ("max_token_per_sequence", None), ("max_sequence_kv", None),
                 ("fixed_split_size", None), ("disable_split_kv", False)])
RAGGED_PLAN = ([(n, REQUIRED) for n in ("qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk")]
               + [("head_dim_vo", None)] + PLAN_TAIL
               + [("window_left", -1), ("logits_soft_cap", None), ("sm_scale", None), ("rope_scale", None),
                  ("rope_theta", None), ("q_data_type", "float16"), ("kv_data_type", None), ("o_data_type", None),
                  ("non_blocking", True)])
RUN_KEYWORDS = [("q_scale", None), ("k_scale", None), ("v_scale", None), ("out", None), ("lse", None),
                ("return_lse", False), ("enable_pdl", None), ("window_left", None), ("sinks", None)]
SINGLE = ([(n, REQUIRED) for n in ("q", "k", "v")]
          + [("scale_q", None), ("scale_k", None), ("scale_v", None), ("o_dtype", None), ("custom_mask", None),
             ("packed_custom_mask", None), ("causal", False), ("kv_layout", "NHD"), ("pos_encoding_mode", "NONE"),
             ("use_fp16_qk_reduction", False), ("sm_scale", None), ("window_left", -1), ("logits_soft_cap", None),
             ("rope_scale", None), ("rope_theta", None), ("backend", "auto"), ("return_lse", False)])


def _params(fn, skip_self: bool = True):
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if skip_self and params and params[0].name == "self" else params


def _assert_leading(params, expected, what: str) -> None:
    names = [p.name for p in params[: len(expected)]]
    assert names == [n for n, _ in expected], f"{what}: parameters {names}, FlashInfer's {[n for n, _ in expected]}"
    for p, (name, default) in zip(params, expected):
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY), f"{what}: {name} should be positional"
        if default is not REQUIRED:
            assert p.default == default, f"{what}: {name} defaults to {p.default!r}, FlashInfer's {default!r}"


@pytest.mark.parametrize("name, init, plan, kv_args", [
    ("BatchPrefillWithPagedKVCacheWrapper", PAGED_INIT, PAGED_PLAN, ["paged_kv_cache"]),
    ("BatchPrefillWithRaggedKVCacheWrapper", RAGGED_INIT, RAGGED_PLAN, ["k", "v"]),
])
def test_wrapper_signatures_follow_flashinfer(name, init, plan, kv_args):
    cls = getattr(fij, name)
    assert name in fij.__all__
    _assert_leading(_params(cls.__init__), init, f"{name}.__init__")
    plan_params = _params(cls.plan)
    _assert_leading(plan_params, plan, f"{name}.plan")
    by_name = {p.name: p for p in plan_params}
    for extra, default in (("fixed_split_size", None), ("disable_split_kv", False), ("mask_indptr", None)):
        assert extra in by_name and by_name[extra].default == default, f"{name}.plan: {extra}={default!r}"
    run_params = _params(cls.run)
    assert [p.name for p in run_params[: 1 + len(kv_args)]] == ["q", *kv_args], f"{name}.run"
    by_name = {p.name: p for p in run_params}
    for kw, default in RUN_KEYWORDS:
        assert kw in by_name and by_name[kw].default == default, f"{name}.run: {kw}={default!r}"
        assert by_name[kw].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def test_single_prefill_signature_follows_flashinfer():
    assert "single_prefill_with_kv_cache" in fij.__all__
    _assert_leading(_params(fij.single_prefill_with_kv_cache, False), SINGLE, "single_prefill_with_kv_cache")


# --- plan() argument checks (no GPU: they fire before anything touches it) --------------------------
CPU_HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128)


def _cpu(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cpu_workspace() -> torch.Tensor:
    return torch.empty(1 << 20, dtype=torch.uint8)


def _paged_args(qo_lens, kv_lens, page_size: int = 16) -> dict:
    """plan()'s leading arguments for these lengths, CSR on the host."""
    pages = [-(-n // page_size) for n in kv_lens]
    return dict(qo_indptr=_cpu(list(itertools.accumulate(qo_lens, initial=0))),
                paged_kv_indptr=_cpu(list(itertools.accumulate(pages, initial=0))),
                paged_kv_indices=_cpu(list(range(sum(pages)))),
                paged_kv_last_page_len=_cpu([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)]),
                page_size=page_size)


def _ragged_args(qo_lens, kv_lens) -> dict:
    return dict(qo_indptr=_cpu(list(itertools.accumulate(qo_lens, initial=0))),
                kv_indptr=_cpu(list(itertools.accumulate(kv_lens, initial=0))))


def _plan(source: str, args: dict, **kwargs):
    """plan() of a fresh wrapper on a CPU workspace."""
    if source == "paged":
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD")
    else:
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD")
    return wrapper.plan(**args, **{**CPU_HEADS, **kwargs})


def _args(source: str, qo_lens=(3, 5), kv_lens=(10, 20)) -> dict:
    return _paged_args(qo_lens, kv_lens) if source == "paged" else _ragged_args(qo_lens, kv_lens)


SOURCES = ["paged", "ragged"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("bad", [[0, 5, 3, 8], [1, 5, 8], [0, 3, 8, 8, 2]], ids=["not_monotone", "not_from_0", "falls"])
def test_plan_rejects_a_bad_qo_indptr(source, bad):
    args = _args(source, (3, 5, 0, 4), (10, 20, 5, 9)) if len(bad) == 5 else _args(source)
    args["qo_indptr"] = _cpu(bad)
    with pytest.raises(ValueError, match="qo_indptr"):
        _plan(source, args)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("bad", [[0, 2, 1], [1, 2, 3]], ids=["not_monotone", "not_from_0"])
def test_plan_rejects_a_bad_kv_indptr(source, bad):
    args = _args(source)
    if source == "paged":
        args["paged_kv_indptr"] = _cpu(bad)
    else:
        args["kv_indptr"] = _cpu([0, 20, 10] if bad[0] == 0 else [1, 11, 31])
    with pytest.raises(ValueError, match="kv_indptr"):
        _plan(source, args)


@pytest.mark.parametrize("source", SOURCES)
def test_plan_rejects_indptrs_of_other_batch_sizes(source):
    args = _args(source)
    if source == "paged":
        args["paged_kv_indptr"] = _cpu([0, 1, 2, 3])
        args["paged_kv_indices"] = _cpu([0, 1, 2])
        args["paged_kv_last_page_len"] = _cpu([10, 4, 4])
    else:
        args["kv_indptr"] = _cpu([0, 10, 20, 30])
    with pytest.raises(ValueError, match="indptr|batch"):
        _plan(source, args)


@pytest.mark.parametrize("source", SOURCES)
def test_plan_takes_causal_with_fewer_keys_than_queries(source):
    """0 < kv_len < qo_len with causal plans (FlashInfer's semantics; the rows that see no key
    are checked on a GPU: test_causal_rows_that_see_no_key)."""
    _plan(source, _args(source, (3, 5, 2), (10, 4, 0)), causal=True)


@pytest.mark.parametrize("source", SOURCES)
def test_plan_rejects_a_packed_mask_without_mask_indptr(source):
    """Batch > 1: where each request's bits start is not guessed."""
    shapes = [(3, 10), (5, 20)]
    masks = [torch.ones(m, n, dtype=torch.bool) for m, n in shapes]
    flat = torch.cat([mk.reshape(-1) for mk in masks])
    packed, _ = segment_packbits_ref(flat, _cpu([0, 30, 130]), "little")
    with pytest.raises(ValueError, match="mask_indptr"):
        _plan(source, _args(source), packed_custom_mask=packed)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("what", ["short_packed", "element_indptr", "short_bool", "long_bool"])
def test_plan_rejects_custom_masks_of_the_wrong_length(source, what):
    shapes = [(3, 10), (5, 20)]
    flat = torch.ones(sum(m * n for m, n in shapes), dtype=torch.bool)
    packed, byte_indptr = segment_packbits_ref(flat, _cpu([0, 30, 130]), "little")  # bytes [0, 4, 17]
    if what == "short_packed":
        kwargs, match = dict(packed_custom_mask=packed[:-2], mask_indptr=byte_indptr), "packed_custom_mask|mask_indptr"
    elif what == "element_indptr":  # elements where bytes are meant
        kwargs, match = dict(packed_custom_mask=packed, mask_indptr=_cpu([0, 30, 130])), "packed_custom_mask|mask_indptr"
    elif what == "short_bool":
        kwargs, match = dict(custom_mask=flat[:-1]), "custom_mask"
    else:
        kwargs, match = dict(custom_mask=torch.ones(flat.numel() + 8, dtype=torch.bool)), "custom_mask"
    with pytest.raises(ValueError, match=match):
        _plan(source, _args(source), **kwargs)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dims", [(64, 128), (128, 64), (96, 96), (192, 192), (256, 128), (448, 256), (512, 256)])
def test_plan_rejects_unsupported_head_dims(source, dims):
    with pytest.raises(ValueError, match="head_dim"):
        _plan(source, _args(source), head_dim_qk=dims[0], head_dim_vo=dims[1])


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("heads", [(12, 8), (32, 3), (8, 16)])
def test_plan_rejects_heads_not_a_multiple(source, heads):
    with pytest.raises(ValueError, match="num_qo_heads|num_kv_heads"):
        _plan(source, _args(source), num_qo_heads=heads[0], num_kv_heads=heads[1])


@pytest.mark.parametrize("source", SOURCES)
def test_plan_rejects_rope_at_head_dim_192(source):
    with pytest.raises(ValueError, match="pos_encoding|ROPE"):
        _plan(source, _args(source), head_dim_qk=192, head_dim_vo=128, pos_encoding_mode="ROPE_LLAMA")


@pytest.mark.parametrize("source", SOURCES)
def test_plan_rejects_an_unknown_pos_encoding_mode(source):
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        _plan(source, _args(source), pos_encoding_mode="ROPE_SOMETHING")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arg", ["q_data_type", "o_data_type"])
def test_plan_rejects_unsupported_dtypes(source, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        _plan(source, _args(source), **{arg: torch.float32})


def test_ragged_plan_rejects_fp8_kv():
    with pytest.raises((ValueError, TypeError), match="kv_data_type|fp8|float8"):
        _plan("ragged", _args("ragged"), q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)


def test_paged_plan_rejects_a_page_size_of_0():
    args = _args("paged")
    args["page_size"] = 0
    with pytest.raises(ValueError, match="page_size"):
        _plan("paged", args)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_paged_plan_rejects_sort_pages_not_a_bool(value):
    with pytest.raises(ValueError, match="sort_pages"):
        _plan("paged", _args("paged"), sort_pages=value)


@pytest.mark.parametrize("name", ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"])
def test_fa3_backend_is_a_clear_error(name):
    """backend="fa3" (the Hopper path) on a CPU workspace: a ValueError naming it from plan()
    (it runs on sm_90 GPUs; paged K/V are not on it yet); an unknown backend names `backend`."""
    source = "paged" if "Paged" in name else "ragged"
    with pytest.raises(ValueError, match=r"(?i)fa3|hopper"):
        getattr(fij, name)(_cpu_workspace(), "NHD", backend="fa3").plan(**_args(source), **CPU_HEADS)
    with pytest.raises(ValueError, match="backend"):
        getattr(fij, name)(_cpu_workspace(), "NHD", backend="no-such-backend").plan(**_args(source), **CPU_HEADS)


def test_cuda_graph_plan_rejects_more_requests_than_the_buffers_hold():
    capacity = 4
    wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(
        _cpu_workspace(), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32),
        paged_kv_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32),
        paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32),
        paged_kv_last_page_len_buf=torch.zeros(capacity, dtype=torch.int32))
    with pytest.raises(ValueError, match="qo_indptr|batch|capacity"):
        wrapper.plan(**_paged_args([2] * (capacity + 1), [20] * (capacity + 1)), **CPU_HEADS)
    with pytest.raises(ValueError, match="paged_kv_indices"):  # 4 requests of 20 pages: 80 page ids > 64
        wrapper.plan(**_paged_args([2] * capacity, [320] * capacity), **CPU_HEADS)


# --- multi-item scoring -----------------------------------------------------------------------------
def _items_dense_mask(token_pos: list, prefix_len: int, qo_len: int, kv_len: int) -> torch.Tensor:
    """FlashInfer's test reference for multi-item scoring, written from its rules: the tokens
    past the prefix are items separated by delimiters (position 0); a delimiter sees the
    prefix only, an item token the prefix and its own item's tokens up to itself (causal).
    Rows are the request's qo_len last positions; the query rows inside the prefix (if any)
    are plain causal."""
    pos = torch.arange(kv_len - qo_len, kv_len)
    keys = torch.arange(kv_len)
    rows = []
    for p in pos.tolist():
        if p < prefix_len:
            rows.append(keys <= p)
            continue
        t = token_pos[p - prefix_len]
        delim = [i for i in range(prefix_len, p + 1) if token_pos[i - prefix_len] == 0]
        start = max(delim) if delim else prefix_len  # the delimiter opening this item
        own = (keys > start) & (keys <= p) if t > 0 else torch.zeros(kv_len, dtype=torch.bool)
        rows.append((keys < prefix_len) | own)
    return torch.stack(rows) if rows else torch.zeros(0, kv_len, dtype=torch.bool)


# FlashInfer's two cases (test_batch_prefill_with_paged_kv_cache_multi_item_scoring): (kv_len,
# qo_len, prefix_len, token positions, entries a request, max item length)
FI_MULTI_ITEM = [(54, 37, 17, list(range(17)) + list(range(19)) + [0], 100, 18),
                 (97, 81, 16, list(range(80)) + [0], 97, 79)]


def _random_items(rnd: random.Random, prefix: int, tail: int) -> list:
    out = []
    while len(out) < tail:
        out += [0] + list(range(1, rnd.randint(1, 30) + 1))
    return out[:tail]


def test_multi_item_mask_is_flashinfers():
    """The mask plan() builds from prefix_len_ptr / token_pos_in_items_ptr (FlashInfer's
    kernel rule: past the prefix, key j is seen when j < prefix_len or pos < j + t) equals
    FlashInfer's test reference (delimiters, items, the prefix), on its two cases and random
    batches of one to four requests, the query rows starting inside the prefix too."""
    from flashinfer_jit.prefill.wrapper import multi_item_mask

    rnd = random.Random(5)
    cases = [[c[:4]] for c in FI_MULTI_ITEM]
    for _ in range(20):
        batch = []
        for _ in range(rnd.randint(1, 4)):
            prefix, tail = rnd.randint(0, 40), rnd.randint(0, 90)
            kv = prefix + tail
            qo = rnd.randint(0, kv)
            batch.append((kv, qo, prefix, _random_items(rnd, prefix, tail)))
        cases.append(batch)
    for batch in cases:
        width = max(len(b[3]) for b in batch) + 3
        flat = np.zeros(width * len(batch), dtype=np.int64)
        for i, (_, _, _, tp) in enumerate(batch):
            flat[i * width: i * width + len(tp)] = tp
        got = multi_item_mask(np.array([b[1] for b in batch]), np.array([b[0] for b in batch]),
                              np.array([b[2] for b in batch]), flat, width)
        want = torch.cat([_items_dense_mask(tp, p, q, k).reshape(-1) for k, q, p, tp in batch])
        assert torch.equal(torch.from_numpy(got), want), batch


@pytest.mark.parametrize("change, match", [
    (dict(token_pos_in_items_ptr=None), "prefix_len_ptr and token_pos_in_items_ptr"),
    (dict(prefix_len_ptr=[17, 3]), "prefix_len_ptr: expected one prefix length a request"),
    (dict(prefix_len_ptr=[60]), "prefix_len_ptr: request 0's prefix 60"),
    (dict(token_pos_in_items_ptr=list(range(10))), "token_pos_in_items_ptr: 10 entries"),
    (dict(token_pos_in_items_len=-1), "token_pos_in_items_len"),
    (dict(token_pos_in_items_ptr=[-1] * 40), "token_pos_in_items_ptr: expected positions >= 0"),
    (dict(max_item_len_ptr=[1, 2]), "max_item_len_ptr"),
])
def test_multi_item_arguments_are_checked(change, match):
    """plan()'s multi-item arguments are checked before anything is planned (CPU wrapper)."""
    kv_len, qo_len, prefix, tp, width, max_item = FI_MULTI_ITEM[0]
    args = dict(prefix_len_ptr=[prefix], token_pos_in_items_ptr=tp, token_pos_in_items_len=width,
                max_item_len_ptr=[max_item])
    args.update(change)
    args = {k: (torch.tensor(v, dtype=torch.int64) if isinstance(v, list) else v) for k, v in args.items()}
    w = fij.BatchPrefillWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8), "NHD")
    pages = -(-kv_len // 16)
    with pytest.raises(ValueError, match=match):
        w.plan(torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
               torch.arange(pages, dtype=torch.int32), torch.tensor([kv_len - (pages - 1) * 16], dtype=torch.int32),
               32, 8, 128, 16, causal=True, q_data_type=torch.bfloat16, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_item_scoring(page_size, workspace):
    """FlashInfer's multi-item scoring (prefix_len_ptr, token_pos_in_items_ptr,
    token_pos_in_items_len, max_item_len_ptr, as its uint32 / uint16 device tensors): its two
    cases and a batch of three requests with random items in one plan, against the float64
    reference with the dense mask of FlashInfer's test reference; outputs poisoned."""
    rnd = random.Random(12 + page_size)
    gen = torch.Generator(device=DEV).manual_seed(12 + page_size)
    batches = [[c[:4]] for c in FI_MULTI_ITEM]
    batches.append([(p + t, q, p, _random_items(rnd, p, t)) for p, t, q in ((300, 120, 120), (40, 700, 500),
                                                                            (0, 64, 64))])
    for batch in batches:
        shapes = [(q, k) for k, q, _, _ in batch]
        q, qo_indptr, k_rows, v_rows, kv = base_inputs(shapes, gen, rnd, "csr", page_size=page_size)
        width = max(len(b[3]) for b in batch)
        flat = torch.zeros(width * len(batch), dtype=torch.int64)
        for i, (_, _, _, tp) in enumerate(batch):
            flat[i * width: i * width + len(tp)] = torch.tensor(tp)
        maxlen = [max([t for t in b[3]] or [0]) for b in batch]
        _, result = run_base(workspace, shapes, q, qo_indptr, kv, True, page_size=page_size,
                             prefix_len_ptr=torch.tensor([b[2] for b in batch]).to(torch.uint32).to(DEV),
                             token_pos_in_items_ptr=flat.to(torch.uint16).to(DEV), token_pos_in_items_len=width,
                             max_item_len_ptr=torch.tensor(maxlen).to(torch.uint16).to(DEV))
        masks = [_items_dense_mask(tp, p, qq, k).to(DEV) for k, qq, p, tp in batch]
        ref_out, ref_lse = reference(q, qo_indptr, kv, **mask_args(masks, shapes, False))
        check_prefill(*result, ref_out, ref_lse, shapes, tolerance(BF16))
