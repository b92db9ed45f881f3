"""Spec of POD: a prefill and a batch of decodes in one launch (csrc/pod/pod.cuh,
docs/pod.md). Its blocks are the prefill and decode families' own, so its spec names one
configuration of each: PodSpec.prefill_spec() and decode_spec() are the modules whose work
lists, params and split merges a POD launch takes over."""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.spec import DecodeSpec, group_tile
from ..pipeline.spec import FP8_DTYPES, HEAD_DIMS, KV_LAYOUTS, PAGE_TABLES, PAGED_KV_DTYPES, Spec, choice
from ..prefill.spec import MASKS, PrefillSm90Spec, PrefillSpec



def pod_tiles(head_dim: int) -> tuple[int, ...]:
    """The prefill side's query tiles a POD module holds. One launch has one block size: the
    decode block's 128 threads. The 64-row tile has them at every head_dim (128 registers,
    four blocks an SM at head_dim <= 128); the 128-row tile has them up to head_dim 128 (4
    warps of 32 rows, 255 registers, two blocks an SM), and 8 warps at 256 (csrc/prefill/
    prefill.cuh kWide), so not there."""
    return (64, 128) if head_dim <= 128 else (64,)


@dataclass(frozen=True)
class PodSpec(Spec):
    """A prefill (`prefill_kv`: one request's ragged K/V, as PODWithPagedKVCacheWrapper
    takes it, or a batch over the paged cache, as BatchPODWithPagedKVCacheWrapper) and a
    batch of one-token decodes over the paged cache, in one kernel.

    Compiled in: the dtypes (one q/output dtype and one K/V dtype for both sides, as
    FlashInfer's POD), head_dim (both sides), the page table and KV layout of the paged
    cache, the prefill's mask (none, causal bottom-right aligned, custom bits) and the
    decode's group tile (query heads a tile). Run-time: everything either family takes at
    run time (lengths, page ids, sm_scale and scales, windows, the LSE).

    Not in POD (ValueError at plan()): in-kernel RoPE on either side and the soft cap
    (FlashInfer's POD applies neither), sinks, head_dim 192/128, fp8 for ragged K/V."""

    FAMILY = "pod"
    TEMPLATES = {"kernel.cu": "pod/pod.cu.j2", "binding.cc": "pod/pod_binding.cc.j2"}

    dtype_q: str = choice("float16", "bfloat16")
    dtype_kv: str = choice(*PAGED_KV_DTYPES)
    head_dim: int = choice(*HEAD_DIMS, tag="hd{}")
    prefill_kv: str = choice("paged", "ragged", tag="p{}")
    page_table: str = choice(*PAGE_TABLES, default="csr", name_default=False)
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD", name_default=False)
    mask: str = choice(*MASKS, default="none", name_default=False)
    group_tile: int = choice(1, 2, 4, 8, 16, tag="g{}", default=1)

    def check(self) -> None:
        if self.dtype_kv not in FP8_DTYPES and self.dtype_kv != self.dtype_q:
            raise ValueError(f"PodSpec: a {self.dtype_kv} K/V needs q of the same dtype, got {self.dtype_q}")
        if self.prefill_kv == "ragged" and self.dtype_kv in FP8_DTYPES:
            raise ValueError(f"PodSpec: the single prefill's ragged K/V takes q's dtype; fp8 ({self.dtype_kv}) K/V "
                             "is for the paged cache (BatchPODWithPagedKVCacheWrapper)")
        self.prefill_spec().validate()
        self.decode_spec().validate()

    def prefill_spec(self) -> PrefillSpec:
        """The prefill module whose work list, params and merge the launch's prefill side takes."""
        ragged = self.prefill_kv == "ragged"
        return PrefillSpec(dtype_q=self.dtype_q, dtype_kv=self.dtype_kv, dtype_o=self.dtype_q,
                           head_dim_qk=self.head_dim, head_dim_vo=self.head_dim, kv_source=self.prefill_kv,
                           page_table="csr" if ragged else self.page_table,
                           kv_layout="NHD" if ragged else self.kv_layout, mask=self.mask)

    def decode_spec(self) -> DecodeSpec:
        """The decode module whose work list, params and merge the launch's decode side takes."""
        return DecodeSpec(dtype_q=self.dtype_q, dtype_kv=self.dtype_kv, head_dim=self.head_dim,
                          group_tile=self.group_tile, page_table=self.page_table, kv_layout=self.kv_layout)

    def context(self) -> dict:
        return super().context() | {"prefill": self.prefill_spec().context(), "decode": self.decode_spec().context(),
                                    "tile_rows": list(pod_tiles(self.head_dim))}

    def op_schemas(self) -> dict[str, str]:
        # One op: the prefill op's arguments (_p; flashinfer_jit/prefill/spec.py) and the
        # decode op's (_d; flashinfer_jit/decode/spec.py), without what POD leaves out (sinks,
        # soft cap, RoPE, KV-head pairs, clusters), and pod_counters: int32 zeros
        # (csrc/pod/pod_params.h kPodCounters), which the kernel leaves at zero;
        # decode_share: the share of an SM's blocks that run decode units while both sides
        # have work, on decode_sms SMs (0: every SM; csrc/pod/pod.cuh launch_pod). prepared:
        # a CPU byte tensor that receives the resolved launch (csrc/pod/pod_params.h
        # PodLaunch) for run()'s fast path, <namespace>_pod_fast.
        # partial_o_d is not declared mutated: it is scratch of this launch (both sides' splits
        # merge inside it), in the workspace half beside partial_o_p's. Under torch.compile two
        # mutated views of one buffer become a synthetic base that the graph copies whole, and
        # inductor read that copy past the buffer's end (an illegal address on an H200,
        # 2026-11-29); one mutated view of the workspace keeps the graph copy-free.
        return {"pod": (
            "(Tensor q_p, Tensor k_p, Tensor v_p, Tensor[] kv_index_p, Tensor qo_indptr_p, Tensor work_p, "
            "Tensor merge_indptr_p, Tensor? mask_p, Tensor? mask_indptr_p, Tensor(a!) out_p, Tensor(b!) lse_p, "
            "Tensor(c!) partial_o_p, Tensor(d!) partial_lse_p, Tensor(e!) merge_counters_p, float logit_scale_p, "
            "float v_scale_p, int window_left_p, int grid_p, int tile_rows_p, int merge_rows_p, "
            "Tensor q_d, Tensor k_cache_d, Tensor v_cache_d, Tensor[] page_table_d, Tensor work_d, "
            "Tensor merge_indptr_d, Tensor(f!) out_d, Tensor(g!) lse_d, Tensor partial_o_d, "
            "Tensor(i!) partial_lse_d, float logit_scale_d, float v_scale_d, int window_left_d, int grid_items_d, "
            "int merge_rows_d, Tensor(j!)? merge_counters_d, Tensor(k!) pod_counters, float decode_share, int decode_sms, "
            "bool enable_pdl=False, Tensor(l!)? prepared=None) -> ()")}


