"""append_paged_kv_cache, get_batch_indices_positions, get_seq_lens (FlashInfer's API)."""

from __future__ import annotations

import torch

from ..pipeline import env
from ..pipeline.jit import get_module, op_cache, traced_op
from ..pipeline.spec import HEAD_DIMS, PAGED_KV_DTYPES, dtype_name
from ..runtime.checks import (
    aligned16,
    as_int32_index,
    compiling,
    constant_result,
    dtype_str,
    expect_dim,
    expect_index_vector,
    expect_same_cuda_device,
    expect_vector_aligned,
    index_ok,
    index_vector,
    same_cuda_device,
)
from ..runtime.page_table import PageTable, csr_page_table, unpack_paged_kv_cache
from .append_spec import AppendSpec, BatchIndicesSpec

_BATCH_INDICES_SPEC = BatchIndicesSpec()


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices=None, kv_indptr=None, kv_last_page_len=None,
                          kv_layout: str = "NHD", *, page_table: PageTable | None = None) -> None:
    """Write `append_key`/`append_value` rows ([nnz, num_kv_heads, head_dim]) into the
    paged cache at (batch_indices[i], positions[i]).

    The page table is FlashInfer's CSR triple (kv_indices, kv_indptr, kv_last_page_len),
    or any layout of flashinfer_jit.runtime.page_table given as `page_table=`. Tokens with
    batch index -1 (padding, as get_batch_indices_positions emits past
    append_indptr[-1]) are skipped and touch nothing.
    """
    cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    if page_table is None:
        page_table = csr_page_table(kv_indptr, kv_indices, kv_last_page_len)
    elif kv_indices is not None or kv_indptr is not None or kv_last_page_len is not None:
        raise ValueError("give either kv_indices/kv_indptr/kv_last_page_len or page_table=, not both")
    args = (append_key, append_value, batch_indices, positions, cache, page_table)
    if not _append_args_ok(*args):
        # int64 indices (FlashInfer takes them) are narrowed once; anything else unusual
        # is checked one argument at a time
        batch_indices = as_int32_index(batch_indices, "batch_indices")
        positions = as_int32_index(positions, "positions")
        args = (append_key, append_value, batch_indices, positions, cache, page_table)
        if not _append_args_ok(*args):
            _explain_append_args(*args)  # raises, naming the argument
    config = (cache.k.dtype, cache.k.shape[3], kv_layout, page_table.layout)
    if compiling():  # Dynamo traces this: no value checks (a device sync), the op by its name
        op = traced_op(_append_namespace(*config), "append_paged_kv_cache")
    else:
        debug = env.debug()
        if debug:
            check_append_values(batch_indices, positions, page_table, cache.num_pages, cache.page_size)
        op = _append_op(*config, debug)
    op(append_key, append_value, batch_indices, positions, cache.k, cache.v, page_table.tensors)


def _append_spec(dtype, head_dim: int, kv_layout: str, table_layout: str) -> AppendSpec:
    return AppendSpec(dtype_name(dtype), head_dim, kv_layout, table_layout).validate()


@op_cache
def _append_op(dtype, head_dim: int, kv_layout: str, table_layout: str, debug: bool):
    return get_module(_append_spec(dtype, head_dim, kv_layout, table_layout)).append_paged_kv_cache


@constant_result
def _append_namespace(dtype, head_dim: int, kv_layout: str, table_layout: str) -> str:
    return get_module(_append_spec(dtype, head_dim, kv_layout, table_layout)).namespace


_SUPPORTED = {(d, h) for d in PAGED_KV_DTYPES for h in HEAD_DIMS}


def _append_args_ok(key, value, batch_indices, positions, cache, table) -> bool:
    """One cheap pass over everything _explain_append_args checks (the hot path)."""
    k_cache = cache.k
    if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and key.dim() == 3):
        return False
    nnz, heads, dim = key.shape
    return (value.shape == key.shape and key.dtype == k_cache.dtype and value.dtype == k_cache.dtype
            and heads == cache.num_kv_heads and dim == k_cache.shape[3]
            and key.stride(-1) == 1 and value.stride(-1) == 1
            and index_ok(batch_indices, nnz) and index_ok(positions, nnz)
            and (dtype_name(k_cache.dtype), dim) in _SUPPORTED
            and aligned16(key, value, k_cache, cache.v)
            and same_cuda_device((key, value, batch_indices, positions, k_cache, cache.v) + table.tensors))


