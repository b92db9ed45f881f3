"""FlashInfer's calls, written the way FlashInfer's users write them (issue 35).

`import flashinfer_jit as flashinfer` must take the calls of FlashInfer's own tests and of
the serving engines built on it: FlashInfer's names, argument order, defaults and return
values; index tensors in int32 or int64 (int32 used as given, int64 narrowed once);
output buffers given by the caller written in place; FlashInfer's submodule paths;
torch.compile(fullgraph=True) through the wrappers; a first-use build announced through
`logging`.

CPU tests (no marker, they run on CI) check what can be checked before a launch: names
and signatures, argument handling, and - with the launch replaced by a recorder
(`recorded_launches`) - which tensors would reach the kernel. Tests marked `gpu` run the
kernels on fresh random data, int64 against int32 and against flashinfer_jit/reference,
with NaN in every output buffer beforehand; their modules are in scripts/matrices/tests
(`test_matrix_covers_gpu_tests` keeps the two in step).

Sections: submodules and signatures / index dtypes / caller buffers and padding / RoPE +
fp8 names and backends / torch.compile / logging of first-use builds. Decode's calls
(the lead's part of the issue) get sections of their own.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kv_helpers import capture_graph

import flashinfer_jit as flashinfer
from flashinfer_jit.pipeline import jit, log
from flashinfer_jit.reference import append_paged_kv_cache_ref, get_batch_indices_positions_ref
from flashinfer_jit.reference.decode import decode_ref
from flashinfer_jit.reference.flatten import flatten_kv_cache_ref
from flashinfer_jit.reference.rope import (
    apply_rope_ref,
    cos_sin_cache_ref,
    positions_from_indptr,
    rope_quantize_append_ref,
    rope_quantize_ref,
)
from flashinfer_jit.runtime.page_table import block_page_table, csr_page_table
from flashinfer_jit.specs import AppendSpec, BatchIndicesSpec, FlattenSpec, RopeSpec

REPO = Path(__file__).resolve().parents[1]
DEV = "cuda"  # of the GPU tests
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
FP8_NAN = 0x7F  # a NaN byte in e4m3 and in e5m2


# --- generic helpers (module level: the decode sections use them too) ---------------------------
def rand(shape, dtype=BF16, gen=None, device=DEV) -> torch.Tensor:
    """Standard normal values in `dtype`, drawn on the CPU (reproducible), on `device`."""
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype full of NaN (fp8: the NaN byte): a poisoned output."""
    out = torch.empty_like(t)
    if out.element_size() == 1:
        out.view(torch.uint8).fill_(FP8_NAN)
    else:
        out.fill_(float("nan"))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(actual, expected, what: str) -> None:
    a, e = as_bytes(actual.cpu()), as_bytes(expected.cpu())
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    differ = int((a != e).sum())
    assert differ == 0, f"{what}: {differ} of {a.numel()} bytes differ"


def i64(t):
    return t.long() if isinstance(t, torch.Tensor) else t


def leaves(x) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else
            tuple(t.clone() for t in a) if isinstance(a, tuple) else a for a in args]


def paged_batch(before, append, page_size, gen, device=DEV, spare_pages=3) -> dict:
    """Requests with `before` tokens cached and `append` tokens appended: FlashInfer's CSR
    triple for the lengths after the append, on random pages (int32), plus append_indptr
    and seq_lens."""
    before, append = torch.tensor(before), torch.tensor(append)
    seq = before + append
    pages = (seq + page_size - 1) // page_size
    num_pages = int(pages.sum()) + spare_pages
    indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
    indptr[1:] = pages.cumsum(0)
    append_indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
    append_indptr[1:] = append.cumsum(0)
    last = torch.where(pages > 0, seq - (pages - 1) * page_size, 0)
    batch = {"append_indptr": append_indptr, "seq_lens": seq,
             "kv_indices": torch.randperm(num_pages, generator=gen)[: int(indptr[-1])],
             "kv_indptr": indptr, "kv_last_page_len": last}
    batch = {k: v.to(torch.int32).to(device) for k, v in batch.items()}
    batch.update(num_pages=num_pages, page_size=page_size, nnz=int(append.sum()))
    return batch


def gpu_specs_used() -> set:
    """Every module the GPU tests of this file build (keep in step with the tests)."""
    rope = {RopeSpec("bfloat16", "bfloat16", False, positions, cos_sin)
            for positions, cos_sin in (("pos_ids", "computed"), ("indptr", "computed"), ("pos_ids", "cache"))}
    rope |= {RopeSpec("bfloat16", "float8_e4m3fn", False, "pos_ids", "cache", table, layout)
             for table, layout in (("none", "NHD"), ("csr", "NHD"), ("csr", "HND"))}
    append = {AppendSpec("bfloat16", 128, layout, table)
              for layout, table in (("NHD", "csr"), ("NHD", "block_table"), ("HND", "block_table"))}
    flatten = {FlattenSpec("bfloat16", "bfloat16", 128, "NHD", table) for table in ("csr", "block_table")}
    return rope | append | flatten | {BatchIndicesSpec()}


def test_matrix_covers_gpu_tests():
    from flashinfer_jit.pipeline.matrix import parse_matrix

    listed = set(parse_matrix(REPO / "scripts" / "matrices" / "tests"))
    missing = sorted(s.name for s in gpu_specs_used() - listed)
    assert not missing, f"scripts/matrices/tests lacks modules the GPU tests use: {missing}"


# === submodules and signatures (CPU) =============================================================
# FlashInfer's public names of each module, for the features flashinfer_jit covers
FLASHINFER_MODULE_NAMES = {
    "page": ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"],
    "rope": ["apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
             "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
             "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
             "apply_rope_with_cos_sin_cache_inplace", "mla_rope_quantize_fp8", "rope_quantize_fp8",
             "rope_quantize_fp8_append_paged_kv_cache"],
    "cascade": ["merge_state", "merge_states"],
}

REQUIRED = inspect.Parameter.empty
_ROPE_TAIL = [("rotary_dim", None), ("interleave", False), ("rope_scale", 1), ("rope_theta", 1e4)]
_LLAMA31_TAIL = [("rotary_dim", None), ("interleave", False), ("rope_scale", 8), ("rope_theta", 5e5),
                 ("low_freq_factor", 1), ("high_freq_factor", 4), ("old_context_len", 8192)]
_FP8_TAIL = [("is_neox", True), ("quantize_dtype", None), ("quant_scale_q", 1.0), ("quant_scale_kv", 1.0)]
_FP8_OUTS = [("q_rope_out", None), ("k_rope_out", None), ("q_nope_out", None), ("k_nope_out", None),
             ("enable_pdl", False)]


def _required(*names):
    return [(n, REQUIRED) for n in names]


# FlashInfer's positional parameters (name, default) in order; REQUIRED where it has none.
# Defaults flashinfer_jit adds where FlashInfer requires a value (kv_indices=None beside
# page_table=) are allowed; a different default or order is not.
FLASHINFER_SIGNATURES = {
    "append_paged_kv_cache": _required("append_key", "append_value", "batch_indices", "positions",
                                       "paged_kv_cache", "kv_indices", "kv_indptr", "kv_last_page_len")
    + [("kv_layout", "NHD")],
    "get_batch_indices_positions": _required("append_indptr", "seq_lens", "nnz")
    + [("batch_indices", None), ("positions", None)],
    "get_seq_lens": _required("kv_indptr", "kv_last_page_len", "page_size"),
    "apply_rope": _required("q", "k", "indptr", "offsets") + _ROPE_TAIL,
    "apply_rope_inplace": _required("q", "k", "indptr", "offsets") + _ROPE_TAIL,
    "apply_rope_pos_ids": _required("q", "k", "pos_ids") + _ROPE_TAIL,
    "apply_rope_pos_ids_inplace": _required("q", "k", "pos_ids") + _ROPE_TAIL,
    "apply_llama31_rope": _required("q", "k", "indptr", "offsets") + _LLAMA31_TAIL,
    "apply_llama31_rope_inplace": _required("q", "k", "indptr", "offsets") + _LLAMA31_TAIL,
    "apply_llama31_rope_pos_ids": _required("q", "k", "pos_ids") + _LLAMA31_TAIL,
    "apply_llama31_rope_pos_ids_inplace": _required("q", "k", "pos_ids") + _LLAMA31_TAIL,
    "apply_rope_with_cos_sin_cache": _required("positions", "query", "key", "head_size", "cos_sin_cache")
    + [("is_neox", True)],
    "apply_rope_with_cos_sin_cache_inplace": _required("positions", "query", "key", "head_size",
                                                       "cos_sin_cache") + [("is_neox", True)],
    "rope_quantize_fp8": _required("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids")
    + _FP8_TAIL + _FP8_OUTS + [("backend", "cuda")],
    "mla_rope_quantize_fp8": _required("q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids")
    + _FP8_TAIL + _FP8_OUTS,
    "rope_quantize_fp8_append_paged_kv_cache": _required(
        "q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids", "paged_kv_cache",
        "kv_indices", "kv_indptr", "batch_indices", "positions")
    + _FP8_TAIL + [("page_size", 16), ("kv_layout", "NHD"), ("q_rope_out", None), ("q_nope_out", None),
                   ("enable_pdl", False)],
    "merge_state": _required("v_a", "s_a", "v_b", "s_b"),
    "merge_states": _required("v", "s"),
}


