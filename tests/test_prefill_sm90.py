"""Batch and single prefill on the Hopper path (backend="fa3": sm_90a, wgmma / TMA, warp-specialized,
persistent), against the float64 reference (flashinfer_jit/reference/prefill.py prefill_ref) and
against backend="fa2" (the mma.sync kernels) on the same inputs.

What the Hopper path supports in its first version, and so what is checked here: ragged K/V
(BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache), q and K/V float16 or
bfloat16 (one dtype, the output q's), head_dim 64 or 128, causal or not (bottom-right aligned),
any GQA group, the LSE, q_scale / k_scale / v_scale, sm_scale, requests with qo_len 0 or kv_len 0,
q/k/v with any token and head strides, out= given, and use_cuda_graph=True. What it lacks is a
ValueError at plan() naming the feature; a workspace not on an sm_90 GPU a ValueError naming sm_90.

GPU tests (marked gpu, and skipped unless torch.cuda.get_device_capability() == (9, 0): the
sm90 / hopper_workspace fixtures):
- test_fa3_batch_against_reference: a pairwise grid (CASES, its coverage checked on the CPU by
  test_fa3_cases_cover_every_pair_of_options) of dtype x head_dim x causal x GQA group
  (1, 4, 6, 8) x batch (BATCHES: mixed lengths with qo_len 0 padding, kv_len 0, kv_len < qo_len,
  chunks at the end of longer K/V, long prompts over many 128-row tiles) x LSE asked or not;
- test_fa3_causal_rows_that_see_no_key, test_fa3_padding_requests: kv_len < qo_len with causal
  (exact zeros, LSE -inf) and batches of padding requests, an all-kv_len-0 batch among them;
- test_fa3_matches_fa2: the two backends on the same inputs agree to rounding (tol / 2) and
  each matches the reference;
- test_fa3_strided_qkv: q / K / V slices of a packed qkv buffer, K and V halves of one
  [tokens, Hk, 2D] buffer with a strided q, and head-major [heads, tokens, D] transposed views;
- test_fa3_single_prefill: single_prefill_with_kv_cache(backend="fa3"), NHD and HND;
- test_fa3_long_causal_16k (thorough): 1 x 16384 causal, 32/8 heads, hd128 bf16, against fa2
  in full and a random sample of rows against prefill_ref;
- test_fa3_cuda_graph_replay_after_replan: run() captured once, replayed after plans with fewer
  requests and tokens, padding and kv_len 0 (within the captured capacity); rows past
  qo_indptr[-1] stay untouched;
- test_auto_cuda_graph_replay_across_the_backend_choice: an "auto" CUDA-graph wrapper re-planned
  with a batch that alone would pick the other backend: re-plan refused or replay correct;
- test_auto_picks_the_backend / test_auto_keeps_fa2_where_fa3_lacks_the_feature: planned_backend
  of backend="auto" on sm_90 (mean qo_len >= 64, enough keys a query tile, a supported configuration: "fa3");
- test_fa3_scales: q_scale / k_scale / v_scale per run() and sm_scale per plan();
- test_fa3_run_rejects_sinks_and_windows: run(sinks=) (and run(window_left >= 0)) on an fa3 plan.
Every output is NaN-poisoned (out= / lse= filled with NaN inside SENTINEL rows that must stay
untouched: test_prefill.run_poisoned) and every input fresh torch.randn data; comparisons are
test_prefill's (|out - ref| <= tol * (1 + |ref|), tol by dtype; LSE base 2 as prefill_ref
returns it, within LSE_TOL * max(1, |ref|); rows that see no key exactly 0 with LSE -inf).

CPU tests (no marker; a CPU workspace, as test_prefill.py's plan() checks use): backend="fa3"
with what the Hopper path lacks raises a ValueError naming it (the feature checks come before
the device check); with a supported configuration, a ValueError naming sm_90; backend="auto"
on a CPU workspace plans fa2. And the fa2 modules the default GPU run compares with are in
scripts/matrices/tests (the fa3 modules are not listed here: add them to that matrix with the
Hopper family's spec).
"""

from __future__ import annotations

import functools
import itertools
import random
from typing import NamedTuple

import numpy as np
import pytest
import torch
from kv_helpers import DEV, TESTS_MATRIX, dtype_of, randn, replay_poisoned
from test_prefill import (
    KV,
    LLAMA,
    PADDING_BATCHES,
    check_agree,
    check_lse,
    check_out,
    check_prefill,
    indptr_of,
    make_page_table,
    make_q,
    make_rows,
    paged_kv,
    paged_wrapper,
    plan_kv,
    prefill_spec,
    ragged_kv,
    ragged_wrapper,
    reference,
    reference_by_rows,
    run_poisoned,
    tolerance,
    write_rows,
)

import flashinfer_jit as fij
from flashinfer_jit.pipeline.matrix import parse_matrix
from flashinfer_jit.prefill.spec import PrefillSm90Spec
from flashinfer_jit.reference.prefill import prefill_ref, segment_packbits_ref

F16, BF16 = "float16", "bfloat16"
# fa3 against fa2: both round P to 16 bits and sum in float32, in other orders; half the
# tolerance against the float64 reference is still a few output ulps
AGREE_FACTOR = 0.5


# --- the device ------------------------------------------------------------------------------------
@pytest.fixture
def sm90():
    """Skips unless the GPU is an sm_90 (Hopper) one; the gpu marker already skips without a GPU.
    (Checked in the test, not at collection: no CUDA context in the collecting process.)"""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("backend='fa3' (wgmma, TMA) needs an sm_90 device")


@pytest.fixture
def hopper_workspace(sm90, workspace):
    """conftest's module workspace (128 MB on the GPU), on an sm_90 device only."""
    return workspace


# --- the pairwise grid ---------------------------------------------------------------------------
class Case(NamedTuple):
    dtype: str
    head_dim: int
    causal: bool
    heads: tuple          # (num_qo_heads, num_kv_heads): groups 1, 4, 8 and 6 (not a power of two)
    batch: str            # a key of BATCHES
    lse: bool             # lse= given (and compared), or no LSE asked for


OPTIONS = {
    "dtype": (F16, BF16),
    "head_dim": (64, 128),
    "causal": (False, True),
    "heads": ((8, 8), (32, 8), (32, 4), (24, 4)),
    "batch": ("mixed", "chunks", "long"),
    "lse": (True, False),
}

# (qo_len, kv_len) per request (shuffled per case). Query lengths off the 128-row tile (1, 5, 20,
# 37, 127, 129, 130, 255, 300, 383, 577, 1025, 2049) beside multiples of it.
BATCHES = {
    # padding (qo_len 0, with and without keys), queries without keys (kv_len 0), kv_len < qo_len
    # (causal: the first qo_len - kv_len rows see no key), a decode-like row on long K/V,
    # self-attention, a chunk at the end of its keys
    "mixed": [(37, 37), (0, 50), (300, 1200), (129, 129), (5, 0), (200, 150), (1, 700), (0, 0), (577, 641),
              (128, 128), (20, 5)],
    # chunked prefill: queries at the end of longer K/V (a prefix every row sees), one padding request
    "chunks": [(255, 2048), (64, 1064), (383, 383), (1, 1), (130, 4000), (0, 9), (256, 333)],
    # long prompts over many tiles and K/V stages
    "long": [(1025, 1025), (2049, 2049), (127, 300), (768, 897)],
}

# A covering array of OPTIONS (every pair of option values in some case, and every
# dtype x head_dim x causal triple: each fa3 module once at least), generated greedily (seed 0)
# over the 12 heads x batch pairs; checked by test_fa3_cases_cover_every_pair_of_options.
CASES = [
    Case(BF16, 64, False, (32, 4), "long", False),
    Case(BF16, 64, True, (32, 8), "mixed", True),
    Case(BF16, 128, False, (32, 4), "mixed", True),
    Case(BF16, 128, False, (32, 8), "chunks", False),
    Case(BF16, 128, True, (8, 8), "chunks", True),
    Case(BF16, 128, True, (24, 4), "long", False),
    Case(F16, 64, False, (8, 8), "mixed", False),
    Case(F16, 64, False, (24, 4), "chunks", True),
    Case(F16, 64, True, (32, 8), "long", True),
    Case(F16, 128, False, (24, 4), "mixed", False),
    Case(F16, 128, True, (8, 8), "long", False),
    Case(F16, 128, True, (32, 4), "chunks", True),
]


def case_id(i: int, c: Case) -> str:
    short = {F16: "f16", BF16: "bf16"}[c.dtype]
    return (f"{i:02d}-{short}-hd{c.head_dim}-{'causal' if c.causal else 'none'}-{c.heads[0]}x{c.heads[1]}-{c.batch}"
            + ("-lse" if c.lse else ""))


# --- inputs and runs -----------------------------------------------------------------------------
def ragged_inputs(shapes, heads, head_dim: int, dtype: torch.dtype, gen, host: bool = True, q_scale: float = 1.0):
    """(q, qo_indptr, k_rows, v_rows, kv) for ragged K/V: fresh random q [tokens, Hq, D] (times
    q_scale: larger logits move the running max across K/V tiles) and K/V rows [kv_tokens, Hk, D];
    the indptrs on the host or the device."""
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, heads[1], (head_dim, head_dim), dtype, gen)
    kv = ragged_kv(k_rows, v_rows, kv_lens, host_indptr=host)
    q = make_q(sum(qo_lens), heads[0], head_dim, dtype, gen, q_scale)
    return q, indptr_of(qo_lens, "cpu" if host else DEV), k_rows, v_rows, kv


def fa3_wrapper(workspace, **kwargs):
    return ragged_wrapper(workspace, backend="fa3", **kwargs)


def plan_and_run(workspace, backend: str, shapes, q, qo_indptr, kv, heads, head_dim: int, dtype: torch.dtype,
                 causal: bool, return_lse: bool = True, run_kwargs: dict | None = None, **plan_kwargs):
    """A ragged wrapper of `backend`, planned (checking planned_backend) and run into poisoned
    outputs. -> (out, lse or None)."""
    wrapper = ragged_wrapper(workspace, backend=backend)
    plan_kv(wrapper, qo_indptr, kv, *heads, (head_dim, head_dim), causal=causal, q_data_type=dtype, **plan_kwargs)
    assert wrapper.planned_backend == backend, f"backend={backend!r} planned {wrapper.planned_backend!r}"
    return run_poisoned(wrapper, q, kv, head_dim, dtype, return_lse, **(run_kwargs or {}))


# --- the grid and the edge lengths ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(i, c) for i, c in enumerate(CASES)])
def test_fa3_batch_against_reference(index, hopper_workspace):
    case = CASES[index]
    rnd = random.Random(index)
    gen = torch.Generator(device=DEV).manual_seed(900 + index)
    dtype = dtype_of(case.dtype)
    shapes = list(BATCHES[case.batch])
    rnd.shuffle(shapes)
    host = index % 2 == 0  # index tensors on the host or on the device
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, case.heads, case.head_dim, dtype, gen, host,
                                                     q_scale=(1.0, 3.0)[index % 2])
    wrapper = fa3_wrapper(hopper_workspace)
    plan_kv(wrapper, qo_indptr, kv, *case.heads, (case.head_dim, case.head_dim), causal=case.causal,
            q_data_type=case.dtype if host else dtype, o_data_type=None if index % 3 else dtype)
    assert wrapper.planned_backend == "fa3"
    out, lse = run_poisoned(wrapper, q, kv, case.head_dim, dtype, case.lse)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, case.causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal, ramp", [(128, True, "up"), (128, False, "steps"), (256, True, "steps"),
                                                    (64, False, "up")])
def test_fa3_running_max_that_grows(head_dim, causal, ramp, hopper_workspace):
    """The softmax keeps a row's old max until a key tile's logits exceed it by more than
    kStaleLog2 (8, log2 units), and skips O's rescale where none of a warp's rows moved: keys
    whose logits grow along the sequence, smoothly ("up": K row j times 0.25 + 6 j / kv_len,
    logits from about +-2 to +-50) or in jumps every 300 keys ("steps": times 1, 3, 9, 1, 9),
    so tiles move the max by less and by more than the threshold, against the float64
    reference; the LSE checks the kept max and the sums agree."""
    gen = torch.Generator(device=DEV).manual_seed(47 + head_dim)
    shapes = [(128, 2000), (300, 1500), (64, 900), (1, 1200), (200, 200)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (head_dim, head_dim), torch.bfloat16, gen)
    factors = []
    for n in kv_lens:
        j = torch.arange(n, device=DEV, dtype=torch.float32)
        factors.append(0.25 + 6.0 * j / n if ramp == "up" else
                       torch.tensor([1.0, 3.0, 9.0, 1.0, 9.0], device=DEV)[(j // 300).long().clamp(max=4)])
    k_rows = (k_rows.float() * torch.cat(factors)[:, None, None]).to(torch.bfloat16)
    kv = ragged_kv(k_rows, v_rows, kv_lens, host_indptr=True)
    q = make_q(sum(qo_lens), LLAMA[0], head_dim, torch.bfloat16, gen, 2.0)
    out, lse = plan_and_run(hopper_workspace, "fa3", shapes, q, indptr_of(qo_lens, "cpu"), kv, LLAMA, head_dim,
                            torch.bfloat16, causal)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fa3_causal_rows_that_see_no_key(head_dim, hopper_workspace):
    """Causal with kv_len < qo_len, as prefill_ref and the fa2 kernels define it (bottom-right
    aligned; test_prefill.py test_causal_rows_that_see_no_key): the first qo_len - kv_len rows
    see no key and give exact zeros and LSE -inf, no NaN; whole 128-row tiles above the diagonal
    (300 rows on 64 keys, 129 rows on one key) beside ordinary requests."""
    gen = torch.Generator(device=DEV).manual_seed(31 + head_dim)
    shapes = [(20, 5), (7, 7), (300, 64), (0, 3), (129, 1), (64, 2000), (5, 0), (200, 150), (384, 130)]
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, head_dim, torch.bfloat16, gen)
    out, lse = plan_and_run(hopper_workspace, "fa3", shapes, q, qo_indptr, kv, LLAMA, head_dim, torch.bfloat16, True)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))
    first = 0
    for m, n in shapes:  # (check_prefill: exact zeros where the reference's LSE is -inf)
        blind = max(0, m - n) if n > 0 else m
        assert bool(torch.isneginf(lse[first:first + blind]).all()), (m, n)
        assert bool(torch.isfinite(lse[first + blind:first + m]).all()), (m, n)
        first += m


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, dtype", [(128, BF16), (128, F16), (64, BF16)], ids=["hd128-bf16", "hd128-f16",
                                                                                  "hd64-bf16"])
def test_fa3_causal_diagonal_offsets(head_dim, dtype, hopper_workspace):
    """Causal masks with the diagonal at every offset from a key tile's and a consumer
    warpgroup's start (kv_len - qo_len of 0, 1, 63, 64, 65, 127, 128, 129, 191, 255 and 1000):
    items of one key tile and of several, a request shorter than a warpgroup's 64 rows, tiles
    a warpgroup sees only in part or not at all, against the float64 reference with poisoned
    outputs. (Written for the causal half tiles, an A/B that was not kept: docs/history/hopper.md.)"""
    gen = torch.Generator(device=DEV).manual_seed(77 + head_dim)
    shapes = [(m, m + off) for m, off in ((256, 0), (256, 1), (130, 63), (200, 64), (64, 65), (300, 127), (129, 128),
                                          (1, 129), (192, 191), (383, 255), (40, 1000), (512, 0))]
    torch_dtype = getattr(torch, dtype)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, head_dim, torch_dtype, gen)
    out, lse = plan_and_run(hopper_workspace, "fa3", shapes, q, qo_indptr, kv, LLAMA, head_dim, torch_dtype, True)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("batch", sorted(PADDING_BATCHES))
