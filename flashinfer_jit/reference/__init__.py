"""Plain PyTorch references of the kernels, for tests and benchmarks.

Each reference computes the same function as its kernel in the simplest way torch
allows; none of them is fast, and none is used by the package itself.
"""

from .append import append_paged_kv_cache_ref, get_batch_indices_positions_ref, page_slots_ref

__all__ = ["append_paged_kv_cache_ref", "get_batch_indices_positions_ref", "page_slots_ref"]
