"""append_paged_kv_cache, get_batch_indices_positions, get_seq_lens.

GPU tests (marked `gpu`) run the kernels on fresh random data, with caches pre-filled
with random bytes, and compare *every byte* of the cache (and of any buffer the cache
views lie in) with the PyTorch reference applied to a clone: appended rows must land
exactly at their slots, and nothing else may change. fp8 caches are compared as bytes
too, so every comparison is exact.

CPU tests (no marker, they run on CI) cover argument validation, which must fail before
anything is built or launched, the debug-mode value checks, get_seq_lens, and the
references themselves against naive loops.

The modules the GPU tests use are listed in scripts/matrices/tests (the AOT prebuild of
the GPU check); `test_matrix_covers_gpu_tests` keeps the two in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kv_helpers import capture_graph

import flashinfer_jit as fij
from flashinfer_jit.kvcache.append import check_append_values
from flashinfer_jit.reference import append_paged_kv_cache_ref, get_batch_indices_positions_ref, page_slots_ref
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table

DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
HEAD_DIMS = (64, 128, 256)
LAYOUTS = ("NHD", "HND")
TABLES = ("csr", "block_table", "block_table_kv_separate")
CACHE_FORMS = ("tuple", "combined", "strided", "mixed")
ROOT = Path(__file__).resolve().parents[1]

DEVICE = torch.device("cuda")  # of the GPU tests

# The configuration everything but the dtype x head_dim test runs on.
BASE_DTYPE, BASE_HEAD_DIM = torch.bfloat16, 128


def gpu_specs_used() -> set:
    """Every AppendSpec the GPU tests below build (keep in step with the tests)."""
    from flashinfer_jit.specs import AppendSpec, BatchIndicesSpec

    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    specs = {AppendSpec(name(d), hd, "NHD", "csr") for d in DTYPES for hd in HEAD_DIMS}
    specs |= {AppendSpec(name(BASE_DTYPE), BASE_HEAD_DIM, lay, tab) for lay in LAYOUTS for tab in TABLES}
    specs.add(BatchIndicesSpec())
    return specs


# --- data -------------------------------------------------------------------------------
def random_tensor(shape, dtype, device, generator=None) -> torch.Tensor:
    """Standard normal values in `dtype` (fp8: randn cast to fp8). Never zeros."""
    return torch.randn(shape, generator=generator, device="cpu").to(dtype).to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = as_bytes(actual), as_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if torch.equal(a, e):
        return
    diff = (a != e).nonzero()
    raise AssertionError(f"{what}: {diff.shape[0]} of {a.numel()} bytes differ; first at "
                         f"index {tuple(diff[0].tolist())} (byte view shape {tuple(a.shape)})")


@dataclass
class Batch:
    """A random batch of requests and its page table (all on `device`)."""

    page_table: PageTable
    csr_args: tuple | None  # (kv_indices, kv_indptr, kv_last_page_len) for the csr layout
    append_indptr: torch.Tensor
    seq_lens: torch.Tensor
    num_pages: int
    page_size: int

    @property
    def num_appended(self) -> int:
        return int(self.append_indptr[-1])

    def op_kwargs(self) -> dict:
        if self.csr_args is not None:
            return dict(zip(("kv_indices", "kv_indptr", "kv_last_page_len"), self.csr_args))
        return {"page_table": self.page_table}


def make_batch(table: str, batch_size: int, page_size: int, device, generator, *,
               max_before: int = 40, max_append: int = 40, extra_pages: int = 5,
               before=None, append=None) -> Batch:
    """Requests with random KV lengths before the append (some 0) and random append
    lengths (some 0, so some requests have no pages at all). Pages are a random
    permutation; the last page of the cache is a trash page no request owns, which
    unused block-table entries and trailing kv_indices point at, so a kernel reading
    past a request's pages writes somewhere the byte comparison sees."""
    def draw(high):
        return torch.randint(0, high + 1, (batch_size,), generator=generator)

    before = torch.as_tensor(before) if before is not None else draw(max_before)
    if append is None:
        append = draw(max_append)
        append[::4] = 0  # every 4th request appends nothing
    append = torch.as_tensor(append)
    seq = before + append
    pages = (seq + page_size - 1) // page_size
    total = int(pages.sum())
    num_pages = total + extra_pages + 1
    trash = num_pages - 1
    perm_k = torch.randperm(num_pages - 1, generator=generator)[:total].to(torch.int32)
    append_indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    append_indptr[1:] = torch.cumsum(append, 0)
    seq_lens = seq.to(torch.int32)
    csr_args = None
    if table == "csr":
        kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        kv_indices = torch.cat([perm_k, torch.full((2,), trash, dtype=torch.int32)])
        last = torch.where(pages > 0, seq - (pages - 1) * page_size, 0).to(torch.int32)
        csr_args = tuple(t.to(device) for t in (kv_indices, kv_indptr, last))
        page_table = csr_page_table(csr_args[1], csr_args[0], csr_args[2])
    else:
        max_pages = int(pages.max()) + 1 if batch_size else 1
        separate = table == "block_table_kv_separate"
        shape = (batch_size, 2, max_pages) if separate else (batch_size, max_pages)
        bt = torch.full(shape, trash, dtype=torch.int32)
        perm_v = torch.randperm(num_pages - 1, generator=generator)[:total].to(torch.int32)
        start = 0
        for b in range(batch_size):
            n = int(pages[b])
            if separate:
                bt[b, 0, :n] = perm_k[start:start + n]
                bt[b, 1, :n] = perm_v[start:start + n]
            else:
                bt[b, :n] = perm_k[start:start + n]
            start += n
        page_table = block_page_table(bt.to(device), seq_lens.to(device), kv_separate=separate)
    return Batch(page_table, csr_args, append_indptr.to(device), seq_lens.to(device), num_pages,
                 page_size)