def test_fa3_padding_requests(batch, causal, hopper_workspace):
    """test_prefill.py's padding batches (requests with qo_len 0, kv_len 0 or both; "no_keys":
    no request has a key, K and V have no rows): rows without keys are zeros with LSE -inf, no
    NaN anywhere, nothing written outside out / lse."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    shapes = PADDING_BATCHES[batch]
    q, qo_indptr, _, _, kv = ragged_inputs(shapes, LLAMA, 128, torch.bfloat16, gen)
    out, lse = plan_and_run(hopper_workspace, "fa3", shapes, q, qo_indptr, kv, LLAMA, 128, torch.bfloat16, causal)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))
    no_keys = torch.tensor([n == 0 for m, n in shapes for _ in range(m)], dtype=torch.bool, device=DEV)
    assert bool((out[no_keys] == 0).all()) and bool(torch.isneginf(lse[no_keys]).all())


# --- against fa2 ---------------------------------------------------------------------------------
# (dtype, head_dim, causal) compared with fa2 in the default run: the fa2 modules that
# scripts/matrices/tests already has (test_tests_matrix_has_the_fa2_modules_compared_with); the
# other five build an fa2 module each (~40 s of nvcc): thorough.
FA2_DEFAULT = [(BF16, 128, False), (BF16, 128, True), (BF16, 64, False)]


def fa2_params():
    for dtype, head_dim, causal in itertools.product((F16, BF16), (64, 128), (False, True)):
        marks = () if (dtype, head_dim, causal) in FA2_DEFAULT else (pytest.mark.thorough,)
        yield pytest.param(dtype, head_dim, causal, marks=marks,
                           id=f"{dtype}-hd{head_dim}-{'causal' if causal else 'none'}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,causal", list(fa2_params()))
def test_fa3_matches_fa2(dtype, head_dim, causal, hopper_workspace):
    """backend="fa3" and backend="fa2" on the same inputs (the mixed batch, GQA-4): each matches
    the reference, and they agree with each other to rounding (AGREE_FACTOR x the tolerance)."""
    gen = torch.Generator(device=DEV).manual_seed(41 + head_dim + causal)
    torch_dtype = dtype_of(dtype)
    shapes = BATCHES["mixed"]
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, head_dim, torch_dtype, gen, q_scale=2.0)
    results = [plan_and_run(hopper_workspace, backend, shapes, q, qo_indptr, kv, LLAMA, head_dim, torch_dtype, causal)
               for backend in ("fa3", "fa2")]
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    tol = tolerance(torch_dtype)
    for out, lse in results:
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*results[0], *results[1], shapes, tol * AGREE_FACTOR, "fa3", "fa2")


# --- strides -------------------------------------------------------------------------------------
def _strided_inputs(layout: str, gen):
    """(shapes, heads, head_dim, dtype, causal, q, k_rows, v_rows) with q / K / V as views that are
    not contiguous (last dimension contiguous, every other stride a multiple of 16 bytes)."""
    if layout == "qkv_packed":  # one [tokens, Hq + 2 Hk, D] projection output: self-attention
        shapes, heads, d, dtype, causal = [(300, 300), (0, 0), (129, 129), (1, 1), (700, 700)], LLAMA, 128, \
            torch.bfloat16, True
        tokens = sum(m for m, _ in shapes)
        buf = randn((tokens, heads[0] + 2 * heads[1], d), dtype, gen)
        q, k, v = buf[:, :heads[0]], buf[:, heads[0]:heads[0] + heads[1]], buf[:, heads[0] + heads[1]:]
    elif layout == "kv_halves":  # K and V halves of one [kv_tokens, Hk, 2D] buffer; q a slice of [T, Hq + 1, D]
        shapes, heads, d, dtype, causal = BATCHES["mixed"], (32, 4), 64, torch.float16, False
        k, v = make_rows([n for _, n in shapes], heads[1], (d, d), dtype, gen, form="halves")
        q = make_q(sum(m for m, _ in shapes), heads[0], d, dtype, gen, strided=True)
    else:  # "heads_major": [heads, tokens, D] transposed (token stride D, head stride tokens x D)
        shapes, heads, d, dtype, causal = BATCHES["chunks"], (24, 4), 128, torch.bfloat16, True
        qo_tokens, kv_tokens = sum(m for m, _ in shapes), sum(n for _, n in shapes)
        q = randn((heads[0], qo_tokens, d), dtype, gen).transpose(0, 1)
        k = randn((heads[1], kv_tokens, d), dtype, gen).transpose(0, 1)
        v = randn((heads[1], kv_tokens, d), dtype, gen).transpose(0, 1)
    return shapes, heads, d, dtype, causal, q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["qkv_packed", "kv_halves", "heads_major"])
def test_fa3_strided_qkv(layout, hopper_workspace):
    """q, K and V as strided views (the Hopper path's TMA descriptors take the strides; no
    hidden copy is asked for), out= given (poisoned), against the reference."""
    gen = torch.Generator(device=DEV).manual_seed(61)
    shapes, heads, d, dtype, causal, q, k_rows, v_rows = _strided_inputs(layout, gen)
    for name, t in (("q", q), ("k", k_rows), ("v", v_rows)):
        assert not t.is_contiguous() and t.stride(-1) == 1, f"{layout}: {name} should be a strided view"
    kv = ragged_kv(k_rows, v_rows, [n for _, n in shapes])
    qo_indptr = indptr_of([m for m, _ in shapes], "cpu")
    out, lse = plan_and_run(hopper_workspace, "fa3", shapes, q, qo_indptr, kv, heads, d, dtype, causal)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(dtype))


# --- single prefill ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_fa3_single_prefill(kv_layout, sm90):
    """single_prefill_with_kv_cache(backend="fa3"), K/V NHD or HND (HND: a transposed view
    reaches the kernel), causal or not, kv_len > qo_len, == and (causal) <; with return_lse and
    without, against the reference."""
    gen = torch.Generator(device=DEV).manual_seed(71)
    for dtype, head_dim, heads, causal, m, n in ((torch.bfloat16, 128, LLAMA, True, 300, 1000),
                                                 (torch.float16, 64, (16, 16), False, 257, 257),
                                                 (torch.bfloat16, 128, (32, 4), True, 500, 200),
                                                 (torch.float16, 128, (8, 1), False, 129, 4000)):
        q = make_q(m, heads[0], head_dim, dtype, gen)
        k, v = make_rows([n], heads[1], (head_dim, head_dim), dtype, gen)
        k_in, v_in = (k, v) if kv_layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
        shapes = [(m, n)]
        out, lse = fij.single_prefill_with_kv_cache(q, k_in, v_in, causal=causal, kv_layout=kv_layout,
                                                    backend="fa3", return_lse=True)
        assert out.shape == (m, heads[0], head_dim) and out.dtype == dtype and lse.shape == (m, heads[0])
        ref_out, ref_lse = prefill_ref(q, indptr_of([m]), k, v, indptr_of([n]), causal=causal)
        check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(dtype))
        plain = fij.single_prefill_with_kv_cache(q, k_in, v_in, causal=causal, kv_layout=kv_layout, backend="fa3")
        assert isinstance(plain, torch.Tensor)
        check_out(plain, ref_out, shapes, tolerance(dtype))


# --- one long request ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.thorough
def test_fa3_long_causal_16k(hopper_workspace):
    """One causal request of 16384 tokens, 32/8 heads, head_dim 128, bf16 (the benchmark's
    shape): fa3 against fa2 on every row (to rounding), and 160 rows (random, and the tile edges
    and the ends) against the float64 reference, a row at a time (row i sees keys 0..i)."""
    n, heads = 16384, LLAMA
    rnd = random.Random(16)
    gen = torch.Generator(device=DEV).manual_seed(16)
    shapes = [(n, n)]
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, heads, 128, torch.bfloat16, gen)
    fa3 = plan_and_run(hopper_workspace, "fa3", shapes, q, qo_indptr, kv, heads, 128, torch.bfloat16, True)
    fa2 = plan_and_run(hopper_workspace, "fa2", shapes, q, qo_indptr, kv, heads, 128, torch.bfloat16, True)
    tol = tolerance(BF16)
    check_agree(*fa3, *fa2, shapes, tol * AGREE_FACTOR, "fa3", "fa2")
    rows = sorted(set(rnd.sample(range(n), 144)) | {0, 1, 63, 64, 127, 128, 129, 4095, 8191, 8192, 16255, 16256,
                                                   n - 2, n - 1})
    refs = [prefill_ref(q[i:i + 1], indptr_of([1]), k_rows[:i + 1], v_rows[:i + 1], indptr_of([i + 1]), causal=True)
            for i in rows]
    ref_out, ref_lse = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
    sample = torch.tensor(rows, device=DEV)
    picked = [(len(rows), n)]  # (the rows as one request, for the failure messages)
    check_out(fa3[0][sample], ref_out, picked, tol, "fa3 sampled rows")
    check_lse(fa3[1][sample], ref_lse, picked, "fa3 sampled rows' lse")


# --- CUDA graphs ---------------------------------------------------------------------------------
def _partition(total: int, parts: int, rnd: random.Random) -> list[int]:
    cuts = sorted(rnd.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _graph_wrapper(workspace, capacity: int, backend: str):
    return ragged_wrapper(workspace, use_cuda_graph=True, backend=backend,
                          qo_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
                          kv_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV))


class _Static(NamedTuple):
    """A CUDA graph's fixed tensors: q [max_q, Hq, D], K/V [max_kv, Hk, D], out, lse (NaN)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def make(cls, max_q: int, max_kv: int, heads, d: int, gen):
        dt = torch.bfloat16
        return cls(randn((max_q, heads[0], d), dt, gen), randn((max_kv, heads[1], d), dt, gen),
                   randn((max_kv, heads[1], d), dt, gen),
                   torch.full((max_q, heads[0], d), float("nan"), dtype=dt, device=DEV),
                   torch.full((max_q, heads[0]), float("nan"), dtype=torch.float32, device=DEV))

    def refill(self, gen) -> None:
        """New inputs copied into the captured tensors (an engine's next step)."""
        for t in (self.q, self.k, self.v):
            t.copy_(randn(t.shape, t.dtype, gen))

    def run(self, wrapper):
        return wrapper.run(self.q, self.k, self.v, out=self.out, lse=self.lse, return_lse=True)


def _plan_graph_round(wrapper, shapes, heads, causal: bool) -> None:
    wrapper.plan(indptr_of([m for m, _ in shapes], "cpu"), indptr_of([n for _, n in shapes], "cpu"),
                 num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim_qk=128, causal=causal,
                 q_data_type=torch.bfloat16)


def _check_graph_round(static: _Static, shapes, causal: bool) -> None:
    """The live rows against the reference; the rows past qo_indptr[-1] still NaN."""
    rows = sum(m for m, _ in shapes)
    kv_rows = sum(n for _, n in shapes)
    ref_out, ref_lse = reference_by_rows(static.q[:rows], shapes, static.k[:kv_rows], static.v[:kv_rows], causal)
    check_prefill(static.out[:rows], static.lse[:rows], ref_out, ref_lse, shapes, tolerance(BF16))
    assert bool(static.out[rows:].isnan().all()) and bool(static.lse[rows:].isnan().all()), \
        "rows past qo_indptr[-1] were written"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_fa3_cuda_graph_replay_after_replan(causal, hopper_workspace):
    """use_cuda_graph=True, backend="fa3": run() captured once (8 requests, 1024 query tokens),
    then plan() with other lengths (fewer requests and tokens; one long K/V; padding and
    kv_len 0; one token), new inputs copied into the captured q / K / V, replay: the live rows
    match the reference, the rows past them stay untouched; a plan() with more requests than
    the buffers hold is an error."""
    capacity, max_q, max_kv, heads = 8, 1024, 8192, LLAMA
    rnd = random.Random(13)
    gen = torch.Generator(device=DEV).manual_seed(13)
    wrapper = _graph_wrapper(hopper_workspace, capacity, "fa3")
    static = _Static.make(max_q, max_kv, heads, 128, gen)
    rounds = [
        [(m, m + rnd.randint(0, 500)) for m in _partition(max_q, capacity, rnd)],
        [(1, 6000), (300, 300), (0, 50), (250, 1200), (49, 66)],
        [(0, 0), (200, 200), (17, 0)],
        [(1, 1)],
        [(127, 127)] * capacity,  # the full capacity again
    ]
    graph = None
    for shapes in rounds:
        assert len(shapes) <= capacity and sum(m for m, _ in shapes) <= max_q and sum(n for _, n in shapes) <= max_kv
        _plan_graph_round(wrapper, shapes, heads, causal)
        assert wrapper.planned_backend == "fa3"
        static.refill(gen)
        graph = replay_poisoned(graph, lambda: static.run(wrapper), static.out, static.lse)
        _check_graph_round(static, shapes, causal)
    with pytest.raises(ValueError, match="qo_indptr|batch|capacity|captured"):
        _plan_graph_round(wrapper, [(1, 10)] * (capacity + 1), heads, causal)