@pytest.mark.parametrize("module", sorted(FLASHINFER_MODULE_NAMES))
def test_submodule_paths_have_flashinfers_names(module):
    """`from flashinfer_jit.rope import apply_rope`, `flashinfer_jit.page.get_seq_lens`:
    the module exists at FlashInfer's path, its __all__ is FlashInfer's names, and each is
    the package's top-level function of that name."""
    import importlib

    mod = importlib.import_module(f"flashinfer_jit.{module}")
    assert getattr(flashinfer, module) is mod
    assert sorted(mod.__all__) == FLASHINFER_MODULE_NAMES[module]
    for name in mod.__all__:
        assert getattr(mod, name) is getattr(flashinfer, name), name
        assert name in flashinfer.__all__


@pytest.mark.parametrize("name", sorted(FLASHINFER_SIGNATURES))
def test_signatures_follow_flashinfer(name):
    params = [p for p in inspect.signature(getattr(flashinfer, name)).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    expected = FLASHINFER_SIGNATURES[name]
    assert [p.name for p in params[: len(expected)]] == [n for n, _ in expected], name
    for p, (pname, default) in zip(params, expected):
        if default is not REQUIRED:
            assert p.default == default and type(p.default) in (type(default), int, float), (name, pname)
    extra_positional = params[len(expected):]
    assert not extra_positional, f"{name}: positional parameters FlashInfer lacks: {extra_positional}"


def test_import_touches_neither_gpu_nor_disk(tmp_path):
    """Importing the package and FlashInfer's submodule paths reads no cache directory,
    starts no CUDA context and configures no logging."""
    root = tmp_path / "never-created"
    code = textwrap.dedent("""
        import json, logging, torch
        import flashinfer_jit as flashinfer
        from flashinfer_jit.page import get_batch_indices_positions
        from flashinfer_jit.rope import mla_rope_quantize_fp8
        from flashinfer_jit.cascade import merge_states
        flashinfer.page, flashinfer.rope, flashinfer.cascade, flashinfer.mla_rope_quantize_fp8
        print(json.dumps({"cuda": torch.cuda.is_initialized(),
                          "handlers": len(logging.getLogger("flashinfer_jit").handlers)}))
    """)
    out = _run_python(code, FLASHINFER_JIT_CACHE_DIR=str(root))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"cuda": False, "handlers": 0}
    assert not root.exists()


# === index dtypes: int32 as given, int64 narrowed once ============================================
@pytest.fixture
def recorded_launches(monkeypatch):
    """The wrappers run on CPU tensors up to their launch, which is recorded instead of
    made: the CUDA-device checks accept CPU tensors and every op lookup returns a
    recorder. Returns the list of recorded argument tuples (one per launch)."""
    from flashinfer_jit.kvcache import append, flatten, rope

    launches = []

    def launcher(*_config):
        return lambda *args: launches.append(args)

    class Module:  # get_module(spec).<op> for the wrappers that look modules up directly
        def __getattr__(self, op):
            return launcher()

    for mod in (append, rope):
        monkeypatch.setattr(mod, "same_cuda_device", lambda ts: all(t.device == ts[0].device for t in ts))
    for mod in (append, rope, flatten):
        monkeypatch.setattr(mod, "expect_same_cuda_device", lambda named: None)
    for mod in (append, flatten):
        monkeypatch.setattr(mod, "get_module", lambda spec: Module())
    for mod, name in ((append, "_append_op"), (rope, "_rope_op")):
        monkeypatch.setattr(mod, name, launcher)
    return launches


def _cpu_batch(gen):
    return paged_batch([5, 0, 21, 9], [3, 4, 0, 16], 16, gen, device="cpu")


def _index_cases():
    """name -> (call(ix), the index tensors given): `ix` is applied to every index tensor
    (identity or int64), so one case runs in both dtypes."""
    gen = torch.Generator().manual_seed(0)
    b = _cpu_batch(gen)
    nnz, heads, dim = b["nnz"] + 5, 2, 128
    bi, pos = get_batch_indices_positions_ref(b["append_indptr"], b["seq_lens"], nnz)
    key, value = rand((nnz, heads, dim), gen=gen, device="cpu"), rand((nnz, heads, dim), gen=gen, device="cpu")
    cache = (rand((b["num_pages"], 16, heads, dim), gen=gen, device="cpu"),
             rand((b["num_pages"], 16, heads, dim), gen=gen, device="cpu"))
    fp8_cache = tuple(c.to(E4M3) for c in cache)
    q = rand((nnz, 4, dim), gen=gen, device="cpu")
    cs = cos_sin_cache_ref(256, dim)
    cs64 = cos_sin_cache_ref(256, 64)
    pos_ids = pos.clamp(min=0)
    offsets = torch.tensor([0, 7, 100, 3], dtype=torch.int32)
    bt = torch.zeros(4, 3, dtype=torch.int32)
    csr = (b["kv_indices"], b["kv_indptr"], b["kv_last_page_len"])
    mla = (rand((nnz, 4, 64), gen=gen, device="cpu"), rand((nnz, 64), gen=gen, device="cpu"),
           rand((nnz, 4, 512), gen=gen, device="cpu"), rand((nnz, 512), gen=gen, device="cpu"))
    return {
        "append_paged_kv_cache": (lambda ix: flashinfer.append_paged_kv_cache(
            key, value, ix(bi), ix(pos), cache, *map(ix, csr)), (bi, pos, *csr)),
        "append_paged_kv_cache(page_table=block_page_table)": (lambda ix: flashinfer.append_paged_kv_cache(
            key, value, ix(bi), ix(pos), cache, page_table=block_page_table(ix(bt), ix(b["seq_lens"]))),
            (bi, pos, bt, b["seq_lens"])),
        "get_batch_indices_positions": (lambda ix: flashinfer.get_batch_indices_positions(
            ix(b["append_indptr"]), ix(b["seq_lens"]), nnz), (b["append_indptr"], b["seq_lens"])),
        "apply_rope_pos_ids": (lambda ix: flashinfer.apply_rope_pos_ids(q, key, ix(pos_ids)), (pos_ids,)),
        "apply_rope_inplace": (lambda ix: flashinfer.apply_rope_inplace(
            q.clone(), key.clone(), ix(b["append_indptr"]), ix(offsets)), (b["append_indptr"], offsets)),
        "apply_llama31_rope": (lambda ix: flashinfer.apply_llama31_rope(
            q, key, ix(b["append_indptr"]), ix(offsets)), (b["append_indptr"], offsets)),
        "apply_llama31_rope_pos_ids_inplace": (lambda ix: flashinfer.apply_llama31_rope_pos_ids_inplace(
            q.clone(), key.clone(), ix(pos_ids)), (pos_ids,)),
        "apply_rope_with_cos_sin_cache": (lambda ix: flashinfer.apply_rope_with_cos_sin_cache(
            ix(pos_ids), q.flatten(1), key.flatten(1), dim, cs), (pos_ids,)),
        "rope_quantize_fp8": (lambda ix: flashinfer.rope_quantize_fp8(
            q, key, None, None, cs, ix(pos_ids)), (pos_ids,)),
        "mla_rope_quantize_fp8": (lambda ix: flashinfer.mla_rope_quantize_fp8(
            *mla, cs64, ix(pos_ids)), (pos_ids,)),
        "rope_quantize_fp8_append_paged_kv_cache": (
            lambda ix: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                q, key, None, None, value, cs, ix(pos_ids), fp8_cache, ix(b["kv_indices"]), ix(b["kv_indptr"]),
                ix(bi), ix(pos)), (pos_ids, b["kv_indices"], b["kv_indptr"], bi, pos)),
        "rope_quantize_fp8_append_paged_kv_cache(MLA)": (
            lambda ix: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                *mla[:4], None, cs64, ix(pos_ids), (torch.zeros(b["num_pages"], 16, 512, dtype=E4M3),
                                                    torch.zeros(b["num_pages"], 16, 64, dtype=E4M3)),
                ix(b["kv_indices"]), ix(b["kv_indptr"]), ix(bi), ix(pos)),
            (pos_ids, b["kv_indices"], b["kv_indptr"], bi, pos)),
        "flatten_kv_cache": (lambda ix: flashinfer.flatten_kv_cache(
            *cache, ix(b["seq_lens"]), (ix(b["kv_indptr"]), ix(b["kv_indices"])), out_size=64),
            (b["kv_indptr"], b["kv_indices"])),  # kv_seqlens reach the kernel as their cumsum
        "flatten_kv_cache(block table)": (lambda ix: flashinfer.flatten_kv_cache(
            *cache, ix(b["seq_lens"]), ix(bt), out_size=64), (b["seq_lens"], bt)),
    }


INDEX_CASES = sorted(_index_cases())


def _launch_tensors(launch) -> list:
    """The tensors a launch reads or writes (0-element placeholders of absent parts left out:
    the fast and the detailed path make different ones)."""
    flat = []
    for a in launch:
        flat += list(a) if isinstance(a, (list, tuple)) else [a]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.numel()]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_int64_indices_reach_the_kernel_as_int32(case, recorded_launches):
    """The same call with int32 and with int64 index tensors launches with equal int32
    arguments; int32 tensors reach the launch as given (no copy)."""
    call, given = _index_cases()[case]
    call(lambda t: t)
    call(i64)
    assert len(recorded_launches) == 2
    as_given, narrowed = (_launch_tensors(launch) for launch in recorded_launches)
    assert len(as_given) == len(narrowed)
    assert [(a.dtype, a.shape) for a in as_given] == [(b.dtype, b.shape) for b in narrowed], case
    for t in given:
        slots = [i for i, a in enumerate(as_given) if a is t]
        assert slots, f"{case}: an int32 index was copied"
        assert all(torch.equal(narrowed[i], t) for i in slots), f"{case}: an index changed in narrowing"
    assert not any(a.dtype == torch.int64 for a in narrowed), f"{case}: an int64 tensor reached the launch"


