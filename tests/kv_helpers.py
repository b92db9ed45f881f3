"""Helpers shared by the tests of batch decode (test_decode.py) and batch prefill
(test_prefill.py), and the CUDA-graph capture of test_append.py and test_flashinfer_api.py:
random data and the seeds of a grid case, the check of the tests' AOT matrix, paged KV page
tables drawn at random, NaN-poisoned outputs between sentinel rows, and capture / replay of
CUDA graphs.

Not a test module (pytest collects test_*.py only); the test modules import it by name,
as tests/ is on sys.path under pytest (no __init__.py: rootdir-relative imports).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import NamedTuple

import torch

from flashinfer_jit.pipeline.matrix import parse_matrix
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table

DEV = "cuda"
SENTINEL = 7.0  # rows around the outputs that must stay untouched
TESTS_MATRIX = Path(__file__).resolve().parent.parent / "scripts" / "matrices" / "tests"


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def randn(shape, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """torch.randn on DEV from `gen`, times `scale`, then cast to `dtype`."""
    return (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)


# --- the pairwise grids and the AOT matrix --------------------------------------------------------
def assert_tests_matrix_has(needed: set, spec_type: type, most: int, what: str) -> None:
    """scripts/matrices/tests (the AOT prebuild of the GPU check) lists every module in
    `needed`; of them at most `most` are `spec_type`s ("<what> modules"), to keep the tests'
    build moderate."""
    have = set(parse_matrix(TESTS_MATRIX))
    missing = sorted(s.name for s in needed - have)
    assert not missing, f"scripts/matrices/tests lacks {missing}"
    own = {s for s in needed if isinstance(s, spec_type)}
    assert len(own) <= most, f"{len(own)} {what} modules; keep the tests' build moderate"


def grid_case(cases: list, index: int, gen_seed_base: int):
    """The inputs of a pairwise-grid test case: (cases[index], random.Random(index) for the
    lengths and page ids, a DEV torch.Generator seeded gen_seed_base + index for the data)."""
    return cases[index], random.Random(index), torch.Generator(device=DEV).manual_seed(gen_seed_base + index)


# --- page tables -----------------------------------------------------------------------------------
class Paged(NamedTuple):
    table: PageTable      # for the reference
    plan_args: dict       # the page-table arguments of plan()
    k_unused: list        # pages no request reads K from
    v_unused: list


def make_page_table(layout: str, lens, page_size: int, num_pages: int, rnd: random.Random,
                    host_indptr: bool = False, csr_prefix: str = "") -> Paged:
    """Each request's pages drawn at random from the pool (K and V independently for
    block_table_kv_separate); block-table columns past a request's pages point at a page no
    request uses. Page ids on the device; CSR indptr and last_page_len on the host if asked.
    plan_args names the CSR arguments csr_prefix + indptr / indices / last_page_len (decode's
    plan(): "", prefill's: "paged_kv_")."""
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages)
    assert total < num_pages, "keep at least one unused page for the padding entries"
    k_perm = rnd.sample(range(num_pages), num_pages)
    v_perm = rnd.sample(range(num_pages), num_pages) if layout == "block_table_kv_separate" else k_perm
    starts = list(itertools.accumulate(pages, initial=0))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if layout == "csr":
        host = "cpu" if host_indptr else DEV
        indptr = torch.tensor(starts, dtype=torch.int32, device=host)
        indices = torch.tensor(k_perm[:total], dtype=torch.int32, device=DEV)
        last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)],
                            dtype=torch.int32, device=host)
        table = csr_page_table(indptr.to(DEV), indices, last.to(DEV))
        csr = dict(indptr=indptr, indices=indices, last_page_len=last)
        args = {csr_prefix + name: value for name, value in csr.items()}
    else:
        width = max(pages + [0]) + 1
        rows = []
        for perm in ((k_perm, v_perm) if layout == "block_table_kv_separate" else (k_perm,)):
            spare = perm[-1]
            rows.append([perm[s: s + p] + [spare] * (width - p) for s, p in zip(starts, pages)])
        bt = torch.tensor(rows, dtype=torch.int32, device=DEV)  # [1 or 2, B, width]
        bt = bt[0] if layout == "block_table" else bt.transpose(0, 1).contiguous()
        table = block_page_table(bt, seq_lens, kv_separate=layout == "block_table_kv_separate")
        args = {csr_prefix + name: None for name in ("indptr", "indices", "last_page_len")}
        args.update(block_tables=bt, seq_lens=seq_lens)
    return Paged(table, args, k_perm[total:], v_perm[total:])


def on_host(table: PageTable) -> PageTable:
    """The same page table with its tensors on the host (for request_pages_ref)."""
    return PageTable(table.layout, tuple(t.cpu() for t in table.tensors), table.batch_size)


# --- poisoned outputs ------------------------------------------------------------------------------
def poisoned(shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, out): `out` is rows 1..-1 of `buffer`, filled with NaN; the first and last
    rows of `buffer` hold SENTINEL and must stay untouched."""
    buf = torch.full((shape[0] + 2, *shape[1:]), SENTINEL, dtype=dtype, device=DEV)
    buf[1:-1] = float("nan")
    return buf, buf[1:-1]


def assert_sentinels(buf: torch.Tensor, name: str) -> None:
    assert bool((buf[0] == SENTINEL).all() and (buf[-1] == SENTINEL).all()), f"{name}: written outside its rows"


# --- CUDA graphs -----------------------------------------------------------------------------------
def capture_graph(call):
    """call() run once on a side stream (warm-up, as capture needs: it loads the modules),
    then captured. -> (graph, what the captured call() returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result


def replay_poisoned(graph, call, *outputs):
    """Replay `graph`, captured from call() first where it is None, with `outputs` filled
    with NaN just before, and wait for it. -> the graph."""
    if graph is None:
        graph, _ = capture_graph(call)
    for t in outputs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return graph