def _widened(paged, layout: str, width: int):
    """make_page_table's block table padded to `width` columns with its spare page id."""
    from flashinfer_jit.runtime.page_table import block_page_table
    bt, seq_lens = paged.plan_args["block_tables"], paged.plan_args["seq_lens"]
    pad = width - bt.shape[-1]
    wide = torch.cat([bt, bt[..., -1:].expand(*bt.shape[:-1], pad)], dim=-1).contiguous()
    args = dict(paged.plan_args, block_tables=wide)
    return paged._replace(table=block_page_table(wide, seq_lens, kv_separate=layout == "block_table_kv_separate"),
                          plan_args=args)


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["csr", "block_table", "block_table_kv_separate"])
def test_fa3_paged_cuda_graph_replay_after_replan(table, hopper_workspace):
    """use_cuda_graph=True, backend="fa3" over one paged cache (pages of 16, NHD): run()
    captured once, then plan() with other requests, lengths and page tables (the page ids
    copied into the wrapper's fixed buffer, whose address the captured launch holds), the
    rounds' K/V written into the cache on fresh random pages, every other slot NaN, new q,
    replay: the live rows match the float64 reference, the rows past them stay NaN."""
    capacity, max_q, page_size, num_pages, heads, causal = 6, 768, 16, 640, LLAMA, True
    rnd = random.Random(29)
    gen = torch.Generator(device=DEV).manual_seed(29)
    k_cache = torch.empty((num_pages, page_size, heads[1], 128), dtype=torch.bfloat16, device=DEV)
    v_cache = torch.empty_like(k_cache)
    q = torch.empty((max_q, heads[0], 128), dtype=torch.bfloat16, device=DEV)
    out = torch.empty((max_q, heads[0], 128), dtype=torch.bfloat16, device=DEV)
    lse = torch.empty((max_q, heads[0]), dtype=torch.float32, device=DEV)
    buffers = dict(paged_kv_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV),
                   paged_kv_last_page_len_buf=torch.zeros(capacity, dtype=torch.int32, device=DEV)) \
        if table == "csr" else {}
    if table == "csr":
        buffers["paged_kv_indices_buf"] = torch.zeros(num_pages, dtype=torch.int32, device=DEV)
    wrapper = paged_wrapper(hopper_workspace, "NHD", use_cuda_graph=True, backend="fa3",
                            qo_indptr_buf=torch.zeros(capacity + 1, dtype=torch.int32, device=DEV), **buffers)
    rounds = [
        [(128, 1500), (300, 300), (64, 4000), (200, 900), (1, 33), (75, 75)],
        [(256, 2048), (0, 17), (33, 0)],
        [(512, 5000)],
        [(100, 100)] * capacity,
    ]
    graph = None
    for shapes in rounds:
        qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        paged = make_page_table(table, kv_lens, page_size, num_pages, rnd)
        if table != "csr":  # one table width for every plan (the graph's fixed buffer is the first's)
            paged = _widened(paged, table, width=num_pages // 2)
        k_rows, v_rows = make_rows(kv_lens, heads[1], (128, 128), torch.bfloat16, gen)
        write_rows(k_cache, paged.table, kv_lens, page_size, "NHD", k_rows, 0)
        write_rows(v_cache, paged.table, kv_lens, page_size, "NHD", v_rows, 1)
        kv = KV(((k_cache, v_cache),), k_cache, v_cache, paged.table, paged.plan_args, "NHD")
        rows = sum(qo_lens)
        q[:rows].copy_(make_q(rows, heads[0], 128, torch.bfloat16, gen))
        qo_indptr = indptr_of(qo_lens, "cpu")
        plan_kv(wrapper, qo_indptr, kv, *heads, (128, 128), page_size, causal=causal, q_data_type=torch.bfloat16)
        assert wrapper.planned_backend == "fa3"
        graph = replay_poisoned(graph, lambda: wrapper.run(q, (k_cache, v_cache), out=out, lse=lse, return_lse=True),
                                out, lse)
        ref_out, ref_lse = reference(q[:rows], qo_indptr.to(DEV), kv, causal=causal)
        check_prefill(out[:rows], lse[:rows], ref_out, ref_lse, shapes, tolerance(BF16))
        assert bool(out[rows:].isnan().all()) and bool(lse[rows:].isnan().all()), "rows past qo_indptr[-1] were written"


@pytest.mark.gpu
def test_auto_cuda_graph_replay_across_the_backend_choice(hopper_workspace):
    """backend="auto" with use_cuda_graph=True: the first plan (long prompts) picks fa3 and run()
    is captured; a later plan of 4-token requests (alone: fa2) must not leave the graph replaying
    one backend's kernel on the other's plan. The API leaves open how (the first plan fixing the
    backend, as it fixes fa2's tile; or the re-plan refused): either passes, a wrong replay
    does not."""
    capacity, heads = 8, LLAMA
    gen = torch.Generator(device=DEV).manual_seed(17)
    wrapper = _graph_wrapper(hopper_workspace, capacity, "auto")
    static = _Static.make(2048, 4096, heads, 128, gen)
    # (chunks at the end of longer keys: 876 keys a query tile on average, above auto's 512)
    long_prompts = [(512, 1200), (300, 900), (700, 1100), (129, 800)]
    _plan_graph_round(wrapper, long_prompts, heads, True)
    assert wrapper.planned_backend == "fa3"
    graph = replay_poisoned(None, lambda: static.run(wrapper), static.out, static.lse)
    _check_graph_round(static, long_prompts, True)
    short = [(4, 4 + 9 * i) for i in range(capacity)]
    try:
        _plan_graph_round(wrapper, short, heads, True)
    except ValueError:
        return  # the re-plan refused: allowed
    static.refill(gen)
    replay_poisoned(graph, None, static.out, static.lse)
    _check_graph_round(static, short, True)


# --- backend="auto" ------------------------------------------------------------------------------
# (sm90.AUTO_MIN_MEAN_QO_LEN 64 query tokens a request and AUTO_MIN_KEYS[128] = 192 keys a
# query tile, on average: 627 for long_prompts, 1024 for the two 1024-key batches, 192 for
# few_keys, 128 for fewer_keys)
AUTO_BATCHES = {
    "long_prompts": ([(512, 512), (300, 1300), (1025, 1025), (64, 64)], "fa3"),
    "mean_64": ([(64, 1024)] * 6, "fa3"),       # the query threshold: mean qo_len >= 64
    "mean_63": ([(63, 1024)] * 6, "fa2"),
    "few_keys": ([(256, 256)] * 8, "fa3"),     # 192 keys a query tile: the threshold
    "fewer_keys": ([(128, 128)] * 8, "fa2"),   # 128
    "four_tokens": ([(4, 4 + 37 * i) for i in range(16)], "fa2"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("batch", sorted(AUTO_BATCHES))
def test_auto_picks_the_backend(batch, hopper_workspace):
    """backend="auto" (the default) on sm_90, bf16 head_dim 128 causal GQA-4: planned_backend is
    "fa3" where the mean qo_len is at least 64 tokens and the query tiles see 192 keys or more
    on average, "fa2" otherwise; run() matches the reference either way."""
    shapes, expected = AUTO_BATCHES[batch]
    gen = torch.Generator(device=DEV).manual_seed(19)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, 128, torch.bfloat16, gen)
    wrapper = ragged_wrapper(hopper_workspace)  # (backend left at its default)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), causal=True, q_data_type=torch.bfloat16)
    assert wrapper.planned_backend == expected
    out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows", ["prefix", "fresh"])
def test_fa3_ragged_rope_matches_fa2(rows, causal, head_dim, hopper_workspace):
    """pos_encoding_mode="ROPE_LLAMA" on the Hopper path (ragged K/V: q and k rotated before the
    kernel, sm90.rope_prepass), rope_scale and rope_theta set: against the float64 reference
    and the mma.sync kernel's in-kernel RoPE on the same inputs, outputs poisoned; "auto" picks
    the kernel it picks for the same batch without RoPE; the single-request function too.
    "prefix": requests with qo_len < kv_len (q rows at kv_len - qo_len + i; one rotation call a
    tensor); "fresh": qo_len = kv_len everywhere (q and k rotated in one call)."""
    shapes = ([(300, 900), (517, 517), (64, 2000), (0, 40), (200, 260)] if rows == "prefix" else
              [(300, 300), (517, 517), (0, 0), (200, 200), (64, 64)])
    gen = torch.Generator(device=DEV).manual_seed(23 + head_dim)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, head_dim, torch.bfloat16, gen)
    rope = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5)
    results = {}
    for backend in ("fa3", "fa2", "auto"):
        wrapper = ragged_wrapper(hopper_workspace, backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (head_dim, head_dim), causal=causal, q_data_type=torch.bfloat16,
                **rope)
        if backend == "auto":  # RoPE leaves auto's choice to its rule: that of the same batch without it
            plain = ragged_wrapper(hopper_workspace, backend="auto")
            plan_kv(plain, qo_indptr, kv, *LLAMA, (head_dim, head_dim), causal=causal, q_data_type=torch.bfloat16)
            assert wrapper.planned_backend == plain.planned_backend
            continue
        assert wrapper.planned_backend == backend
        if backend == "fa3":  # the one-call rotation exactly where every request's rows coincide
            assert wrapper._plan.rope[4] == (rows == "fresh")
        results[backend] = run_poisoned(wrapper, q, kv, head_dim, torch.bfloat16)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal, **rope)
    tol = tolerance(BF16)
    check_prefill(*results["fa3"], ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol / 2, "fa3", "fa2")
    first_qo, first_kv = shapes[0]
    qs, ks, vs = q[:first_qo], k_rows[:first_kv], v_rows[:first_kv]
    single3 = fij.single_prefill_with_kv_cache(qs, ks, vs, causal=causal, backend="fa3", **rope)
    single2 = fij.single_prefill_with_kv_cache(qs, ks, vs, causal=causal, backend="fa2", **rope)
    check_out(single3, single2, [shapes[0]], tol / 2, "single fa3 against fa2")


@pytest.mark.gpu
@pytest.mark.parametrize("table, kv_layout, kv_dtype, rope, head_dim, causal, page_size", [
    ("csr", "NHD", torch.float8_e4m3fn, False, 128, True, 16),
    ("csr", "HND", torch.float8_e5m2, False, 64, False, 16),
    ("block_table_kv_separate", "NHD", torch.float8_e4m3fn, False, 128, False, 16),
    ("csr", "NHD", torch.bfloat16, True, 128, True, 16),
    ("block_table", "HND", torch.float8_e4m3fn, True, 256, True, 16),
    ("block_table_kv_separate", "NHD", torch.bfloat16, True, 64, False, 16),
    # pages under 16 tokens, over a copy read as rows (sm90.small_pages)
    ("csr", "NHD", torch.bfloat16, False, 128, True, 1),
    ("csr", "HND", torch.bfloat16, False, 128, False, 2),
    ("block_table_kv_separate", "NHD", torch.float8_e4m3fn, True, 128, False, 2),
    ("csr", "NHD", torch.bfloat16, True, 64, True, 4),
    ("block_table", "NHD", torch.bfloat16, False, 256, True, 1),
], ids=lambda v: str(v).replace("torch.", ""))
def test_fa3_paged_copy_fp8_and_rope(table, kv_layout, kv_dtype, rope, head_dim, causal, page_size, hopper_workspace):
    """An fp8 cache, RoPE over the paged cache and pages of 1-4 tokens on the Hopper path: run()
    copies the batch's pages (widened to bf16, keys rotated, small pages repacked into pages of
    16) and the kernel reads the copy (sm90.gather_pages). On random pages with NaN in every
    unused page and slot, the three page tables, NHD and HND, k_scale / v_scale (fp8), requests
    without keys or queries: against the float64 reference and the mma.sync kernel on the same
    cache, NaN-poisoned outputs; "auto" takes it; POD's prefill side and a CUDA-graph wrapper
    do not."""
    rnd = random.Random(head_dim + 3 * rope)
    gen = torch.Generator(device=DEV).manual_seed(head_dim + 5 * rope)
    qo_lens, kv_lens = [m for m, _ in PAGED_SHAPES], [n for _, n in PAGED_SHAPES]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (head_dim, head_dim), torch.bfloat16, gen)
    kv = paged_kv(k_rows, v_rows, kv_lens, page_size, table, kv_layout, "tuple", rnd, dtype=kv_dtype)
    q = make_q(sum(qo_lens), LLAMA[0], head_dim, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    fp8 = kv_dtype != torch.bfloat16
    options = dict(causal=causal, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    if rope:
        options.update(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5)
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    results = {}
    for backend in ("fa3", "fa2", "auto"):
        wrapper = paged_wrapper(hopper_workspace, kv_layout, backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (head_dim, head_dim), page_size, **options)
        if backend == "auto":  # as for the same batch over a bf16 cache without RoPE
            plain = paged_wrapper(hopper_workspace, kv_layout, backend="auto")
            plan_kv(plain, qo_indptr, kv, *LLAMA, (head_dim, head_dim), page_size, causal=causal,
                    q_data_type=torch.bfloat16)
            assert wrapper.planned_backend == plain.planned_backend
            continue
        assert wrapper.planned_backend == backend
        results[backend] = run_poisoned(wrapper, q, kv, head_dim, torch.bfloat16, **scales)
    ref_out, ref_lse = reference(q, qo_indptr.to(DEV), kv, **{k: v for k, v in options.items() if k not in
                                                             ("q_data_type", "kv_data_type")}, **scales)
    tol = tolerance(BF16, fp8=fp8)
    check_prefill(*results["fa3"], ref_out, ref_lse, PAGED_SHAPES, tol, scales.get("v_scale"))
    check_agree(*results["fa3"], *results["fa2"], PAGED_SHAPES, tol * AGREE_FACTOR, "fa3", "fa2")
    graph = fij.BatchPrefillWithPagedKVCacheWrapper(hopper_workspace, kv_layout, use_cuda_graph=True, backend="auto")
    plan_kv(graph, qo_indptr, kv, *LLAMA, (head_dim, head_dim), page_size, **options)
    assert graph.planned_backend == "fa2"  # (the copy is made per run(): no CUDA graphs on the Hopper path)


def _auto_lacking_params():
    """(plan() arguments beyond the base, whether on the paged wrapper)."""
    return [
        pytest.param(dict(o_data_type=torch.float16), False, id="o_dtype"),
        pytest.param(dict(page_size=3), True, id="paged_page_3"),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("extra, paged", _auto_lacking_params())
def test_auto_keeps_fa2_where_fa3_lacks_the_feature(extra, paged, hopper_workspace):
    """backend="auto" on sm_90 with long prompts that alone pick fa3 (checked first), plus a
    feature the Hopper path lacks (RoPE over a paged cache, an o_data_type, a page size, fp8 K/V):
    planned_backend "fa2", no error. Plans only (no module is built)."""
    shapes = AUTO_BATCHES["long_prompts"][0]
    qo, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    base = dict(num_qo_heads=LLAMA[0], num_kv_heads=LLAMA[1], head_dim_qk=128, causal=True,
                q_data_type=torch.bfloat16)
    control = ragged_wrapper(hopper_workspace)
    control.plan(indptr_of(qo, "cpu"), indptr_of(kv_lens, "cpu"), **base)
    assert control.planned_backend == "fa3", "the control plan (long prompts, supported) should pick fa3"
    kwargs = dict(base, **extra)
    if "custom_mask" in extra or "packed_custom_mask" in extra:
        kwargs.pop("causal")
    if paged:
        ps = kwargs.pop("page_size", 16)
        pages = [-(-n // ps) for n in kv_lens]
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(hopper_workspace, "NHD")
        wrapper.plan(indptr_of(qo, "cpu"), indptr_of(pages, "cpu"), torch.arange(sum(pages), dtype=torch.int32),
                     torch.tensor([n - ps * (p - 1) for n, p in zip(kv_lens, pages)], dtype=torch.int32),
                     page_size=ps, **kwargs)
    else:
        wrapper = ragged_wrapper(hopper_workspace)
        wrapper.plan(indptr_of(qo, "cpu"), indptr_of(kv_lens, "cpu"), **kwargs)
    assert wrapper.planned_backend == "fa2"


# --- head_dim 256 (80-key tiles, 64 on pages of 32 or more; auto takes it where query tiles average 2048 keys)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, causal, group", [(BF16, True, 4), (F16, False, 1), (BF16, False, 8)])
def test_fa3_head_dim_256(dtype, causal, group, hopper_workspace):
    """head_dim 256 on the Hopper path (80-key tiles, O in 128 registers a thread, m64n256k16
    P V): mixed ragged batches against the float64 reference and the mma.sync kernel."""
    gen = torch.Generator(device=DEV).manual_seed(256 + group)
    shapes = [(300, 300), (0, 9), (17, 400), (129, 129), (5, 0), (64, 1000)]
    heads = {1: (4, 4), 4: (8, 2), 8: (8, 1)}[group]
    torch_dtype = dtype_of(dtype)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, heads, 256, torch_dtype, gen)
    results = {}
    for backend in ("fa3", "fa2"):
        wrapper = ragged_wrapper(hopper_workspace, backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *heads, (256, 256), causal=causal, q_data_type=torch_dtype)
        assert wrapper.planned_backend == backend
        if backend == "fa3":
            assert wrapper._plan.spec.key_tile == 80
        results[backend] = run_poisoned(wrapper, q, kv, 256, torch_dtype)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    tol = tolerance(dtype)
    for out, lse in results.values():
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")
    auto = ragged_wrapper(hopper_workspace)
    plan_kv(auto, qo_indptr, kv, *heads, (256, 256), causal=causal, q_data_type=torch_dtype)
    assert auto.planned_backend == "fa2"


# --- paged K/V ----------------------------------------------------------------------------------
PAGED_SHAPES = [(1, 700), (37, 100), (128, 128), (200, 1500), (0, 9), (5, 0), (64, 65), (300, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, kv_layout, causal, head_dim, dtype, form", [
    (16, "NHD", True, 128, BF16, "tuple"),
    (16, "HND", False, 128, F16, "single"),
    (16, "NHD", False, 128, BF16, "halves"),
    (32, "NHD", False, 64, BF16, "tuple"),
    (32, "HND", True, 128, BF16, "tuple"),
    (64, "HND", True, 64, F16, "tuple"),
    (64, "NHD", False, 128, F16, "single"),
    (128, "NHD", True, 128, BF16, "tuple"),
    (128, "HND", False, 64, BF16, "tuple"),
    (16, "NHD", True, 256, BF16, "tuple"),
    (64, "HND", False, 256, F16, "tuple"),
    (8, "NHD", True, 128, BF16, "tuple"),  # (pages of 8: over a copy read as rows, sm90.small_pages)
    (8, "HND", False, 128, BF16, "single"),
    (8, "NHD", True, 64, F16, "tuple"),
    (8, "NHD", False, 256, BF16, "tuple"),
], ids=lambda v: str(v))
def test_fa3_paged_against_reference(page_size, kv_layout, causal, head_dim, dtype, form, hopper_workspace):
    """The paged wrapper on the Hopper path (one TMA box a page): the CSR page table on a
    random permutation of pages, NaN in every unused page and slot (the last page's rows past
    kv_len reach the tile: the kernel zeroes V's), requests without keys or queries, page
    sizes 16-128, NHD and HND, K/V as a tuple, one [P, 2, ...] tensor or halves of one buffer
    (strided); against the float64 reference, NaN-poisoned outputs."""
    rnd = random.Random(page_size + head_dim)
    gen = torch.Generator(device=DEV).manual_seed(page_size + head_dim)
    torch_dtype = dtype_of(dtype)
    qo_lens, kv_lens = [m for m, _ in PAGED_SHAPES], [n for _, n in PAGED_SHAPES]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (head_dim, head_dim), torch_dtype, gen)
    kv = paged_kv(k_rows, v_rows, kv_lens, page_size, "csr", kv_layout, form, rnd)
    q = make_q(sum(qo_lens), LLAMA[0], head_dim, torch_dtype, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    wrapper = paged_wrapper(hopper_workspace, kv_layout, backend="fa3")
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (head_dim, head_dim), page_size, causal=causal, q_data_type=torch_dtype)
    assert wrapper.planned_backend == "fa3"
    out, lse = run_poisoned(wrapper, q, kv, head_dim, torch_dtype)
    ref_out, ref_lse = reference(q, qo_indptr.to(DEV), kv, causal=causal)
    check_prefill(out, lse, ref_out, ref_lse, PAGED_SHAPES, tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, kv_layout, causal, head_dim, dtype, table", [
    (16, "NHD", True, 128, BF16, "block_table"),
    (32, "HND", False, 128, F16, "block_table_kv_separate"),
    (64, "NHD", True, 64, BF16, "block_table_kv_separate"),
    (16, "HND", False, 256, BF16, "block_table"),
    (16, "NHD", False, 128, BF16, "block_table_kv_separate"),
], ids=lambda v: str(v))
def test_fa3_block_tables_against_reference(page_size, kv_layout, causal, head_dim, dtype, table, hopper_workspace):
    """Block tables on the Hopper path: vLLM's [B, max_pages] (request b's page ids from entry
    b x the row stride) and TensorRT-LLM's [B, 2, max_pages] (K and V pages drawn apart; V's
    ids one table row past K's); columns past a request's pages point at a NaN page. Against
    the float64 reference and the mma.sync kernel on the same table, NaN-poisoned outputs."""
    rnd = random.Random(7 * page_size + head_dim)
    gen = torch.Generator(device=DEV).manual_seed(page_size + head_dim + 1)
    torch_dtype = dtype_of(dtype)
    qo_lens, kv_lens = [m for m, _ in PAGED_SHAPES], [n for _, n in PAGED_SHAPES]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (head_dim, head_dim), torch_dtype, gen)
    kv = paged_kv(k_rows, v_rows, kv_lens, page_size, table, kv_layout, "tuple", rnd)
    q = make_q(sum(qo_lens), LLAMA[0], head_dim, torch_dtype, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    results = {}
    for backend in ("fa3", "fa2"):
        wrapper = paged_wrapper(hopper_workspace, kv_layout, backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (head_dim, head_dim), page_size, causal=causal,
                q_data_type=torch_dtype)
        assert wrapper.planned_backend == backend
        results[backend] = run_poisoned(wrapper, q, kv, head_dim, torch_dtype)
    ref_out, ref_lse = reference(q, qo_indptr.to(DEV), kv, causal=causal)
    tol = tolerance(dtype)
    for out, lse in results.values():
        check_prefill(out, lse, ref_out, ref_lse, PAGED_SHAPES, tol)
    check_agree(*results["fa3"], *results["fa2"], PAGED_SHAPES, tol * AGREE_FACTOR, "fa3", "fa2")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_fa3_paged_matches_ragged_and_fa2(causal, hopper_workspace):
    """The same rows through the paged cache (pages of 16) and as ragged tensors, on the
    Hopper path, and the paged cache on the mma.sync kernel: the three agree."""
    rnd = random.Random(31)
    gen = torch.Generator(device=DEV).manual_seed(31)
    shapes = [(512, 2048), (300, 1300), (129, 700), (1, 33)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (128, 128), torch.bfloat16, gen)
    q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    paged = paged_kv(k_rows, v_rows, kv_lens, 16, rnd=rnd)
    results = {}
    for name, wrapper, kv in (("fa3 paged", paged_wrapper(hopper_workspace, backend="fa3"), paged),
                              ("fa3 ragged", ragged_wrapper(hopper_workspace, backend="fa3"),
                               ragged_kv(k_rows, v_rows, kv_lens)),
                              ("fa2 paged", paged_wrapper(hopper_workspace, backend="fa2"), paged)):
        plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), 16, causal=causal, q_data_type=torch.bfloat16)
        results[name] = run_poisoned(wrapper, q, kv, 128, torch.bfloat16)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    tol = tolerance(BF16)
    for name, (out, lse) in results.items():
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    first = results["fa3 paged"]
    for name in ("fa3 ragged", "fa2 paged"):
        check_agree(*first, *results[name], shapes, tol * AGREE_FACTOR, "fa3 paged", name)