@pytest.mark.parametrize("case", INDEX_CASES)
@pytest.mark.parametrize("dtype", [torch.int16, torch.float32], ids=["int16", "float32"])
def test_other_index_dtypes_are_a_type_error(case, dtype, recorded_launches):
    """Any index dtype but int32 and int64 is a TypeError naming the argument, before launch."""
    call, _ = _index_cases()[case]
    with pytest.raises(TypeError, match="int32 or int64"):
        call(lambda t: t.to(dtype))
    assert recorded_launches == []


def test_int32_page_tables_are_used_as_given_int64_narrowed():
    gen = torch.Generator().manual_seed(1)
    b = _cpu_batch(gen)
    csr = (b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"])
    table = csr_page_table(*csr)
    assert all(t is g for t, g in zip(table.tensors, csr))
    narrowed = csr_page_table(*map(i64, csr))
    assert all(t.dtype == torch.int32 and torch.equal(t, g) for t, g in zip(narrowed.tensors, csr))
    bt = torch.randint(0, 9, (4, 3), dtype=torch.int32)
    assert block_page_table(bt, b["seq_lens"]).tensors[0] is bt
    wide = block_page_table(i64(bt), i64(b["seq_lens"]))
    assert [t.dtype for t in wide.tensors] == [torch.int32, torch.int32]
    assert torch.equal(wide.tensors[0], bt) and torch.equal(wide.tensors[1], b["seq_lens"])


def test_get_seq_lens_int64():
    kv_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    last = torch.tensor([5, 0, 16, 1], dtype=torch.int32)
    want = [2 * 16 + 5, 0, 16, 4 * 16 + 1]
    for ix in (lambda t: t, i64):
        got = flashinfer.page.get_seq_lens(ix(kv_indptr), ix(last), 16)
        assert got.dtype == torch.int32 and got.tolist() == want
    with pytest.raises(TypeError, match="kv_last_page_len.*int32 or int64"):
        flashinfer.get_seq_lens(kv_indptr, last.float(), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["csr", "block_table"])
def test_append_int64_indices_match_int32_and_reference(table):
    gen = torch.Generator().manual_seed(2)
    b = paged_batch([37, 0, 5, 60], [3, 20, 0, 9], 16, gen)
    heads, dim = 4, 128
    key, value = rand((b["nnz"], heads, dim), gen=gen), rand((b["nnz"], heads, dim), gen=gen)
    bi, pos = flashinfer.get_batch_indices_positions(b["append_indptr"], b["seq_lens"], b["nnz"])
    cache = (rand((b["num_pages"], 16, heads, dim), gen=gen), rand((b["num_pages"], 16, heads, dim), gen=gen))
    if table == "csr":
        page_table = csr_page_table(b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"])
        kwargs = lambda ix: dict(kv_indices=ix(b["kv_indices"]), kv_indptr=ix(b["kv_indptr"]),  # noqa: E731
                                 kv_last_page_len=ix(b["kv_last_page_len"]))
    else:
        bt = torch.full((4, 8), b["num_pages"] - 1, dtype=torch.int32, device=DEV)
        for r in range(4):
            lo, hi = int(b["kv_indptr"][r]), int(b["kv_indptr"][r + 1])
            bt[r, : hi - lo] = b["kv_indices"][lo:hi]
        page_table = block_page_table(bt, b["seq_lens"])
        kwargs = lambda ix: dict(page_table=block_page_table(ix(bt), ix(b["seq_lens"])))  # noqa: E731
    k_ref, v_ref = append_paged_kv_cache_ref(key, value, bi, pos, *cache, page_table, "NHD")
    results = []
    for ix in (lambda t: t, i64):
        c = tuple(t.clone() for t in cache)
        flashinfer.append_paged_kv_cache(key, value, ix(bi), ix(pos), c, **kwargs(ix))
        results.append(c)
    torch.cuda.synchronize()
    for c in results:
        assert_same_bytes(c[0], k_ref, "K cache")
        assert_same_bytes(c[1], v_ref, "V cache")


@pytest.mark.gpu
def test_rope_int64_positions_match_int32_and_reference():
    """Every RoPE form with int64 pos_ids / indptr / offsets gives the int32 call's bits,
    and those match the float64 reference."""
    gen = torch.Generator().manual_seed(3)
    lens = [7, 0, 130, 64]
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 5, 1000, 9000], dtype=torch.int32, device=DEV)
    nnz = sum(lens)
    q, k = rand((nnz, 32, 128), gen=gen), rand((nnz, 8, 128), gen=gen)
    pos = positions_from_indptr(indptr, offsets).to(DEV)
    cs = cos_sin_cache_ref(16384, 128).to(DEV)
    calls = {
        "apply_rope": (lambda ix: flashinfer.apply_rope(q, k, ix(indptr), ix(offsets)),
                       apply_rope_ref(q, k, pos)),
        "apply_rope_pos_ids": (lambda ix: flashinfer.apply_rope_pos_ids(q, k, ix(pos), rotary_dim=64),
                               apply_rope_ref(q, k, pos, rotary_dim=64)),
        "apply_llama31_rope": (lambda ix: flashinfer.apply_llama31_rope(q, k, ix(indptr), ix(offsets)),
                               apply_rope_ref(q, k, pos, rope_scale=8, rope_theta=5e5, llama31=(1, 4, 8192))),
        "apply_llama31_rope_pos_ids": (lambda ix: flashinfer.apply_llama31_rope_pos_ids(q, k, ix(pos)),
                                       apply_rope_ref(q, k, pos, rope_scale=8, rope_theta=5e5,
                                                      llama31=(1, 4, 8192))),
        "apply_rope_with_cos_sin_cache": (
            lambda ix: tuple(t.view(nnz, -1, 128) for t in flashinfer.apply_rope_with_cos_sin_cache(
                ix(pos), q.flatten(1), k.flatten(1), 128, cs)),
            apply_rope_ref(q, k, pos, cos_sin_cache=cs)),
    }
    for name, (call, refs) in calls.items():
        narrow, wide = call(lambda t: t), call(i64)
        for n, w, ref in zip(narrow, wide, refs):
            assert_same_bytes(w, n, f"{name}: int64 vs int32")
            err = (n.double().cpu() - ref).norm() / ref.norm()
            assert not torch.isnan(n).any() and err < 1.6e-2, f"{name}: relative error {err:.2e}"
    for name, inplace in (("apply_rope_pos_ids_inplace", flashinfer.apply_rope_pos_ids_inplace),
                          ("apply_llama31_rope_pos_ids_inplace", flashinfer.apply_llama31_rope_pos_ids_inplace)):
        outs = []
        for ix in (lambda t: t, i64):
            q2, k2 = q.clone(), k.clone()
            inplace(q2, k2, ix(pos))
            outs.append((q2, k2))
        assert_same_bytes(outs[1][0], outs[0][0], f"{name}: q")
        assert_same_bytes(outs[1][1], outs[0][1], f"{name}: k")


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["csr", "block_table"])
def test_flatten_int64_matches_int32_and_reference(table):
    gen = torch.Generator().manual_seed(4)
    b = paged_batch([37, 0, 16, 100], [0, 0, 0, 0], 16, gen)
    cache = (rand((b["num_pages"], 16, 4, 128), gen=gen), rand((b["num_pages"], 16, 4, 128), gen=gen))
    if table == "csr":
        arg = lambda ix: (ix(b["kv_indptr"]), ix(b["kv_indices"]))  # noqa: E731
        page_table = csr_page_table(b["kv_indptr"], b["kv_indices"])
    else:
        bt = torch.zeros(4, 8, dtype=torch.int32, device=DEV)
        for r in range(4):
            lo, hi = int(b["kv_indptr"][r]), int(b["kv_indptr"][r + 1])
            bt[r, : hi - lo] = b["kv_indices"][lo:hi]
        arg = lambda ix: ix(bt)  # noqa: E731
        page_table = block_page_table(bt, b["seq_lens"])
    out_size = int(b["seq_lens"].sum()) + 11
    ref = flatten_kv_cache_ref(*cache, b["seq_lens"], page_table, out_size)
    for ix in (lambda t: t, i64):
        outs = flashinfer.flatten_kv_cache(*cache, ix(b["seq_lens"]), arg(ix), out_size=out_size)
        for out, r in zip(outs, ref):
            assert_same_bytes(out, r, f"flatten ({table})")


