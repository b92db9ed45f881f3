"""`flashinfer.page`'s path and names, for code written against FlashInfer
(`from flashinfer.page import get_seq_lens`, with `flashinfer_jit` in its place).

The functions live in flashinfer_jit.kvcache.append; this module only gives them FlashInfer's
module path. FlashInfer's other page.py functions (MLA and NVFP4 appends, block-sparse
offsets) have no kernel here.
"""

from .kvcache.append import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]