@pytest.mark.gpu
def test_auto_takes_fa3_for_paged_prompts(hopper_workspace):
    """backend="auto" on the paged wrapper: long prompts on pages of 16 take the Hopper path, on
    pages of 8 too (over a copy of the batch's pages: at least AUTO_MIN_KEYS_PAGE_8 keys a query
    tile here); pages of 12 tokens (not a power of two) keep the mma.sync kernel."""
    shapes = AUTO_BATCHES["long_prompts"][0]
    qo, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    base = dict(num_qo_heads=LLAMA[0], num_kv_heads=LLAMA[1], head_dim_qk=128, causal=True,
                q_data_type=torch.bfloat16)
    for ps, expected in ((16, "fa3"), (8, "fa3"), (12, "fa2")):
        pages = [-(-n // ps) for n in kv_lens]
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(hopper_workspace, "NHD")
        wrapper.plan(indptr_of(qo, "cpu"), indptr_of(pages, "cpu"), torch.arange(sum(pages), dtype=torch.int32),
                     torch.tensor([n - ps * (p - 1) for n, p in zip(kv_lens, pages)], dtype=torch.int32),
                     page_size=ps, **base)
        assert wrapper.planned_backend == expected, ps


# --- scales and run()'s options ------------------------------------------------------------------
@pytest.mark.gpu
def test_fa3_scales(hopper_workspace):
    """One fa3 plan, run() per layer with its own q, K/V and scales (q_scale and k_scale fold
    into the logits' scale, v_scale multiplies the output: test_prefill.py
    test_plan_once_run_per_layer), then a plan with sm_scale: each against the reference."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    shapes = [(300, 900), (1, 17), (129, 129), (250, 600), (0, 5), (7, 0)]
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    qo_indptr = indptr_of(qo_lens, "cpu")
    tol = tolerance(BF16)
    for sm_scale, layers in ((None, (dict(), dict(k_scale=0.7, v_scale=1.5), dict(q_scale=1.3),
                                     dict(q_scale=0.5, k_scale=2.5, v_scale=0.25))),
                             (0.05, (dict(), dict(q_scale=1.3, v_scale=3.0)))):
        wrapper = fa3_wrapper(hopper_workspace)
        wrapper.plan(qo_indptr, indptr_of(kv_lens, "cpu"), num_qo_heads=LLAMA[0], num_kv_heads=LLAMA[1],
                     head_dim_qk=128, causal=True, sm_scale=sm_scale, q_data_type=torch.bfloat16)
        assert wrapper.planned_backend == "fa3"
        for scales in layers:
            k_rows, v_rows = make_rows(kv_lens, LLAMA[1], (128, 128), torch.bfloat16, gen)
            kv = ragged_kv(k_rows, v_rows, kv_lens, host_indptr=True)
            q = make_q(sum(qo_lens), LLAMA[0], 128, torch.bfloat16, gen, 2.0)
            out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, **scales)
            ref_out, ref_lse = reference(q, qo_indptr, kv, causal=True, sm_scale=sm_scale, **scales)
            check_prefill(out, lse, ref_out, ref_lse, shapes, tol, scales.get("v_scale"))


@pytest.mark.gpu
def test_fa3_run_checks_sinks_and_windows(hopper_workspace):
    """run() on an fa3 plan: sinks of another shape or dtype, and a window other than plan()'s
    (the Hopper plan's first key tiles follow plan()'s window), are ValueErrors before any
    launch (out keeps its NaN); run(window_left=-1), the plan's (none), runs."""
    gen = torch.Generator(device=DEV).manual_seed(15)
    shapes = [(100, 300), (64, 64)]
    q, qo_indptr, _, _, kv = ragged_inputs(shapes, LLAMA, 128, torch.bfloat16, gen)
    wrapper = fa3_wrapper(hopper_workspace)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), causal=True, q_data_type=torch.bfloat16)
    out = torch.full((q.shape[0], LLAMA[0], 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    for bad in (torch.zeros(LLAMA[0] + 1, dtype=torch.float32, device=DEV),
                torch.zeros(LLAMA[0], dtype=torch.float16, device=DEV)):
        with pytest.raises(ValueError, match="sinks"):
            wrapper.run(q, *kv.run_args, out=out, sinks=bad)
    with pytest.raises(ValueError, match="window"):  # another window than plan()'s
        wrapper.run(q, *kv.run_args, out=out, window_left=32)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()), "a rejected run() wrote its output"
    out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, window_left=-1)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=True)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal, head_dim, options", [
    (True, 128, {}), (False, 64, {}), (True, 128, dict(logits_soft_cap=30.0, window_left=150)), (False, 256, {}),
], ids=lambda v: str(v))
def test_fa3_sinks(causal, head_dim, options, hopper_workspace):
    """run(sinks=...) on the Hopper path: one logit a query head joins each row's denominator
    (a row with no key writes 0 and the sink as its LSE); against the float64 reference and
    the mma.sync kernel on a mixed batch with padding and a request without keys."""
    gen = torch.Generator(device=DEV).manual_seed(head_dim + 3)
    shapes = [(300, 300), (0, 9), (17, 400), (5, 0), (129, 1000)]
    heads = (8, 2)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, heads, head_dim, torch.bfloat16, gen, q_scale=2.0)
    sinks = torch.randn(heads[0], generator=gen, device=DEV, dtype=torch.float32) * 3.0
    results = {}
    for backend in ("fa3", "fa2"):
        results[backend] = plan_and_run(hopper_workspace, backend, shapes, q, qo_indptr, kv, heads, head_dim,
                                        torch.bfloat16, causal, run_kwargs=dict(sinks=sinks), **options)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal, sinks=sinks, **options)
    tol = tolerance(BF16)
    for out, lse in results.values():
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")


# --- FP8 attention (q, K and V in e4m3) ----------------------------------------------------------
# The output against the float64 reference of the dequantized e4m3 values: P is rounded to e4m3
# (3 mantissa bits) before P V and the e4m3 MMA adds in about 13-14 bits (tests/hopper/fp8_probe.cu),
# so an element may be a few percent off (|out - ref| <= FP8_ATTN_TOL (1 + |ref|)); over the whole
# output the error is small (FP8_ATTN_RMS of the reference's rms), where a wrong fragment layout or
# a missed tile is O(1) off. The LSE (Q K^T and fp32 sums only) keeps the usual tolerance.
FP8_ATTN_TOL, FP8_ATTN_RMS = 0.06, 0.03
E4M3 = torch.float8_e4m3fn


def fp8_inputs(shapes, heads, gen, scales: tuple):
    """(q, k, v) in e4m3 and (q, k, v) dequantized in float32 (the e4m3 values times the
    scales): fresh random values, q twice K's spread (peakier rows)."""
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k, v = make_rows(kv_lens, heads[1], (128, 128), torch.float32, gen)
    q = make_q(sum(qo_lens), heads[0], 128, torch.float32, gen, 2.0)
    quant = [(x / sc).to(E4M3) for x, sc in zip((q, k, v), scales)]
    return quant, [x.float() * sc for x, sc in zip(quant, scales)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal, heads, o_dtype", [(True, (32, 8), torch.float16), (False, (8, 8), torch.bfloat16),
                                                    (True, (24, 4), torch.bfloat16)])
def test_fa3_fp8_attention(causal, heads, o_dtype, hopper_workspace):
    """FP8 attention through the ragged wrapper (q_data_type float8_e4m3fn: the Hopper kernel's
    fp8 form) on the mixed batch (padding, rows without keys, kv_len < qo_len) and a long
    request, with q / k / v scales: against the float64 reference of the dequantized values, and
    against the bf16 Hopper kernel on the same e4m3 values (exact in bf16) with the same scales."""
    gen = torch.Generator(device=DEV).manual_seed(171 + heads[0] + causal)
    shapes = list(BATCHES["mixed"]) + [(1025, 1025)]
    scales = (0.7, 1.3, 0.9)
    (q8, k8, v8), (q, k, v) = fp8_inputs(shapes, heads, gen, scales)
    kv_lens = [n for _, n in shapes]
    qo_indptr = indptr_of([m for m, _ in shapes], "cpu")
    wrapper = fa3_wrapper(hopper_workspace)
    kv8 = ragged_kv(k8, v8, kv_lens, host_indptr=True)
    plan_kv(wrapper, qo_indptr, kv8, *heads, (128, 128), causal=causal, q_data_type=E4M3, kv_data_type=E4M3,
            o_data_type=o_dtype)
    assert wrapper.planned_backend == "fa3" and wrapper._plan.spec.fp8
    run_scales = dict(zip(("q_scale", "k_scale", "v_scale"), scales))
    out, lse = run_poisoned(wrapper, q8, kv8, 128, o_dtype, True, **run_scales)
    ref_out, ref_lse = reference_by_rows(q, shapes, k, v, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, FP8_ATTN_TOL)
    err = (out.double() - ref_out.double().to(out.device)).square().mean().sqrt()
    assert float(err) <= FP8_ATTN_RMS * float(ref_out.double().square().mean().sqrt()), f"rms error {float(err):.4f}"
    # the bf16 kernel on the same values
    bf16 = fa3_wrapper(hopper_workspace)
    kv16 = ragged_kv(k8.to(torch.bfloat16), v8.to(torch.bfloat16), kv_lens, host_indptr=True)
    plan_kv(bf16, qo_indptr, kv16, *heads, (128, 128), causal=causal, q_data_type=torch.bfloat16)
    out16, lse16 = run_poisoned(bf16, q8.to(torch.bfloat16), kv16, 128, torch.bfloat16, True, **run_scales)
    check_agree(out, lse, out16, lse16, shapes, FP8_ATTN_TOL, "fp8", "bf16")