# === caller buffers and padding ===================================================================
def test_get_batch_indices_positions_buffers_checked(recorded_launches):
    """FlashInfer's current form: (append_indptr, seq_lens, nnz, batch_indices, positions)
    writes into the caller's int32 [nnz] buffers and returns them; anything else is an
    error naming the buffer."""
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq_lens = torch.tensor([4, 9], dtype=torch.int32)
    bi, pos = torch.full((8,), 77, dtype=torch.int32), torch.full((8,), 77, dtype=torch.int32)
    got = flashinfer.page.get_batch_indices_positions(indptr, seq_lens, 8, bi, pos)
    assert got[0] is bi and got[1] is pos
    [launch] = recorded_launches
    assert launch[2] is bi and launch[3] is pos
    got = flashinfer.get_batch_indices_positions(indptr, seq_lens, 8, batch_indices=bi)  # one given
    assert got[0] is bi and got[1] is not pos and got[1].dtype == torch.int32 and got[1].shape == (8,)
    bad = {
        "int64": (TypeError, "batch_indices: the output buffer must be int32", bi.long()),
        "shape": (ValueError, r"batch_indices: expected an output buffer of shape \[nnz\] = \(8,\)", bi[:7]),
        "2-D": (ValueError, r"batch_indices: expected an output buffer of shape", bi.view(2, 4)),
        "strided": (ValueError, "batch_indices: the output buffer must be contiguous",
                    torch.zeros(16, dtype=torch.int32)[::2]),
        "list": (TypeError, "batch_indices: expected None or an int32 tensor", [0] * 8),
    }
    for what, (error, match, buffer) in bad.items():
        with pytest.raises(error, match=match):
            flashinfer.get_batch_indices_positions(indptr, seq_lens, 8, buffer, pos)
    with pytest.raises(ValueError, match="positions: expected an output buffer"):
        flashinfer.get_batch_indices_positions(indptr, seq_lens, 8, bi, pos[:3])


def test_get_batch_indices_positions_buffer_device_checked():
    """A buffer on another device than append_indptr: named, before any launch."""
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    meta = torch.empty(8, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="batch_indices is on meta"):
        flashinfer.get_batch_indices_positions(indptr, indptr[1:], 8, meta, torch.empty(8, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_get_batch_indices_positions_into_captured_buffers(index_dtype):
    """A CUDA graph captured once with persistent buffers and nnz padded past
    append_indptr[-1], replayed for new batches: every replay writes the buffers in place,
    padding entries -1 / 0."""
    nnz, batch = 64, 6
    append_indptr = torch.zeros(batch + 1, dtype=index_dtype, device=DEV)
    seq_lens = torch.zeros(batch, dtype=index_dtype, device=DEV)
    bi = torch.full((nnz,), 12345, dtype=torch.int32, device=DEV)
    pos = torch.full((nnz,), 12345, dtype=torch.int32, device=DEV)
    # one warm-up call (loads the module) off the capture stream, then the capture
    graph, out = capture_graph(lambda: flashinfer.get_batch_indices_positions(append_indptr, seq_lens, nnz, bi, pos))
    assert out[0] is bi and out[1] is pos
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        append = torch.randint(0, 10, (batch,), generator=gen)
        append_indptr.copy_(torch.cat([torch.zeros(1, dtype=torch.long), append.cumsum(0)]))
        seq_lens.copy_(append + torch.randint(0, 50, (batch,), generator=gen))
        bi.fill_(12345)
        pos.fill_(12345)
        graph.replay()
        torch.cuda.synchronize()
        ref_bi, ref_pos = get_batch_indices_positions_ref(append_indptr, seq_lens, nnz)
        assert_same_bytes(bi, ref_bi, "batch_indices")
        assert_same_bytes(pos, ref_pos, "positions")
        assert int((bi == -1).sum()) == nnz - int(append.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_rope_quantize_append_padding_regression(kv_layout, index_dtype):
    """The padding regression test of the fused RoPE + fp8 + append (FlashInfer's PR):
    batch_indices / positions from get_batch_indices_positions into persistent buffers,
    nnz padded past append_indptr[-1]; the fused call must leave every cache byte of the
    padding tokens untouched and give them zero q outputs, in caller buffers poisoned with
    NaN beforehand."""
    gen = torch.Generator().manual_seed(6)
    page_size, hq, hk, rope_dim, nope_dim = 16, 8, 2, 64, 64
    head_dim = rope_dim + nope_dim
    b = paged_batch([20, 0, 1, 31], [3, 33, 1, 16], page_size, gen)
    nnz = b["nnz"] + 13  # padding, as a captured batch size would have
    ix = (lambda t: t) if index_dtype == torch.int32 else i64
    batch_indices = torch.full((nnz,), 999, dtype=torch.int32, device=DEV)
    positions = torch.full((nnz,), 999, dtype=torch.int32, device=DEV)
    flashinfer.get_batch_indices_positions(ix(b["append_indptr"]), ix(b["seq_lens"]), nnz,
                                           batch_indices, positions)
    pad = batch_indices.cpu() < 0
    assert int(pad.sum()) == 13
    shape = (b["num_pages"], page_size, hk, head_dim) if kv_layout == "NHD" else \
        (b["num_pages"], hk, page_size, head_dim)
    fill = torch.randint(0, 0x70, shape, dtype=torch.uint8, generator=gen)  # finite e4m3 bytes
    k_cache, v_cache = fill.view(E4M3).to(DEV), fill.flip(0).contiguous().view(E4M3).to(DEV)
    before = (k_cache.clone(), v_cache.clone())
    cs = cos_sin_cache_ref(4096, rope_dim).to(DEV)
    pos_ids = positions.clone()
    pos_ids[pad.to(DEV)] = 10 ** 6  # padding positions far past the cos/sin cache: must not be read
    q_rope, q_nope = rand((nnz, hq, rope_dim), gen=gen), rand((nnz, hq, nope_dim), gen=gen)
    k_rope, k_nope = rand((nnz, hk, rope_dim), gen=gen), rand((nnz, hk, nope_dim), gen=gen)
    v = rand((nnz, hk, head_dim), gen=gen)
    q_rope_out = nan_like(torch.empty(nnz, hq, rope_dim, dtype=E4M3, device=DEV))
    q_nope_out = nan_like(torch.empty(nnz, hq, nope_dim, dtype=E4M3, device=DEV))
    got = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cs, ix(pos_ids), (k_cache, v_cache), ix(b["kv_indices"]),
        ix(b["kv_indptr"]), ix(batch_indices), ix(positions), page_size=page_size, kv_layout=kv_layout,
        quant_scale_q=0.5, quant_scale_kv=1.5, q_rope_out=q_rope_out, q_nope_out=q_nope_out)
    assert got[0] is q_rope_out and got[1] is q_nope_out
    table = csr_page_table(b["kv_indptr"], b["kv_indices"])
    qr_ref, qn_ref, (k_ref, v_ref) = rope_quantize_append_ref(
        q_rope, k_rope, q_nope, k_nope, v, cs, pos_ids, before, table, batch_indices, positions, False,
        0.5, 1.5, kv_layout)
    for out, ref, what in ((q_rope_out, qr_ref, "q_rope_out"), (q_nope_out, qn_ref, "q_nope_out")):
        out = out.cpu()
        assert as_bytes(out[pad]).eq(0).all(), f"{what}: padding rows not zero"
        torch.testing.assert_close(out.float(), ref.float().cpu(), rtol=0.13, atol=2 ** -6)
    for cache, ref, old, name in ((k_cache, k_ref, before[0], "K"), (v_cache, v_ref, before[1], "V")):
        changed = (as_bytes(cache.cpu()) != as_bytes(old.cpu())).any(-1)  # [pages, ., ., head row]
        expect_changed = (as_bytes(ref.cpu()) != as_bytes(old.cpu())).any(-1)
        assert not (changed & ~expect_changed).any(), f"{name} cache: a byte changed outside the real tokens' slots"
        torch.testing.assert_close(cache.cpu().float(), ref.cpu().float(), rtol=0.13, atol=2 ** -6)


# === RoPE + fp8: FlashInfer's names and backends ===================================================
def _mla_inputs(gen, device, nnz=40):
    return (rand((nnz, 16, 64), gen=gen, device=device), rand((nnz, 64), gen=gen, device=device),
            rand((nnz, 16, 512), gen=gen, device=device), rand((nnz, 512), gen=gen, device=device),
            cos_sin_cache_ref(4096, 64).to(device),
            torch.randint(0, 4096, (nnz,), generator=gen, dtype=torch.int32).to(device))


def test_mla_rope_quantize_fp8_is_rope_quantize_fp8(recorded_launches):
    """FlashInfer's MLA name launches exactly what rope_quantize_fp8 launches and returns
    its four outputs, k parts 2-D as given."""
    inputs = _mla_inputs(torch.Generator().manual_seed(7), "cpu")
    outs = flashinfer.rope.mla_rope_quantize_fp8(*inputs, quant_scale_q=0.5)
    flashinfer.rope_quantize_fp8(*inputs, quant_scale_q=0.5)
    assert [tuple(o.shape) for o in outs] == [(40, 16, 64), (40, 64), (40, 16, 512), (40, 512)]
    assert all(o.dtype == E4M3 for o in outs)
    first, second = recorded_launches
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("backend", ["cuda", "auto"])
def test_rope_quantize_fp8_backends_that_run_here(backend, recorded_launches):
    inputs = _mla_inputs(torch.Generator().manual_seed(8), "cpu")
    flashinfer.rope_quantize_fp8(*inputs, backend=backend)
    assert len(recorded_launches) == 1


@pytest.mark.parametrize("backend,match", [("cutile", "'cutile'.*not have"), ("triton", "expected 'auto', 'cuda'"),
                                           (None, "expected")])
def test_rope_quantize_fp8_other_backends_rejected(backend, match, recorded_launches):
    inputs = _mla_inputs(torch.Generator().manual_seed(8), "cpu")
    with pytest.raises(ValueError, match=f"backend: {match}"):
        flashinfer.rope_quantize_fp8(*inputs, backend=backend)
    assert recorded_launches == []


@pytest.mark.gpu
def test_mla_rope_quantize_fp8_matches_reference():
    """Caller outputs poisoned with NaN, int64 pos_ids: every output written, equal to
    rope_quantize_fp8 (backend "cuda" and "auto") bit for bit and close to the reference."""
    q_rope, k_rope, q_nope, k_nope, cs, pos = _mla_inputs(torch.Generator().manual_seed(9), DEV)
    outs = tuple(nan_like(torch.empty(t.shape, dtype=E4M3, device=DEV)) for t in (q_rope, k_rope, q_nope, k_nope))
    got = flashinfer.mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cs, i64(pos), quant_scale_q=0.5,
                                           quant_scale_kv=2.0, q_rope_out=outs[0], k_rope_out=outs[1],
                                           q_nope_out=outs[2], k_nope_out=outs[3])
    assert all(g is o for g, o in zip(got, outs))
    refs = rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cs, pos, False, 0.5, 2.0, E4M3)
    for out, ref in zip(got, refs):
        assert not torch.isnan(out.float()).any()
        torch.testing.assert_close(out.float().cpu(), ref.float(), rtol=0.13, atol=2 ** -6)
    for backend in ("cuda", "auto"):
        again = flashinfer.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cs, pos, quant_scale_q=0.5,
                                             quant_scale_kv=2.0, backend=backend)
        for a, g in zip(again, got):
            assert_same_bytes(a, g, f"rope_quantize_fp8(backend={backend!r})")