def _explain_append_args(append_key, append_value, batch_indices, positions, cache, page_table) -> None:
    """The slow path: check one thing at a time and raise naming the argument."""
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        expect_dim(t, name, 3, "[nnz, num_kv_heads, head_dim]")
        if t.dtype != cache.dtype:
            raise TypeError(f"{name}: expected the cache's dtype {cache.dtype_name}, got "
                            f"{str(t.dtype).replace('torch.', '')} (quantizing appends: "
                            "rope_quantize_fp8_append_paged_kv_cache)")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim dimension must be contiguous")
        expect_vector_aligned(t, name)
    expect_vector_aligned(cache.k, "paged_kv_cache (k_cache)")
    expect_vector_aligned(cache.v, "paged_kv_cache (v_cache)")
    nnz, heads, dim = append_key.shape
    if tuple(append_value.shape) != (nnz, heads, dim):
        raise ValueError(f"append_value: expected the shape of append_key {tuple(append_key.shape)}, "
                         f"got {tuple(append_value.shape)}")
    if heads != cache.num_kv_heads or dim != cache.head_dim:
        raise ValueError(
            f"append_key: [nnz, num_kv_heads, head_dim] = {tuple(append_key.shape)} does not match the "
            f"cache's num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim} ({cache.layout})")
    expect_index_vector(batch_indices, "batch_indices", nnz, "[nnz] (one per appended token)")
    expect_index_vector(positions, "positions", nnz, "[nnz] (one per appended token)")
    AppendSpec(cache.dtype_name, dim, cache.layout, page_table.layout).validate()
    expect_same_cuda_device({"append_key": append_key, "append_value": append_value,
                             "batch_indices": batch_indices, "positions": positions,
                             "k_cache": cache.k, "v_cache": cache.v,
                             **{f"page_table[{i}]": t for i, t in enumerate(page_table.tensors)}})
    raise ValueError("append_paged_kv_cache: invalid arguments")  # not reached: a check above fires


def check_append_values(batch_indices, positions, page_table: PageTable, num_pages: int,
                        page_size: int) -> None:
    """Debug-mode value checks (one device sync): page ids, lengths, destinations."""
    page_table.check_values(num_pages, page_size)
    real = batch_indices >= 0
    if ((batch_indices < -1) | (batch_indices >= page_table.batch_size)).any():
        raise ValueError(f"batch_indices: expected -1 (padding) or 0..{page_table.batch_size - 1}")
    b = batch_indices[real].long()
    pos = positions[real]
    capacity = page_table.capacity().to(pos.dtype)[b] * page_size
    if ((pos < 0) | (pos >= capacity)).any():
        raise ValueError("positions: a token's position lies outside its request's pages "
                         "(expected 0 <= position < pages_of_request * page_size)")


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None, positions=None):
    """Per appended token: its request and its position in that request's KV.

    append_indptr[B+1] splits the nnz tokens among requests; seq_lens[B] are the KV
    lengths after the append (int32 or int64). Entries past append_indptr[-1] (padding
    to a captured size) get batch index -1 and position 0. Returns (batch_indices,
    positions), int32 [nnz]: the caller's buffers when given (FlashInfer's current
    form, e.g. the persistent buffers of a captured CUDA graph), written in place; new
    tensors otherwise.
    """
    append_indptr = index_vector(append_indptr, "append_indptr", what="[batch_size + 1]")
    if append_indptr.shape[0] < 1:
        raise ValueError("append_indptr: expected batch_size + 1 >= 1 entries, got 0")
    seq_lens = index_vector(seq_lens, "seq_lens", append_indptr.shape[0] - 1, "[batch_size]")
    if not isinstance(nnz, (int, torch.SymInt)) or isinstance(nnz, bool) or nnz < 0:
        raise ValueError(f"nnz: expected a non-negative int, got {nnz!r}")
    device = append_indptr.device
    batch_indices = _output_index(batch_indices, "batch_indices", nnz, device)
    positions = _output_index(positions, "positions", nnz, device)
    expect_same_cuda_device({"append_indptr": append_indptr, "seq_lens": seq_lens,
                             "batch_indices": batch_indices, "positions": positions})
    if compiling():
        op = traced_op(_batch_indices_namespace(), "get_batch_indices_positions")
    else:
        op = get_module(_BATCH_INDICES_SPEC).get_batch_indices_positions
    op(append_indptr, seq_lens, batch_indices, positions)
    return batch_indices, positions


def _output_index(out, name: str, nnz: int, device):
    """A caller's int32 [nnz] output buffer, checked, or a new one."""
    if out is None:
        return torch.empty(nnz, dtype=torch.int32, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected None or an int32 tensor [nnz] to write into, got "
                        f"{type(out).__name__}")
    if out.dtype != torch.int32:  # written in place: no narrowing here
        raise TypeError(f"{name}: the output buffer must be int32, got {dtype_str(out.dtype)}")
    if tuple(out.shape) != (nnz,):
        raise ValueError(f"{name}: expected an output buffer of shape [nnz] = ({nnz},), got "
                         f"{tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: the output buffer must be contiguous")
    return out


@constant_result
def _batch_indices_namespace() -> str:
    return get_module(_BATCH_INDICES_SPEC).namespace


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """KV length of each request of a CSR page table (int32 or int64 in, int32 out); 0 for
    a request without pages."""
    kv_indptr = index_vector(kv_indptr, "kv_indptr", what="[batch_size + 1]")
    kv_last_page_len = index_vector(kv_last_page_len, "kv_last_page_len", kv_indptr.shape[0] - 1,
                                    "[batch_size]")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len,
                       torch.zeros_like(pages)).to(torch.int32)