# --- on the CPU: the grid's coverage, the matrix, plan()'s errors ----------------------------------
def test_fa3_cases_cover_every_pair_of_options():
    names = list(OPTIONS)
    seen = set()
    for case in CASES:
        assert all(getattr(case, n) in OPTIONS[n] for n in names), case
        seen |= {(a, getattr(case, a), b, getattr(case, b)) for a, b in itertools.combinations(names, 2)}
    missing = [(a, x, b, y) for a, b in itertools.combinations(names, 2) for x in OPTIONS[a] for y in OPTIONS[b]
               if (a, x, b, y) not in seen]
    assert not missing, f"{len(missing)} pairs no case has, e.g. {missing[:5]}"
    triples = {(c.dtype, c.head_dim, c.causal) for c in CASES}
    assert len(triples) == 8, "every dtype x head_dim x causal should appear"


def test_tests_matrix_has_the_fa2_modules_compared_with():
    """The fa2 modules the default GPU run of this file loads (test_fa3_matches_fa2's default
    cases, the fa2 plans of test_auto_picks_the_backend) are prebuilt by scripts/matrices/tests."""
    needed = {prefill_spec(dtype, dims=(hd, hd), source="ragged", mask="causal" if causal else "none")
              for dtype, hd, causal in FA2_DEFAULT + [(BF16, 128, True)]}
    missing = sorted(s.name for s in needed - set(parse_matrix(TESTS_MATRIX)))
    assert not missing, f"scripts/matrices/tests lacks {missing}"


def test_tests_matrix_has_the_fp8_attention_modules():
    needed = {PrefillSm90Spec(o, 128, mask, fp8=True) for o in (F16, BF16) for mask in ("none", "causal")}
    missing = sorted(s.name for s in needed - set(parse_matrix(TESTS_MATRIX)))
    assert not missing, f"scripts/matrices/tests lacks {missing}"


CPU_HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128)
CPU_QO, CPU_KV = (100, 200, 0, 7), (300, 200, 5, 0)


def _cpu_workspace() -> torch.Tensor:
    # (as test_prefill.py's plan() checks: the wrappers take a CPU workspace and plan on the host)
    return torch.empty(1 << 20, dtype=torch.uint8)


def _cpu_indptr(lens) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32)


def _cpu_ragged_plan(backend: str = "fa3", use_cuda_graph: bool = False, **kwargs):
    """A ragged wrapper on a CPU workspace, planned (bf16, 32/8 heads, head_dim 128 by default)."""
    graph = dict(qo_indptr_buf=torch.zeros(len(CPU_QO) + 1, dtype=torch.int32),
                 kv_indptr_buf=torch.zeros(len(CPU_QO) + 1, dtype=torch.int32)) if use_cuda_graph else {}
    wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", use_cuda_graph=use_cuda_graph,
                                                       backend=backend, **graph)
    args = dict(CPU_HEADS, q_data_type=torch.bfloat16)
    args.update(kwargs)
    wrapper.plan(_cpu_indptr(CPU_QO), _cpu_indptr(CPU_KV), **args)
    return wrapper


def _cpu_masks() -> dict:
    sizes = [m * n for m, n in zip(CPU_QO, CPU_KV)]
    flat = torch.ones(sum(sizes), dtype=torch.bool)
    packed, byte_indptr = segment_packbits_ref(flat, _cpu_indptr(sizes), "little")
    return dict(bool=dict(custom_mask=flat), packed=dict(packed_custom_mask=packed, mask_indptr=byte_indptr))


# (plan() arguments beyond CPU_HEADS, the error's match): what the Hopper path lacks
FA3_LACKS = [
    pytest.param(dict(kv_data_type=torch.float8_e4m3fn), r"(?i)fp8|float8|kv_data_type", id="fp8_kv"),
    pytest.param(dict(q_data_type=torch.float16, kv_data_type=torch.bfloat16), r"kv_data_type|q_data_type|dtype",
                 id="kv_dtype_not_q"),  # (inferred from "same dtype for q and kv")
    pytest.param(dict(head_dim_qk=512), r"head_dim", id="hd512"),
    pytest.param(dict(head_dim_qk=192, head_dim_vo=192), r"head_dim", id="hd192x192"),
    pytest.param(dict(o_data_type=torch.float16), r"o_data_type", id="o_dtype"),
]


@pytest.mark.parametrize("extra, match", FA3_LACKS)
def test_fa3_plan_names_what_it_lacks(extra, match):
    """backend="fa3" on a CPU workspace with a feature the Hopper path lacks: plan() raises a
    ValueError naming the feature (the feature checks come before the device check)."""
    with pytest.raises(ValueError, match=match):
        _cpu_ragged_plan(**extra)


def _cpu_paged_plan(page_size: int = 16, table: str = "csr", use_cuda_graph: bool = False, **kwargs):
    pages = [-(-n // page_size) for n in CPU_KV]
    wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", use_cuda_graph=use_cuda_graph,
                                                      backend="fa3")
    kwargs = dict(dict(q_data_type=torch.bfloat16, **CPU_HEADS), **kwargs)
    table_kind = table
    if table == "csr":
        wrapper.plan(_cpu_indptr(CPU_QO), _cpu_indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
                     torch.tensor([n - page_size * (p - 1) if p else 0 for n, p in zip(CPU_KV, pages)],
                                  dtype=torch.int32), page_size=page_size, **kwargs)
    else:  # "block_table" (vLLM [B, max_pages]) or "block_table_kv_separate" ([B, 2, max_pages])
        table = torch.arange(len(CPU_KV) * max(pages), dtype=torch.int32).reshape(len(CPU_KV), max(pages))
        if table_kind == "block_table_kv_separate":
            table = torch.stack([table, table], 1)
        wrapper.plan(_cpu_indptr(CPU_QO), None, None, None, page_size=page_size, block_tables=table,
                     seq_lens=torch.tensor(CPU_KV, dtype=torch.int32), **kwargs)


@pytest.mark.parametrize("options, match", [
    pytest.param(dict(_cpu_masks()["bool"], use_cuda_graph=True), r"(?i)custom.*use_cuda_graph", id="mask_graph"),
    pytest.param(dict(kv_data_type=torch.float8_e4m3fn, use_cuda_graph=True), r"float8_e4m3.*use_cuda_graph",
                 id="fp8_graph"),
    pytest.param(dict(q_data_type=torch.float16, kv_data_type=torch.bfloat16), r"bfloat16 K/V needs q of the same",
                 id="kv_dtype_not_q"),
    pytest.param(dict(page_size=3), r"page_size=3", id="page_3"),
    pytest.param(dict(page_size=4, use_cuda_graph=True), r"page_size=4 with use_cuda_graph", id="page_4_graph"),
    pytest.param(dict(page_size=128, head_dim_qk=256), r"page_size=128", id="page_128_hd256"),
    pytest.param(dict(page_size=1, use_cuda_graph=True), r"page_size=1 with use_cuda_graph", id="page_1_graph"),
    pytest.param(dict(causal=True, pos_encoding_mode="ROPE_LLAMA", use_cuda_graph=True), r"ROPE_LLAMA.*use_cuda_graph",
                 id="rope_paged_graph"),
])
def test_fa3_paged_plan_names_what_it_lacks(options, match):
    """The paged wrapper with backend="fa3": plan() raises a ValueError naming what the Hopper
    path does not take with paged K/V (before the arch: a CPU workspace here). An fp8 cache and
    RoPE run over a copy of the batch's pages, which a CUDA-graph wrapper does not make."""
    with pytest.raises(ValueError, match=match):
        _cpu_paged_plan(**options)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("table", ["csr", "block_table_kv_separate"])
def test_copy_of_pages_is_read_as_rows(table, page_size, monkeypatch):
    """A plan over a copy of the batch's pages (sm90.gathers: pages under 16 tokens here, or 16
    with every paged plan pinned to the copy) reads the copy as ragged rows: request b's token t
    at row copy_offsets[b] x page_size + t of gather_pages' output (K's and V's own ids from a
    TensorRT-LLM table), its tiles' first rows there, a ragged module. On the CPU with the arch
    check passed (the GPU tests run the kernel)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    rnd = random.Random(page_size)
    qo_lens, kv_lens = [33, 0, 16, 100, 1], [33, 7, 16, 300, 1]
    have = [-(-n // page_size) for n in kv_lens]
    w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", backend="fa3")
    w._force_copy = True if page_size == 16 else None
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim_qk=64, page_size=page_size, causal=True,
                q_data_type=torch.bfloat16)
    if table == "csr":
        ids = torch.tensor(rnd.sample(range(1000), sum(have)), dtype=torch.int32)
        starts = list(itertools.accumulate(have, initial=0))
        k_rows = v_rows = [ids[starts[b]:starts[b] + have[b]].tolist() for b in range(len(have))]
        last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, have)], dtype=torch.int32)
        w.plan(_cpu_indptr(qo_lens), _cpu_indptr(have), ids, last, **args)
    else:
        width = max(have) + 3
        tables = torch.tensor(rnd.sample(range(5000), len(have) * 2 * width), dtype=torch.int32)
        tables = tables.reshape(len(have), 2, width)
        k_rows = [tables[b, 0, :have[b]].tolist() for b in range(len(have))]
        v_rows = [tables[b, 1, :have[b]].tolist() for b in range(len(have))]
        w.plan(_cpu_indptr(qo_lens), None, None, None, block_tables=tables,
               seq_lens=torch.tensor(kv_lens, dtype=torch.int32), **args)
    plan = w._plan
    assert w.planned_backend == "fa3" and plan.spec.kv_source == "ragged" and plan.gather is not None
    offsets = sm90.copy_offsets(np.array(kv_lens), page_size) * page_size
    tiles = plan.work[sm90.WORK_HEADER:plan.work_ints].reshape(-1, sm90.TILE_INTS)
    qo = np.cumsum([0] + qo_lens)
    for t in tiles.tolist():
        b = int(np.searchsorted(qo, t[0], side="right") - 1)
        assert t[2] == offsets[b] and t[3] == kv_lens[b], (t, b)
    k = torch.randn(5000, page_size, 2, 64, generator=torch.Generator().manual_seed(page_size))
    v = torch.randn(5000, page_size, 2, 64, generator=torch.Generator().manual_seed(page_size + 1))
    ck, cv = sm90.gather_pages(k, v, plan.gather, "NHD", torch.float32)
    assert ck.dim() == 3 and ck.shape[1:] == (2, 64) and cv.shape == ck.shape
    for b, n in enumerate(kv_lens):
        for t in range(n):
            row = int(offsets[b]) + t
            assert torch.equal(ck[row], k[k_rows[b][t // page_size], t % page_size])
            assert torch.equal(cv[row], v[v_rows[b][t // page_size], t % page_size])
        for row in range(int(offsets[b]) + n, int(offsets[b + 1])):  # (its last page's unused slots)
            assert not cv[row].any(), (b, row)


@pytest.mark.parametrize("qo_len, kv_len, graph, cap, copied", [
    (4096, 4096, False, None, True), (1024, 1024, False, None, False), (4096, 4096, True, None, False),
    (4096, 4096, False, 32 << 20, True), (4096, 4096, False, (32 << 20) - 1, False),
    (512, 4096, False, None, True), (512, 4080, False, None, False), (256, 8192, False, None, False),
    (1024, 16384, False, None, True)])
def test_long_prompts_read_a_copy_of_their_pages(qo_len, kv_len, graph, cap, copied, monkeypatch):
    """A paged plan of prompts of COPY_MIN_MEAN_QO_LEN query tokens or more on average, or of
    chunks of COPY_MIN_CHUNK_QO_LEN on COPY_MIN_CHUNK_KV_LEN keys or more, reads a copy of its
    pages as rows (the ragged module) where the copy takes at most COPY_MAX_BYTES (here two
    requests' 4096 keys each x 8 heads x 256 dims x 2 bytes: 32 MiB exactly); shorter prompts,
    shorter chunks or contexts, larger copies and CUDA-graph wrappers read the cache, one TMA
    box a page. Planned on the CPU with the arch check passed."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    if cap is not None:
        monkeypatch.setattr(sm90, "COPY_MAX_BYTES", cap)
    pages = [-(-kv_len // 16)] * 2
    last = kv_len - 16 * (pages[0] - 1)
    w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", use_cuda_graph=graph, backend="fa3")
    w.plan(_cpu_indptr([qo_len] * 2), _cpu_indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
           torch.tensor([last, last], dtype=torch.int32), *LLAMA, 128, 16, causal=True, q_data_type=torch.bfloat16)
    assert (w._plan.spec.kv_source == "ragged") == copied and (w._plan.gather is not None) == copied


@pytest.mark.parametrize("table", ["csr", "block_table", "block_table_kv_separate"])
def test_copy_of_pages_gathers_each_requests_pages_in_order(table):
    """What run() copies for an fp8 cache or RoPE over the paged cache (sm90.copy_offsets,
    gather_ids): request b's pages at copy offsets b's running page count, K's ids and V's
    (TensorRT-LLM's table: V's own) in the request's order; the kernel reads the copy as rows.
    On the CPU (the planner's arithmetic; the GPU test runs the copy)."""
    from flashinfer_jit.prefill import sm90

    rnd = random.Random(5)
    kv_lens = np.array([33, 0, 16, 100, 1], dtype=np.int64)
    ps = 16
    pages = [-(-int(n) // ps) for n in kv_lens]
    offsets = sm90.copy_offsets(kv_lens, ps)
    assert offsets.tolist() == [0, *itertools.accumulate(pages)]
    if table == "csr":
        ids = torch.tensor(rnd.sample(range(100), sum(pages)), dtype=torch.int32)
        first = np.array([0, *itertools.accumulate(pages)])
        want_k = want_v = [ids[first[b] + p].item() for b in range(len(pages)) for p in range(pages[b])]
        k_ids, v_ids = sm90.gather_ids(ids, first, offsets, 0, torch.device("cpu"), False)
    else:
        width = max(pages) + 2
        tables = torch.tensor(rnd.sample(range(1000), len(pages) * 2 * width), dtype=torch.int32)
        tables = tables.reshape(len(pages), 2, width) if table == "block_table_kv_separate" else \
            tables[:len(pages) * width].reshape(len(pages), width)
        flat, first, v_off = sm90.block_table_ids(tables, kv_lens, ps)
        k_rows = tables[:, 0] if tables.dim() == 3 else tables
        v_rows = tables[:, 1] if tables.dim() == 3 else tables
        want_k = [k_rows[b, p].item() for b in range(len(pages)) for p in range(pages[b])]
        want_v = [v_rows[b, p].item() for b in range(len(pages)) for p in range(pages[b])]
        k_ids, v_ids = sm90.gather_ids(flat, first, offsets, v_off, torch.device("cpu"), False)
    assert k_ids.tolist() == want_k and v_ids.tolist() == want_v


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64, 128])
def test_fa3_paged_plan_on_the_cpu_names_sm90(page_size):
    """A paged configuration the Hopper path takes (CSR, pages of 1-128, under 16 over a copy): on a CPU
    workspace, the ValueError names the arch."""
    with pytest.raises(ValueError, match=r"sm_90"):
        _cpu_paged_plan(page_size=page_size, causal=True)


@pytest.mark.parametrize("config", [
    pytest.param(dict(), id="bf16-hd128-none"),
    pytest.param(_cpu_masks()["bool"], id="custom_mask"),
    pytest.param(_cpu_masks()["packed"], id="packed_custom_mask"),
    pytest.param(dict(causal=True, q_data_type=torch.float16, head_dim_qk=64), id="f16-hd64-causal"),
    pytest.param(dict(causal=True, num_qo_heads=24, num_kv_heads=4, sm_scale=0.07, o_data_type=torch.bfloat16,
                      kv_data_type=torch.bfloat16), id="gqa6-sm_scale-explicit-dtypes"),
    pytest.param(dict(causal=True, use_cuda_graph=True), id="cuda_graph"),
    pytest.param(dict(causal=True, head_dim_qk=256), id="bf16-hd256-causal"),
])
def test_fa3_plan_on_the_cpu_names_sm90(config):
    """backend="fa3" with a configuration the Hopper path supports, on a CPU workspace: a
    ValueError naming the arch it needs (sm_90), from the constructor or plan()."""
    with pytest.raises(ValueError, match=r"sm_90"):
        _cpu_ragged_plan(**config)


def test_fa3_single_prefill_on_the_cpu():
    """single_prefill_with_kv_cache(backend="fa3") with CPU tensors: a ValueError naming the
    feature it lacks (fp8 K/V) first, else one naming sm_90 (inferred from the wrappers' rule:
    the single function has no workspace; its tensors' device is the check). RoPE is taken
    (ragged K/V: rotated before the kernel)."""
    q = torch.randn(50, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(80, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(80, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"sm_90"):
        fij.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", backend="fa3")
    with pytest.raises(ValueError, match=r"sm_90"):  # a custom mask is taken
        fij.single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(50, 80, dtype=torch.bool), backend="fa3")
    with pytest.raises(ValueError, match=r"sm_90"):  # a soft cap and a window are taken
        fij.single_prefill_with_kv_cache(q, k, v, causal=True, logits_soft_cap=30.0, window_left=20, backend="fa3")
    with pytest.raises(ValueError, match=r"sm_90"):
        fij.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3")


@pytest.mark.parametrize("backend", ["auto", "fa2"])
def test_planned_backend_off_hopper_is_fa2(backend):
    """backend="auto" on a CPU workspace (no sm_90 device) plans fa2, never raises for the
    device; "fa2" plans fa2. planned_backend is read-only."""
    wrapper = _cpu_ragged_plan(backend, causal=True)
    assert wrapper.planned_backend == "fa2"
    with pytest.raises(AttributeError):
        wrapper.planned_backend = "fa3"
    # the long prompts that pick fa3 on sm_90 (test_auto_picks_the_backend): still fa2 here
    wrapper.plan(_cpu_indptr([512, 1025]), _cpu_indptr([512, 1025]), causal=True, q_data_type=torch.bfloat16,
                 **CPU_HEADS)
    assert wrapper.planned_backend == "fa2"


# --- head_dim (192, 128) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, causal, source", [(BF16, True, "ragged"), (F16, False, "ragged"),
                                                   (BF16, False, "paged"), (F16, True, "paged")])
def test_fa3_head_dim_192_128(dtype, causal, source, hopper_workspace):
    """head_dim_qk 192 with head_dim_vo 128 (the MLA-style pair without MLA) on the Hopper
    path: Q K^T over three 64-column atoms, P V and O over two; a mixed batch, ragged or on
    the CSR paged cache (K and V caches of their own head dims), against the float64
    reference and the mma.sync kernel."""
    gen = torch.Generator(device=DEV).manual_seed(192 + causal)
    rnd = random.Random(192)
    torch_dtype = dtype_of(dtype)
    shapes = [(300, 300), (0, 9), (17, 400), (129, 129), (5, 0), (64, 1000)]
    heads = (8, 2)
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, heads[1], (192, 128), torch_dtype, gen)
    if source == "ragged":
        kv, page_size, make = ragged_kv(k_rows, v_rows, kv_lens), None, ragged_wrapper
    else:
        kv, page_size = paged_kv(k_rows, v_rows, kv_lens, 16, "csr", "NHD", "tuple", rnd), 16
        make = functools.partial(paged_wrapper, kv_layout="NHD")
    q = make_q(sum(qo_lens), heads[0], 192, torch_dtype, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    results = {}
    for backend in ("fa3", "fa2"):
        wrapper = make(hopper_workspace, backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *heads, (192, 128), page_size, causal=causal, q_data_type=torch_dtype)
        assert wrapper.planned_backend == backend
        results[backend] = run_poisoned(wrapper, q, kv, 128, torch_dtype)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    tol = tolerance(dtype)
    for out, lse in results.values():
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")


def test_head_dim_192_spec():
    """PrefillSm90Spec at head_dim 192: V and the output at 128 (head_dim_vo), 128-key tiles,
    one Q stage (209 KB of shared memory)."""
    spec = fij.prefill.spec.PrefillSm90Spec("bfloat16", 192, "causal").validate()
    assert spec.head_dim_vo == 128 and spec.context()["head_dim_vo"] == 128 and spec.key_tile == 128
    from flashinfer_jit.prefill import sm90
    assert sm90.key_tile(192, False) == 128 and sm90.AUTO_MIN_KEYS[192] == 512


@pytest.mark.gpu
@pytest.mark.parametrize("causal, source", [(True, "ragged"), (False, "paged")])
def test_fa3_head_dim_256_on_64_key_tiles(causal, source, hopper_workspace):
    """head_dim 256 on 64-key tiles (plan() takes them for pages of 32 or more; pinned here, ragged
    or on pages of 16, where it takes 80; S in 32 registers a thread), against the float64
    reference."""
    gen = torch.Generator(device=DEV).manual_seed(80 + causal)
    rnd = random.Random(80)
    shapes = [(300, 300), (0, 9), (17, 400), (129, 129), (5, 0), (64, 1000)]
    heads = (8, 2)
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, heads[1], (256, 256), torch.bfloat16, gen)
    if source == "ragged":
        kv, page_size, wrapper = ragged_kv(k_rows, v_rows, kv_lens), None, fa3_wrapper(hopper_workspace)
    else:
        kv, page_size = paged_kv(k_rows, v_rows, kv_lens, 16, "csr", "NHD", "tuple", rnd), 16
        wrapper = paged_wrapper(hopper_workspace, "NHD", backend="fa3")
    wrapper._force_key_tile = 64
    q = make_q(sum(qo_lens), heads[0], 256, torch.bfloat16, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    plan_kv(wrapper, qo_indptr, kv, *heads, (256, 256), page_size, causal=causal, q_data_type=torch.bfloat16)
    assert wrapper.planned_backend == "fa3" and wrapper._plan.spec.key_tile == 64
    out, lse = run_poisoned(wrapper, q, kv, 256, torch.bfloat16)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal, source, dtype", [(True, "ragged", BF16), (False, "ragged", F16), (True, "paged", BF16),
                                                   (False, "paged", BF16)])
def test_fa3_head_dim_64_on_192_row_tiles(causal, source, dtype, hopper_workspace):
    """head_dim 64 on 192-row query tiles (three consumer warpgroups at 160 registers, pinned
    until an A/B decides), ragged or on pages of 16, against the float64 reference and the
    128-row tile: requests shorter than a tile, longer than two, without queries or keys, and
    a causal diagonal that crosses the tile's third warpgroup."""
    gen = torch.Generator(device=DEV).manual_seed(192 + causal)
    rnd = random.Random(192)
    shapes = [(300, 300), (0, 9), (17, 400), (193, 193), (5, 0), (64, 1000), (385, 700), (191, 191)]
    heads = (8, 2)
    torch_dtype = dtype_of(dtype)
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, heads[1], (64, 64), torch_dtype, gen)
    q = make_q(sum(qo_lens), heads[0], 64, torch_dtype, gen)
    qo_indptr = indptr_of(qo_lens, "cpu")
    if source == "ragged":
        kv, page_size = ragged_kv(k_rows, v_rows, kv_lens), None
    else:
        kv, page_size = paged_kv(k_rows, v_rows, kv_lens, 16, "csr", "NHD", "tuple", rnd), 16
    results = {}
    for rows in (192, 128):
        wrapper = fa3_wrapper(hopper_workspace) if source == "ragged" else paged_wrapper(hopper_workspace, "NHD",
                                                                                          backend="fa3")
        wrapper._force_query_tile = rows if rows == 192 else None
        plan_kv(wrapper, qo_indptr, kv, *heads, (64, 64), page_size, causal=causal, q_data_type=torch_dtype)
        assert wrapper.planned_backend == "fa3" and wrapper._plan.spec.query_tile == rows
        results[rows] = run_poisoned(wrapper, q, kv, 64, torch_dtype)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    tol = tolerance(dtype)
    check_prefill(*results[192], ref_out, ref_lse, shapes, tol)
    check_agree(*results[192], *results[128], shapes, tol * AGREE_FACTOR, "192 rows", "128 rows")