# === torch.compile: fullgraph through the wrappers, equal to eager ===================================
def _compile_cases(gen, int64: bool):
    """name -> (fn, args, indices of args it mutates), on fresh random data."""
    ix = i64 if int64 else (lambda t: t)
    b = paged_batch([5, 0, 21, 9], [3, 4, 0, 16], 16, gen, spare_pages=8)
    nnz, hq, hk, dim = b["nnz"] + 5, 8, 2, 128
    fp8_cache = lambda: tuple(torch.zeros(b["num_pages"], 16, hk, dim, dtype=E4M3, device=DEV)  # noqa: E731
                              for _ in range(2))
    bi, pos = (t.to(DEV) for t in get_batch_indices_positions_ref(b["append_indptr"], b["seq_lens"], nnz))
    pos_ids = pos.clamp(min=0)
    cs = cos_sin_cache_ref(4096, dim).to(DEV)
    cs64 = cos_sin_cache_ref(4096, 64).to(DEV)
    q, k, v = rand((nnz, hq, dim), gen=gen), rand((nnz, hk, dim), gen=gen), rand((nnz, hk, dim), gen=gen)
    mla = _mla_inputs(gen, DEV, nnz)[:4]
    rope_indptr = torch.tensor([0, 3, 7, 7, nnz], dtype=torch.int32, device=DEV)  # every row rotated
    offsets = torch.tensor([0, 7, 100, 3], dtype=torch.int32, device=DEV)
    bt = torch.randperm(b["num_pages"], generator=gen)[:12].view(4, 3).to(torch.int32).to(DEV)  # distinct pages
    cache = (rand((b["num_pages"], 16, hk, dim), gen=gen), rand((b["num_pages"], 16, hk, dim), gen=gen))
    csr = tuple(ix(b[n]) for n in ("kv_indices", "kv_indptr", "kv_last_page_len"))
    return {
        "append_paged_kv_cache": (
            lambda kc, vc: flashinfer.append_paged_kv_cache(k, v, ix(bi), ix(pos), (kc, vc), *csr), cache, (0, 1)),
        "append_paged_kv_cache(block table, HND view)": (
            lambda kc: flashinfer.append_paged_kv_cache(
                k, v, ix(bi), ix(pos), kc, kv_layout="HND",
                page_table=block_page_table(ix(bt), ix(b["seq_lens"]))),
            (rand((b["num_pages"], 2, hk, 16, dim), gen=gen),), (0,)),
        "get_batch_indices_positions(buffers)": (
            lambda bb, pp: flashinfer.get_batch_indices_positions(ix(b["append_indptr"]), ix(b["seq_lens"]),
                                                                  nnz, bb, pp),
            (torch.zeros(nnz, dtype=torch.int32, device=DEV), torch.zeros(nnz, dtype=torch.int32, device=DEV)),
            (0, 1)),
        "apply_rope_pos_ids": (lambda: flashinfer.apply_rope_pos_ids(q, k, ix(pos_ids)), (), ()),
        "apply_rope_pos_ids_inplace": (
            lambda qq, kk: flashinfer.apply_rope_pos_ids_inplace(qq, kk, ix(pos_ids), rotary_dim=64),
            (q.clone(), k.clone()), (0, 1)),
        "apply_rope": (lambda: flashinfer.apply_rope(q, k, ix(rope_indptr), ix(offsets)), (), ()),
        "apply_llama31_rope": (lambda: flashinfer.apply_llama31_rope(q, k, ix(rope_indptr), ix(offsets)), (), ()),
        "apply_rope_with_cos_sin_cache_inplace": (
            lambda qq, kk: flashinfer.apply_rope_with_cos_sin_cache_inplace(ix(pos_ids), qq, kk, dim, cs),
            (q.flatten(1).clone(), k.flatten(1).clone()), (0, 1)),
        "rope_quantize_fp8": (lambda: flashinfer.rope_quantize_fp8(q, k, None, None, cs, ix(pos_ids)), (), ()),
        "mla_rope_quantize_fp8": (lambda: flashinfer.mla_rope_quantize_fp8(*mla, cs64, ix(pos_ids)), (), ()),
        "rope_quantize_fp8_append_paged_kv_cache": (
            lambda kc, vc: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                q, k, None, None, v, cs, ix(pos_ids), (kc, vc), csr[0], csr[1], ix(bi), ix(pos)),
            fp8_cache(), (0, 1)),
        "rope_quantize_fp8_append_paged_kv_cache(MLA)": (
            lambda ckv, kpe: flashinfer.rope_quantize_fp8_append_paged_kv_cache(
                *mla, None, cs64, ix(pos_ids), (ckv, kpe), csr[0], csr[1], ix(bi), ix(pos)),
            (torch.zeros(b["num_pages"], 16, 512, dtype=E4M3, device=DEV),
             torch.zeros(b["num_pages"], 16, 64, dtype=E4M3, device=DEV)), (0, 1)),
    }


COMPILE_CASES = ["append_paged_kv_cache", "append_paged_kv_cache(block table, HND view)",
                 "get_batch_indices_positions(buffers)", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
                 "apply_rope", "apply_llama31_rope", "apply_rope_with_cos_sin_cache_inplace", "rope_quantize_fp8",
                 "mla_rope_quantize_fp8", "rope_quantize_fp8_append_paged_kv_cache",
                 "rope_quantize_fp8_append_paged_kv_cache(MLA)"]


def _assert_matches_eager(fn, args, mutated, compiled, what):
    eager_args, compiled_args = clone_args(args), clone_args(args)
    expected = fn(*eager_args)
    got = compiled(*compiled_args)
    for e, g in zip(leaves(expected), leaves(got)):
        assert_same_bytes(g, e, f"{what}: output")
    for i in mutated:
        for g, e in zip(leaves(compiled_args[i]), leaves(eager_args[i])):
            assert_same_bytes(g, e, f"{what}: argument {i} (written in place)")