@dataclass
class Cache:
    """A paged KV cache as one of the forms users pass, over `bases` (the tensors that
    own the memory; all their bytes are compared)."""

    bases: list
    form: str
    layout: str

    def views(self, bases=None):
        bases = self.bases if bases is None else bases
        if self.form == "tuple":
            return bases[0], bases[1]
        if self.form == "combined":
            return bases[0][:, 0], bases[0][:, 1]
        d = bases[0].shape[-1] // (2 if self.form == "strided" else 3)
        if self.form == "strided":  # K and V: two halves of one buffer's last dim
            return bases[0][..., :d], bases[0][..., d:]
        return bases[0][..., d:2 * d], bases[1]  # mixed: K a strided slice, V its own tensor

    def argument(self):
        return self.bases[0] if self.form == "combined" else self.views()


def make_cache(form: str, layout: str, num_pages: int, page_size: int, heads: int, dim: int,
               dtype, device, generator) -> Cache:
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    rnd = lambda *shape: random_tensor(shape, dtype, device, generator)  # noqa: E731
    if form == "tuple":
        bases = [rnd(num_pages, *inner, dim), rnd(num_pages, *inner, dim)]
    elif form == "combined":
        bases = [rnd(num_pages, 2, *inner, dim)]
    elif form == "strided":
        bases = [rnd(num_pages, *inner, 2 * dim)]
    elif form == "mixed":
        bases = [rnd(num_pages, *inner, 3 * dim), rnd(num_pages, *inner, dim)]
    else:
        raise ValueError(form)
    return Cache(bases, form, layout)


def make_appends(nnz: int, heads: int, dim: int, dtype, device, generator, qkv: bool = False):
    """append_key, append_value: separate tensors, or non-contiguous head slices of one
    fused qkv projection output [nnz, num_qo_heads + 2 * heads, dim]."""
    if not qkv:
        return (random_tensor((nnz, heads, dim), dtype, device, generator),
                random_tensor((nnz, heads, dim), dtype, device, generator))
    qo_heads = 3 * heads
    fused = random_tensor((nnz, qo_heads + 2 * heads, dim), dtype, device, generator)
    return fused[:, qo_heads:qo_heads + heads], fused[:, qo_heads + heads:]


def expected_after(cache: Cache, key, value, batch_indices, positions, page_table) -> list:
    """Clones of the cache's bases with the reference append applied to their views."""
    bases = [b.clone() for b in cache.bases]
    k, v = cache.views(bases)
    k_new, v_new = append_paged_kv_cache_ref(key, value, batch_indices, positions, k, v, page_table,
                                             cache.layout)
    k.copy_(k_new)
    v.copy_(v_new)
    return bases


def check_append(cache: Cache, batch: Batch, key, value, batch_indices, positions, run) -> None:
    """Run `run()` (the op) and check (a) each appended row is at its slot, (b) every
    byte of every buffer matches the reference, (c) the inputs are unchanged."""
    expected = expected_after(cache, key, value, batch_indices, positions, batch.page_table)
    inputs = [t.clone() for t in (key, value, batch_indices, positions)]
    run()
    torch.cuda.synchronize()
    k, v = cache.views()
    page_size = batch.page_size
    tokens, k_page, v_page, slot = page_slots_ref(batch_indices, positions, batch.page_table,
                                                  page_size, k.shape[0])
    for name, dst, rows, page in (("K", k, key, k_page), ("V", v, value, v_page)):
        raw = as_bytes(dst)
        got = raw[page, slot] if cache.layout == "NHD" else raw[page, :, slot]
        assert_bytes_equal(got, as_bytes(rows[tokens].contiguous()), f"appended {name} rows")
    for i, (base, exp) in enumerate(zip(cache.bases, expected)):
        assert_bytes_equal(base, exp, f"cache buffer {i} ({cache.form}, {cache.layout})")
    for name, before, now in zip(("append_key", "append_value", "batch_indices", "positions"),
                                 inputs, (key, value, batch_indices, positions)):
        assert_bytes_equal(now, before, f"{name} (an input) changed")