def _on_both_kernels(workspace, source: str, k_rows, v_rows, kv_lens, rnd, q, qo_indptr, heads, head_dim: int,
                     dtype: torch.dtype, **plan_kwargs) -> tuple:
    """The batch's K/V ragged, or on pages of 16 (CSR, NHD), planned with plan_kwargs and run on
    the Hopper kernel and on the mma.sync kernel into poisoned outputs: (kv, {backend: (out,
    lse)})."""
    if source == "ragged":
        kv, page_size = ragged_kv(k_rows, v_rows, kv_lens), None
    else:
        kv, page_size = paged_kv(k_rows, v_rows, kv_lens, 16, "csr", "NHD", "tuple", rnd), 16
    results = {}
    for backend in ("fa3", "fa2"):
        wrapper = ragged_wrapper(workspace, backend=backend) if source == "ragged" else \
            paged_wrapper(workspace, "NHD", backend=backend)
        plan_kv(wrapper, qo_indptr, kv, *heads, (head_dim, head_dim), page_size, q_data_type=dtype, **plan_kwargs)
        assert wrapper.planned_backend == backend
        results[backend] = run_poisoned(wrapper, q, kv, head_dim, dtype)
    return kv, results


@pytest.mark.gpu
@pytest.mark.parametrize("source, form, dtype, head_dim", [("ragged", "bool", BF16, 128), ("ragged", "packed", F16, 64),
                                                           ("paged", "packed", BF16, 128), ("paged", "bool", BF16, 256)])
def test_fa3_custom_mask(source, form, dtype, head_dim, hopper_workspace):
    """A custom mask on the Hopper path (each tile's bits read as 32-bit words from a padded
    copy, funnel-shifted to the thread's keys): random bits with a row that sees no key, a row
    that sees every key, requests of odd lengths (bit offsets off word boundaries), one
    without queries and one without keys; bool and packed forms, ragged and paged, against
    the float64 reference and the mma.sync kernel."""
    gen = torch.Generator(device=DEV).manual_seed(77 + head_dim)
    rnd = random.Random(77)
    shapes = [(130, 301), (0, 9), (17, 400), (129, 129), (5, 0), (64, 1000), (200, 77)]
    heads = (8, 2)
    torch_dtype = dtype_of(dtype)
    kv_lens = [n for _, n in shapes]
    q, qo_indptr, k_rows, v_rows, _ = ragged_inputs(shapes, heads, head_dim, torch_dtype, gen)
    masks = []
    for m, n in shapes:
        bits = torch.rand(m, n, generator=torch.Generator().manual_seed(m * 1000 + n)) < 0.6
        if m > 3 and n > 0:
            bits[1] = False  # a row with no key: zeros and an LSE of -inf
            bits[2] = True
        masks.append(bits.reshape(-1))
    flat = torch.cat(masks)
    if form == "bool":
        mask_kwargs = dict(custom_mask=flat.to(DEV))
    else:
        packed, byte_indptr = segment_packbits_ref(flat, indptr_of([m * n for m, n in shapes], "cpu"), "little")
        mask_kwargs = dict(packed_custom_mask=packed.to(DEV), mask_indptr=byte_indptr)
    kv, results = _on_both_kernels(hopper_workspace, source, k_rows, v_rows, kv_lens, rnd, q, qo_indptr, heads,
                                   head_dim, torch_dtype, **mask_kwargs)
    ref_out, ref_lse = reference(q, qo_indptr, kv, custom_mask=flat.to(DEV))
    tol = tolerance(dtype)
    check_prefill(*results["fa3"], ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")


def test_mask_bases_of_the_tiles():
    """sm90.mask_bases: a tile's first bit is its request's byte offset x 8 + the tile's first
    row's position in the request x kv_len; mask_buffer pads to 16-byte multiples, 64 bytes
    or more past the bits, and keeps them."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    qo = np.array([0, 300, 300, 310], dtype=np.int32)
    kv = np.array([0, 700, 709, 1109], dtype=np.int32)
    kv_lens = np.diff(kv).astype(np.int64)
    starts = np.array([0, 26250, 26250, 26750], dtype=np.int64)  # ceil(300 x 700 / 8), then 0, then 10 x 400 / 8
    tiles, _ = sm90.plan_tiles(qo, kv, False, 128)
    bases = sm90.mask_bases(tiles, qo, kv_lens, starts)
    want = {0: 0, 128: 128 * 700, 256: 256 * 700, 300: 26250 * 8}
    assert {int(t[0]): int(b) for t, b in zip(tiles, bases)} == want
    packed = torch.arange(37, dtype=torch.uint8)
    buf = sm90.mask_buffer(packed, torch.device("cpu"))
    assert buf.numel() % 16 == 0 and buf.numel() >= 37 + 64 and torch.equal(buf[:37], packed)
    assert int(buf[37:].sum()) == 0


def test_plan_tiles_of_192_rows():
    """plan_tiles with 192-row query tiles: a request's tiles start every 192 rows, the last
    holds the rest, and a causal tile's keys end at its last row's diagonal."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    qo = np.array([0, 400, 592], dtype=np.int32)  # 400 rows: 192 + 192 + 16; 192 rows: one tile
    kv = np.array([0, 1000, 1192], dtype=np.int32)
    tiles, active = sm90.plan_tiles(qo, kv, True, 128, None, -1, 192)
    by_start = {int(t[0]): t for t in tiles}
    assert sorted(by_start) == [0, 192, 384, 400] and active == 4
    assert [int(by_start[s][1]) for s in (0, 192, 384, 400)] == [192, 192, 16, 192]
    # request 0: diag = q_start + 1000 - 400; the tile at 192 sees keys up to 792 + 191
    assert int(by_start[192][4]) == 792 and int(by_start[192][6]) == 792 + 192
    assert int(by_start[192][5]) == -(-(792 + 192) // 128)


def test_key_tiles_the_spec_takes():
    """PrefillSm90Spec's key tiles: 176 at head_dim 128 only, 64 and 80 at head_dim 256 and
    only there, 128 elsewhere; its 192-row query tile at head_dim 64 only."""
    from flashinfer_jit.prefill.spec import PrefillSm90Spec
    for head_dim, tile in ((256, 64), (256, 80), (128, 176), (128, 128), (64, 128), (192, 128)):
        PrefillSm90Spec("bfloat16", head_dim, "none", key_tile=tile).validate()
    for head_dim, tile in ((256, 128), (128, 80), (64, 176), (192, 64)):
        with pytest.raises(ValueError, match="key_tile"):
            PrefillSm90Spec("bfloat16", head_dim, "none", key_tile=tile).validate()
    # 192-row query tiles: head_dim 64 on 128-key tiles only
    assert PrefillSm90Spec("bfloat16", 64, "causal", query_tile=192).validate().name.endswith("_m192")
    for head_dim, tile in ((128, 128), (256, 80), (192, 128)):
        with pytest.raises(ValueError, match="query_tile"):
            PrefillSm90Spec("bfloat16", head_dim, "none", key_tile=tile, query_tile=192).validate()


# --- soft cap and sliding window ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("options, head_dim, causal, dtype", [
    (dict(logits_soft_cap=30.0), 128, True, BF16),
    (dict(logits_soft_cap=50.0), 64, False, F16),
    (dict(window_left=200), 128, True, BF16),
    (dict(window_left=0), 128, True, F16),
    (dict(window_left=300), 128, False, BF16),
    (dict(window_left=77, logits_soft_cap=20.0), 256, True, BF16),
    (dict(window_left=1000), 64, True, BF16),
], ids=lambda v: str(v))
def test_fa3_soft_cap_and_window(options, head_dim, causal, dtype, hopper_workspace):
    """logits_soft_cap (cap x tanh(logit / cap), in the softmax's log2 units) and window_left
    (row at position pos sees keys >= pos - window_left; plan() starts each query tile at its
    first row's window) on the Hopper path: a mixed batch (long requests whose windows skip
    whole key tiles, a row past every window, padding) against the float64 reference and the
    mma.sync kernel, NaN-poisoned outputs."""
    gen = torch.Generator(device=DEV).manual_seed(head_dim + int(causal))
    torch_dtype = dtype_of(dtype)
    shapes = [(1000, 1000), (0, 9), (300, 2500), (129, 129), (5, 0), (64, 700), (1, 3000)]
    heads = (8, 2)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, heads, head_dim, torch_dtype, gen, q_scale=2.0)
    results = {}
    for backend in ("fa3", "fa2"):
        results[backend] = plan_and_run(hopper_workspace, backend, shapes, q, qo_indptr, kv, heads, head_dim,
                                        torch_dtype, causal, **options)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal, **options)
    tol = tolerance(dtype)
    for out, lse in results.values():
        check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")