def test_constant_result_is_torchs_mark_and_the_families_import_no_dynamo():
    """checks.constant_result sets what torch.compiler.assume_constant_result sets (Dynamo
    reads that mark), and importing every family leaves torch._dynamo unimported (its
    import costs seconds on the first RoPE or append call)."""
    code = textwrap.dedent("""
        import sys, torch
        import importlib
        import flashinfer_jit as fi
        for name in ("rope", "kvcache.append", "decode", "prefill", "cascade", "kvcache.flatten", "page"):
            importlib.import_module(f"flashinfer_jit.{name}")
        fi.rope_quantize_fp8_append_paged_kv_cache, fi.append_paged_kv_cache, fi.apply_rope
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo"
    from flashinfer_jit.runtime.checks import constant_result

    def ours():
        return 1

    def theirs():
        return 1

    marked = {k: v for k, v in vars(torch.compiler.assume_constant_result(theirs)).items()}
    assert marked and vars(constant_result(ours)) == marked


@pytest.mark.gpu
@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compile_fullgraph_without_graph_breaks(case, int64):
    """Dynamo records each call as one graph with no break, and that graph (functionalized,
    the ops' in-place writes included) gives eager's bits."""
    import torch._dynamo

    fn, args, mutated = _compile_cases(torch.Generator().manual_seed(10), int64)[case]
    fn(*clone_args(args))  # eager first: modules loaded, as in a serving engine's warm-up
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*clone_args(args))
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    _assert_matches_eager(fn, args, mutated, torch.compile(fn, fullgraph=True, backend="aot_eager"), case)


def _layer_step(q, k, v, k_cache, v_cache, kv_cache8, cs, append_indptr, seq_lens, kv_indices, kv_indptr,
                kv_last_page_len, bi, pos):
    """A decoder layer's cache writes, as a serving engine captures them: indices into
    persistent buffers, RoPE + fp8 + append into one cache, a plain append into another."""
    nnz = q.shape[0]
    bi, pos = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, nnz, bi, pos)
    q8, _ = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q, k, None, None, v, cs, pos.clamp(min=0), kv_cache8, kv_indices, kv_indptr, bi, pos)
    q_rot, k_rot = flashinfer.apply_rope_pos_ids(q, k, pos.clamp(min=0))
    flashinfer.append_paged_kv_cache(k_rot, v, bi, pos, (k_cache, v_cache), kv_indices, kv_indptr,
                                     kv_last_page_len)
    return q8, q_rot


def _layer_inputs(gen, b, nnz):
    hq, hk, dim = 8, 2, 128
    return [rand((nnz, hq, dim), gen=gen), rand((nnz, hk, dim), gen=gen), rand((nnz, hk, dim), gen=gen),
            rand((b["num_pages"], 16, hk, dim), gen=gen), rand((b["num_pages"], 16, hk, dim), gen=gen),
            tuple(torch.zeros(b["num_pages"], 16, hk, dim, dtype=E4M3, device=DEV) for _ in range(2)),
            cos_sin_cache_ref(4096, dim).to(DEV), i64(b["append_indptr"]), i64(b["seq_lens"]),
            i64(b["kv_indices"]), i64(b["kv_indptr"]), i64(b["kv_last_page_len"]),
            torch.zeros(nnz, dtype=torch.int32, device=DEV), torch.zeros(nnz, dtype=torch.int32, device=DEV)]


@pytest.mark.gpu
def test_compile_layer_step_inductor_matches_eager():
    """The layer's cache writes compiled whole by Inductor (fullgraph), int64 indices."""
    gen = torch.Generator().manual_seed(11)
    b = paged_batch([5, 0, 21, 9], [3, 4, 0, 16], 16, gen)
    args = _layer_inputs(gen, b, b["nnz"] + 5)
    _layer_step(*clone_args(args))
    torch._dynamo.reset()
    _assert_matches_eager(_layer_step, args, (3, 4, 5, 12, 13), torch.compile(_layer_step, fullgraph=True),
                          "layer step")


@pytest.mark.gpu
def test_compile_reduce_overhead_matches_eager():
    """mode="reduce-overhead" (CUDA-graph trees) around the same step, replayed on new
    data in the same input tensors, as a serving engine does: each step equals eager."""
    gen = torch.Generator().manual_seed(12)
    b = paged_batch([5, 0, 21, 9], [3, 4, 0, 16], 16, gen)
    nnz = b["nnz"] + 5
    args = _layer_inputs(gen, b, nnz)
    torch._dynamo.reset()
    compiled = torch.compile(_layer_step, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        fresh = _layer_inputs(torch.Generator().manual_seed(100 + step), b, nnz)
        for a, f in zip(args, fresh):  # new values, same tensors
            if isinstance(a, torch.Tensor):
                a.copy_(f)
            elif isinstance(a, tuple):
                for x, y in zip(a, f):
                    x.copy_(y)
        eager_args = clone_args(args)
        expected = _layer_step(*eager_args)
        got = [t.clone() for t in compiled(*args)]  # CUDA-graph outputs are reused by the next replay
        for e, g in zip(expected, got):
            assert_same_bytes(g, e, f"step {step}: output")
        for i in (3, 4, 5, 12, 13):
            for x, y in zip(leaves(args[i]), leaves(eager_args[i])):
                assert_same_bytes(x, y, f"step {step}: argument {i} (written in place)")


# === logging of first-use builds ================================================================
class Records(logging.Handler):
    """Keeps every record with whether the module was published when it was emitted."""

    def __init__(self, root: Path):
        super().__init__(logging.DEBUG)
        self.root, self.records = root, []

    def emit(self, record):
        published = any(self.root.glob("batch_indices_i32-*/manifest.json"))
        self.records.append((record.levelno, record.getMessage(), published))


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """One lazy build of the cheapest module (BatchIndicesSpec) in an empty cache, with
    every record of the `flashinfer_jit` logger kept: (cache root, records)."""
    root = tmp_path_factory.mktemp("first-build") / "cache"
    logger = logging.getLogger("flashinfer_jit")
    handler, level = Records(root), logger.level
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
        mp.setenv("XDG_CACHE_HOME", str(root.parent / "xdg"))
        for name in ("FLASHINFER_JIT_DISABLE_JIT", "FLASHINFER_JIT_LOG_LEVEL"):
            mp.delenv(name, raising=False)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        jit.clear_registry()
        try:
            jit.get_module(BatchIndicesSpec())
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            jit.clear_registry()
    return root, handler.records


@pytest.fixture
def logging_state(monkeypatch):
    """The logger and flashinfer_jit.pipeline.log's state as they were, afterwards."""
    logger = logging.getLogger("flashinfer_jit")
    handlers, level = list(logger.handlers), logger.level
    monkeypatch.delenv("FLASHINFER_JIT_LOG_LEVEL", raising=False)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    log._handler, log._default_level = None, None


def _fake_build_from(built_root: Path):
    """jit._build_one's stand-in: publishes a copy of the entry `built_root` holds (the
    same key), so a test sees a miss, a build and a load without compiling again."""
    def build(prep, entry, jobs=None):
        shutil.copytree(built_root / entry.dirname, entry.path)
    return build


def _miss(monkeypatch, tmp_path, first_build, name="empty"):
    """An empty cache root where BatchIndicesSpec misses and `builds` from first_build's entry."""
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / name))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(jit, "_build_one", _fake_build_from(first_build[0]))
    jit.clear_registry()


def _messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "flashinfer_jit" and r.levelno >= level]


def test_first_use_build_announced_before_and_after(first_build):
    _, records = first_build
    info = [(msg, published) for level, msg, published in records if level == logging.INFO]
    assert len(info) == 2, records
    (start, published_at_start), (end, published_at_end) = info
    assert start.startswith("building batch_indices_i32 on first use") and "expect about" in start
    assert " s" in start.split("expect about")[1]
    assert not published_at_start and published_at_end
    assert end.startswith("built batch_indices_i32 in ") and end.endswith(" s")
    float(end.split(" in ")[1][:-2])


def test_cache_hit_and_aot_build_log_nothing_at_info(first_build, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="flashinfer_jit")
    root = tmp_path / "copy"
    shutil.copytree(first_build[0], root, ignore=shutil.ignore_patterns(".locks", ".tmp"))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    jit.clear_registry()
    jit.get_module(BatchIndicesSpec())
    assert _messages(caplog) == []
    assert any(m.startswith("loading batch_indices_i32 from the cache") for m in _messages(caplog, logging.DEBUG))
    caplog.clear()
    # AOT into an empty root: ninja replaced by a copy of the built library (the CLI shows
    # its own progress; the library logs nothing, not even at DEBUG)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "aot"))
    from flashinfer_jit.pipeline import build

    library = next(first_build[0].glob("batch_indices_i32-*/batch_indices_i32.so"))

    def ninja(tc, top, jobs=None, on_line=None):
        for sub in Path(top).iterdir():
            if sub.is_dir():
                shutil.copy(library, sub / library.name)
        return 0, "", 0.1

    monkeypatch.setattr(build, "run_ninja", ninja)
    report = jit.build_many([BatchIndicesSpec()])
    assert report.built == ["batch_indices_i32"]
    assert _messages(caplog, logging.DEBUG) == []


def test_log_level_variable(first_build, tmp_path, monkeypatch, caplog, logging_state):
    caplog.set_level(logging.DEBUG, logger="flashinfer_jit")
    _miss(monkeypatch, tmp_path, first_build, "default")
    jit.get_module(BatchIndicesSpec())
    assert len(_messages(caplog)) == 2  # the stand-in build is announced like a real one
    caplog.clear()
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", "warning")
    _miss(monkeypatch, tmp_path, first_build, "quiet")
    jit.get_module(BatchIndicesSpec())
    assert caplog.records == [] and logging_state.level == logging.WARNING
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", "DEBUG")
    jit.clear_registry()
    jit.get_module(BatchIndicesSpec())  # a cache hit now
    assert any(m.startswith("loading batch_indices_i32") for m in _messages(caplog, logging.DEBUG))
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="FLASHINFER_JIT_LOG_LEVEL='loud': expected DEBUG"):
        log.configure()


def test_handler_only_where_nothing_else_would_show_the_records(monkeypatch, logging_state):
    """No handler anywhere: one stderr handler at INFO, however often configure() runs.
    A handler of the application's (on the root or on this logger): none of ours, and the
    level is the application's."""
    logger = logging_state
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    monkeypatch.setattr(logging.root, "handlers", [])
    for _ in range(3):
        log.configure()
    assert len(logger.handlers) == 1 and isinstance(logger.handlers[0], logging.StreamHandler)
    assert logger.level == logging.INFO
    app = logging.StreamHandler()
    logging.root.handlers.append(app)  # the application configures logging
    log.configure()
    assert logger.handlers == [] and logger.level == logging.NOTSET
    logging.root.handlers.remove(app)
    own = logging.NullHandler()
    logger.addHandler(own)  # ...or configures this logger itself
    logger.setLevel(logging.ERROR)
    log.configure()
    assert logger.handlers == [own] and logger.level == logging.ERROR


