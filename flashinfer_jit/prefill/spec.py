"""Spec of batch prefill over paged or ragged K/V on tensor cores (csrc/prefill/prefill.cuh,
docs/prefill.md). Its reference is flashinfer_jit/reference/prefill.py."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import FP8_DTYPES, KV_LAYOUTS, PAGE_TABLES, PAGED_KV_DTYPES, Spec, choice

# (head_dim_qk, head_dim_vo): square heads, and DeepSeek-style prefill without MLA
# absorption (192 = 128 nope + 64 rope dims for q and k, 128 for v); 512 on the 64-row tile
# only, its output dims split over two warps a row (csrc/prefill/prefill.cuh kVoSplit)
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (256, 256), (192, 128), (512, 512))
KV_SOURCES = ("paged", "ragged")
MASKS = ("none", "causal", "custom")
POS_ENCODINGS = ("none", "rope_llama", "alibi")


@dataclass(frozen=True)
class PrefillSpec(Spec):
    """Query tokens of each request against its K/V, on tensor cores.

    Compiled in (each changes the loads or the inner loop): the dtypes of q, K/V and the
    output; head_dim_qk and head_dim_vo; where K/V come from (`kv_source`: the paged cache
    through `page_table` in `kv_layout`, or ragged [kv_tokens, H, D] rows); the mask
    (none, causal bottom-right aligned, custom bits); the in-kernel positional encoding
    (RoPE: ROPE_LLAMA; ALiBi's logit bias, its slopes from the head index and num_qo_heads as
    FlashInfer's, csrc/common/pos_encoding.cuh); whether logits are soft-capped; whether sink
    logits join the softmax.

    Run-time (plan() or run() arguments, one module for all of them): the lengths
    (qo_indptr, kv_indptr or the page table, mask_indptr), page ids and page size, the
    head counts and so the GQA group, sm_scale, q_scale/k_scale/v_scale, the soft cap's
    value, window_left (-1 off; a window is a bound on the keys read, so one module serves
    a model's sliding-window and global layers), rope_scale and rope_theta, the sink values,
    the custom mask's bits, whether the LSE is written, and plan()'s choice of query tile
    and KV split.

    page_table and kv_layout mean nothing for ragged K/V, which keeps their defaults; they
    are left out of the readable name at their defaults (csr, NHD), as are mask and
    pos_encoding at "none", so a name lists what a module does beyond plain attention.
    """

    FAMILY = "prefill"
    TEMPLATES = {"kernel.cu": "prefill/prefill.cu.j2", "binding.cc": "prefill/prefill_binding.cc.j2"}

    dtype_q: str = choice("float16", "bfloat16")
    dtype_kv: str = choice(*PAGED_KV_DTYPES)
    dtype_o: str = choice("float16", "bfloat16")
    head_dim_qk: int = choice(*sorted({qk for qk, _ in HEAD_DIM_PAIRS}), tag="hd{}")
    head_dim_vo: int = choice(*sorted({vo for _, vo in HEAD_DIM_PAIRS}), tag="vo{}")
    kv_source: str = choice(*KV_SOURCES, default="paged")
    page_table: str = choice(*PAGE_TABLES, default="csr", name_default=False)
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD", name_default=False)
    mask: str = choice(*MASKS, default="none", name_default=False)
    pos_encoding: str = choice(*POS_ENCODINGS, default="none", name_default=False)
    soft_cap: bool = choice(False, True, tag="cap", default=False)
    sinks: bool = choice(False, True, tag="sinks", default=False)

    def check(self) -> None:
        heads = (self.head_dim_qk, self.head_dim_vo)
        if heads not in HEAD_DIM_PAIRS:
            raise ValueError(f"PrefillSpec: head_dim_qk={self.head_dim_qk} with head_dim_vo={self.head_dim_vo} is not "
                             f"supported; supported (qk, vo) pairs: {', '.join(map(str, HEAD_DIM_PAIRS))}")
        if self.dtype_kv not in FP8_DTYPES and self.dtype_kv != self.dtype_q:
            raise ValueError(f"PrefillSpec: a {self.dtype_kv} K/V needs q of the same dtype, got {self.dtype_q}")
        if self.kv_source == "ragged":
            if self.dtype_kv in FP8_DTYPES:
                raise ValueError(f"PrefillSpec: fp8 K/V ({self.dtype_kv}) is for the paged cache only; ragged K/V "
                                 f"takes {self.dtype_q}")
            if (self.page_table, self.kv_layout) != ("csr", "NHD"):
                raise ValueError("PrefillSpec: ragged K/V has no page table or KV layout (rows [kv_tokens, H, D] "
                                 "with any strides); leave page_table='csr' and kv_layout='NHD'")
        if self.pos_encoding == "rope_llama" and heads == (192, 128):
            # DeepSeek's 192-dim q/k carry RoPE in 64 of their dims, applied before attention;
            # rotating all 192 in the kernel is no model's semantics.
            raise ValueError("PrefillSpec: pos_encoding='rope_llama' rotates every head dim; with head_dim_qk=192 "
                             "(DeepSeek-style) apply RoPE to the rope dims before prefill instead")
        if self.pos_encoding == "alibi":
            # FlashInfer caps the biased logit with sm_scale applied twice (variants.cuh), and its
            # sink variant has no ALiBi: no convention to follow, and no model pairs them
            if self.soft_cap:
                raise ValueError("PrefillSpec: pos_encoding='alibi' with soft_cap is not supported")
            if self.sinks:
                raise ValueError("PrefillSpec: pos_encoding='alibi' with sinks is not supported")

    @property
    def tile_rows(self) -> tuple[int, ...]:
        """Query-tile sizes (rows of (token, head) pairs a block) the module holds: 64 and
        128 (at head_dim_qk 256 a 128-row tile is 8 warps of 16 rows: 32 rows a warp would
        hold 256 accumulators a lane). plan() picks one per batch (csrc/prefill/prefill_plan.h).
        head_dim 512: the 64-row tile only (its q rows alone take 64 KB of shared memory)."""
        return tile_rows_of(self.head_dim_qk)

    def context(self) -> dict:
        return super().context() | {"tile_rows": self.tile_rows, "mask_enum": _MASK_ENUMS[self.mask]}

    def op_schemas(self) -> dict[str, str]:
        # One op runs the prefill kernel over plan()'s work list (grid blocks, tiles of
        # tile_rows rows) and, when plan() split requests (merge_rows > 0, the number of
        # q tokens), the merge of their partial rows: in the kernel, by the last block of each
        # split tile, when merge_counters is given (int32, zeros, >= partial_lse's size),
        # else by the merge kernel. kv_index: the page table's tensors
        # (paged) or [kv_indptr] (ragged). prepared: a CPU byte tensor that receives the
        # resolved launch (csrc/prefill/prefill_params.h PrefillLaunch) for run()'s fast path,
        # <namespace>_prefill_fast. block_shape: [threads, shared memory bytes, registers]
        # of a tile's block (needs a GPU).
        return {
            "prefill": (
                "(Tensor q, Tensor k, Tensor v, Tensor[] kv_index, Tensor qo_indptr, Tensor work, "
                "Tensor merge_indptr, Tensor? mask, Tensor? mask_indptr, Tensor? sinks, Tensor(a!) out, "
                "Tensor(b!) lse, Tensor(c!) partial_o, Tensor(d!) partial_lse, Tensor(f!) merge_counters, "
                "float logit_scale, "
                "float soft_cap_log2, float v_scale, int window_left, float rope_scale, float rope_theta, "
                "int grid, int tile_rows, int merge_rows, bool enable_pdl=False, Tensor(e!)? prepared=None) -> ()"),
            "block_shape": "(int tile_rows) -> int[]",
        }


_MASK_ENUMS = {"none": "kNone", "causal": "kCausal", "custom": "kCustom"}


TILE_ROWS = (64, 128)  # query-tile sizes a prefill module holds (PrefillSpec.tile_rows)


def tile_rows_of(head_dim_qk: int) -> tuple[int, ...]:
    """The query tiles a module of head_dim_qk holds: TILE_ROWS, the 64-row tile alone at 512."""
    return (64,) if head_dim_qk >= 512 else TILE_ROWS


# What the Hopper path (PrefillSm90Spec) takes in this version; everything else runs the
# mma.sync kernel (backend "fa2"; docs/hopper.md lists the cases and why)
SM90_HEAD_DIMS = (64, 128, 192, 256)  # 192: (192, 128), V and the output at 128
SM90_HEAD_DIM_VO = {64: 64, 128: 128, 192: 128, 256: 256}
SM90_MASKS = ("none", "causal", "custom")


@dataclass(frozen=True)
class PrefillSm90Spec(Spec):
    """Batch prefill on Hopper (csrc/hopper/prefill_sm90.cuh, docs/hopper.md): wgmma from shared
    memory, TMA loads of q and K/V, a producer warpgroup and two ping-ponging consumer
    warpgroups (three for 192-row query tiles), a persistent grid over plan()'s list of (query tile, head) items, heaviest
    first. sm_90a only (ARCHS): its wgmma and setmaxnreg exist on no other arch.

    Compiled in: the dtype (q, K/V and the output share it; with fp8, q, K and V are e4m3 and
    the dtype is the output's: FP8 attention), head_dim (qk = vo), the mask,
    whether the logits are soft-capped. Run-time: the sliding window, the cap, the lengths (plan()'s work list, read on the device, so a CUDA graph replays
    any later plan), head counts and so the GQA group, sm_scale * q_scale * k_scale,
    v_scale, whether the LSE is written, the strides of q, K/V and out."""

    FAMILY = "prefill_sm90"
    TEMPLATES = {"kernel.cu": "prefill/prefill_sm90.cu.j2", "binding.cc": "prefill/prefill_sm90_binding.cc.j2"}
    ARCHS = ("9.0a",)

    dtype_q: str = choice("float16", "bfloat16")
    head_dim: int = choice(*SM90_HEAD_DIMS, tag="hd{}")
    mask: str = choice(*SM90_MASKS, default="none", name_default=False)
    # ragged rows, or the paged cache through a CSR page table (pages of 16, 32, 64 or 128
    # tokens, one TMA box a page) in kv_layout; smaller pages (and long prompts) run the ragged
    # module over a copy of the batch's pages read as rows
    kv_source: str = choice("ragged", "paged", default="ragged", name_default=False)
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD", name_default=False)
    # keys a K/V tile (flashinfer_jit/prefill/sm90.py key_tile: 176 at head_dim 128 without a
    # causal mask, 80 at head_dim 256 (64 on pages of 32 or more), else 128); 176 at head_dim
    # 128 only (S takes 88 registers a thread), and head_dim 256 takes 64 or 80 only (shared
    # memory and O's registers)
    key_tile: int = choice(64, 80, 128, 176, tag="n{}", default=128, name_default=False)
    # logits soft-capped, cap * tanh(logit / cap) (the cap itself is a launch argument)
    soft_cap: bool = choice(False, True, tag="cap", default=False)
    # query rows an item: 128 (two consumer warpgroups), or 192 at head_dim 64 (three, FA3's
    # choice there; plan() takes it for long query tiles: sm90.query_tile)
    query_tile: int = choice(128, 192, tag="m{}", default=128, name_default=False)
    # ALiBi (FlashInfer's linear bias, pos_encoding_mode="ALIBI"): slope[h] x (key - row) on the
    # logits (csrc/common/pos_encoding.cuh); not with a soft cap
    alibi: bool = choice(False, True, tag="alibi", default=False)
    # FP8 attention: q, K and V in e4m3, dtype_q the output's (csrc/hopper/prefill_sm90.cuh
    # kFp8: e4m3 wgmma, V transposed in shared memory); head_dim 128 on 128-key tiles, ragged K/V,
    # no custom mask, soft cap or ALiBi
    fp8: bool = choice(False, True, tag="e4m3", default=False)

    def check(self) -> None:
        if self.fp8 and (self.head_dim != 128 or self.key_tile != 128 or self.query_tile != 128 or
                         self.kv_source != "ragged" or self.mask == "custom" or self.soft_cap or self.alibi):
            raise ValueError("PrefillSm90Spec: fp8 (e4m3 q, K and V) is for head_dim 128 on 128-key tiles, ragged K/V, "
                             f"no custom mask, soft cap or ALiBi; got {self}")
        if self.alibi and self.soft_cap:
            raise ValueError("PrefillSm90Spec: ALiBi takes no soft cap (FlashInfer's ALiBi has none); pass one of them")
        if self.query_tile == 192 and (self.head_dim != 64 or self.key_tile != 128):
            raise ValueError(f"PrefillSm90Spec: query_tile=192 is for head_dim 64 on 128-key tiles, got "
                             f"head_dim={self.head_dim}, key_tile={self.key_tile}")
        if self.key_tile == 176 and self.head_dim != 128:
            raise ValueError(f"PrefillSm90Spec: key_tile=176 is for head_dim 128, got head_dim={self.head_dim}")
        if (self.head_dim == 256) != (self.key_tile in (64, 80)):
            raise ValueError(f"PrefillSm90Spec: head_dim 256 takes key_tile=64 or 80, and only it takes them; got "
                             f"head_dim={self.head_dim}, key_tile={self.key_tile}")
        if self.kv_source == "ragged" and self.kv_layout != "NHD":
            raise ValueError("PrefillSm90Spec: ragged K/V has no KV layout (rows [kv_tokens, H, D] with any "
                             "strides); leave kv_layout='NHD'")

    @property
    def head_dim_vo(self) -> int:
        """V's and the output's head_dim: head_dim's, but 128 at 192 (the (192, 128) pair)."""
        return SM90_HEAD_DIM_VO[self.head_dim]

    def context(self) -> dict:
        return super().context() | {"head_dim_vo": self.head_dim_vo}

    def op_schemas(self) -> dict[str, str]:
        # work: plan()'s list (csrc/hopper/prefill_sm90_params.h); page_ids: the page table's
        # int32 indices on q's device (paged; empty for ragged K/V); counters: the dynamic
        # schedule's two int32 zeros (each launch leaves them at zero); lse: [q_tokens,
        # heads] or an empty tensor (not written); sinks: one float32 logit a query head, or an
        # empty tensor (none); grid: the persistent grid (one block an SM).
        return {
            "prefill_sm90": ("(Tensor q, Tensor k, Tensor v, Tensor work, Tensor page_ids, Tensor mask, Tensor(c!) counters, "
                             "Tensor(a!) out, Tensor(b!) lse, Tensor sinks, float scale_log2, float soft_cap_log2, int window_left, "
                             "float v_scale, int grid) -> ()"),
            "block_shape": "() -> int[]",
        }


@dataclass(frozen=True)
class PrefillPlanSpec(Spec):
    """Batch prefill's plan() on the host, in C++ (csrc/prefill/prefill_plan.h): one module for every
    prefill configuration (the configuration is a run-time struct), called through ctypes;
    its one op reports the size of that struct."""

    FAMILY = "prefill_plan"
    TEMPLATES = {"kernel.cu": "prefill/prefill_plan.cu.j2", "binding.cc": "prefill/prefill_plan_binding.cc.j2"}
    HOST_ONLY = True

    def op_schemas(self) -> dict[str, str]:
        return {"config_bytes": "() -> int"}