def test_plan_tiles_start_at_the_window():
    """sm90.plan_tiles with window_left: a tile's first key tile is its first row's window
    start over the key tile (column 7), its keys those from there (column 6), the heaviest
    by key tiles visited first; a tile past every key visits none."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    qo = np.array([0, 1000, 1001])
    kv = np.array([0, 1000, 4000])
    tiles, active = sm90.plan_tiles(qo, kv, True, 128, None, 200)
    by_row0 = {int(t[0]): t for t in tiles}
    t = by_row0[512]  # request 0, rows 512-639: causal up to 639, window from 312
    assert (int(t[5]), int(t[7]), int(t[6])) == (5, 312 // 128, 640 - 312)
    t = by_row0[1000]  # request 1, one row at position 2999: keys 2799..2999
    assert (int(t[5]), int(t[7]), int(t[6])) == (24, 2799 // 128, 3000 - 2799)
    assert active == 9 and int(tiles[0][5] - tiles[0][7]) == max(int(r[5] - r[7]) for r in tiles)
    none, active = sm90.plan_tiles(np.array([0, 4]), np.array([0, 0]), False, 128, None, 5)
    assert active == 0 and int(none[0][5]) == 0 and int(none[0][7]) == 0


# --- the key tile a batch takes ------------------------------------------------------------------
def test_short_requests_take_the_narrower_key_tile():
    """Without a causal mask at head_dim 128, a batch keeps the 176-key tile unless it computes
    more than WIDE_TILE_MAX_PAD times the keys of 128-key tiles (sm90.narrower_tile: 1.0, so
    176 stays only where it computes no more keys)."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    assert sm90.WIDE_TILE_MAX_PAD == 1.0
    assert sm90.narrower_tile(np.array([256] * 64))  # 352 keys a tile at 176, 256 at 128
    assert sm90.narrower_tile(np.array([128, 128]))
    assert sm90.narrower_tile(np.array([4096] * 4))  # 4224 against 4096: 1.03
    assert sm90.narrower_tile(np.array([1024] * 16))  # 1056 against 1024
    assert not sm90.narrower_tile(np.array([176] * 8))
    assert not sm90.narrower_tile(np.array([1050] * 3))  # 1056 against 1152


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len,key_tile", [(256, 128), (1050, 176)])
def test_fa3_key_tile_follows_the_batch(kv_len, key_tile, hopper_workspace):
    """The same non-causal head_dim-128 wrapper runs 128-key tiles for 256-key requests and
    176-key tiles for long ones (the plan's spec says which), each against the reference."""
    gen = torch.Generator(device=DEV).manual_seed(kv_len)
    shapes = [(kv_len, kv_len), (200, kv_len), (kv_len, kv_len)]
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, 128, torch.bfloat16, gen, q_scale=2.0)
    wrapper = fa3_wrapper(hopper_workspace)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (128, 128), causal=False, q_data_type=torch.bfloat16)
    assert wrapper._plan.spec.key_tile == key_tile
    out, lse = run_poisoned(wrapper, q, kv, 128, torch.bfloat16, True)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, False)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(torch.bfloat16))


def test_auto_rule_by_head_dim():
    """auto's measured thresholds (sm90.auto_takes): mean query tokens a request >= 64 and mean
    keys a query tile >= AUTO_MIN_KEYS[head_dim] (192 at 128, 512 at 64 and (192, 128), 2048 at
    256), with or without the options it takes."""
    import types
    import numpy as np
    from flashinfer_jit.prefill import sm90
    long_q = np.array([512, 512])
    for head_dim, below, at in ((128, 191, 192), (64, 511, 512), (256, 2047, 2048), (192, 511, 512)):
        c = types.SimpleNamespace(head_dim_qk=head_dim, soft_cap=0.0, window_left=-1, mask="causal", page_size=16)
        assert sm90.auto_takes(c, long_q, np.array([at, at]))
        for measured in (dict(soft_cap=30.0), dict(window_left=256), dict(mask="custom")):  # measured faster on fa3
            assert sm90.auto_takes(types.SimpleNamespace(**dict(vars(c), **measured)), long_q, np.array([at, at]))
        assert not sm90.auto_takes(c, long_q, np.array([below, below]))
        assert not sm90.auto_takes(c, np.array([63, 63]), np.array([at * 4, at * 4]))  # decode-like rows


@pytest.mark.parametrize("page_size, causal, expected", [
    (8, True, "fa2"),   # 64 x 256 causal: 192 keys a tile, under AUTO_MIN_KEYS_PAGE_8
    (8, False, "fa3"),  # 256 keys a tile
    (1, True, "fa3"),   # pages of 1: the copy wins on every row measured
    (16, True, "fa3"),  # one TMA box a page: AUTO_MIN_KEYS alone
])
def test_auto_over_the_copy_of_small_pages(page_size, causal, expected, monkeypatch):
    """backend="auto" for pages of 8 tokens (over the repacked copy) takes the Hopper path only
    from AUTO_MIN_KEYS_PAGE_8 keys a query tile; pages of 1 and 16 keep AUTO_MIN_KEYS. Planned
    on the CPU with the arch check passed (64 requests of 256 tokens, hd128)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    lens = [256] * 64
    pages = [-(-n // page_size) for n in lens]
    w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", backend="auto")
    w.plan(_cpu_indptr(lens), _cpu_indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
           torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32), *LLAMA, 128,
           page_size, causal=causal, q_data_type=torch.bfloat16)
    assert w.planned_backend == expected


@pytest.mark.parametrize("batch", sorted(AUTO_BATCHES))
def test_auto_decides_on_the_cpu_as_on_sm90(batch, monkeypatch):
    """The same decisions as test_auto_picks_the_backend, planned on the CPU with the arch check
    passed (plan() decides on the host; the GPU test then runs what it planned)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    shapes, expected = AUTO_BATCHES[batch]
    wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD")
    wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 128,
                 causal=True, q_data_type=torch.bfloat16)
    assert wrapper.planned_backend == expected



@pytest.mark.parametrize("backend", ["fa3", "auto"])
@pytest.mark.parametrize("shapes", [[(4, 4096)] * 2, [(300, 300), (77, 200)]])
def test_fp8_attention_plans_its_form_on_the_cpu(backend, shapes, monkeypatch):
    """q_data_type float8_e4m3fn plans the Hopper kernel's fp8 form (the spec's dtype the
    output's, float16 unless o_data_type says otherwise; 128-key tiles, where the 16-bit kernel
    of these options takes 176) under "fa3" and "auto", short queries too (no other kernel takes
    fp8 q)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    for o_dtype, name in ((None, F16), (torch.bfloat16, BF16)):
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", backend=backend)
        wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 128,
                     q_data_type=torch.float8_e4m3fn, kv_data_type="float8_e4m3fn", o_data_type=o_dtype)
        assert wrapper.planned_backend == "fa3"
        assert wrapper._plan.spec == PrefillSm90Spec(name, 128, "none", fp8=True)


@pytest.mark.parametrize("wrapper_kind, options, message", [
    ("ragged", dict(backend="fa2"), "FP8 attention runs on the Hopper kernel only"),
    ("ragged", dict(head_dim=64), "at head_dim 64"),
    ("ragged", dict(logits_soft_cap=30.0), "a soft cap"),
    ("ragged", dict(pos_encoding_mode="ROPE_LLAMA"), "a positional encoding"),
    ("ragged", dict(use_cuda_graph=True), "use_cuda_graph=True"),
    ("ragged", dict(kv_data_type=torch.bfloat16), "takes e4m3 K and V"),
    ("ragged", dict(o_data_type=torch.float8_e4m3fn), "o_data_type: expected one of"),
    ("ragged", dict(q_data_type=torch.float8_e5m2), "q_data_type: expected one of"),
    ("paged", {}, "with a paged cache"),
])
def test_fp8_attention_refuses_what_its_form_does_not_take(wrapper_kind, options, message, monkeypatch):
    """What the fp8 form does not take is a ValueError at plan() naming it, under "auto" too
    (the mma.sync kernel takes no fp8 q to fall back to)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    options = dict(options)
    ctor = dict(backend=options.pop("backend", "auto"), use_cuda_graph=options.pop("use_cuda_graph", False))
    head_dim = options.pop("head_dim", 128)
    plan = dict(q_data_type=torch.float8_e4m3fn) | options
    qo = _cpu_indptr([100, 200])
    if wrapper_kind == "ragged":
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", **ctor)
        call = lambda: wrapper.plan(qo, qo, *LLAMA, head_dim, causal=True, **plan)  # noqa: E731
    else:
        wrapper = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", **ctor)
        call = lambda: wrapper.plan(qo, _cpu_indptr([7, 13]), torch.arange(20, dtype=torch.int32),  # noqa: E731
                                    torch.tensor([4, 8], dtype=torch.int32), *LLAMA, head_dim, 16, causal=True, **plan)
    with pytest.raises(ValueError, match=message):
        call()


def test_fp8_attention_names_the_arch_off_sm90():
    """Off sm_90 (here: a CPU workspace) FP8 attention is a ValueError naming the arch, under
    "auto" as under "fa3"."""
    for backend in ("auto", "fa3"):
        wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", backend=backend)
        with pytest.raises(ValueError, match="float8_e4m3fn .FP8 attention.: .*sm_90"):
            wrapper.plan(_cpu_indptr([100]), _cpu_indptr([100]), *LLAMA, 128, q_data_type=torch.float8_e4m3fn)


def test_fp8_attention_spec_holds_its_limits():
    with pytest.raises(ValueError, match="fp8"):
        PrefillSm90Spec(BF16, 64, "causal", fp8=True).validate()
    with pytest.raises(ValueError, match="fp8"):
        PrefillSm90Spec(BF16, 128, "none", key_tile=176, fp8=True).validate()
    assert PrefillSm90Spec(BF16, 128, "causal", fp8=True).validate().name.endswith("_e4m3")


@pytest.mark.parametrize("shapes, options, rows", [
    ([(4096, 4096)] * 2, {}, 192),                          # causal, ~2k keys a 128-row tile
    ([(1024, 1024)] * 4, dict(causal=False), 192),          # 1024 keys a tile
    ([(1024, 1024)] * 4, {}, 128),                          # causal: ~576 keys a tile
    ([(256, 256)] * 16, dict(causal=False), 128),           # 256 keys
    ([(4096, 4096)] * 2, dict(logits_soft_cap=30.0), 128),  # options the 192-row tile is not measured with
    ([(4096, 4096)] * 2, dict(window_left=512), 128),
])
def test_query_tile_of_head_dim_64(shapes, options, rows, monkeypatch):
    """sm90.query_tile through plan(): head_dim 64 takes 192-row query tiles where its 128-row
    tiles visit QUERY_TILE_MIN_KEYS keys or more on average, without a soft cap or a window;
    planned on the CPU with the arch check passed."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", backend="fa3")
    kwargs = dict(dict(causal=True), **options)
    wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 64,
                 q_data_type=torch.bfloat16, **kwargs)
    assert wrapper._plan.spec.query_tile == rows
    wrapper._force_query_tile = 128  # a pin wins
    wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 64,
                 q_data_type=torch.bfloat16, **kwargs)
    assert wrapper._plan.spec.query_tile == 128


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_fa3_head_dim_64_picks_192_rows_on_long_tiles(causal, hopper_workspace):
    """Unpinned, a head_dim 64 batch of long requests plans 192-row query tiles and matches the
    float64 reference (a causal diagonal inside the third warpgroup's rows, a request shorter
    than one tile)."""
    shapes = [(1500, 1500), (2000, 2600), (100, 2100)]
    gen = torch.Generator(device=DEV).manual_seed(64192 + causal)
    q, qo_indptr, k_rows, v_rows, kv = ragged_inputs(shapes, LLAMA, 64, torch.bfloat16, gen)
    wrapper = fa3_wrapper(hopper_workspace)
    plan_kv(wrapper, qo_indptr, kv, *LLAMA, (64, 64), causal=causal, q_data_type=torch.bfloat16)
    assert wrapper._plan.spec.query_tile == 192
    out, lse = run_poisoned(wrapper, q, kv, 64, torch.bfloat16)
    ref_out, ref_lse = reference_by_rows(q, shapes, k_rows, v_rows, causal)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tolerance(BF16))


def test_alibi_plan_ships_each_tiles_shift(monkeypatch):
    """pos_encoding_mode="ALIBI" on the Hopper path (planned on the CPU with the arch check
    passed): the ALiBi module, and each tile's `keys` replaced by its request's kv_len - qo_len
    (the LSE's shift the kernel adds); with a soft cap, plan()'s ValueError."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    shapes = [(300, 700), (129, 129), (0, 5), (40, 1000)]
    wrapper = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", backend="fa3")
    wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 128,
                 causal=True, pos_encoding_mode="ALIBI", q_data_type=torch.bfloat16)
    plan = wrapper._plan
    assert plan.spec.alibi and "alibi" in plan.spec.name
    work = plan.work.cpu().numpy()
    tiles = work[sm90.WORK_HEADER: sm90.WORK_HEADER + sm90.TILE_INTS * (work[0] // LLAMA[0])]
    tiles = tiles.reshape(-1, sm90.TILE_INTS)
    qo = np.cumsum([0] + [m for m, _ in shapes])
    for t in tiles:
        b = int(np.searchsorted(qo, t[0], side="right") - 1)
        assert t[6] == shapes[b][1] - shapes[b][0], (t, b)
    with pytest.raises(ValueError, match="ALIBI"):
        wrapper.plan(_cpu_indptr([m for m, _ in shapes]), _cpu_indptr([n for _, n in shapes]), *LLAMA, 128,
                     causal=True, pos_encoding_mode="ALIBI", logits_soft_cap=30.0, q_data_type=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, source, dtype, head_dim", [(True, "ragged", BF16, 128), (False, "ragged", F16, 64),
                                                              (True, "paged", BF16, 128), (False, "paged", BF16, 256)])
def test_fa3_alibi(causal, source, dtype, head_dim, hopper_workspace):
    """pos_encoding_mode="ALIBI" on the Hopper path: FlashInfer's slopes and bias slope x (key -
    row), the LSE FlashInfer's (the kernel's shift added back), against the float64 reference
    and the mma.sync kernel, outputs poisoned; requests without queries or keys, one shorter
    than a tile, 12 query heads (not a power of two: the odd slopes)."""
    gen = torch.Generator(device=DEV).manual_seed(333 + causal + head_dim)
    rnd = random.Random(333)
    shapes = [(300, 700), (0, 9), (17, 400), (129, 129), (5, 0), (64, 1000)]
    heads = (12, 4)
    torch_dtype = dtype_of(dtype)
    kv_lens = [n for _, n in shapes]
    q, qo_indptr, k_rows, v_rows, _ = ragged_inputs(shapes, heads, head_dim, torch_dtype, gen)
    kv, results = _on_both_kernels(hopper_workspace, source, k_rows, v_rows, kv_lens, rnd, q, qo_indptr, heads,
                                   head_dim, torch_dtype, causal=causal, pos_encoding_mode="ALIBI")
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal, pos_encoding_mode="ALIBI")
    tol = tolerance(dtype)
    check_prefill(*results["fa3"], ref_out, ref_lse, shapes, tol)
    check_agree(*results["fa3"], *results["fa2"], shapes, tol * AGREE_FACTOR, "fa3", "fa2")