def test_visible_by_default_on_stderr_once_with_an_application_config(first_build, tmp_path):
    """In a process that configured no logging, the announcement is on stderr; after
    logging.basicConfig(INFO) it appears once, in the application's format; after
    basicConfig's default (WARNING) not at all."""
    code = textwrap.dedent(f"""
        import logging, os, shutil, sys
        from pathlib import Path
        from flashinfer_jit.pipeline import jit
        from flashinfer_jit.specs import BatchIndicesSpec

        def build(prep, entry, jobs=None):
            shutil.copytree(Path({str(first_build[0])!r}) / entry.dirname, entry.path)

        jit._build_one = build

        def miss(name):
            os.environ["FLASHINFER_JIT_CACHE_DIR"] = str(Path({str(tmp_path)!r}) / name)
            jit.clear_registry()
            jit.get_module(BatchIndicesSpec())
            print("--", file=sys.stderr, flush=True)

        miss("unconfigured")
        logging.basicConfig(level=logging.INFO)
        miss("configured-info")
        logging.getLogger().setLevel(logging.WARNING)
        miss("configured-warning")
    """)
    out = _run_python(code, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    unconfigured, info, warning, _ = out.stderr.split("--\n")
    lines = lambda text: [ln for ln in text.splitlines() if "flashinfer_jit" in ln]  # noqa: E731
    assert [ln.split(" on first use")[0] for ln in lines(unconfigured)][0] == \
        "flashinfer_jit: building batch_indices_i32"
    assert len(lines(unconfigured)) == 2 and lines(unconfigured)[1].startswith("flashinfer_jit: built ")
    assert len(lines(info)) == 2 and all(ln.startswith("INFO:flashinfer_jit:") for ln in lines(info)), info
    assert lines(warning) == [], warning


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.pop("FLASHINFER_JIT_LOG_LEVEL", None)
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", code], env=environ, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# === batch decode ==================================================================================
# The soft cap 0.0 as "off", int64 index tensors, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
# fast_decode_plan (SGLang), the older method names, torch.compile(fullgraph=True) through run()
# and mode="reduce-overhead" around single_decode_with_kv_cache inside a custom op. Multi-token
# decode (q_len_per_req) has its kernel tests in tests/test_decode.py.
DEC_HQ, DEC_HK, DEC_D, DEC_PS = 32, 8, 128, 16


def _decode_csr(lens, page_size=DEC_PS, device="cpu", dtype=torch.int32, seed=0):
    rnd = random.Random(seed)
    pages = [-(-n // page_size) for n in lens]
    ids = rnd.sample(range(sum(pages) + 4), sum(pages))
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
    return (torch.tensor(indptr, dtype=dtype, device=device), torch.tensor(ids, dtype=dtype, device=device),
            torch.tensor(last, dtype=dtype, device=device))


# --- CPU: argument conventions ----------------------------------------------------------------------
def test_decode_submodule_has_flashinfer_names():
    from flashinfer_jit.decode import wrapper as decode

    for name in ("BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
                 "single_decode_with_kv_cache", "fast_decode_plan"):
        assert callable(getattr(decode, name)) and name in decode.__all__
    assert flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper is decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper
    w = decode.BatchDecodeWithPagedKVCacheWrapper
    assert w.begin_forward is w.plan and w.forward is w.run


def test_soft_cap_zero_is_off_and_int64_plans_like_int32():
    lens = [37, 0, 300, 16]
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    plans = []
    for dtype, cap in ((torch.int32, None), (torch.int64, 0.0)):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*_decode_csr(lens, dtype=dtype), DEC_HQ, DEC_HK, DEC_D, DEC_PS, logits_soft_cap=cap, q_data_type=torch.bfloat16)
        plans.append(w)
    a, b = plans
    assert a._plan.spec == b._plan.spec and not b._plan.spec.soft_cap and b._plan.config.soft_cap == 0.0
    shipped_a, shipped_b = a._plan_buffer, b._plan_buffer
    end = shipped_a.views_key[1][-1]  # the packed plan buffer's used length
    assert shipped_a.views_key == shipped_b.views_key and torch.equal(shipped_a.buf[:end], shipped_b.buf[:end])
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            b.plan(*_decode_csr(lens), DEC_HQ, DEC_HK, DEC_D, DEC_PS, logits_soft_cap=bad)
    with pytest.raises(TypeError, match="indptr"):
        b.plan(*_decode_csr(lens, dtype=torch.int16), DEC_HQ, DEC_HK, DEC_D, DEC_PS)


def test_cuda_graph_wrapper_buffers_are_checked():
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    i32 = torch.zeros(9, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices_buffer: expected a contiguous 1-D int32"):
        flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, i32, torch.zeros(64, dtype=torch.int64), i32[:8])
    with pytest.raises(TypeError, match="indptr_buffer"):
        flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, [0] * 9, i32, i32[:8])
    with pytest.raises(ValueError, match="workspace's device"):
        flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, i32.to("meta"), i32, i32[:8])
    w = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, i32, i32, i32[:8])
    assert w.is_cuda_graph_enabled


def test_backend_and_sinks_are_checked():
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="backend"):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="trtllm-gen")
    flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")  # (plan(): NotImplementedError)


