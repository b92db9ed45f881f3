"""Spec of flatten_kv_cache: paged K/V -> contiguous K/V with a zero-filled tail."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import FP8_DTYPES, HEAD_DIMS, KV_LAYOUTS, PAGE_TABLES, PAGED_KV_DTYPES, Spec, choice


@dataclass(frozen=True)
class FlattenSpec(Spec):
    """The output size and the shd/hsd output layout are run-time values (strides), so
    no batch shape ever causes a recompile."""

    FAMILY = "flatten"
    TEMPLATES = {"kernel.cu": "kvcache/flatten.cu.j2", "binding.cc": "kvcache/flatten_binding.cc.j2"}

    dtype_kv: str = choice(*PAGED_KV_DTYPES)
    dtype_out: str = choice("float16", "bfloat16", "float32", *FP8_DTYPES)
    head_dim: int = choice(*HEAD_DIMS, tag="hd{}")
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD")
    page_table: str = choice(*PAGE_TABLES, default="csr")

    def check(self) -> None:
        if self.dtype_out in FP8_DTYPES and self.dtype_out != self.dtype_kv:
            raise ValueError("FlattenSpec: an fp8 output needs the same fp8 cache dtype "
                             f"(got cache {self.dtype_kv}, output {self.dtype_out})")

    def op_schemas(self) -> dict[str, str]:
        return {"flatten_kv_cache": (
            "(Tensor k_cache, Tensor v_cache, Tensor cu_seqlens, Tensor[] page_table, "
            "Tensor(a!) k_out, Tensor(b!) v_out, float k_scale, float v_scale, bool hsd) -> ()")}
