"""Spec of batch decode over the paged KV cache (csrc/decode/decode_mma.cuh on tensor cores,
csrc/decode/decode.cuh on CUDA cores) and of its host planner."""

from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.spec import DTYPES, FP8_DTYPES, HEAD_DIMS, KV_LAYOUTS, PAGE_TABLES, PAGED_KV_DTYPES, Spec, choice

GROUP_TILES = (1, 2, 4, 8, 16)
# head_dim values a decode module takes: the shared ones and 512, which runs on the CUDA-core
# kernel only (see uses_tensor_cores). (POD, append and merge keep pipeline.spec.HEAD_DIMS.)
DECODE_HEAD_DIMS = (*HEAD_DIMS, 512)
# the largest head_dim of the tensor-core kernel (csrc/decode/decode_mma.cuh)
MAX_MMA_HEAD_DIM = 256


MAX_Q_TOKENS = 16


def max_tile_rows(head_dim: int) -> int:
    """Rows of a tensor-core decode tile: 16, 8 at head_dim 256 (16 rows x 256 dims of
    accumulators would spill)."""
    return 16 if head_dim <= 128 else 8


def group_tile(num_qo_heads: int, num_kv_heads: int, head_dim: int = 128, q_tokens: int = 1) -> int:
    """Query heads one thread block handles per KV head: the GQA group, capped so that its
    rows (q_tokens x heads, padded to a power of two) fit a tile of max_tile_rows (a larger
    group, e.g. MQA with 32 or 64 query heads, takes several tiles that re-read the same K/V
    from L2). Every tile runs on tensor cores (the rows of the mma tiles are (token, head)
    pairs) unless a positional encoding (RoPE, ALiBi) is applied in the kernel; see
    uses_tensor_cores."""
    group = num_qo_heads // num_kv_heads
    cap = max_tile_rows(head_dim)
    return max(t for t in GROUP_TILES if group % t == 0 and _pow2_ceil(t * q_tokens) <= cap)


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def uses_tensor_cores(positional: bool, head_dim: int = 128) -> bool:
    """Which kernel a DecodeSpec compiles to: csrc/decode/decode_mma.cuh (tensor cores) without
    an in-kernel positional encoding, whatever the group tile (1 and 2 heads too: the mma's
    idle rows cost nothing that matters, and per KV byte it runs the instructions of a 4-head
    tile), csrc/decode/decode.cuh (CUDA cores) with one (positional: RoPE or ALiBi; the
    tensor-core kernel has neither), and at head_dim 512 (the tensor-core kernel holds q's
    fragments, 4 registers a k step, and O^T's accumulators, 4 a 16-dim row tile, in
    registers: 128 + 128 a lane at 512, beyond what a thread has; FlashInfer's CUDA-core decode
    takes head_dim 512 the same way). The templates take this choice from the spec's
    context."""
    return not positional and head_dim <= MAX_MMA_HEAD_DIM


def pairs_kv_heads(dtype_kv: str, head_dim: int, group_tile: int, positional: bool, kv_layout: str,
                   q_tokens: int = 1) -> bool:
    """Whether a decode module also holds the tensor-core kernel whose blocks take two
    adjacent KV heads (csrc/decode/decode_mma.cuh, kKvHeads = 2): a head's K/V row of <= 128
    bytes in an NHD cache (fp8 at head_dim <= 128, 16-bit at 64), for tiles of 4 or 8
    query heads (16-head tiles need more registers than a pair's block can have). Both
    heads' rows of a token are then requested together, not 128 of every
    num_kv_heads x 128 bytes. Multi-token tiles (q_tokens > 1) take one KV head a block.
    positional: RoPE or ALiBi in the kernel (then the CUDA-core kernel, which has no pairs)."""
    row_bytes = head_dim * (1 if dtype_kv.startswith("float8") else 2)
    return uses_tensor_cores(positional, head_dim) and group_tile <= 8 and kv_layout == "NHD" and row_bytes <= 128 and q_tokens == 1


