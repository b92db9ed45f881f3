"""Spec of the RoPE family: apply_rope*, rope_quantize_fp8 and the fused
rope + quantize + append into the paged cache (one kernel, csrc/kvcache/rope.cuh)."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import FP8_DTYPES, KV_LAYOUTS, PAGE_TABLES, Spec, choice

_IN_DTYPES = ("float16", "bfloat16")
_OUT_DTYPES = ("float16", "bfloat16") + FP8_DTYPES

_COMMON_ARGS = (
    "Tensor pos_ids, Tensor indptr, Tensor offsets, Tensor cos_sin_cache, float rope_scale, "
    "float rope_theta, float smooth_a, float smooth_b, float quant_scale_q, float quant_scale_kv"
)


@dataclass(frozen=True)
class RopeSpec(Spec):
    """Rotates the first rope_dim dims of each q/k head row (NeoX halves or interleaved
    pairs), passes the rest through, writes dtype_out scaled by the quantization scale.
    page_table != 'none' is the append form: k and v rows go into the paged cache.
    Head sizes are run-time values (multiples of 16), so one module serves them all."""

    FAMILY = "rope"
    TEMPLATES = {"kernel.cu": "kvcache/rope.cu.j2", "binding.cc": "kvcache/rope_binding.cc.j2"}

    dtype_in: str = choice(*_IN_DTYPES)
    dtype_out: str = choice(*_OUT_DTYPES)
    interleave: bool = choice(False, True, tag="il", default=False)
    positions: str = choice("pos_ids", "indptr", default="pos_ids")
    cos_sin: str = choice("computed", "cache", default="computed")
    page_table: str = choice("none", *PAGE_TABLES, default="none")
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD")

    @property
    def append(self) -> bool:
        return self.page_table != "none"

    def check(self) -> None:
        if self.dtype_out not in FP8_DTYPES and self.dtype_out != self.dtype_in:
            raise ValueError(f"RopeSpec: dtype_out {self.dtype_out} must equal dtype_in "
                             f"{self.dtype_in} unless it is an fp8 type ({', '.join(FP8_DTYPES)})")
        if not self.append and self.kv_layout != "NHD":
            raise ValueError("RopeSpec: kv_layout applies to the append form only; "
                             "use the default 'NHD' with page_table='none'")

    def op_schemas(self) -> dict[str, str]:
        if self.append:
            return {"rope_append": (
                "(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope, Tensor v, "
                "Tensor(a!) q_rope_out, Tensor(b!) q_nope_out, " + _COMMON_ARGS +
                ", Tensor(c!) k_rope_cache, Tensor(d!) k_nope_cache, int k_nope_offset, Tensor(e!) v_cache, "
                "Tensor[] page_table, Tensor batch_indices, Tensor positions) -> ()")}
        return {"rope": (
            "(Tensor q_rope, Tensor k_rope, Tensor q_nope, Tensor k_nope, Tensor(a!) q_rope_out, "
            "Tensor(b!) k_rope_out, Tensor(c!) q_nope_out, Tensor(d!) k_nope_out, " + _COMMON_ARGS +
            ") -> ()")}
