"""Specs of the modules every attention family shares: the merge of partial attention
states (merge_state / merge_states, csrc/common/merge.cuh) and the page order that decode's
and prefill's plan() launch (csrc/runtime/page_order.cuh, runtime/page_order.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import HEAD_DIMS, Spec, choice


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