def cluster_blocks(head_dim: int) -> int:
    """Blocks per thread-block cluster of the tensor-core kernel's cluster split (csrc/decode/decode_mma.cuh,
    kCluster): 8. On the H100 (b=1, 8 KV heads) clusters of 16 were placed two blocks to
    an SM (7 clusters of 16 fit the GPCs, the 8th doubled up), which made every row
    slower; clusters of 8 took one SM each (docs/decode.md)."""
    return min(8, head_dim // 8)


def kv_heads_per_block(paired_kernel: bool, num_qo_heads: int, num_kv_heads: int, group_tile: int) -> int:
    """KV heads one block of the decode kernel can take (the module's launch checks the
    same, templates/decode/decode.cu.j2): 2 when the module has the paired kernel, the group is
    one tile and the KV heads pair up, else 1. plan() pairs only where the paired grid
    still fills the SMs (fewer, larger blocks leave SMs idle in small batches)."""
    paired = paired_kernel and num_qo_heads // num_kv_heads == group_tile and num_kv_heads % 2 == 0
    return 2 if paired else 1


@dataclass(frozen=True)
class DecodeSpec(Spec):
    """One query token per request against its paged K/V. Compile-time: dtypes, head_dim,
    the group tile, the page table and KV layout, RoPE, ALiBi and the soft cap (each
    changes the inner loop); sm_scale, window, scales and lengths are run-time values.
    ALiBi's slopes follow from the head index and num_qo_heads (run-time), as FlashInfer's
    (csrc/common/pos_encoding.cuh).

    q is fp16 or bf16 (the output takes its dtype), or fp8 over a cache of the same fp8
    dtype: then q is widened to fp16 where it is loaded (exactly) and dtype_o names the
    output's dtype, fp16 or bf16 (None for 16-bit q, so that each module has one spec)."""

    FAMILY = "decode"
    TEMPLATES = {"kernel.cu": "decode/decode.cu.j2", "binding.cc": "decode/decode_binding.cc.j2"}

    dtype_q: str = choice("float16", "bfloat16", *FP8_DTYPES)
    dtype_kv: str = choice(*PAGED_KV_DTYPES)
    head_dim: int = choice(*DECODE_HEAD_DIMS, tag="hd{}")
    group_tile: int = choice(*GROUP_TILES, tag="g{}", default=1)
    page_table: str = choice(*PAGE_TABLES, default="csr")
    kv_layout: str = choice(*KV_LAYOUTS, default="NHD")
    rope: bool = choice(False, True, tag="rope", default=False)
    soft_cap: bool = choice(False, True, tag="cap", default=False)
    # query tokens per request (plan()'s q_len_per_req), causal among themselves
    q_tokens: int = choice(*range(1, MAX_Q_TOKENS + 1), tag="q{}", default=1, name_default=False)
    # the output's dtype where it is not q's: fp8 q only (None: q's dtype)
    dtype_o: str | None = choice(None, "float16", "bfloat16", tag="o{}", default=None, name_default=False)
    # pos_encoding_mode="ALIBI": the logits' linear bias, on the CUDA-core kernel as RoPE
    alibi: bool = choice(False, True, tag="alibi", default=False)

    def check(self) -> None:
        if self.dtype_kv in ("float16", "bfloat16") and self.dtype_kv != self.dtype_q:
            raise ValueError(f"DecodeSpec: a {self.dtype_kv} cache needs q of the same dtype, got {self.dtype_q}")
        if self.dtype_q in FP8_DTYPES:
            if self.dtype_kv != self.dtype_q:
                raise ValueError(f"DecodeSpec: fp8 q ({self.dtype_q}) needs a cache of the same dtype, got "
                                 f"{self.dtype_kv}")
            if self.dtype_o is None:
                raise ValueError(f"DecodeSpec: fp8 q ({self.dtype_q}) needs dtype_o, the output's dtype: "
                                 "'float16' or 'bfloat16'")
        elif self.dtype_o is not None:
            raise ValueError(f"DecodeSpec: dtype_o is for fp8 q only ({self.dtype_q} q writes its own dtype); "
                             f"leave it None, got {self.dtype_o!r}")
        if self.alibi:
            if self.rope:
                raise ValueError("DecodeSpec: rope and alibi are two pos_encoding_modes; take one")
            if self.soft_cap:
                # FlashInfer caps the biased logit with sm_scale applied twice (variants.cuh);
                # no model pairs the two, so neither is guessed at here
                raise ValueError("DecodeSpec: alibi with soft_cap is not supported")
            if self.q_tokens > 1:
                raise ValueError("DecodeSpec: alibi with q_tokens > 1 is not supported (multi-token decode runs on "
                                 "tensor cores, without an in-kernel positional encoding)")
        if self.q_tokens > 1:
            if not uses_tensor_cores(False, self.head_dim):
                raise ValueError(f"DecodeSpec: q_tokens > 1 (multi-token decode) runs on tensor cores, which take "
                                 f"head_dim <= {MAX_MMA_HEAD_DIM}, got {self.head_dim}")
            if self.rope:
                raise ValueError("DecodeSpec: q_tokens > 1 (multi-token decode) runs on tensor cores, without "
                                 "in-kernel RoPE (rotate q and k before the append instead)")
            if _pow2_ceil(self.q_tokens * self.group_tile) > max_tile_rows(self.head_dim):
                raise ValueError(f"DecodeSpec: q_tokens x group_tile = {self.q_tokens} x {self.group_tile} rows exceed "
                                 f"a tile of {max_tile_rows(self.head_dim)} at head_dim {self.head_dim}")

    @property
    def pairs_kv_heads(self) -> bool:
        """Whether the module also holds the paired tensor-core kernel (see pairs_kv_heads)."""
        return pairs_kv_heads(self.dtype_kv, self.head_dim, self.group_tile, self.positional, self.kv_layout,
                              self.q_tokens)

    @property
    def positional(self) -> bool:
        """Whether a positional encoding (RoPE or ALiBi) runs in the kernel."""
        return self.rope or self.alibi

    @property
    def out_dtype(self) -> str:
        """The output's dtype: q's, or dtype_o for fp8 q."""
        return self.dtype_o or self.dtype_q

    def context(self) -> dict:
        # q_type: the kernel traits' query type, q's C++ type, or for fp8 q
        # fij::QueryOut<fp8 type, output type> (csrc/common/common.cuh)
        q_type = DTYPES[self.dtype_q][0] if self.dtype_o is None else \
            f"fij::QueryOut<{DTYPES[self.dtype_q][0]}, {DTYPES[self.dtype_o][0]}>"
        return super().context() | {"pair_kv_heads": self.pairs_kv_heads,
                                    "cluster_blocks": cluster_blocks(self.head_dim),
                                    "tensor_cores": uses_tensor_cores(self.positional, self.head_dim), "q_type": q_type,
                                    "out_dtype": self.out_dtype,
                                    "pos_encoding": "rope_llama" if self.rope else "alibi" if self.alibi else "none"}

    def op_schemas(self) -> dict[str, str]:
        # One op runs the decode kernel over the planned work items and, when plan() split
        # some requests (merge_rows > 0), the merge of their partial states: inside the
        # kernel (the last block of a split request merges it) when merge_counters (int32,
        # >= batch x blocks per item, zeros) is given, else as a second kernel. enable_pdl: the
        # launches are programmatic dependent launches (they may start while the kernel
        # before them in the stream finishes; see common.cuh). prepared: a CPU byte tensor
        # that receives the resolved launch (csrc/decode/decode_params.h DecodeLaunch) for run()'s
        # fast path, <namespace>_decode_fast. kv_heads_per_block: 2 where the module has the
        # paired tensor-core kernel and plan() chose it (see kv_heads_per_block), else 1.
        # cluster_size: cluster_blocks(head_dim) where plan() splits each request over a
        # thread-block cluster (tensor-core kernel, sm_90+; no partial rows), else 1;
        # cluster_warps: that cluster kernel's warps per block, 4 or 8 (plan()'s choice).
        return {"decode": (
            "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor[] page_table, Tensor work, "
            "Tensor merge_indptr, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) partial_o, "
            "Tensor(d!) partial_lse, float logit_scale, float v_scale, float soft_cap, int window_left, "
            "float rope_scale, float rope_theta, int grid_items, int merge_rows, "
            "Tensor(e!)? merge_counters=None, bool enable_pdl=False, Tensor(f!)? prepared=None, "
            "int kv_heads_per_block=1, int cluster_size=1, int cluster_warps=4) -> ()")}


@dataclass(frozen=True)
class DecodePlanSpec(Spec):
    """Batch decode's plan() on the host, in C++ (csrc/decode/decode_plan.h): one module for every
    decode configuration (the configuration is a run-time struct), called through ctypes;
    its one op reports the size of that struct."""

    FAMILY = "decode_plan"
    TEMPLATES = {"kernel.cu": "decode/decode_plan.cu.j2", "binding.cc": "decode/decode_plan_binding.cc.j2"}
    HOST_ONLY = True

    def op_schemas(self) -> dict[str, str]:
        return {"config_bytes": "() -> int"}
