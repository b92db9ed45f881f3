"""flashinfer_jit: specialized CUDA attention and KV-cache kernels, generated per
configuration and compiled on first use into a content-hashed cache.

Importing the package imports only this file (and pipeline/__init__.py, for the version): no GPU query, no disk access, no
compiler probe. Public names resolve on first attribute access.
"""

from __future__ import annotations

import importlib

from .pipeline import __version__

_EXPORTS = {
    # cache-writing helpers
    "append_paged_kv_cache": "kvcache.append",
    "get_batch_indices_positions": "kvcache.append",
    "get_seq_lens": "kvcache.append",
    "flatten_kv_cache": "kvcache.flatten",
    # RoPE
    "apply_rope": "kvcache.rope",
    "apply_rope_inplace": "kvcache.rope",
    "apply_rope_pos_ids": "kvcache.rope",
    "apply_rope_pos_ids_inplace": "kvcache.rope",
    "apply_llama31_rope": "kvcache.rope",
    "apply_llama31_rope_inplace": "kvcache.rope",
    "apply_llama31_rope_pos_ids": "kvcache.rope",
    "apply_llama31_rope_pos_ids_inplace": "kvcache.rope",
    "apply_rope_with_cos_sin_cache": "kvcache.rope",
    "apply_rope_with_cos_sin_cache_inplace": "kvcache.rope",
    "rope_quantize_fp8": "kvcache.rope",
    "mla_rope_quantize_fp8": "kvcache.rope",
    "rope_quantize_fp8_append_paged_kv_cache": "kvcache.rope",
    # attention
    "BatchDecodeWithPagedKVCacheWrapper": "decode",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper": "decode",
    "fast_decode_plan": "decode",
    "single_decode_with_kv_cache": "decode",
    "BatchPrefillWithPagedKVCacheWrapper": "prefill",
    "BatchPrefillWithRaggedKVCacheWrapper": "prefill",
    "single_prefill_with_kv_cache": "prefill",
    "single_prefill_with_kv_cache_return_lse": "prefill",
    "PODWithPagedKVCacheWrapper": "pod",
    "BatchPODWithPagedKVCacheWrapper": "pod",
    "BatchAttention": "pod",
    "merge_state": "cascade",
    "merge_states": "cascade",
    # page tables
    "PageTable": "runtime.page_table",
    "csr_page_table": "runtime.page_table",
    "block_page_table": "runtime.page_table",
    # JIT machinery
    "get_module": "pipeline.jit",
    "load_or_build": "pipeline.jit",
    "build_many": "pipeline.jit",
    "BuildError": "pipeline.errors",
    "JitError": "pipeline.errors",
    "JitDisabledError": "pipeline.errors",
    "ToolchainError": "pipeline.errors",
    "CacheError": "pipeline.errors",
    "specs": None,
    # submodules at FlashInfer's paths (flashinfer_jit.page.get_seq_lens, ...)
    "decode": None,
    "prefill": None,
    "pod": None,
    "attention": None,
    "page": None,
    "rope": None,
    "cascade": None,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashinfer_jit' has no attribute {name!r}")
    module_name = _EXPORTS[name]
    if module_name is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