# --- vLLM block tables on the Hopper path ----------------------------------------------------------
def test_block_table_ids_view_and_offsets():
    """sm90.block_table_ids: a 1-D view from row 0 to the end of the last row of a (possibly
    row-strided) block table, request b's first page id at b x the row stride; seq_lens past
    the table's pages, or negative, are ValueErrors naming seq_lens."""
    import numpy as np
    from flashinfer_jit.prefill import sm90
    base = torch.arange(4 * 10, dtype=torch.int32).reshape(4, 10)
    table = base[:, :6]  # row stride 10, 6 pages a request
    ids, first, v_ids = sm90.block_table_ids(table, np.array([96, 1, 0, 50]), 16)
    assert first.tolist() == [0, 10, 20, 30, 40] and v_ids == 0
    assert ids.shape == (36,) and ids.data_ptr() == table.data_ptr()
    for b in range(4):
        assert torch.equal(ids[first[b]:first[b] + 6], table[b])
    separate = torch.arange(4 * 2 * 8, dtype=torch.int32).reshape(4, 2, 8)[..., :6]  # K ids, V ids
    ids, first, v_ids = sm90.block_table_ids(separate, np.array([96, 1, 0, 50]), 16)
    assert first.tolist() == [0, 16, 32, 48, 64] and v_ids == 8 and ids.shape == (3 * 16 + 8 + 6,)
    for b in range(4):
        assert torch.equal(ids[first[b]:first[b] + 6], separate[b, 0])
        assert torch.equal(ids[first[b] + v_ids:first[b] + v_ids + 6], separate[b, 1])
    with pytest.raises(ValueError, match="seq_lens: request 0's 97 keys need 7 pages"):
        sm90.block_table_ids(table, np.array([97, 1, 0, 50]), 16)
    with pytest.raises(ValueError, match="seq_lens: expected lengths >= 0"):
        sm90.block_table_ids(table, np.array([1, -1, 0, 0]), 16)
    empty, first, _ = sm90.block_table_ids(torch.zeros((0, 6), dtype=torch.int32), np.zeros(0, dtype=np.int64), 16)
    assert empty.numel() == 0 and first.tolist() == [0]


@pytest.mark.parametrize("table", ["csr", "block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager", "graph"])
def test_block_table_plan_on_the_cpu_names_sm90(table, use_cuda_graph):
    """Every page table, CUDA-graph wrappers included, passes the Hopper path's feature
    checks: backend="fa3" then names the arch."""
    with pytest.raises(ValueError, match="sm_90"):
        _cpu_paged_plan(table=table, use_cuda_graph=use_cuda_graph)


def test_block_table_plan_matches_the_csr_plan(monkeypatch):
    """With the arch check passed, a block-table plan's work list equals the CSR plan's but
    for each tile's first page index (b x the row stride instead of the CSR indptr), and its
    page-id vector holds the table's rows at those offsets."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    monkeypatch.setattr(sm90, "sm_count", lambda device: 132)
    page_size, qo, kv = 16, [300, 1, 129, 64], [300, 700, 129, 1000]
    pages = [-(-n // page_size) for n in kv]
    max_pages = max(pages) + 3
    ids = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(5)).int()
    table = torch.full((len(kv), max_pages), -1, dtype=torch.int32)
    starts = list(itertools.accumulate(pages, initial=0))
    for b, p in enumerate(pages):
        table[b, :p] = ids[starts[b]:starts[b] + p]
    v_ids = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(6)).int()
    separate = torch.full((len(kv), 2, max_pages), -1, dtype=torch.int32)
    for b, p in enumerate(pages):
        separate[b, 0, :p] = ids[starts[b]:starts[b] + p]
        separate[b, 1, :p] = v_ids[starts[b]:starts[b] + p]
    plans = {}
    for form in ("csr", "block_table", "block_table_kv_separate"):
        w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", backend="fa3")
        args = dict(num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, page_size=page_size, causal=True,
                    q_data_type=torch.bfloat16)
        if form == "csr":
            w.plan(_cpu_indptr(qo), _cpu_indptr(pages), ids, torch.tensor(
                [n - page_size * (p - 1) for n, p in zip(kv, pages)], dtype=torch.int32), **args)
        else:
            w.plan(_cpu_indptr(qo), None, None, None, block_tables=table if form == "block_table" else separate,
                   seq_lens=torch.tensor(kv, dtype=torch.int32), **args)
        assert w.planned_backend == "fa3"
        plans[form] = w._plan
    work = {f: p.work[4:p.work_ints].reshape(-1, 8) for f, p in plans.items()}
    assert [int(p.work[2]) for p in plans.values()] == [0, 0, max_pages]  # V ids past K's
    assert torch.equal(work["csr"][:, [0, 1, 3, 4, 5]], work["block_table"][:, [0, 1, 3, 4, 5]])
    assert torch.equal(work["csr"][:, [0, 1, 3, 4, 5]], work["block_table_kv_separate"][:, [0, 1, 3, 4, 5]])
    req_of = {s: b for b, s in enumerate(starts[:-1])}
    for row_csr, row_bt, row_sep in zip(*(work[f].tolist() for f in plans)):
        b = req_of[row_csr[2]]
        assert row_bt[2] == b * max_pages and row_sep[2] == 2 * b * max_pages
        n = pages[b]
        csr_ids = plans["csr"].page_ids[row_csr[2]:row_csr[2] + n]
        assert torch.equal(plans["block_table"].page_ids[row_bt[2]:row_bt[2] + n], csr_ids)
        sep = plans["block_table_kv_separate"].page_ids
        assert torch.equal(sep[row_sep[2]:row_sep[2] + n], csr_ids)
        assert torch.equal(sep[row_sep[2] + max_pages:row_sep[2] + max_pages + n], v_ids[starts[b]:starts[b] + n])


@pytest.mark.parametrize("seed", range(6))
def test_common_form_plan_equals_the_general_path(seed, monkeypatch):
    """The common form's plan (_sm90_plan_common: the work list planned in C++ into the plan
    buffer's slot) equals the general path's (numpy's tiles, forced by the extension's
    absence): work list, page ids, module, grid, query rows; ragged and CSR, causal or not,
    head_dim 64 / 128 / 256 (the 176-key tile and its narrowing, the 192-row tile), "auto"
    declining alike; and a wrong last_page_len length still raises the general path's error."""
    import random
    from flashinfer_jit.prefill import sm90
    from flashinfer_jit.prefill import wrapper as prefill_wrapper
    from flashinfer_jit.runtime import fastcall
    if fastcall.extension() is None:
        pytest.skip("the fij_fastcall extension is unavailable here")
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    common = prefill_wrapper._PrefillWrapper._sm90_plan_common
    taken = []

    def spy(self, *args):
        got = common(self, *args)
        taken.append(got is not prefill_wrapper._GENERAL)
        return got

    rnd = random.Random(seed)
    page_size = 16
    for _ in range(6):
        batch = rnd.randint(1, 9)
        qo_lens = [rnd.choice([0, 1, 64, 129, rnd.randint(0, 3000)]) for _ in range(batch)]
        kv_lens = [q + rnd.choice([0, 7, rnd.randint(0, 4000)]) for q in qo_lens]
        pages = [-(-k // page_size) for k in kv_lens]
        last = torch.tensor([k - (p - 1) * page_size if p else 0 for k, p in zip(kv_lens, pages)], dtype=torch.int32)
        ids = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed)).int()
        head_dim, causal = rnd.choice([64, 128, 256]), rnd.random() < 0.5
        backend = rnd.choice(["auto", "fa3"])
        plans = []
        for general in (False, True):
            taken.clear()
            if general:
                monkeypatch.setattr(fastcall, "extension", lambda: None)
            else:
                monkeypatch.setattr(prefill_wrapper._PrefillWrapper, "_sm90_plan_common", spy)
            ragged = rnd.random() < 0.5 if not general else ragged
            if ragged:
                w = fij.BatchPrefillWithRaggedKVCacheWrapper(_cpu_workspace(), "NHD", backend=backend)
                w.plan(_cpu_indptr(qo_lens), _cpu_indptr(kv_lens), *LLAMA, head_dim, causal=causal,
                       q_data_type=torch.bfloat16)
            else:
                w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", backend=backend)
                w.plan(_cpu_indptr(qo_lens), _cpu_indptr(pages), ids, last, *LLAMA, head_dim, page_size,
                       causal=causal, q_data_type=torch.bfloat16)
            plans.append((w.planned_backend, w._plan, getattr(w, "_kv_rows", None)))
            assert taken == ([] if general else [True])  # (the common form's path, then the general one)
            monkeypatch.undo()
            monkeypatch.setattr(sm90, "arch_error", lambda device: None)
        (fast_backend, fast, fast_rows), (slow_backend, slow, slow_rows) = plans
        assert fast_backend == slow_backend, (qo_lens, kv_lens, head_dim, causal, backend)
        if fast_backend != "fa3":
            continue
        assert fast.work_ints == slow.work_ints
        assert torch.equal(fast.work[:fast.work_ints], slow.work[:slow.work_ints])
        assert fast.spec == slow.spec and fast.grid == slow.grid and fast.qo_tokens == slow.qo_tokens
        assert torch.equal(fast.page_ids, slow.page_ids) and fast_rows == slow_rows
    # (a last_page_len longer than the batch: the general path's error, as before)
    w = fij.BatchPrefillWithPagedKVCacheWrapper(_cpu_workspace(), "NHD", backend="fa3")
    with pytest.raises(ValueError, match="paged_kv_last_page_len"):
        w.plan(_cpu_indptr([100]), _cpu_indptr([7]), torch.arange(7, dtype=torch.int32),
               torch.tensor([16, 16], dtype=torch.int32), *LLAMA, 128, 16, causal=True, q_data_type=torch.bfloat16)
    assert prefill_wrapper._GENERAL is not None


@pytest.mark.parametrize("seed", range(8))
def test_native_tiles_equal_plan_tiles(seed):
    """The C++ tile planner (fij_fastcall.sm90_tiles, csrc/hopper/prefill_sm90_plan.h) gives
    numpy's plan_tiles exactly: ragged, CSR and block-table sides, causal or not, windows, 128-
    and 192-row query tiles, every key tile; and refuses vectors of another form (-1: plan()
    then takes numpy's, which raises its errors)."""
    import random
    import numpy as np
    from flashinfer_jit.prefill import sm90
    from flashinfer_jit.runtime import fastcall
    if fastcall.extension() is None:
        pytest.skip("the fij_fastcall extension is unavailable here")
    rnd = random.Random(seed)
    planner = sm90.Sm90Planner(torch.device("cpu"), False)
    page_size = rnd.choice([16, 64])
    batch = rnd.randint(0, 12)
    qo_lens = [rnd.choice([0, 1, 64, 127, 128, 129, rnd.randint(0, 3000)]) for _ in range(batch)]
    kv_lens = [q + rnd.choice([0, 0, 7, rnd.randint(0, 5000)]) for q in qo_lens]
    i32 = lambda v: torch.tensor(list(v), dtype=torch.int32)  # noqa: E731
    qo = i32(np.cumsum([0] + qo_lens))
    pages = [-(-k // page_size) for k in kv_lens]
    indptr = i32(np.cumsum([0] + pages))
    last = i32([k - (p - 1) * page_size if p else 0 for k, p in zip(kv_lens, pages)])
    stride = max(pages + [1]) + rnd.randint(0, 3)
    sides = [(2, i32(np.cumsum([0] + kv_lens)), None, 0, 0, np.cumsum([0] + kv_lens), None),
             (0, indptr, last, page_size, 0, indptr.numpy(), np.array(kv_lens, dtype=np.int64)),
             (1, i32(kv_lens), None, page_size, stride, np.arange(batch + 1) * stride, np.array(kv_lens, np.int64))]
    for side, kv_a, kv_b, ps, row_stride, kv_np, lens_np in sides:
        for causal in (False, True):
            for window in (-1, 0, 300):
                for keys_a_tile, rows in ((128, 128), (176, 128), (80, 128), (128, 192)):
                    got = planner.native_tiles(side, qo, kv_a, kv_b, ps, row_stride, causal, keys_a_tile, window, rows)
                    want, active = sm90.plan_tiles(qo.numpy(), kv_np, causal, keys_a_tile, lens_np, window, rows)
                    assert got is not None
                    assert np.array_equal(got[0], want) and got[1] == active, (side, causal, window, keys_a_tile)
                    assert got[2] == int(want[:, 6].astype(np.int64).sum())
    ext = fastcall.extension()
    bad = (i32([0, 5, 3]), i32([0, 9, 9]))  # (a negative query length)
    assert ext.sm90_tiles(2, *bad, None, 0, 0, True, 128, -1, 128, planner._tiles.ctypes.data, 1, 0) == -1
    assert ext.sm90_tiles(2, qo.long(), i32(np.cumsum([0] + kv_lens)), None, 0, 0, True, 128, -1, 128,
                          planner._tiles.ctypes.data, 1, 0) == -1  # (int64)
    # the whole work list (heads > 0): the header, then the same tiles; the batch's scalars
    for side, kv_a, kv_b, ps, _, kv_np, lens_np in sides[:2]:
        want, active = sm90.plan_tiles(qo.numpy(), kv_np, True, 128, lens_np, -1, 128)
        got = planner.native_work(side, qo, kv_a, kv_b, ps, True, 128, -1, 128, 32)
        assert got is not None
        slot, tiles, got_active, keys, got_batch, qo_first, qo_last, kv_last = got
        assert np.array_equal(tiles, want) and got_active == active and got_batch == batch
        assert list(slot.array[:2]) == [want.shape[0] * 32, active * 32]
        assert (qo_first, qo_last, kv_last) == (0, int(qo[-1]), int(kv_a[-1]))
        assert keys == int(want[:, 6].astype(np.int64).sum())
        planner._plan_buffer.give_back()