def ref_indices(batch: Batch, nnz: int | None = None):
    nnz = batch.num_appended if nnz is None else nnz
    return get_batch_indices_positions_ref(batch.append_indptr, batch.seq_lens, nnz)


def run_case(*, dtype=BASE_DTYPE, head_dim=BASE_HEAD_DIM, layout="NHD", table="csr",
             form="tuple", batch_size=33, page_size=16, heads=4, qkv=False, seed=0, **batch_kw):
    gen = torch.Generator().manual_seed(seed)
    dev = DEVICE
    batch = make_batch(table, batch_size, page_size, dev, gen, **batch_kw)
    cache = make_cache(form, layout, batch.num_pages, page_size, heads, head_dim, dtype, dev, gen)
    bi, pos = ref_indices(batch)
    key, value = make_appends(bi.shape[0], heads, head_dim, dtype, dev, gen, qkv=qkv)
    run = lambda: fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(),  # noqa: E731
                                            kv_layout=layout, **batch.op_kwargs())
    check_append(cache, batch, key, value, bi, pos, run)


def dtype_id(d) -> str:
    return str(d).replace("torch.", "")


# --- GPU: append ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_append_dtype_head_dim(dtype, head_dim):
    run_case(dtype=dtype, head_dim=head_dim, seed=head_dim + DTYPES.index(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("form", CACHE_FORMS)
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_layouts_tables_forms(layout, table, form):
    run_case(layout=layout, table=table, form=form, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", (1, 33))
@pytest.mark.parametrize("page_size", (1, 16, 64))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_page_sizes_batch_sizes(layout, page_size, batch_size):
    # batch 1 must append something, or the test checks nothing
    kw = {"before": [37], "append": [100]} if batch_size == 1 else {"max_before": 150, "max_append": 90}
    run_case(layout=layout, page_size=page_size, batch_size=batch_size, seed=page_size, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout,table", [
    (torch.bfloat16, "NHD", "csr"), (torch.float8_e4m3fn, "NHD", "csr"),
    (torch.bfloat16, "HND", "block_table"), (torch.bfloat16, "NHD", "block_table_kv_separate")],
    ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else x)
def test_append_from_qkv_slices(dtype, layout, table):
    """append_key/value as head slices of a fused qkv output: non-contiguous, no copy."""
    run_case(dtype=dtype, layout=layout, table=table, qkv=True, form="strided", seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_padding_tokens_touch_nothing(layout, table):
    """Entries past append_indptr[-1] (padding to a captured size) get batch index -1
    from get_batch_indices_positions; append skips them. Their append_key rows are
    random data, so a write anywhere shows in the byte comparison."""
    gen = torch.Generator().manual_seed(11)
    dev = DEVICE
    batch = make_batch(table, 33, 16, dev, gen)
    nnz = batch.num_appended + 77
    bi, pos = fij.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, nnz)
    ref_bi, ref_pos = ref_indices(batch, nnz)
    assert_bytes_equal(bi, ref_bi, "batch_indices")
    assert_bytes_equal(pos, ref_pos, "positions")
    assert int((bi == -1).sum()) == 77
    cache = make_cache("tuple", layout, batch.num_pages, 16, 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
    key, value = make_appends(nnz, 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
    check_append(cache, batch, key, value, bi, pos,
                 lambda: fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(),
                                                   kv_layout=layout, **batch.op_kwargs()))


@pytest.mark.gpu
@pytest.mark.parametrize("table", TABLES)
def test_append_only_padding_and_empty(table):
    """A batch that appends nothing (every request 0 tokens), padded to 64 tokens, and
    a call with nnz = 0: the cache is untouched."""
    gen = torch.Generator().manual_seed(5)
    dev = DEVICE
    batch = make_batch(table, 9, 16, dev, gen, append=[0] * 9)
    assert batch.num_appended == 0
    cache = make_cache("tuple", "NHD", batch.num_pages, 16, 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
    for nnz in (64, 0):
        bi, pos = fij.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, nnz)
        assert bool((bi == -1).all()) and bool((pos == 0).all())
        key, value = make_appends(nnz, 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
        check_append(cache, batch, key, value, bi, pos,
                     lambda: fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(),
                                                       **batch.op_kwargs()))


@pytest.mark.gpu
def test_append_runs_on_current_stream():
    """The op launches on torch's current stream: on a side stream, the input is written
    after a long sleep kernel; a launch on another stream would read the old rows."""
    gen = torch.Generator().manual_seed(13)
    dev = DEVICE
    batch = make_batch("csr", 8, 16, dev, gen)
    cache = make_cache("tuple", "NHD", batch.num_pages, 16, 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
    bi, pos = ref_indices(batch)
    key, value = make_appends(bi.shape[0], 4, BASE_HEAD_DIM, BASE_DTYPE, dev, gen)
    fresh_key = random_tensor(key.shape, BASE_DTYPE, dev, gen)
    expected = expected_after(cache, fresh_key, value, bi, pos, batch.page_table)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms at H100 clocks
        key.copy_(fresh_key)
        fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(), **batch.op_kwargs())
    torch.cuda.synchronize()
    for base, exp in zip(cache.bases, expected):
        assert_bytes_equal(base, exp, "cache after a side-stream append")


@pytest.mark.gpu
def test_append_cuda_graph_capture_and_replay():
    """get_batch_indices_positions + append captured once in a CUDA graph at a fixed
    padded size, replayed with new requests (different lengths, pages, data) written
    into the same static buffers: each replay matches the reference."""
    dev = DEVICE
    gen = torch.Generator().manual_seed(17)
    batch_size, page_size, heads, dim, nnz = 16, 16, 4, BASE_HEAD_DIM, 512
    max_before, max_append = 60, 30  # sum of appends <= 16 * 30 = 480 < nnz
    num_pages = batch_size * math.ceil((max_before + max_append) / page_size) + 1
    trash = num_pages - 1
    static = {
        "append_indptr": torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
        "seq_lens": torch.zeros(batch_size, dtype=torch.int32, device=dev),
        "kv_indptr": torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
        "kv_indices": torch.full((num_pages,), trash, dtype=torch.int32, device=dev),
        "kv_last_page_len": torch.zeros(batch_size, dtype=torch.int32, device=dev),
    }
    key = torch.empty(nnz, heads, dim, dtype=BASE_DTYPE, device=dev)
    value = torch.empty_like(key)
    cache = make_cache("combined", "NHD", num_pages, page_size, heads, dim, BASE_DTYPE, dev, gen)

    def load_new_batch(seed):
        g = torch.Generator().manual_seed(seed)
        b = make_batch("csr", batch_size, page_size, "cpu", g, max_before=max_before,
                       max_append=max_append, extra_pages=0)
        indices, indptr, last = b.csr_args
        assert b.num_pages <= num_pages
        static["append_indptr"].copy_(b.append_indptr)
        static["seq_lens"].copy_(b.seq_lens)
        static["kv_indptr"].copy_(indptr)
        static["kv_indices"].fill_(trash)
        static["kv_indices"][: indices.numel() - 2].copy_(indices[:-2])
        static["kv_last_page_len"].copy_(last)
        key.copy_(random_tensor(key.shape, BASE_DTYPE, dev, g))
        value.copy_(random_tensor(value.shape, BASE_DTYPE, dev, g))

    def step():
        bi, pos = fij.get_batch_indices_positions(static["append_indptr"], static["seq_lens"], nnz)
        fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(), static["kv_indices"],
                                  static["kv_indptr"], static["kv_last_page_len"])
        return bi, pos

    load_new_batch(100)
    graph, (bi, pos) = capture_graph(step)  # a warm-up step() (loads the modules), then the capture
    for seed in (101, 102, 103):
        load_new_batch(seed)
        torch.cuda.synchronize()
        table = csr_page_table(static["kv_indptr"], static["kv_indices"], static["kv_last_page_len"])
        ref_bi, ref_pos = get_batch_indices_positions_ref(static["append_indptr"], static["seq_lens"], nnz)
        expected = expected_after(cache, key, value, ref_bi, ref_pos, table)
        graph.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(bi, ref_bi, f"batch_indices (replay {seed})")
        assert_bytes_equal(pos, ref_pos, f"positions (replay {seed})")
        assert_bytes_equal(cache.bases[0], expected[0], f"cache (replay {seed})")


# --- GPU: get_batch_indices_positions -------------------------------------------------------
def poison_allocator(device, nbytes: int = 8 << 20) -> None:
    """Fill memory the caching allocator hands out next with a poison pattern, so that
    an output the op allocates and fails to write shows up (fresh memory is often
    zeros, which would hide unwritten entries)."""
    for n in (nbytes // 4, 1 << 16, 1 << 10):
        torch.full((n,), 0x7F7F7F7F, dtype=torch.int32, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", (0, 1, 33, 1000))
@pytest.mark.parametrize("padding", (0, 1, 300))
def test_get_batch_indices_positions(batch_size, padding):
    gen = torch.Generator().manual_seed(batch_size * 7 + padding)
    dev = DEVICE
    append = torch.randint(0, 50, (batch_size,), generator=gen)
    if batch_size >= 3:
        append[::3] = 0  # zero-length requests
    before = torch.randint(0, 1000, (batch_size,), generator=gen)
    append_indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    append_indptr[1:] = torch.cumsum(append, 0)
    seq_lens = (before + append).to(torch.int32)
    nnz = int(append_indptr[-1]) + padding
    poison_allocator(dev)
    bi, pos = fij.get_batch_indices_positions(append_indptr.to(dev), seq_lens.to(dev), nnz)
    torch.cuda.synchronize()
    ref_bi, ref_pos = get_batch_indices_positions_ref(append_indptr, seq_lens, nnz)
    assert bi.dtype == torch.int32 and pos.dtype == torch.int32
    assert bi.device.type == "cuda" and bi.shape == (nnz,) and pos.shape == (nnz,)
    assert_bytes_equal(bi.cpu(), ref_bi, "batch_indices")
    assert_bytes_equal(pos.cpu(), ref_pos, "positions")


# --- GPU: checks that need CUDA tensors ----------------------------------------------------
def small_cuda_args(device=None):
    device = DEVICE if device is None else device
    gen = torch.Generator().manual_seed(23)
    batch = make_batch("csr", 4, 16, device, gen, before=[3, 20, 0, 0], append=[5, 1, 17, 0])
    cache = make_cache("tuple", "NHD", batch.num_pages, 16, 4, 128, torch.bfloat16, device, gen)
    bi, pos = ref_indices(batch)
    key, value = make_appends(bi.shape[0], 4, 128, torch.bfloat16, device, gen)
    indices, indptr, last = batch.csr_args
    return dict(append_key=key, append_value=value, batch_indices=bi, positions=pos,
                paged_kv_cache=cache.argument(), kv_indices=indices, kv_indptr=indptr,
                kv_last_page_len=last), batch


@pytest.mark.gpu
def test_mixed_devices_rejected(no_build):
    args, _ = small_cuda_args()
    args["append_value"] = args["append_value"].cpu()
    with pytest.raises(ValueError, match="append_value is on cpu"):
        fij.append_paged_kv_cache(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("problem", ("last_page_len_0", "page_id_too_large", "position_past_pages",
                                     "batch_index_too_large"))
def test_debug_value_checks_through_op(problem, monkeypatch, no_build):
    """FLASHINFER_JIT_DEBUG=1: bad page-table values are a ValueError before launch.
    (Each check raises before the module is looked up, so no debug build happens.)"""
    monkeypatch.setenv("FLASHINFER_JIT_DEBUG", "1")
    args, batch = small_cuda_args()
    corrupt(args, batch, problem)
    with pytest.raises(ValueError, match=PROBLEM_MESSAGES[problem]):
        fij.append_paged_kv_cache(**args)


# --- CPU: validation (runs on CI; nothing may be built or launched) --------------------------
@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the op gets as far as looking up (building) a module."""
    import flashinfer_jit.kvcache.append as append_module

    def refuse(spec):
        raise AssertionError(f"validation let the call through to get_module({spec.name})")

    monkeypatch.setattr(append_module, "get_module", refuse)


def cpu_args(**changes):
    args, _ = small_cuda_args("cpu")
    args.update(changes)
    return args


PROBLEM_MESSAGES = {
    "last_page_len_0": "kv_last_page_len",
    "page_id_too_large": "page ids out of range",
    "position_past_pages": "positions",
    "batch_index_too_large": "batch_indices",
}


def corrupt(args: dict, batch: Batch, problem: str) -> None:
    """Make one value of a valid call wrong (batch: requests with 8, 21, 17, 0 tokens)."""
    if problem == "last_page_len_0":
        args["kv_last_page_len"] = args["kv_last_page_len"].clone()
        args["kv_last_page_len"][1] = 0  # request 1 has 2 pages
    elif problem == "page_id_too_large":
        args["kv_indices"] = args["kv_indices"].clone()
        args["kv_indices"][0] = batch.num_pages
    elif problem == "position_past_pages":
        args["positions"] = args["positions"].clone()
        args["positions"][0] = 16  # request 0 has 1 page of 16
    elif problem == "batch_index_too_large":
        args["batch_indices"] = args["batch_indices"].clone()
        args["batch_indices"][0] = 4
    else:
        raise ValueError(problem)


def test_cpu_tensors_rejected_last(no_build):
    """A call that is valid but for the device fails on the device, naming it."""
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        fij.append_paged_kv_cache(**cpu_args())


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {"append_key": a["append_key"].float()}, TypeError, "append_key"),
    (lambda a: {"append_value": a["append_value"].half()}, TypeError, "append_value"),
    (lambda a: {"append_key": a["append_key"][:, 0]}, ValueError, "append_key.*3-D"),
    (lambda a: {"append_key": a["append_key"][:, :2], "append_value": a["append_value"][:, :2]},
     ValueError, "append_key.*num_kv_heads=4"),
    (lambda a: {"append_key": a["append_key"][..., :64], "append_value": a["append_value"][..., :64]},
     ValueError, "append_key.*head_dim=128"),
    (lambda a: {"append_value": a["append_value"][:-1]}, ValueError, "append_value"),
    (lambda a: {"kv_indices": a["kv_indices"].short()}, TypeError, "kv_indices.*int32 or int64"),
    (lambda a: {"kv_indptr": a["kv_indptr"].float()}, TypeError, "kv_indptr.*int32 or int64"),
    (lambda a: {"kv_last_page_len": a["kv_last_page_len"][:-1]}, ValueError, "kv_last_page_len"),
    (lambda a: {"batch_indices": a["batch_indices"][:-1]}, ValueError, "batch_indices"),
    (lambda a: {"positions": a["positions"].short()}, TypeError, "positions.*int32 or int64"),
    (lambda a: {"kv_layout": "NCHW"}, ValueError, "kv_layout"),
    (lambda a: {"paged_kv_cache": a["paged_kv_cache"][0]}, ValueError, "paged_kv_cache"),
    (lambda a: {"paged_kv_cache": (a["paged_kv_cache"][0], a["paged_kv_cache"][1].half())},
     TypeError, "paged_kv_cache"),
    (lambda a: {"paged_kv_cache": tuple(t.transpose(2, 3) for t in a["paged_kv_cache"])},
     ValueError, "contiguous"),
    (lambda a: {"kv_indptr": None}, TypeError, "kv_indptr"),
], ids=["key_dtype", "value_dtype", "key_rank", "heads", "head_dim", "value_shape",
        "indices_int16", "indptr_float", "last_page_len_len", "batch_indices_len", "positions_int16",
        "kv_layout", "cache_rank", "cache_dtypes_differ", "cache_not_contiguous", "no_page_table"])
def test_append_argument_errors(change, error, match, no_build):
    args = cpu_args()
    args.update(change(args))
    with pytest.raises(error, match=match):
        fij.append_paged_kv_cache(**args)


@pytest.mark.parametrize("which", ("append_key", "paged_kv_cache"))
def test_append_misaligned_views_rejected(which, no_build):
    """Views whose start or strides are not whole 16-byte vectors: a ValueError before
    launch, never a misaligned vector access."""
    args = cpu_args()
    if which == "append_key":
        key = args["append_key"]
        wide = torch.randn(key.shape[0], key.shape[1], key.shape[2] + 1).to(key.dtype)
        args["append_key"] = wide[..., 1:]  # starts 2 bytes into the buffer; head stride 129
    else:
        k, v = args["paged_kv_cache"]
        wide = torch.randn(*k.shape[:-1], k.shape[-1] + 1).to(k.dtype)
        args["paged_kv_cache"] = (wide[..., 1:], v)
    with pytest.raises(ValueError, match="16 bytes"):
        fij.append_paged_kv_cache(**args)


def test_append_unsupported_head_dim_lists_supported(no_build):
    gen = torch.Generator().manual_seed(0)
    key, value = make_appends(5, 2, 96, torch.bfloat16, "cpu", gen)
    cache = make_cache("tuple", "NHD", 4, 16, 2, 96, torch.bfloat16, "cpu", gen)
    batch = make_batch("csr", 1, 16, "cpu", gen, before=[0], append=[5])
    bi, pos = ref_indices(batch)
    with pytest.raises(ValueError, match=r"head_dim=96.*supported: 64, 128, 256"):
        fij.append_paged_kv_cache(key, value, bi, pos, cache.argument(), **batch.op_kwargs())


def test_append_unsupported_dtype_lists_supported(no_build):
    args = cpu_args()
    args["append_key"], args["append_value"] = args["append_key"].float(), args["append_value"].float()
    args["paged_kv_cache"] = tuple(t.float() for t in args["paged_kv_cache"])
    with pytest.raises(ValueError, match=r"dtype_kv='float32'.*supported:.*bfloat16"):
        fij.append_paged_kv_cache(**args)


def test_block_table_layout_shape_errors(no_build):
    bt2 = torch.zeros(4, 3, dtype=torch.int32)
    seq_lens = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables.*\[batch_size, 2, max_pages\]"):
        block_page_table(bt2, seq_lens, kv_separate=True)
    with pytest.raises(ValueError, match="block_tables"):
        block_page_table(torch.zeros(4, 2, 3, dtype=torch.int32), seq_lens)
    with pytest.raises(TypeError, match="block_tables"):
        block_page_table(bt2.float(), seq_lens)
    with pytest.raises(ValueError, match="seq_lens"):
        block_page_table(bt2, seq_lens[:3])


def test_page_table_and_csr_arguments_exclusive(no_build):
    args = cpu_args()
    table = csr_page_table(args["kv_indptr"], args["kv_indices"], args["kv_last_page_len"])
    with pytest.raises(ValueError, match="page_table"):
        fij.append_paged_kv_cache(**args, page_table=table)


def test_get_batch_indices_positions_argument_errors():
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq_lens = torch.tensor([4, 9], dtype=torch.int32)
    with pytest.raises(TypeError, match="append_indptr"):
        fij.get_batch_indices_positions(indptr.short(), seq_lens, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        fij.get_batch_indices_positions(indptr, seq_lens[:1], 8)
    with pytest.raises(TypeError, match="seq_lens"):
        fij.get_batch_indices_positions(indptr, seq_lens.float(), 8)
    with pytest.raises(ValueError, match="nnz"):
        fij.get_batch_indices_positions(indptr, seq_lens, -1)
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        fij.get_batch_indices_positions(indptr, seq_lens, 8)


# --- CPU: debug-mode value checks, called directly on CPU tensors -----------------------------
@pytest.mark.parametrize("problem", sorted(PROBLEM_MESSAGES))
def test_debug_value_checks(problem):
    args, batch = small_cuda_args("cpu")
    table = lambda a: csr_page_table(a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"])  # noqa: E731
    # the valid call passes
    check_append_values(args["batch_indices"], args["positions"], table(args), batch.num_pages, 16)
    corrupt(args, batch, problem)
    with pytest.raises(ValueError, match=PROBLEM_MESSAGES[problem]):
        check_append_values(args["batch_indices"], args["positions"], table(args), batch.num_pages, 16)


def test_debug_checks_accept_empty_requests_and_padding():
    """A request with no pages may have last_page_len 0; padding (-1) is not checked."""
    gen = torch.Generator().manual_seed(2)
    batch = make_batch("csr", 6, 16, "cpu", gen, before=[0, 5, 0, 0, 9, 0], append=[0, 3, 0, 4, 0, 0])
    bi, pos = ref_indices(batch, batch.num_appended + 5)
    assert int((bi == -1).sum()) == 5
    check_append_values(bi, pos, batch.page_table, batch.num_pages, 16)


@pytest.mark.parametrize("table", ("block_table", "block_table_kv_separate"))
def test_debug_checks_block_tables(table):
    gen = torch.Generator().manual_seed(4)
    batch = make_batch(table, 5, 16, "cpu", gen)
    bi, pos = ref_indices(batch)
    check_append_values(bi, pos, batch.page_table, batch.num_pages, 16)
    bt = batch.page_table.tensors[0].clone()
    bt.view(-1)[0] = batch.num_pages
    bad = block_page_table(bt, batch.seq_lens, kv_separate=table.endswith("separate"))
    with pytest.raises(ValueError, match="page ids out of range"):
        check_append_values(bi, pos, bad, batch.num_pages, 16)


# --- CPU: get_seq_lens --------------------------------------------------------------------------
def test_get_seq_lens():
    kv_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    last = torch.tensor([5, 0, 16, 1], dtype=torch.int32)
    got = fij.get_seq_lens(kv_indptr, last, 16)
    assert got.dtype == torch.int32
    assert got.tolist() == [2 * 16 + 5, 0, 16, 4 * 16 + 1]


# --- CPU: the references against naive loops --------------------------------------------------
def naive_append(key, value, bi, pos, k, v, batch: Batch, layout):
    k, v = k.clone(), v.clone()
    tensors = [t.cpu() for t in batch.page_table.tensors]
    ps = batch.page_size
    for t in range(bi.shape[0]):
        b, p = int(bi[t]), int(pos[t])
        if b < 0:
            continue
        if batch.page_table.layout == "csr":
            kp = vp = int(tensors[1][int(tensors[0][b]) + p // ps])
        elif batch.page_table.layout == "block_table":
            kp = vp = int(tensors[0][b, p // ps])
        else:
            kp, vp = int(tensors[0][b, 0, p // ps]), int(tensors[0][b, 1, p // ps])
        if layout == "NHD":
            k[kp, p % ps], v[vp, p % ps] = key[t], value[t]
        else:
            k[kp, :, p % ps], v[vp, :, p % ps] = key[t], value[t]
    return k, v


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float8_e4m3fn), ids=dtype_id)
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_matches_naive_loop(layout, table, dtype):
    gen = torch.Generator().manual_seed(31)
    batch = make_batch(table, 7, 4, "cpu", gen, max_before=9, max_append=9)
    cache = make_cache("combined", layout, batch.num_pages, 4, 2, 16, dtype, "cpu", gen)
    bi, pos = ref_indices(batch, batch.num_appended + 3)
    key, value = make_appends(bi.shape[0], 2, 16, dtype, "cpu", gen, qkv=True)
    k, v = cache.views()
    ref_k, ref_v = append_paged_kv_cache_ref(key, value, bi, pos, k, v, batch.page_table, layout)
    # the loop copies element by element in the dtype, so compare through uint8 views
    loop_k, loop_v = naive_append(key.view(torch.uint8), value.view(torch.uint8), bi, pos,
                                  k.view(torch.uint8), v.view(torch.uint8), batch, layout)
    assert_bytes_equal(ref_k, loop_k, "reference K")
    assert_bytes_equal(ref_v, loop_v, "reference V")
    assert not torch.equal(as_bytes(ref_k), as_bytes(k)), "nothing was appended"


def test_reference_rejects_out_of_range_and_duplicates():
    gen = torch.Generator().manual_seed(1)
    batch = make_batch("csr", 2, 4, "cpu", gen, before=[0, 2], append=[3, 2])
    bi, pos = ref_indices(batch)
    pos_bad = pos.clone()
    pos_bad[0] = 4  # request 0 has 3 tokens: one page of 4
    with pytest.raises(ValueError, match="outside"):
        page_slots_ref(bi, pos_bad, batch.page_table, 4, batch.num_pages)
    tokens, *_ = page_slots_ref(bi, pos_bad, batch.page_table, 4, batch.num_pages, skip_invalid=True)
    assert 0 not in tokens.tolist() and tokens.numel() == bi.numel() - 1
    pos_dup = pos.clone()
    pos_dup[1] = pos_dup[0]
    with pytest.raises(ValueError, match="same K slot"):
        page_slots_ref(bi, pos_dup, batch.page_table, 4, batch.num_pages)


@pytest.mark.parametrize("batch_size,padding", [(0, 4), (1, 0), (13, 9)])
def test_batch_indices_reference_matches_loop(batch_size, padding):
    gen = torch.Generator().manual_seed(batch_size)
    append = torch.randint(0, 6, (batch_size,), generator=gen)
    seq = append + torch.randint(0, 20, (batch_size,), generator=gen)
    indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(append, 0)
    nnz = int(indptr[-1]) + padding
    bi, pos = get_batch_indices_positions_ref(indptr, seq.to(torch.int32), nnz)
    want_bi, want_pos = [-1] * nnz, [0] * nnz
    for b in range(batch_size):
        for j, t in enumerate(range(int(indptr[b]), int(indptr[b + 1]))):
            want_bi[t], want_pos[t] = b, int(seq[b]) - int(append[b]) + j
    assert bi.tolist() == want_bi and pos.tolist() == want_pos


# --- CPU: the AOT matrix of the GPU check covers these tests ----------------------------------
def test_matrix_covers_gpu_tests():
    matrix = pytest.importorskip("flashinfer_jit.pipeline.matrix")
    path = ROOT / "scripts" / "matrices" / "tests"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    listed = set(matrix.parse_matrix(path))
    missing = sorted(s.name for s in gpu_specs_used() - listed)
    assert not missing, f"scripts/matrices/tests lacks modules the GPU tests use: {missing}"


@pytest.mark.gpu
def test_append_rows_wider_than_the_block():
    """40 heads x 256 dims of bf16 = 1280 16-byte vectors per token: several groups of
    rounds per token (csrc/kvcache/append.cuh), each landing exactly."""
    import flashinfer_jit as fij
    from flashinfer_jit.reference import append_paged_kv_cache_ref
    from flashinfer_jit.runtime.page_table import csr_page_table

    gen = torch.Generator().manual_seed(11)
    heads, dim, page, num_pages = 40, 256, 16, 12
    seq = torch.tensor([20, 35], dtype=torch.int32)
    append_len = torch.tensor([20, 3], dtype=torch.int32)
    append_indptr = torch.tensor([0, 20, 23], dtype=torch.int32, device="cuda")
    pages = (seq + page - 1) // page
    kv_indptr = torch.tensor([0, int(pages[0]), int(pages.sum())], dtype=torch.int32, device="cuda")
    kv_indices = torch.randperm(num_pages, generator=gen)[: int(pages.sum())].to(torch.int32).cuda()
    table = csr_page_table(kv_indptr, kv_indices)
    nnz = int(append_len.sum())
    bi, pos = fij.get_batch_indices_positions(append_indptr, seq.cuda(), nnz)
    key = torch.randn(nnz, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    value = torch.randn(nnz, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    k_cache = torch.randn(num_pages, page, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(num_pages, page, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    k_ref, v_ref = append_paged_kv_cache_ref(key, value, bi, pos, k_cache, v_cache, table, "NHD")
    fij.append_paged_kv_cache(key, value, bi, pos, (k_cache, v_cache), page_table=table)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
