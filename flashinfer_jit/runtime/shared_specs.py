"""Specs of the modules the families share: the merge of partial attention states
(merge_state / merge_states, csrc/common/merge.cuh), the page order that decode's and
prefill's plan() launch (csrc/runtime/page_order.cuh, runtime/page_order.py), and the RoPE
kernel (csrc/kvcache/rope.cuh: the kvcache family's apply_rope*, rope_quantize_fp8 and
rope + quantize + append; the Hopper prefill path's RoPE pass, prefill/sm90.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import FP8_DTYPES, HEAD_DIMS, KV_LAYOUTS, PAGE_TABLES, Spec, choice


@dataclass(frozen=True)
class MergeSpec(Spec):
    """merge_state / merge_states: partial attention states merged by their base-2 LSEs
    (split-KV's own merge runs inside the decode module)."""

    FAMILY = "merge"
    TEMPLATES = {"kernel.cu": "runtime/merge.cu.j2", "binding.cc": "runtime/merge_binding.cc.j2"}

    dtype: str = choice("float16", "bfloat16", "float32")
    head_dim: int = choice(*HEAD_DIMS, tag="hd{}")

    def op_schemas(self) -> dict[str, str]:
        return {"merge_states": "(Tensor v, Tensor s, Tensor(a!) v_out, Tensor(b!) s_out) -> ()"}


@dataclass(frozen=True)
class PageOrderSpec(Spec):
    """plan() of batch decode and batch prefill: each request's movable pages in ascending
    page-id order (csrc/runtime/page_order.cuh, flashinfer_jit/runtime/page_order.py), one module for every
    configuration, launched through fij_fastcall (else ctypes); its ops report the size of
    the params struct and the pages sorted together."""

    FAMILY = "page_order"
    TEMPLATES = {"kernel.cu": "runtime/page_order.cu.j2", "binding.cc": "runtime/page_order_binding.cc.j2"}

    def op_schemas(self) -> dict[str, str]:
        return {"params_bytes": "() -> int", "segment": "() -> int"}


_IN_DTYPES = ("float16", "bfloat16")
_OUT_DTYPES = ("float16", "bfloat16") + FP8_DTYPES

_COMMON_ARGS = (
    "Tensor pos_ids, Tensor indptr, Tensor offsets, Tensor cos_sin_cache, float rope_scale, "
    "float rope_theta, float smooth_a, float smooth_b, float quant_scale_q, float quant_scale_kv"
)


@dataclass(frozen=True)
class RopeSpec(Spec):
    """The RoPE kernel (kvcache/rope.py's calls, the Hopper prefill path's RoPE pass). Rotates the first rope_dim dims of each q/k head row (NeoX halves or interleaved
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