def pod_spec(dtype_q: str, dtype_kv: str, head_dim: int, prefill_kv: str, page_table: str, kv_layout: str, mask: str,
             num_qo_heads: int, num_kv_heads: int) -> PodSpec:
    """The POD module of a configuration (validated: ValueError names what is not supported)."""
    return PodSpec(dtype_q=dtype_q, dtype_kv=dtype_kv, head_dim=head_dim, prefill_kv=prefill_kv, page_table=page_table,
                   kv_layout=kv_layout, mask=mask,
                   group_tile=group_tile(num_qo_heads, num_kv_heads, head_dim)).validate()


@dataclass(frozen=True)
class PodSm90Spec(Spec):
    """POD on Hopper (csrc/pod/pod_sm90.cuh): the Hopper prefill kernel's blocks (over the paged
    cache, or one request's K/V rows) and the tensor-core decode blocks, one launch, one block an SM; the SMs split
    between the sides, and the decode side's blocks join the prefill as their units run out.

    Compiled in: the dtype (q, K/V and the output: f16 or bf16), head_dim (64, 128 or 256),
    the page table and KV layout of the paged cache (one for both sides), the prefill's K/V
    (paged or ragged), mask (none or causal) and key tile (the prefill plan's), the decode's
    group tile. Everything else as the two families take it at run time. The POD wrappers and
    BatchAttention launch it where their prefill side plans the Hopper kernel (docs/pod.md)."""

    FAMILY = "pod_sm90"
    TEMPLATES = {"kernel.cu": "pod/pod_sm90.cu.j2", "binding.cc": "pod/pod_sm90_binding.cc.j2"}
    ARCHS = ("9.0a",)

    dtype_q: str = choice("float16", "bfloat16")
    head_dim: int = choice(64, 128, 256, tag="hd{}")
    page_table: str = choice(*PAGE_TABLES, default="csr", name_default=False)
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD", name_default=False)
    mask: str = choice("none", "causal", default="none", name_default=False)
    key_tile: int = choice(64, 80, 128, 176, tag="n{}", default=128, name_default=False)
    group_tile: int = choice(1, 2, 4, 8, 16, tag="g{}", default=1)
    # the prefill's K/V: the paged cache (batch POD, BatchAttention) or one request's rows
    # (PODWithPagedKVCacheWrapper: k_p / v_p)
    prefill_kv: str = choice("paged", "ragged", tag="p{}", default="paged", name_default=False)

    def check(self) -> None:
        try:
            self.prefill_spec().validate()
            self.decode_spec().validate()
        except ValueError as exc:  # (named after this spec: the side's rule is what it breaks)
            raise ValueError(f"PodSm90Spec: {exc}") from None

    def prefill_spec(self) -> PrefillSm90Spec:
        """The Hopper prefill module whose plan (work list) the launch's prefill side takes."""
        layout = self.kv_layout if self.prefill_kv == "paged" else "NHD"  # (ragged rows: strides at run time)
        return PrefillSm90Spec(self.dtype_q, self.head_dim, self.mask, self.prefill_kv, layout, self.key_tile)

    def decode_spec(self) -> DecodeSpec:
        """The decode module whose work list, params and merge the launch's decode side takes."""
        return DecodeSpec(dtype_q=self.dtype_q, dtype_kv=self.dtype_q, head_dim=self.head_dim,
                          group_tile=self.group_tile, page_table=self.page_table, kv_layout=self.kv_layout)

    def context(self) -> dict:
        return super().context() | {"prefill": self.prefill_spec().context(), "decode": self.decode_spec().context()}

    def op_schemas(self) -> dict[str, str]:
        # The Hopper prefill op's arguments (_p; flashinfer_jit/prefill/spec.py
        # PrefillSm90Spec) without the custom mask, sinks, soft cap and grid, the decode op's
        # (_d) as the POD op takes them, POD's counters (int32 zeros, which the kernel leaves
        # at zero; its first three) and prefill_blocks: the blocks that start on prefill
        # items (csrc/pod/pod_sm90.cuh); prepared: a CPU byte tensor that receives the resolved
        # launch (csrc/pod/pod_params.h PodSm90Launch) for run()'s fast path, <namespace>_pod_fast.
        return {"pod_sm90": (
            "(Tensor q_p, Tensor k_p, Tensor v_p, Tensor work_p, Tensor page_ids_p, Tensor(a!) out_p, "
            "Tensor(b!) lse_p, float scale_log2_p, int window_left_p, float v_scale_p, "
            "Tensor q_d, Tensor k_cache_d, Tensor v_cache_d, Tensor[] page_table_d, Tensor work_d, "
            "Tensor merge_indptr_d, Tensor(f!) out_d, Tensor(g!) lse_d, Tensor partial_o_d, "
            "Tensor(i!) partial_lse_d, float logit_scale_d, float v_scale_d, int window_left_d, int grid_items_d, "
            "int merge_rows_d, Tensor(j!)? merge_counters_d, Tensor(k!) pod_counters, int prefill_blocks, "
            "Tensor(l!)? prepared=None) -> ()")}
