"""Specs of the cache-writing helpers: append_paged_kv_cache, get_batch_indices_positions."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import HEAD_DIMS, KV_LAYOUTS, PAGE_TABLES, PAGED_KV_DTYPES, Spec, choice


@dataclass(frozen=True)
class AppendSpec(Spec):
    """append_paged_kv_cache: copy appended K/V rows into their page slots.

    The appended rows have the cache's dtype (fp8 caches get fp8 rows, as in FlashInfer;
    quantizing from fp16/bf16 is rope_quantize_fp8_append_paged_kv_cache's job).
    """

    FAMILY = "append"
    TEMPLATES = {"kernel.cu": "kvcache/append.cu.j2", "binding.cc": "kvcache/append_binding.cc.j2"}

    dtype_kv: str = choice(*PAGED_KV_DTYPES)
    head_dim: int = choice(*HEAD_DIMS, tag="hd{}")
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD")
    page_table: str = choice(*PAGE_TABLES, default="csr")

    def op_schemas(self) -> dict[str, str]:
        return {
            "append_paged_kv_cache": (
                "(Tensor append_key, Tensor append_value, Tensor batch_indices, Tensor positions, "
                "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor[] page_table) -> ()"
            )
        }


@dataclass(frozen=True)
class BatchIndicesSpec(Spec):
    """get_batch_indices_positions: (append_indptr, seq_lens) -> per-token (batch, pos)."""

    FAMILY = "batch_indices"
    TEMPLATES = {"kernel.cu": "kvcache/batch_indices.cu.j2", "binding.cc": "kvcache/batch_indices_binding.cc.j2"}

    index_dtype: str = choice("int32", default="int32")

    def op_schemas(self) -> dict[str, str]:
        return {
            "get_batch_indices_positions": (
                "(Tensor append_indptr, Tensor seq_lens, Tensor(a!) batch_indices, "
                "Tensor(b!) positions) -> ()"
            )
        }