# --- GPU ----------------------------------------------------------------------------------------------
def _decode_inputs(lens, seed, dtype=torch.bfloat16, n_tok=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = sum(-(-n // DEC_PS) for n in lens) + 4
    k = torch.randn(pages, DEC_PS, DEC_HK, DEC_D, generator=gen, device=DEV).to(dtype)
    v = torch.randn(pages, DEC_PS, DEC_HK, DEC_D, generator=gen, device=DEV).to(dtype)
    q = torch.randn(len(lens) * n_tok, DEC_HQ, DEC_D, generator=gen, device=DEV).to(dtype)
    return q, k, v


@pytest.fixture(scope="module")
def decode_workspace():
    return torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)


@pytest.mark.gpu
def test_int64_indices_and_zero_soft_cap_match_int32(decode_workspace):
    lens = [700, 1, 0, 2049, 33]
    q, k, v = _decode_inputs(lens, 3)
    outs = []
    for dtype, cap in ((torch.int32, None), (torch.int64, 0.0)):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(decode_workspace, "NHD")
        w.plan(*_decode_csr(lens, device=DEV, dtype=dtype, seed=5), DEC_HQ, DEC_HK, DEC_D, DEC_PS, logits_soft_cap=cap,
               q_data_type=torch.bfloat16)
        outs.append(w.run(q, (k, v), return_lse=True))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    table = csr_page_table(*_decode_csr(lens, device=DEV, seed=5))
    ref, _ = decode_ref(q, k, v, table, lens)
    err = float((outs[1][0].double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2


def test_fast_decode_plan_bound_as_plan_does_not_recurse():
    """FlashInfer's tests and SGLang's multi-step draft path bind it as the wrapper's plan:
    `wrapper.plan = partial(fast_decode_plan, wrapper)`, then call `wrapper.plan(...)`. It
    must run the class's plan(), not the instance's attribute (itself: a RecursionError
    before). The plan it makes, twice in a row, is a plain plan()'s (CPU: the plan only).
    As in FlashInfer, it re-plans a wrapper planned before (FlashInfer's test plans first)."""
    lens = [120, 4000, 17]
    indptr, indices, last = _decode_csr(lens, seed=6)
    ref = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8), "NHD")
    ref.plan(indptr, indices, last, DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8), "NHD")
    w.plan(*_decode_csr([5, 900]), DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16)  # the prior plan
    w.plan = functools.partial(flashinfer.decode.fast_decode_plan, w)
    for _ in range(2):
        w.plan(indptr, indices, last, DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16,
               global_override_indptr_cpu=indptr)
        got, want = w._plan, ref._plan
        assert (got.spec, got.batch, got.capacity, got.cluster) == (want.spec, want.batch, want.capacity, want.cluster)
        # the page table, work list and merge index, and the scalars (not the partial-state
        # storage); the work list's view runs to the plan buffer's end: its grid_items items
        works = [p.args[1][: 1 + 4 * p.args[8]] for p in (got, want)]
        assert _same(got.args[0], want.args[0]) and _same(*works) and _same(got.args[2], want.args[2])
        assert _same(got.args[5:10], want.args[5:10])


def _same(a, b) -> bool:
    """Equal values: tensors element by element, sequences item by item."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.gpu
def test_fast_decode_plan_as_sglang_binds_it(decode_workspace):
    """SGLang: wrapper.begin_forward = partial(fast_decode_plan, wrapper), called with the
    host copy of indptr (global_override_indptr_cpu): the same plan as plan()."""
    lens = [120, 4000, 17]
    q, k, v = _decode_inputs(lens, 4)
    indptr, indices, last = _decode_csr(lens, device=DEV, seed=6)
    ref_w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(decode_workspace, "NHD")
    ref_w.plan(indptr, indices, last, DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16)
    expected = ref_w.run(q, (k, v)).clone()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(decode_workspace), "NHD")
    w.plan(indptr, indices, last, DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16)  # the prior plan
    w.begin_forward = functools.partial(flashinfer.decode.fast_decode_plan, w)
    w.begin_forward(indptr, indices, last, DEC_HQ, DEC_HK, DEC_D, DEC_PS, data_type=torch.bfloat16, q_data_type=torch.bfloat16,
                    global_override_indptr_cpu=indptr.cpu())
    torch.testing.assert_close(w.forward(q, (k, v)), expected, rtol=0, atol=0)
    out, lse = w.run_return_lse(q, (k, v))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    w.end_forward()


@pytest.mark.gpu
def test_flashinfer_tensor_core_decode_rejects_mismatched_q_len():
    """FlashInfer's test_tensor_core_decode_rejects_mismatched_q_len
    (tests/attention/test_batch_decode_kernels.py), as it is written there: q of another
    q_len_per_req, use_tensor_cores=False with q_len_per_req > 1, backend='fa3', a request
    of kv_len < q_len_per_req, a CUDA-graph wrapper re-planned with another q_len_per_req,
    fast_decode_plan without a prior plan. Its checks case by case on the CPU: tests/
    test_decode.py test_fi_*."""
    batch_size = 4
    page_size = 16
    num_qo_heads, num_kv_heads, head_dim = 8, 2, 128
    dtype = torch.bfloat16
    indptr = torch.arange(0, batch_size + 1, dtype=torch.int32, device="cuda:0")
    indices = torch.arange(batch_size, dtype=torch.int32, device="cuda:0")
    last_len = torch.full((batch_size,), page_size, dtype=torch.int32, device="cuda:0")
    kv_data = torch.randn(batch_size, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device="cuda:0")
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type=dtype,
                 kv_data_type=dtype, q_len_per_req=2)
    q = torch.randn(batch_size * 3, num_qo_heads, head_dim, dtype=dtype, device="cuda:0")
    with pytest.raises(ValueError, match="q_len_per_req"):
        wrapper.run(q, kv_data)

    cuda_core_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
    with pytest.raises(ValueError, match="use_tensor_cores"):
        cuda_core_wrapper.plan(indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                               q_data_type=dtype, kv_data_type=dtype, q_len_per_req=2)

    fa3_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa3")
    with pytest.raises(NotImplementedError, match="fa2"):
        fa3_wrapper.plan(indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         q_data_type=dtype, kv_data_type=dtype, q_len_per_req=2)

    short_kv_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    short_last_len = torch.ones(batch_size, dtype=torch.int32, device="cuda:0")
    with pytest.raises(ValueError, match="empty KV range"):
        short_kv_wrapper.plan(indptr, indices, short_last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                              q_data_type=dtype, kv_data_type=dtype, q_len_per_req=2)

    graph_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.empty(batch_size + 1, dtype=torch.int32, device="cuda:0"),
        paged_kv_indices_buffer=torch.empty(batch_size, dtype=torch.int32, device="cuda:0"),
        paged_kv_last_page_len_buffer=torch.empty(batch_size, dtype=torch.int32, device="cuda:0"))

    def plan_graph(q_len):
        graph_wrapper.plan(indptr, indices, last_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                           q_data_type=dtype, kv_data_type=dtype, q_len_per_req=q_len)

    plan_graph(2)
    plan_graph(2)  # same value re-plans fine
    with pytest.raises(ValueError, match="frozen"):
        plan_graph(3)

    unplanned = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    with pytest.raises(ValueError, match="prior plan"):
        flashinfer.decode.fast_decode_plan(unplanned, indptr, indices, last_len, num_qo_heads, num_kv_heads,
                                           head_dim, page_size, q_data_type=dtype, kv_data_type=dtype,
                                           q_len_per_req=2)
    # (not in FlashInfer's test: the plans that passed still run, and match the reference)
    torch.cuda.synchronize()
    q2 = torch.randn(batch_size * 2, num_qo_heads, head_dim, dtype=dtype, device="cuda:0")
    k, v = kv_data[:, 0], kv_data[:, 1]
    ref, _ = decode_ref(q2, k, v, csr_page_table(indptr, indices, last_len), [page_size] * batch_size,
                        q_len_per_req=2)
    for w in (wrapper, graph_wrapper):
        out = w.run(q2, kv_data)
        torch.cuda.synchronize()
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 4])
def test_torch_compile_fullgraph_traces_run(n_tok, decode_workspace):
    """torch.compile(fullgraph=True) of a function around run(): no graph break, the same
    output as eager, and still right after a re-plan with other lengths (the graph reads
    the plan's buffers)."""
    import torch._dynamo

    lens = [900, 65, 3000]
    q, k, v = _decode_inputs(lens, 7, n_tok=n_tok)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(decode_workspace, "NHD", use_tensor_cores=True)
    w.plan(*_decode_csr(lens, device=DEV, seed=8), DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16, q_len_per_req=n_tok)

    def layer(q, k, v):
        out, lse = w.run(q * 1.0, (k, v), return_lse=True)
        return out.float() * 2.0, lse

    eager = layer(q, k, v)
    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(q, k, v)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], eager[1], rtol=0, atol=0)
    lens2 = [1500, 20, 77]  # same batch, other lengths: a re-plan, the same compiled graph
    w.plan(*_decode_csr(lens2, device=DEV, seed=9), DEC_HQ, DEC_HK, DEC_D, DEC_PS, q_data_type=torch.bfloat16, q_len_per_req=n_tok)
    got2 = compiled(q, k, v)
    eager2 = layer(q, k, v)
    torch.testing.assert_close(got2[0], eager2[0], rtol=0, atol=0)


@pytest.mark.gpu
def test_reduce_overhead_around_single_decode_in_a_custom_op():
    """FlashInfer issue 541's pattern: single_decode_with_kv_cache inside a user's custom op,
    the caller compiled with mode="reduce-overhead" (CUDA-graph trees): replays match eager
    on new inputs written into the same tensors."""
    kv_len = 1000

    @torch.library.custom_op("fij_api_test::attend", mutates_args=())
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashinfer.single_decode_with_kv_cache(q, k, v)

    @attend.register_fake
    def _(q, k, v):
        return torch.empty_like(q)

    def step(q, k, v):
        return attend(q * 1.0, k, v) + 1.0

    gen = torch.Generator(device=DEV).manual_seed(11)
    q = torch.randn(DEC_HQ, DEC_D, generator=gen, device=DEV).to(torch.float16)
    k = torch.randn(kv_len, DEC_HK, DEC_D, generator=gen, device=DEV).to(torch.float16)
    v = torch.randn(kv_len, DEC_HK, DEC_D, generator=gen, device=DEV).to(torch.float16)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(5):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEV))
        got = compiled(q, k, v).clone()
        torch.testing.assert_close(got, step(q, k, v), rtol=0, atol=0)
    table = csr_page_table(torch.tensor([0, 1], dtype=torch.int32, device=DEV),
                           torch.zeros(1, dtype=torch.int32, device=DEV),
                           torch.tensor([kv_len], dtype=torch.int32, device=DEV))
    ref, _ = decode_ref(q[None], k[None], v[None], table, [kv_len])
    direct = flashinfer.single_decode_with_kv_cache(q, k, v)
    err = float((direct.double() - ref[0].double()).norm() / ref.double().norm())
    assert err < 2e-3


# FlashInfer's test_batch_prefill_with_paged_kv_cache_multi_item_scoring, ported (a sample of
# its 48 cases: both length cases, its page sizes, soft cap off and 30, the LSE asked for or
# not; ROPE_LLAMA, fp16, 4 KV heads): our multi-item scoring against our single prefill with
# FlashInfer's dense reference mask, as its test compares them.
MULTI_ITEM_CASES = [(0, 1, 0.0, True), (0, 5, 30.0, False), (0, 16, 0.0, False), (1, 16, 30.0, True),
                    (1, 5, 0.0, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("case, page_size, soft_cap, return_lse", MULTI_ITEM_CASES)
def test_multi_item_scoring_as_flashinfer_tests_it(case, page_size, soft_cap, return_lse):
    from test_prefill import FI_MULTI_ITEM, _items_dense_mask

    kv_len, qo_len, prefix, token_pos, width, max_item = FI_MULTI_ITEM[case]
    hq, hk, d = 32, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(case * 100 + page_size)
    q = torch.randn(qo_len, hq, d, generator=gen, device="cuda").half()
    pages = -(-kv_len // page_size)
    kv_data = torch.randn(pages, 2, page_size, hk, d, generator=gen, device="cuda").half()
    last = (kv_len - 1) % page_size + 1
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.int8, device="cuda"), "NHD")
    w.plan(torch.tensor([0, qo_len], dtype=torch.int32, device="cuda"),
           torch.tensor([0, pages], dtype=torch.int32, device="cuda"),
           torch.arange(pages, dtype=torch.int32, device="cuda"), torch.tensor([last], dtype=torch.int32, device="cuda"),
           hq, hk, d, page_size, causal=True, pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=soft_cap,
           prefix_len_ptr=torch.tensor([prefix]).to(torch.uint32).cuda(),
           token_pos_in_items_ptr=torch.tensor(token_pos).to(torch.uint16).cuda(), token_pos_in_items_len=width,
           max_item_len_ptr=torch.tensor([max_item]).to(torch.uint16).cuda())
    o = w.run_return_lse(q, kv_data)[0] if return_lse else w.run(q, kv_data)
    k = kv_data[:, 0].reshape(-1, hk, d)[:kv_len]
    v = kv_data[:, 1].reshape(-1, hk, d)[:kv_len]
    mask = _items_dense_mask(token_pos, prefix, qo_len, kv_len).cuda()
    o_ref = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA",
                                             logits_soft_cap=soft_cap, custom_mask=mask)
    torch.testing.assert_close(o, o_ref, rtol=1e-3, atol=1e-3)
