"""POD wrappers: a prefill and a batch of decodes in one launch, at FlashInfer's names
(PODWithPagedKVCacheWrapper, BatchPODWithPagedKVCacheWrapper; docs/pod.md).

Each wrapper holds one wrapper of each family, which plans its side exactly as it plans
alone (work list, split-KV, page order, CUDA-graph buffers), with the float workspace split
in halves between them as FlashInfer splits it. run() takes both plans' resolved op
arguments (the families' `_resolved_args`) and launches the POD module
(csrc/pod/pod.cuh): one grid of both sides' blocks, each block choosing its side on the SM
it starts on. The decode side plans for blocks of one KV head without clusters (every POD
block has 4 warps), and the prefill side for the query tile _Pod.tile_rows picks."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..decode.spec import DecodeSpec
from ..decode.wrapper import BatchDecodeWithPagedKVCacheWrapper
from ..pipeline import env
from ..pipeline.jit import get_module, traced_op
from ..prefill.sm90 import Sm90Plan
from ..prefill.spec import PrefillSpec
from ..prefill.wrapper import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from ..runtime import fastcall
from ..runtime.checks import (
    compiling,
    constant_result,
    dtype_str,
    expect_bool,
    expect_choice,
    expect_workspace,
    host_index,
    static_inputs,
)
from ..runtime.device import empty_f32, sm_count, supports_pdl
from ..runtime.launch import fast_entry, launch_buffer, launch_failed, module_op, relaunch_entry
from ..runtime.page_order import launch_pending
from ..runtime.page_table import csr_kv_lens_host, parse_block_tables, unpack_paged_kv_cache
from .spec import PodSm90Spec, PodSpec, pod_tiles

__all__ = ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"]

POD_COUNTERS = 256 + 3  # csrc/pod/pod_params.h kPodCounters


def _halves(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace's two halves (bytes, 256-aligned), the prefill side's and the decode side's."""
    flat = buf.reshape(-1).view(torch.uint8)
    half = flat.numel() // 2 // 256 * 256
    return flat[:half], flat[half:]


def _no_rope(value: str, name: str) -> None:
    if value != "NONE":
        raise ValueError(f"{name}: POD applies no positional encoding in the kernel (as FlashInfer's POD), got "
                         f"{value!r}; rotate q and k first (flashinfer_jit.apply_rope...) and pass 'NONE'")


@functools.lru_cache(maxsize=64)
def _pod_spec_of(prefill: PrefillSpec, decode: DecodeSpec, prefill_kv: str, kv_layout: str) -> PodSpec:
    """The POD module whose sides are these two plans' modules (validated once a pair, not
    at every run())."""
    return PodSpec(dtype_q=decode.dtype_q, dtype_kv=decode.dtype_kv, head_dim=decode.head_dim, prefill_kv=prefill_kv,
                   page_table=decode.page_table, kv_layout=kv_layout, mask=prefill.mask,
                   group_tile=decode.group_tile).validate()


@functools.lru_cache(maxsize=64)
def _pod_sm90_spec_of(prefill, decode: DecodeSpec, kv_layout: str) -> PodSm90Spec:
    """POD on Hopper's module: the prefill plan's Hopper module (PrefillSm90Spec) beside the
    decode plan's (validated once a pair)."""
    return PodSm90Spec(dtype_q=decode.dtype_q, head_dim=decode.head_dim, page_table=decode.page_table,
                       kv_layout=kv_layout, mask=prefill.mask, key_tile=prefill.key_tile,
                       group_tile=decode.group_tile, prefill_kv=prefill.kv_source).validate()


@constant_result
def _pod_sm90_namespace(prefill_key: tuple, decode_key: tuple, kv_layout: str) -> str:
    """POD on Hopper's torch.ops namespace for a run() that torch.compile traces (the two
    sides' runtime.launch.traced_key: the Hopper prefill module's and the decode module's)."""
    (p_type, p_params), (d_type, d_params) = prefill_key, decode_key
    return get_module(_pod_sm90_spec_of(p_type(**dict(p_params)), d_type(**dict(d_params)), kv_layout)).namespace


# POD on Hopper's split (csrc/pod/pod_sm90.cuh): the Hopper prefill kernel's rate over the paged
# cache on an H200 (bf16 head_dim 128, 2 x 2k causal: 446 TFLOP/s) and the decode's DRAM read;
# only their ratio matters.
_SM90_PREFILL_FLOPS_PER_S = 4.5e14
# The most SMs that start on prefill items, as a share of the SMs. POD on Hopper's decode side
# streams at most ~43 GB/s an SM (three decode units a block) and ~0.9x the decode kernel's rate
# overall, which it reaches from a bit over half the SMs; below that, each SM taken from it
# slows the decodes. H200 sweeps (2026-11-29, docs/pod.md): where this cap binds (mixes 1, 3, 5
# and 6), 60 prefill blocks of 132 were the fastest of 36-60 (1-3% over 44); the decode-heavy
# mixes 2 and 4 were fastest near their time ratio (36-44), and 2-8% slower at 52-60.
_SM90_PREFILL_CAP = 0.45


# POD on Hopper's decode side: where it is the longer side by far (estimated at least
# _SM90_DECODE_SPLIT_RATIO x the prefill's time), requests longer than _SM90_DECODE_SPLIT_OVER
# keys run in chunks of _SM90_DECODE_CHUNK (split-KV, merged after the launch). Its units
# (request x head block) run three a block on the SMs the prefill leaves, in waves, and long
# ones make a coarse last wave, which the prefill side has ended too early to fill. Where the
# prefill side is comparable, the decode blocks that run out join it, and the merge is pure
# cost. H200 (2026-11-30, docs/pod.md): 128 decodes of 8k keys beside a 4k prefill (mix 4,
# decode ~3.4x the prefill) 1103 us in chunks of 2048 against 1156 unsplit (1118 in chunks of
# 1024), and 1144 against 1223 in a second run; beside a 6000-token prefill (mix 5, ~1.2x)
# 1685 against 1653; at 4k keys (mix 3) chunks of 2048 cost 1.5% (677 against 667).
_SM90_DECODE_SPLIT_OVER = 4096
_SM90_DECODE_CHUNK = 2048
_SM90_DECODE_SPLIT_RATIO = 2.0


# the types of plan() arguments a recipe's key holds (_Pod._replan: == on them is exact and cheap)
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype))


def sm90_decode_split(longest: int, flops: float, kv_bytes: float) -> int | None:
    """POD on Hopper's decode-side split-KV chunk (the decode plan's fixed_split_size) for a
    decode side whose longest request has `longest` keys and which reads kv_bytes beside a
    prefill side of `flops`; None: the decode planner's own."""
    t_p, t_d = flops / _SM90_PREFILL_FLOPS_PER_S, kv_bytes / _DECODE_BYTES_PER_S
    if longest > _SM90_DECODE_SPLIT_OVER and t_d >= _SM90_DECODE_SPLIT_RATIO * t_p:
        return _SM90_DECODE_CHUNK
    return None


def sm90_prefill_blocks(flops: float, kv_bytes: float, num_sms: int) -> int:
    """The blocks (SMs) that start on prefill items in POD on Hopper. The decode side's blocks
    join the prefill when their units run out, but the prefill's blocks never take decode
    units, so the prefill side gets the SMs on which it ends as the decodes end
    (num_sms x t_p / t_d, the two sides' estimated times alone), at most _SM90_PREFILL_CAP of
    them (past it the decodes slow), and at least one SM each while both have work."""
    t_p, t_d = flops / _SM90_PREFILL_FLOPS_PER_S, kv_bytes / _DECODE_BYTES_PER_S
    if t_d <= 0:
        return num_sms
    if t_p <= 0:
        return 0
    cap = max(1, round(_SM90_PREFILL_CAP * num_sms))
    return max(1, min(num_sms - 1, cap, round(num_sms * t_p / t_d)))


@constant_result
def _pod_namespace(prefill_key: tuple, decode_key: tuple, prefill_kv: str, kv_layout: str) -> str:
    """The POD module's torch.ops namespace for a run() that torch.compile traces (the two
    sides' runtime.launch.traced_key; Dynamo runs this once, at trace time)."""
    (p_type, p_params), (d_type, d_params) = prefill_key, decode_key
    spec = _pod_spec_of(p_type(**dict(p_params)), d_type(**dict(d_params)), prefill_kv, kv_layout)
    return get_module(spec).namespace


# Rates for the two sides' time estimates (decode_share): what each side alone reaches on an
# H200 (bf16, head_dim 128): the prefill's 64-row tile in TFLOP/s, the decode's DRAM read.
# Only their ratio matters.
_PREFILL_FLOPS_PER_S = 3.0e14
_DECODE_BYTES_PER_S = 4.2e12


def prefill_flops(qo_lens, kv_lens, causal: bool, num_qo_heads: int, head_dim: int) -> float:
    """Attention FLOPs of a prefill batch (Q K^T and P V), causal counting the visible keys."""
    return work_flops(prefill_work(qo_lens, kv_lens), causal, num_qo_heads, head_dim)


def prefill_work(qo_lens, kv_lens) -> tuple[int, int]:
    """(sum of q x k, sum of q x max(2k - q + 1, 0)): a prefill batch's (query, key) pairs and
    twice those a bottom-right causal mask leaves, as exact integers (what plan() keeps, so
    that a run() with the other mask needs no lengths; fij_fastcall's pod_work computes the
    same in C++)."""
    q = np.asarray(qo_lens, dtype=np.int64)
    k = np.asarray(kv_lens, dtype=np.int64)
    return int(q @ k), int(q @ np.maximum(2 * k - q + 1, 0))


def work_flops(work: tuple[int, int], causal: bool, num_qo_heads: int, head_dim: int) -> float:
    """prefill_work's pairs as FLOPs (Q K^T and P V: 4 a pair and head dimension)."""
    pairs = work[1] / 2 if causal else float(work[0])
    return pairs * num_qo_heads * head_dim * 4.0


def csr_kv_lens(indptr, last_page_len, page_size: int) -> np.ndarray:
    """Each request's keys from a CSR page table, on the host (csr_kv_lens_host; a last-page
    buffer longer than the batch, a CUDA-graph wrapper's, cut to it)."""
    ip = host_index(indptr, "kv_indptr")
    last = host_index(last_page_len, "kv_last_page_len")[: max(ip.shape[0] - 1, 0)]
    if last.shape[0] != ip.shape[0] - 1:
        raise ValueError(f"kv_last_page_len: expected {ip.shape[0] - 1} values (one a request of kv_indptr), got "
                         f"{last.shape[0]}")
    return csr_kv_lens_host(ip, last, page_size)


def decode_share(flops: float, kv_bytes: float) -> float:
    """The share of an SM's blocks that run decode units while both sides have work: the
    decode side's share of the two sides' estimated times alone (csrc/pod/pod.cuh launch_pod
    turns it into blocks an SM, at least one for each side)."""
    t_p, t_d = flops / _PREFILL_FLOPS_PER_S, kv_bytes / _DECODE_BYTES_PER_S
    return t_d / (t_p + t_d) if t_p + t_d > 0 else 0.5


def pod_schedule(flops: float, kv_bytes: float, tile_rows: int, num_sms: int) -> tuple[float, int]:
    """(decode share of an SM's blocks, decode SMs) of a launch (csrc/pod/pod.cuh launch_pod).

    Measured on an H200 (scripts/sweep_pod.py, docs/history/pod.md): with the 128-row tile (two blocks
    an SM) and a decode side of at least half the estimated time, decode-only SMs in proportion
    to that share (the others prefill-only) were fastest (1.01-1.09x over one decode and one
    prefill block on every SM); below half, and with the 64-row tile (four blocks an SM), a
    share of every SM's blocks."""
    share = decode_share(flops, kv_bytes)
    if tile_rows == 128 and share >= 0.5 and num_sms > 1:
        return 1.0, max(1, min(num_sms - 1, round(share * num_sms)))
    return share, 0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class QuickLaunch(NamedTuple):
    """run()'s fast path: a launch the POD op recorded (`prepared`, at `address`), relaunched
    by fij_fastcall's pod_run (`run`, with the module's <namespace>_pod_fast at `entry`) for
    tensors of the recorded `signature` (fij_fastcall.pod_signature of the call's tensors as
    given), checked in C++; `key`: what the caller compares in Python (the options its
    signature does not hold); spec: the module, for errors.

    POD on Hopper's record outlives a plan() of the same configuration (configs: both sides'
    plan configurations it was recorded with, by identity): plan() keeps it and sets the
    wrapper's _replan_bounds (the plan's bounds on each side's q rows), and the next run() goes
    through fij_fastcall.pod_rerun with the module's <namespace>_pod_relaunch and
    _relaunch_plan()'s arguments: the call's tensors checked in C++ against the signature but
    for their rows, the launch resolved from them and the new plan, recorded and launched
    without the dispatcher (the first run() after each plan(): an engine's every step)."""

    run: object
    entry: int
    prepared: torch.Tensor
    address: int
    signature: bytes
    key: object
    spec: PodSpec | PodSm90Spec
    configs: tuple | None = None


def _side_tables(kv_indptr_p, kv_indices_p, last_page_len_p, block_tables_p, seq_lens_p, kv_indptr_d, kv_indices_d,
                 last_page_len_d, block_tables_d, seq_lens_d) -> tuple | None:
    """Batch POD's page tables: None where both sides are CSR; (the prefill side's KV
    lengths, the decode side's), int64 on the host, where both are block tables of one layout;
    a ValueError naming the argument for one side of each kind, both forms on one side, or two
    layouts."""
    blocks = (block_tables_p is not None, block_tables_d is not None)
    for side, given, csr in (("p", blocks[0], (kv_indptr_p, kv_indices_p, last_page_len_p)),
                             ("d", blocks[1], (kv_indptr_d, kv_indices_d, last_page_len_d))):
        if given and any(t is not None for t in csr):
            raise ValueError(f"block_tables_{side}: pass one page table a side (kv_indptr_{side}, kv_indices_{side} "
                             f"and last_page_len_{side} None with block tables)")
    if not any(blocks):
        return None
    if not all(blocks):
        missing = "block_tables_d" if blocks[0] else "block_tables_p"
        raise ValueError(f"{missing}: POD reads both sides through one page-table layout; pass block tables for both "
                         "sides or CSR tables for both")
    layouts = []
    for side, tables, lens in (("p", block_tables_p, seq_lens_p), ("d", block_tables_d, seq_lens_d)):
        try:
            layouts.append(parse_block_tables(tables, lens)[0])
        except (TypeError, ValueError) as exc:  # (named after the side's arguments)
            raise type(exc)(f"{exc} [block_tables_{side} / seq_lens_{side}]") from None
    layout_p, layout_d = layouts
    if layout_p != layout_d:
        raise ValueError(f"block_tables_d: {layout_d} beside the prefill side's {layout_p}; POD reads both sides "
                         "through one page-table layout")
    return (host_index(seq_lens_p, "seq_lens_p"),
            host_index(seq_lens_d, "seq_lens_d"))


def native_work(qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d, last_page_len_d, qo_indptr_d,
                page_size: int) -> tuple | None:
    """plan()'s per-request arithmetic in C++ (fij_fastcall pod_work): (prefill_work's two
    sums, the decode side's keys, whether qo_indptr_d is arange(batch + 1) or None, the decode
    side's longest request in keys), or None
    where the extension is unavailable or a vector is not a contiguous int32 CPU tensor of its
    batch's length (plan() then reads them into numpy)."""
    ext = fastcall.extension()
    if ext is None or type(page_size) is not int:  # (a bad page_size: the decode side's error)
        return None
    work = ext.pod_work(qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d, last_page_len_d, qo_indptr_d,
                        page_size)
    return None if work == -1 else work


class _Pod:
    """What both POD wrappers share: the two sides' wrappers, the scheduling counters, the launch."""

    # The prefill side's query tile at head_dim <= 128 (pod_tiles): None, the prefill
    # planner's choice (as the prefill family's: 128 rows for long requests), or 64 or 128
    # pinned. Head_dim 256 runs 64. Benchmarks and tests pin it on a wrapper.
    tile_rows = None
    _force = (None, None)

    # The prefill side's kernel: "fa2", the mma.sync kernel's blocks inside POD's kernel
    # (csrc/pod/pod.cuh); "auto", POD on Hopper (csrc/pod/pod_sm90.cuh: the Hopper prefill
    # kernel's blocks, one an SM, beside the decode blocks) where the prefill side plans the
    # Hopper kernel (backend "auto"'s rule: sm_90, prompts long enough; no custom mask), else
    # "fa2"; "fa3", POD on Hopper or a ValueError naming why not. Set it before plan() (the
    # single form: before the run() that plans its prefill). "auto" is the default: on an
    # H100 / H200 POD on Hopper is 1.08-1.13x our Hopper prefill then decode and faster than the
    # mma.sync POD on every measured mix (docs/pod.md); elsewhere, and for what it does not take,
    # "auto" is the mma.sync POD. POD on Hopper takes run()'s fast path as the mma.sync POD does
    # (its recorded launch encodes the prefill side's TMA maps from each call's addresses);
    # torch.compile traces it to its op. A CUDA-graph wrapper keeps its first plan's choice, and
    # its captured launch the split of the plan before the capture (sm90_prefill_blocks: a speed
    # choice, not a result).
    prefill_backend = "auto"
    # Whether a plan() of POD on Hopper keeps run()'s record for its next run() (QuickLaunch):
    # the batch form and BatchAttention's; the single form plans its prefill side in run().
    _replans_record = False
    # Whether such a plan() resolves that run()'s launch itself (_prepare_first_run) for the rows
    # of its batch form; BatchAttention's POD wrapper leaves it to BatchAttention.plan(), which
    # knows its rows.
    _prepares_first_run = True
    # POD on Hopper's split: None, sm90_prefill_blocks() of the plans, or the blocks that
    # start on prefill items (benchmarks pin it; a pin drops run()'s recorded launch, which holds
    # the split)
    @property
    def force_prefill_blocks(self):
        return self._force_blocks

    @force_prefill_blocks.setter
    def force_prefill_blocks(self, value) -> None:
        self._force_blocks, self._quick = value, None


    # The schedule of each launch (launch_pod): None, pod_schedule() of the plans, or pinned
    # (the decode share of an SM's blocks; the decode SMs, 0 every SM). Benchmarks pin them;
    # a pin drops run()'s recorded launch, which holds the schedule.
    @property
    def force_decode_share(self):
        return self._force[0]

    @force_decode_share.setter
    def force_decode_share(self, value) -> None:
        self._force, self._quick = (value, self._force[1]), None

    @property
    def force_decode_sms(self):
        return self._force[1]

    @force_decode_sms.setter
    def force_decode_sms(self, value) -> None:
        self._force, self._quick = (self._force[0], value), None

    def __init__(self, float_workspace_buffer, kv_layout: str, prefill, decode_buffers: tuple, use_cuda_graph: bool):
        expect_workspace(float_workspace_buffer)
        expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
        expect_bool(use_cuda_graph, "use_cuda_graph")
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        ws_p, ws_d = _halves(float_workspace_buffer)
        self._prefill = prefill(ws_p)
        self._prefill._gather_ok = False  # (POD on Hopper's kernel reads the cache itself: no copy of its pages)
        self._decode = BatchDecodeWithPagedKVCacheWrapper(ws_d, kv_layout, use_cuda_graph, True, *decode_buffers)
        self._decode._pod_side = True
        # csrc/pod/pod_params.h: zeros, which every launch leaves at zero
        self._counters = torch.zeros(POD_COUNTERS, dtype=torch.int32, device=self._device)
        self._no_lse = empty_f32(self._device)  # (an LSE not written: an empty tensor, as the op path's)
        static_inputs(self._counters)
        self._pdl = supports_pdl(self._device) if self._device.type == "cuda" else False
        self._flops = 0.0  # the planned prefill's and decodes' work, for pod_schedule
        self._kv_bytes = 0.0
        self._planned_schedule = (0.5, 0)  # (None: not computed for the current plan, on POD on Hopper)
        self._sms = sm_count(self._device)  # (a CPU workspace: CPU_SMS, the H100's 132)
        # run()'s fast path (QuickLaunch): recorded by a run() through the op, dropped by every
        # pinned schedule and every plan but POD on Hopper's plans of its configuration (which
        # keep it for pod_rerun: _plan_launch)
        self._quick = None
        self._sm90_blocks = 0  # POD on Hopper's split of the plan (sm90_prefill_blocks)
        self._sm90_op = None  # ... and its module's op (a CPU workspace: none; a traced run() looks it up)
        self._sm90_key = None  # the specs (and debug switch) _sm90_op was looked up for
        self._sm90_spec = None  # ... and their module (PodSm90Spec)
        self._sm90_relaunch = None  # ... and its <namespace>_pod_relaunch (None: no fast path)
        # a kept record's next run() goes through pod_rerun: the plan's bounds on each side's q
        # rows (prefill at least its tokens, decode its batch), None where the record is current;
        # and the plan's op arguments for it (_relaunch_plan, gathered by plan())
        self._replan_bounds = None
        self._replan_args = None
        # ... where plan() also resolved that run()'s launch for the rows it expects
        # (_prepare_first_run): the record is then that call's, which pod_run takes
        self._run_prepared = False
        self._force_blocks = None  # force_prefill_blocks

    def _no_plan_here(self, traced: str, captured: str) -> None:
        """A run() that must plan its prefill side again: a RuntimeError (message `traced` or
        `captured`) under torch.compile or during CUDA-graph capture, where plan() cannot run."""
        if compiling():
            raise RuntimeError(traced)
        if _capturing(self._device):
            raise RuntimeError(captured)

    def _pin_tile(self, head_dim: int) -> None:
        """The prefill side's tile for its next plan: a tile the POD module holds."""
        self._prefill._force_tile_rows = self.tile_rows if 128 in pod_tiles(head_dim) else 64

    def _plan_launch(self) -> None:
        """The launch of both sides' plans: the mma.sync POD's schedule, or POD on Hopper's
        split and op; drops run()'s recorded launch, but POD on Hopper's where the plan is of
        its module and configurations (kept for the next run()'s pod_rerun: _replan_bounds)."""
        prefill = self._prefill._plan
        if prefill is None or type(prefill) is not Sm90Plan:
            self._plan_schedule()
            return
        # POD on Hopper (its schedule is the split; _schedule() computes the mma.sync POD's on demand)
        quick = self._quick
        self._quick, self._planned_schedule, self._replan_bounds, self._run_prepared = None, None, None, False
        self._sm90_blocks = sm90_prefill_blocks(self._flops, self._kv_bytes, self._sms)
        # (the op of the two sides' specs: looked up again only when either spec or the debug
        # switch changes, not every plan)
        decode = self._decode._plan
        spec_p, spec_d, debug, last = prefill.spec, decode.spec, env.debug(), self._sm90_key
        if last is None or spec_p is not last[0] or spec_d is not last[1] or debug != last[2]:
            # (its decode blocks read a cache of q's dtype: another decode side has no module,
            # and run() raises: _run_sm90)
            spec = _pod_sm90_spec_of(spec_p, spec_d, self._kv_layout) if spec_d.dtype_kv == spec_d.dtype_q else None
            cuda = self._device.type == "cuda" and spec is not None
            self._sm90_op = module_op(spec, "pod_sm90", debug) if cuda else None
            self._sm90_relaunch = relaunch_entry(spec, debug) if cuda else None
            self._sm90_key, self._sm90_spec = (spec_p, spec_d, debug), spec
        # run()'s record outlives a plan of the module and configurations it was recorded with
        # (QuickLaunch): the next run() resolves it again from the call and this plan, in C++,
        # with the plan's op arguments gathered here (plan() runs once a step, where an engine
        # overlaps it with the GPU's work; that run() is on the step's critical path)
        if quick is not None and quick.configs is not None and quick.spec is self._sm90_spec and \
                quick.configs[0] is prefill.config and quick.configs[1] is decode.config and \
                self._replans_record and self._sm90_relaunch is not None:
            self._quick = quick
            self._replan_bounds = (prefill.qo_tokens, 1 << 62, decode.batch, decode.batch)
            self._replan_args = self._relaunch_plan()
            if self._prepares_first_run:  # (the batch form: q_p of the plan's tokens, q_d of its batch)
                self._prepare_first_run((prefill.qo_tokens, decode.batch), (0, 0), (-1, -1))

    def _prepare_first_run(self, rows: tuple, offsets: tuple, counts: tuple) -> None:
        """After a plan() that kept run()'s record: the next run()'s launch resolved now, by
        the module's <namespace>_pod_relaunch without launching (fij_fastcall.pod_prepare), for
        a call of the record's form with `rows` q rows on each side (prefill, decode), each side
        read from its offset in `offsets` for `counts` rows (-1: to the end); the record is then
        that call's, and such a run() takes pod_run as every later one does (5.0-5.6 us of that
        run()'s host time less than through pod_rerun, about 10 more in plan() on the H200 host:
        docs/pod.md "Host time"). Where it cannot be prepared, or the run() is of other rows,
        the run() takes pod_rerun. (A CPU workspace's record is a test's stand-in: nothing to
        resolve.)"""
        if self._device.type != "cuda":
            return
        quick = self._quick
        got = fastcall.extension().pod_prepare(self._sm90_relaunch, quick.address, quick.signature,
                                                self._replan_args, rows, offsets, counts)
        if type(got) is bytes:
            self._quick = QuickLaunch(quick.run, quick.entry, quick.prepared, quick.address, got, quick.key,
                                      quick.spec, quick.configs)
            self._run_prepared = True

    def _sm90_decode_split(self, longest: int, decode_keys: int, num_kv_heads: int, head_dim: int,
                           flops: float | None = None) -> int | None:
        """The decode side's split-KV chunk beside the planned prefill (its plan()'s
        fixed_split_size): sm90_decode_split where the prefill plans the Hopper kernel outside a
        CUDA graph (a graph's decode plan keeps its first configuration), else None (the
        decode planner's own). POD on Hopper's K/V is 16-bit: 2 x head_dim x 2 bytes a token
        and KV head. flops: the prefill's (_replan's, whose Hopper plan is not yet installed),
        else the installed plan's (self._flops, where it is a Hopper plan)."""
        if longest <= _SM90_DECODE_SPLIT_OVER or self._use_cuda_graph or \
                (flops is None and type(self._prefill._plan) is not Sm90Plan):
            return None  # (no decode long enough to split: sm90_decode_split's first test, before the rest)
        return sm90_decode_split(longest, self._flops if flops is None else flops,
                                 float(decode_keys) * num_kv_heads * 4 * head_dim)

    def _run_sm90(self, q_p, kv_p: tuple, q_d, paged_kv_cache_d, scales_p: tuple, scales_d: tuple, return_lse_p,
                  return_lse_d, out_p=None, lse_p=None, out_d=None, lse_d=None, record=None, key=None) -> tuple:
        """POD on Hopper (a prefill plan on the Hopper kernel): one launch of
        csrc/pod/pod_sm90.cuh; each side's checks and outputs as its own run()'s. scales_p,
        scales_d: each side's (q_scale, k_scale, v_scale). record, key: _launch's (the op
        records its launch for run()'s fast path, which relaunches it from C++)."""
        # (both sides were planned with one dtype and head configuration: each side's own
        # checks below hold q_p and q_d to them)
        if self._sm90_spec is None:  # (no module for this decode side: its K/V are not q's dtype, _plan_launch)
            ds = self._decode._plan.spec
            raise ValueError(f"k_p/v_p and paged_kv_cache_d: POD runs one K/V dtype, got {ds.dtype_q} and "
                             f"{ds.dtype_kv}")
        k_p, v_p = kv_p
        plan, pc = self._prefill._plan, self._prefill._plan.config
        out_p, lse_p, scale_p, vs_p = self._prefill._sm90_args(q_p, k_p, v_p, *scales_p, out_p, lse_p, return_lse_p)
        out_d, lse_d, d_args = self._decode._resolved_args(q_d, paged_kv_cache_d, *scales_d, return_lse_d, out_d,
                                                           lse_d)
        if compiling():  # (the shapes are the graph's: it launches whatever rows they hold)
            op = traced_op(_pod_sm90_namespace(plan.traced_key, self._decode._traced[0], self._kv_layout), "pod_sm90")
        else:
            op = self._sm90_op if q_p.shape[0] > 0 or q_d.shape[0] > 0 else None
        if op is not None:
            blocks = self.force_prefill_blocks if self.force_prefill_blocks is not None else self._sm90_blocks
            rec = None if compiling() else self._record_for(self._sm90_spec, record)
            op(q_p, k_p, v_p, plan.work, plan.page_ids, out_p, lse_p if lse_p is not None else empty_f32(q_p.device),
               scale_p, pc.window_left, vs_p, *d_args, self._counters, int(blocks), rec[2] if rec else None)
            self._keep_record(rec, key, self._sm90_spec, (pc, self._decode._plan.config))
        return (out_p, out_d), (lse_p, lse_d)

    def _schedule(self) -> tuple[float, int]:
        """(decode share, decode SMs) of the planned launch: pinned, or pod_schedule()'s."""
        if self._planned_schedule is None:  # (a plan on POD on Hopper: the mma.sync POD's, on demand)
            self._plan_schedule()
        share, sms = self._planned_schedule
        if self.force_decode_share is not None:
            share = float(self.force_decode_share)
        if self.force_decode_sms is not None:
            sms = int(self.force_decode_sms)
        return share, sms

    def _plan_schedule(self) -> None:
        """pod_schedule() of the two plans (after either plans); drops run()'s recorded launch."""
        # (a Hopper prefill plan, POD on Hopper's, has no mma.sync tile: its split is sm90_prefill_blocks)
        tile = getattr(self._prefill._plan, "tile_rows", 128) if self._prefill._plan is not None else 64
        self._planned_schedule = pod_schedule(self._flops, self._kv_bytes, tile, self._sms)
        self._quick, self._replan_bounds = None, None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _spec(self, prefill_kv: str, q_p, q_d):
        """The POD module of the two plans (checked against each other), or under
        torch.compile its torch.ops namespace (the sides' checks then in their traced
        arguments and the POD spec's validation)."""
        if q_p.dtype != q_d.dtype:
            raise ValueError(f"q_p and q_d: POD runs one query dtype, got {dtype_str(q_p.dtype)} and "
                             f"{dtype_str(q_d.dtype)}")
        if compiling():
            p_traced, d_traced = self._prefill._traced, self._decode._traced
            if q_p.shape[1] != d_traced[3] or q_p.shape[2] != d_traced[4]:
                raise ValueError(f"q_p: POD runs one head configuration: the decode plan's is {d_traced[3]} query "
                                 f"heads of head_dim {d_traced[4]}, q_p is {tuple(q_p.shape)}")
            return _pod_namespace(p_traced[0], d_traced[0], prefill_kv, self._kv_layout)
        ps, ds = self._prefill._plan.spec, self._decode._plan.spec
        if ps.dtype_kv != ds.dtype_kv:
            raise ValueError(f"k_p/v_p and paged_kv_cache_d: POD runs one K/V dtype, got {ps.dtype_kv} and "
                             f"{ds.dtype_kv}")
        pc, dc = self._prefill._plan.config, self._decode._plan.config
        if (pc.num_qo_heads, pc.num_kv_heads) != (dc.num_qo_heads, dc.num_kv_heads):
            raise ValueError(f"q_p: the prefill's heads ({pc.num_qo_heads} query / {pc.num_kv_heads} KV) differ "
                             f"from the decode plan's ({dc.num_qo_heads} / {dc.num_kv_heads}); POD runs one head "
                             "configuration")
        if pc.head_dim_qk != dc.head_dim:
            raise ValueError(f"q_p: head_dim {pc.head_dim_qk} differs from the decode plan's {dc.head_dim}")
        return _pod_spec_of(ps, ds, prefill_kv, self._kv_layout)

    def _launch(self, spec, p_args: tuple, d_args: tuple, enable_pdl, record: tuple | None = None, key=None) -> None:
        """One POD launch; spec: _spec()'s module, or under torch.compile its namespace.
        record: the call's tensors as given, in fij_fastcall.pod_signature's order (None:
        a form run()'s fast path does not take): the op records its launch, which later
        calls of that signature and `key` relaunch from C++ (_quick_run)."""
        if compiling():
            traced_op(spec, "pod")(*p_args, *d_args, self._counters, *self._schedule(),
                                   self._pdl if enable_pdl is None else enable_pdl)
            return
        op = module_op(spec, "pod", env.debug())
        pdl = self._pdl if enable_pdl is None else bool(enable_pdl)
        rec = self._record_for(spec, record)
        op(*p_args, *d_args, self._counters, *self._schedule(), pdl, rec[2] if rec else None)
        self._keep_record(rec, key, spec)

    @staticmethod
    def _record_for(spec, record: tuple | None) -> tuple | None:
        """For an op call of `spec`'s module whose tensors are `record` (fij_fastcall.pod_signature's
        arguments; None: a form the fast path does not take): (entry, signature, prepared), the CPU
        bytes the op fills with its launch (both POD kernels' ops take them); None: nothing recorded."""
        entry = fast_entry(spec, "pod", env.debug()) if record is not None else None
        signature = fastcall.extension().pod_signature(*record) if entry is not None and entry.runner else None
        return (entry, signature, launch_buffer(entry)) if signature is not None else None

    def _keep_record(self, rec: tuple | None, key, spec, configs: tuple | None = None) -> None:
        """After the op returned: later calls of _record_for's signature and `key` take the fast
        path. configs: POD on Hopper's plan configurations (a later plan of the same keeps it)."""
        if rec is not None:
            entry, signature, prepared = rec
            run, address = entry.runner
            self._quick = QuickLaunch(run, address, prepared, prepared.data_ptr(), signature, key, spec, configs)
            self._replan_bounds = None

    def _relaunch_plan(self) -> tuple:
        """POD on Hopper's op arguments that come from the plans (fij_fastcall.pod_rerun's `plan`,
        in <namespace>_pod_relaunch's order): run()'s common form (no scales) as _run_sm90 passes
        them to the op."""
        plan, decode = self._prefill._plan, self._decode._plan
        pc, dc = plan.config, decode.config
        tables, work, merge_indptr, partial_o, partial_lse, _, _, _, grid_items, merge_rows, counters = decode.args
        blocks = self.force_prefill_blocks if self.force_prefill_blocks is not None else self._sm90_blocks
        no_lse = self._no_lse
        return (plan.work, plan.page_ids, no_lse, tuple(tables), work, merge_indptr, no_lse,
                partial_o, partial_lse, counters, self._counters, float(pc.logit_scale), 1.0, float(dc.logit_scale),
                1.0, int(pc.window_left), int(dc.window_left), int(grid_items), int(merge_rows), int(blocks))

    def _quick_run(self, quick: QuickLaunch, q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, lse_d, rows_p: int,
                   rows_d: int, want_lse: int, enable_pdl, counts: tuple = (-1, -1), bounds: tuple | None = None):
        """The recorded launch for these tensors (pod_signature's arguments): (out_p, out_d,
        lse_p, lse_d), or None where they are not of its signature, not on a CUDA device, or
        the stream captures a CUDA graph (the caller then runs the op). After a plan() that
        kept the record (_replan_bounds): the launch that plan() resolved for this run(), where
        it did (_run_prepared) and the tensors are of its rows; else fij_fastcall.pod_rerun
        resolves it again; counts: each side's rows from its offset (-1: to the end of its q),
        bounds: on each side's q rows as given (None: the plan's, the batch POD's)."""
        plan_bounds = self._replan_bounds
        got = -1
        if plan_bounds is None or self._run_prepared:
            # the record's launch (after a plan(): the one it resolved for this run(), pod_prepare;
            # a call of other rows leaves it for the next)
            got = quick.run(quick.entry, quick.address, quick.signature, q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p,
                            lse_d, rows_p, rows_d, want_lse, self._pdl if enable_pdl is None else enable_pdl)
            if type(got) is tuple:
                self._replan_bounds = None
                return got
        if plan_bounds is not None and got == -1:
            got = fastcall.extension().pod_rerun(self._sm90_relaunch, quick.address, quick.signature,
                                                 self._replan_args, bounds or plan_bounds, counts, q_p, kv_p, q_d,
                                                 kv_d, out_p, out_d, lse_p, lse_d, rows_p, rows_d, want_lse)
            if type(got) is tuple:
                # (the constructor: namedtuple's _replace costs ~0.5 us more)
                self._quick = QuickLaunch(quick.run, quick.entry, quick.prepared, quick.address, got[4], quick.key,
                                          quick.spec, quick.configs)
                self._replan_bounds = None
                return got[:4]
        if got > 0:
            raise launch_failed(quick.spec, "pod", got)
        return None


def _planned_decode_option(name: str, value, default, planned) -> None:
    """A decode-side setting passed to PODWithPagedKVCacheWrapper.run() (sm_scale_d,
    window_left_d): plan() sets it, as in FlashInfer, where run()'s copy is deprecated.
    Passed, it warns (DeprecationWarning); one that differs from plan()'s is a ValueError."""
    if value is None or value == default:
        return
    warnings.warn(f"{name} in run() is deprecated: the decode side's settings come from plan()",
                  DeprecationWarning, stacklevel=3)
    if float(value) != float(planned):
        raise ValueError(f"{name}={value} differs from the value planned ({planned}); pass it to plan()")


class PODWithPagedKVCacheWrapper(_Pod):
    """FlashInfer's POD wrapper: one prefill request (q_p against k_p / v_p, contiguous K/V
    rows) and a batch of one-token decodes over the paged cache, in one launch.

    plan() plans the decode side (FlashInfer's plan arguments). run() takes the prefill
    (planned there, again only when its lengths or options change) and both sides' inputs.
    Returns (out_p, out_d); with return_lse_p or return_lse_d, ((out_p, out_d), (lse_p,
    lse_d)), the LSE not asked for None (FlashInfer computes them and drops them). LSEs are
    base 2, float32 [rows, num_qo_heads], as every FlashInfer LSE.

    The decode side's sm_scale and window come from plan(). run()'s sm_scale_d and
    window_left_d are deprecated, as in FlashInfer: passed, they warn (DeprecationWarning),
    and one that differs from plan()'s is a ValueError; causal_d=True is a
    NotImplementedError (the decode side is non-causal). q_scale and k_scale
    scale the decode logits and v_scale its output, as in FlashInfer.

    prefill_backend (set before the run() that plans the prefill): "fa2", the mma.sync POD;
    "auto", POD on Hopper (the pod_sm90 module with the request's K/V rows) where the prefill
    plans the Hopper kernel (sm_90, auto's rule; NHD k_p / v_p, no custom mask, not a
    CUDA-graph wrapper), else the mma.sync POD; "fa3", POD on Hopper or a ValueError."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 jit_args=None):
        # (POD launches the mma.sync kernel's blocks: its prefill side plans for them, backend "fa2")
        super().__init__(float_workspace_buffer, kv_layout,
                         lambda ws: BatchPrefillWithRaggedKVCacheWrapper(ws, backend="fa2"),
                         (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer),
                         use_cuda_graph)
        self._prefill_key = None
        # POD on Hopper's decode-side split (_sm90_decode_split) depends on the prefill, which
        # the single form learns at run(): plan() takes the split the last run()'s prefill
        # implies, and a run() whose prefill implies another plans the decode side again
        # from plan()'s arguments (copies, kept only where a split can apply).
        self._decode_replan = None  # (plan()'s arguments, its keywords, the longest request's keys, all keys)

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking: bool = True) -> None:
        _no_rope(pos_encoding_mode, "pos_encoding_mode")
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                       rope_theta=rope_theta, non_blocking=non_blocking)
        try:
            lens = csr_kv_lens(indptr, last_page_len, page_size)
        except (ValueError, TypeError):
            lens = None  # (the decode side's plan() below names what is wrong)
        longest = int(np.maximum.reduce(lens, initial=0)) if lens is not None else 0
        splittable = self.prefill_backend != "fa2" and not self._use_cuda_graph and longest > _SM90_DECODE_SPLIT_OVER
        args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
        keys = int(lens.sum()) if splittable else 0
        self._decode_replan = None
        self._decode.plan(*args, fixed_split_size=self._sm90_decode_split(longest, keys, num_kv_heads, head_dim)
                          if splittable else None, **options)
        if splittable:  # (the caller may refill its index tensors before run(): copies)
            copies = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args[:3])
            self._decode_replan = (copies + args[3:], options, longest, keys)
        if lens is None:
            lens = csr_kv_lens(indptr, last_page_len, page_size)
        c = self._decode._plan.config
        self._kv_bytes = float(lens.sum()) * c.num_kv_heads * c.token_bytes
        self._plan_launch()

    def _replan_decode(self) -> None:
        """run(): the decode side planned again where the prefill just planned implies another
        split than the one planned (POD on Hopper; see __init__)."""
        if self._decode_replan is None:
            return
        args, options, longest, keys = self._decode_replan
        split = self._sm90_decode_split(longest, keys, args[4], args[5])
        if split != (self._decode._plan.config.fixed_split_size or None):
            self._decode.plan(*args, fixed_split_size=split, **options)

    begin_forward = plan

    def end_forward(self) -> None:
        pass

    def _plan_prefill(self, q_p, k_p, custom_mask, packed_custom_mask, causal, sm_scale, window_left,
                      kv_layout_p: str = "NHD") -> None:
        qo_len, kv_len = q_p.shape[0], k_p.shape[0]
        backend = self.prefill_backend
        key = (qo_len, kv_len, bool(causal), sm_scale, window_left, q_p.dtype, k_p.dtype, q_p.shape[1], k_p.shape[1],
               q_p.shape[2], backend, kv_layout_p)
        if custom_mask is None and packed_custom_mask is None and key == self._prefill_key:
            return
        self._no_plan_here(
            "PODWithPagedKVCacheWrapper.run() under torch.compile: the prefill's lengths or options differ from its "
            "last plan (or it has a custom mask); run it once eagerly with them first (Dynamo cannot trace plan())",
            "PODWithPagedKVCacheWrapper.run(): the prefill's lengths or options changed during CUDA-graph capture; "
            "run it once with them before capturing")
        self._pin_tile(q_p.shape[2])
        custom = custom_mask is not None or packed_custom_mask is not None
        expect_choice(backend, "prefill_backend", ("fa2", "auto", "fa3"))
        if backend == "fa3" and (custom or kv_layout_p != "NHD" or self._use_cuda_graph):
            raise ValueError("prefill_backend='fa3': the single-prefill POD on Hopper takes no custom mask, HND "
                             "k_p / v_p (kv_layout_p) or CUDA graphs yet; use 'auto' (the mma.sync POD there) or 'fa2'")
        # (POD on Hopper: NHD rows, no custom mask, eager; its module holds the 128-row tile)
        self._prefill._backend = "fa2" if custom or kv_layout_p != "NHD" or self._use_cuda_graph else backend
        self._prefill._force_query_tile = 128
        self._flops = prefill_flops([qo_len], [kv_len], bool(causal), q_p.shape[1], q_p.shape[2])
        self._prefill.plan(torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                           q_p.shape[1], k_p.shape[1], q_p.shape[2], custom_mask=custom_mask,
                           packed_custom_mask=packed_custom_mask, causal=bool(causal), window_left=window_left,
                           sm_scale=sm_scale, q_data_type=q_p.dtype, kv_data_type=k_p.dtype)
        self._replan_decode()
        self._plan_launch()
        self._prefill_key = None if custom else key

    def run(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p=None, packed_custom_mask_p=None,
            causal_p: bool = False, kv_layout_p: str = "NHD", pos_encoding_mode_p: str = "NONE", sm_scale_p=None,
            window_left_p: int = -1, rope_scale_p=None, rope_theta_p=None, return_lse_p: bool = False,
            custom_mask_d=None, packed_custom_mask_d=None, causal_d: bool = False, kv_layout_d: str = "NHD",
            pos_encoding_mode_d: str = "NONE", sm_scale_d=None, window_left_d: int = -1, rope_scale_d=None,
            rope_theta_d=None, q_scale=None, k_scale=None, v_scale=None, return_lse_d: bool = False,
            use_fp16_qk_reduction: bool = False, enable_pdl=None, *args):
        quick = self._quick
        if quick is not None and not compiling() and quick.key == (causal_p, sm_scale_p, window_left_p, kv_layout_p) \
                and custom_mask_p is None and packed_custom_mask_p is None and custom_mask_d is None and \
                packed_custom_mask_d is None and not causal_d and sm_scale_d is None and window_left_d == -1 and \
                kv_layout_d == self._kv_layout and pos_encoding_mode_p == "NONE" and pos_encoding_mode_d == "NONE" \
                and q_scale is None and k_scale is None and v_scale is None:
            # The common form of a recorded launch (see BatchPODWithPagedKVCacheWrapper.run)
            got = self._quick_run(quick, q_p, (k_p, v_p), q_d, paged_kv_cache_d, None, None, None, None, 0, 0,
                                  int(bool(return_lse_p)) | int(bool(return_lse_d)) << 1, enable_pdl)
            if got is not None:
                out_p, out_d, lse_p, lse_d = got
                return ((out_p, out_d), (lse_p, lse_d)) if return_lse_p or return_lse_d else (out_p, out_d)
        if self._decode._plan is None:
            raise RuntimeError("run() before plan(): call plan() with the decode batch's page table first")
        _no_rope(pos_encoding_mode_p, "pos_encoding_mode_p")
        _no_rope(pos_encoding_mode_d, "pos_encoding_mode_d")
        expect_choice(kv_layout_p, "kv_layout_p", ("NHD", "HND"))
        if kv_layout_d != self._kv_layout:
            raise ValueError(f"kv_layout_d: the decode cache's layout is the wrapper's ({self._kv_layout!r}), got "
                             f"{kv_layout_d!r}")
        if custom_mask_d is not None or packed_custom_mask_d is not None:
            raise ValueError("custom_mask_d: a decode row is one query that sees all its keys; no mask applies")
        if causal_d:
            raise NotImplementedError("causal_d=True: POD's decode side is non-causal (one query row a request, "
                                      "which sees all its keys); leave causal_d False")
        traced = self._decode._traced  # (plain values: what a run() under torch.compile reads too)
        _planned_decode_option("sm_scale_d", sm_scale_d, None, traced[8])
        _planned_decode_option("window_left_d", window_left_d, -1, traced[10])
        for name, t in (("q_p", q_p), ("k_p", k_p), ("v_p", v_p)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name}: expected a 3-D tensor ([tokens, heads, head_dim]; k_p/v_p HND: [heads, "
                                 f"tokens, head_dim])")
        # (the fast path's record: the tensors as given, K/V HND too, whose addresses are the
        # transposed views' own)
        plain = custom_mask_p is None and packed_custom_mask_p is None and sm_scale_d is None and \
            window_left_d == -1 and q_scale is None and k_scale is None and v_scale is None
        record = (q_p, (k_p, v_p), q_d, paged_kv_cache_d, None, None, None, None, 0, 0,
                  int(bool(return_lse_p)) | int(bool(return_lse_d)) << 1) if plain else None
        if kv_layout_p == "HND":
            k_p, v_p = k_p.transpose(0, 1), v_p.transpose(0, 1)
        self._plan_prefill(q_p, k_p, custom_mask_p, packed_custom_mask_p, causal_p, sm_scale_p, window_left_p,
                           kv_layout_p)
        if self._prefill.planned_backend == "fa3":  # POD on Hopper (FlashInfer's scales: the decode side's)
            (out_p, out_d), (lse_p, lse_d) = self._run_sm90(
                q_p, (k_p, v_p), q_d, paged_kv_cache_d, (None,) * 3, (q_scale, k_scale, v_scale), return_lse_p,
                return_lse_d, record=record, key=(causal_p, sm_scale_p, window_left_p, kv_layout_p))
            return ((out_p, out_d), (lse_p, lse_d)) if return_lse_p or return_lse_d else (out_p, out_d)
        spec = self._spec("ragged", q_p, q_d)
        out_p, lse_p, p_args = self._prefill._resolved_args(q_p, k_p, v_p, None, None, None, return_lse_p, None)
        out_d, lse_d, d_args = self._decode._resolved_args(q_d, paged_kv_cache_d, q_scale, k_scale, v_scale,
                                                           return_lse_d)
        self._launch(spec, p_args, d_args, enable_pdl, record, (causal_p, sm_scale_p, window_left_p, kv_layout_p))
        if return_lse_p or return_lse_d:
            return (out_p, out_d), (lse_p, lse_d)
        return out_p, out_d

    forward = run


class BatchPODWithPagedKVCacheWrapper(_Pod):
    """FlashInfer's batch POD wrapper: a batch of prefill requests and a batch of one-token
    decodes, both over paged caches (the same cache or two), in one launch.

    plan() takes both sides' page tables (FlashInfer's arguments). The prefill side's mask
    is a run() argument in FlashInfer (causal_p, custom masks), and a prefill plan depends on
    it: the prefill side is planned at plan() for `causal` (an argument FlashInfer does not
    have, default False) and again at the first run() with another mask. A CUDA-graph
    wrapper (use_cuda_graph=True, not in FlashInfer's batch POD) must pass plan() the
    causal_p its captured run() takes.

    run() returns (out_p, out_d), or ((out_p, out_d), (lse_p, lse_d)) with return_lse (as
    FlashInfer's code returns them; its docstring says otherwise). q_scale, k_scale and
    v_scale apply to both sides, since both read the paged caches (FlashInfer applies them
    to the decode side only)."""

    # the decode side's split-KV chunk in tokens (its plan()'s fixed_split_size): None, POD on
    # Hopper's rule (sm90_decode_split; the decode planner's own choice elsewhere); 0, the
    # decode planner's own choice; else pinned (benchmarks pin it)
    force_decode_split = None

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf_p=None, paged_kv_indptr_buf_p=None, paged_kv_indices_buf_p=None,
                 paged_kv_last_page_len_buf_p=None, paged_kv_indptr_buf_d=None, paged_kv_indices_buf_d=None,
                 paged_kv_last_page_len_buf_d=None):
        def prefill(ws):
            return BatchPrefillWithPagedKVCacheWrapper(
                ws, kv_layout, use_cuda_graph, qo_indptr_buf_p,
                paged_kv_indptr_buf_p, paged_kv_indices_buf_p, paged_kv_last_page_len_buf_p, backend="fa2")

        super().__init__(float_workspace_buffer, kv_layout, prefill,
                         (paged_kv_indptr_buf_d, paged_kv_indices_buf_d, paged_kv_last_page_len_buf_d), use_cuda_graph)
        self._prefill_args = None
        self._prefill_mask = None
        self._recipe = None  # what a plan() of the same configuration repeats (_replan), or None
        self._replans_record = not use_cuda_graph  # (a CUDA-graph wrapper's q rows may exceed the plan's)

    def plan(self, qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, qo_indptr_d, kv_indptr_d, kv_indices_d,
             last_page_len_d, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1, q_data_type="float16", kv_data_type=None,
             data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking: bool = True,
             causal: bool = False, *, block_tables_p=None, seq_lens_p=None, block_tables_d=None,
             seq_lens_d=None) -> None:
        """block_tables_p / seq_lens_p, block_tables_d / seq_lens_d (keywords, not in FlashInfer):
        a side's page table as block tables, vLLM's [B, max_pages] or TensorRT-LLM's
        [B, 2, max_pages] (K and V page ids), with its requests' KV lengths, in place of its
        CSR arguments (None). Both sides take one layout (one POD module reads both)."""
        # A plan of the previous plan's configuration (an engine's every step): planned again
        # from its recipe where it can be (_replan), else in full below
        key = self._plan_key(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                             q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta, non_blocking,
                             causal)
        recipe = self._recipe
        if recipe is not None and block_tables_p is None and block_tables_d is None and recipe[0] == key and \
                self._replan(recipe, qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, qo_indptr_d,
                             kv_indptr_d, kv_indices_d, last_page_len_d):
            return
        self._recipe = None
        _no_rope(pos_encoding_mode, "pos_encoding_mode")
        expect_bool(causal, "causal")
        tables = _side_tables(kv_indptr_p, kv_indices_p, last_page_len_p, block_tables_p, seq_lens_p,
                              kv_indptr_d, kv_indices_d, last_page_len_d, block_tables_d, seq_lens_d)
        # The two sides' work for the schedule, in C++ where the vectors are of plan()'s
        # common form (contiguous int32 CPU tensors): no numpy conversions (docs/pod.md "Host
        # time"); else read into numpy below, after the decode side's own checks.
        work = native_work(qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d, last_page_len_d, qo_indptr_d,
                           page_size) if tables is None else None
        if work is not None:
            decode_ok = work[3]
        elif qo_indptr_d is not None:
            d = host_index(qo_indptr_d, "qo_indptr_d")
            decode_ok = not bool((d[1:] - d[:-1] != 1).any())
        else:
            decode_ok = True
        if not decode_ok:
            raise ValueError("qo_indptr_d: the decode side takes one query token a request (qo_indptr_d = "
                             "arange(batch + 1)); put longer requests on the prefill side")
        q_dtype = data_type if q_data_type is None else q_data_type
        kv_dtype = kv_data_type if kv_data_type is not None else data_type
        # both sides' page orders in one launch, after both plans (also when one of them raises)
        orders = (self._decode._page_order, self._prefill._page_order)
        orders[0].defer = orders[1].defer = True
        try:
            self._prefill_args = (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, num_qo_heads,
                                  num_kv_heads, head_dim, page_size, window_left, sm_scale, q_dtype or "float16",
                                  kv_dtype, non_blocking, block_tables_p, seq_lens_p)
            if tables is not None:  # (block tables: the lengths are the seq_lens)
                decode_lens = tables[1]
                decode_keys, longest = int(decode_lens.sum()), int(np.maximum.reduce(decode_lens, initial=0))
                qo = host_index(qo_indptr_p, "qo_indptr_p")
                self._prefill_work = prefill_work(qo[1:] - qo[:-1], tables[0])
            elif work is None:
                decode_lens = csr_kv_lens(kv_indptr_d, last_page_len_d, page_size)
                decode_keys, longest = int(decode_lens.sum()), int(np.maximum.reduce(decode_lens, initial=0))
                qo = host_index(qo_indptr_p, "qo_indptr_p")
                self._prefill_work = prefill_work(qo[1:] - qo[:-1],
                                                  csr_kv_lens(kv_indptr_p, last_page_len_p, page_size))
            else:
                decode_keys, longest, self._prefill_work = work[2], work[4], work[:2]
            # the prefill side first: whether it runs the Hopper kernel sets the decode side's split
            self._prefill_mask = None
            self._plan_prefill_side(causal, None, None, in_run=False)
            split = self.force_decode_split
            if split is None:
                split = self._sm90_decode_split(longest, decode_keys, num_kv_heads, head_dim)
            self._decode.plan(kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads, head_dim,
                              page_size, window_left=window_left, q_data_type=q_data_type, kv_data_type=kv_data_type,
                              data_type=data_type, sm_scale=sm_scale, non_blocking=non_blocking,
                              fixed_split_size=split or None, block_tables=block_tables_d, seq_lens=seq_lens_d)
            c = self._decode._plan.config
            self._kv_bytes = float(decode_keys) * c.num_kv_heads * c.token_bytes
            self._plan_launch()
        finally:
            launch_pending(*orders)
        prefill, decode = self._prefill, self._decode
        if work is not None and not self._use_cuda_graph and prefill._plan is prefill._common_plan and \
                prefill._plan is not None and decode._native_planned and \
                all(type(v) in _PLAIN for v in key):
            # (what _replan repeats: both sides' configurations, the decode side's split-KV
            # chunk; the key's values plain, so that comparing keys is exact and cheap)
            # (the prefill side's plan arguments past its vectors: hq, hk, head_dim, page_size,
            # window, sm_scale, dtypes, non_blocking, as _plan_prefill_side reads them)
            self._recipe = (key, prefill._plan.config, c, split or None, bool(causal), self._prefill_args[4:13])

    def _plan_key(self, *scalars) -> tuple:
        """plan()'s scalar arguments past the page tables (num_qo_heads .. causal, in its order)
        and the switches its decisions read: a recipe repeats for an equal key."""
        return (*scalars, self.prefill_backend, self.tile_rows, self.force_decode_split, self._prefill._force_key_tile,
                self._prefill._force_copy)

    def _plan_again(self, key: tuple, work: tuple, qo_p, kv_p, ids_p, last_p, kv_d, ids_d, last_d) -> bool:
        """plan() of CSR tables of the common form from the last plan()'s recipe, with both
        sides' work already summed (pod_work's tuple: BatchAttention's cut, fij_fastcall
        pod_cut): _replan, or False (nothing changed) where there is no recipe of this key."""
        recipe = self._recipe
        return recipe is not None and recipe[0] == key and \
            self._replan(recipe, qo_p, kv_p, ids_p, last_p, None, kv_d, ids_d, last_d, work)

    def _replan(self, recipe: tuple, qo_p, kv_p, ids_p, last_p, qo_d, kv_d, ids_d, last_d,
                work: tuple | None = None) -> bool:
        """plan() again in the configuration of the plan that recorded `recipe` (POD on Hopper;
        both sides' CSR tables of the common form, contiguous int32 CPU vectors; an eager
        wrapper): each side planned by its wrapper's common-form planner (C++: the Hopper work
        list, the decode planner), with the same decisions as a full plan() (the "auto"
        backend's, the decode side's split-KV chunk), then made current as plan() makes them
        (_install_sm90, _install_native). False, having changed nothing a run() reads, where
        anything differs (another form of the vectors, a bad value, "auto" declining, another
        split): plan() then plans in full and raises its errors. 0.64-0.85x the full path's
        host time on the H200 host (docs/pod.md "Host time"). work: native_work's tuple of these
        tables where the caller has it (None: summed here)."""
        _, config_p, config_d, split, causal, scalars = recipe
        hq, hk, d, ps, nb = scalars[0], scalars[1], scalars[2], scalars[3], scalars[8]
        if work is None:
            work = native_work(qo_p, kv_p, last_p, kv_d, last_d, qo_d, ps)
        if work is None or not work[3]:
            return False
        prefill_work, decode_keys, longest = work[:2], work[2], work[4]
        flops = work_flops(prefill_work, causal, hq, d)
        if self.force_decode_split is None and self._sm90_decode_split(longest, decode_keys, hk, d, flops) != split:
            return False
        prefill, decode = self._prefill, self._decode
        # (the prefill side's kernel choice and tiles as _plan_prefill_side sets them: a run()
        # with a custom mask since may have changed them)
        backend = prefill._backend = self.prefill_backend
        self._pin_tile(d)
        prefill._force_query_tile = 128
        plan_p = prefill._sm90_plan_common(backend, config_p, qo_p, kv_p, last_p, ids_p, nb)
        if type(plan_p) is not Sm90Plan:  # ("auto" declines, or not the common form)
            return False
        native = decode._plan_native(config_d, "csr", kv_d, ids_d, last_d, None, None, ps)
        if native is None:
            return False
        orders = (decode._page_order, prefill._page_order)
        orders[0].defer = orders[1].defer = True
        try:
            prefill._install_sm90(plan_p)
            decode._install_native(config_d, "csr", native, ids_d, nb)
            self._prefill_args = (qo_p, kv_p, ids_p, last_p, *scalars, None, None)
            self._prefill_work, self._flops, self._prefill_mask = prefill_work, flops, causal
            self._kv_bytes = float(decode_keys) * config_d.num_kv_heads * config_d.token_bytes
            self._plan_launch()
        finally:
            launch_pending(*orders)
        return True

    begin_forward = plan

    def end_forward(self) -> None:
        pass

    def _plan_prefill(self, causal: bool, custom_mask, packed_custom_mask) -> None:
        """run(): the prefill side planned again where its mask differs from the plan's (the
        decode side's plan stays), then the launch's schedule."""
        custom = custom_mask is not None or packed_custom_mask is not None
        if not custom and self._prefill_mask == bool(causal):
            return
        self._plan_prefill_side(causal, custom_mask, packed_custom_mask, in_run=True)
        self._plan_launch()

    def _plan_prefill_side(self, causal: bool, custom_mask, packed_custom_mask, in_run: bool) -> None:
        custom = custom_mask is not None or packed_custom_mask is not None
        if in_run:  # (plan() itself is neither traced nor captured)
            self._no_plan_here(
                "BatchPODWithPagedKVCacheWrapper.run() under torch.compile: causal_p or a custom mask differs from "
                "what plan() planned; pass plan() causal=causal_p (Dynamo cannot trace plan())",
                "BatchPODWithPagedKVCacheWrapper.run(): causal_p or a custom mask differs from what plan() planned, "
                "during CUDA-graph capture; pass plan() causal=causal_p")
        qo, kv, ids, last, hq, hk, d, ps, window, sm_scale, q_dtype, kv_dtype, nb, blocks, lens = self._prefill_args
        self._pin_tile(d)
        backend = self.prefill_backend
        expect_choice(backend, "prefill_backend", ("fa2", "auto", "fa3"))
        if backend == "fa3" and custom:
            raise ValueError("prefill_backend='fa3': POD on Hopper takes no custom mask yet; use 'auto' (the "
                             "mma.sync POD there) or 'fa2'")
        # (a CUDA-graph wrapper's prefill side keeps its first plan's kernel: a captured run()
        # replays that launch)
        self._prefill._backend = backend if not custom else "fa2"
        self._prefill._force_query_tile = 128  # (POD on Hopper's module holds the 128-row tile)
        self._flops = work_flops(self._prefill_work, bool(causal) and not custom, hq, d)
        self._prefill.plan(qo, kv, ids, last, hq, hk, d, ps, custom_mask=custom_mask,
                           packed_custom_mask=packed_custom_mask, causal=bool(causal), window_left=window,
                           sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype, non_blocking=nb,
                           sort_pages=not custom, block_tables=blocks, seq_lens=lens)
        self._prefill_mask = None if custom else bool(causal)


    def run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p=None, packed_custom_mask_p=None,
            causal_p: bool = False, q_scale=None, k_scale=None, v_scale=None, return_lse: bool = False,
            use_fp16_qk_reduction: bool = False, enable_pdl=None):
        quick = self._quick
        if quick is not None and not compiling() and quick.key == causal_p and custom_mask_p is None and packed_custom_mask_p is None \
                and q_scale is None and k_scale is None and v_scale is None:
            # The common form of a recorded launch: fij_fastcall checks in C++ that the tensors
            # are of its signature and relaunches it (None: they are not; the op below)
            got = self._quick_run(quick, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, None, None, None, None, 0, 0,
                                  3 if return_lse else 0, enable_pdl)
            if got is not None:
                out_p, out_d, lse_p, lse_d = got
                return ((out_p, out_d), (lse_p, lse_d)) if return_lse else (out_p, out_d)
        if self._prefill_args is None:
            raise RuntimeError("run() before plan(): call plan() with both sides' page tables first")
        self._plan_prefill(causal_p, custom_mask_p, packed_custom_mask_p)
        if type(paged_kv_cache_p) is tuple and len(paged_kv_cache_p) == 2:
            k_p, v_p = paged_kv_cache_p
        else:
            k_p, v_p, _ = unpack_paged_kv_cache(paged_kv_cache_p, self._kv_layout)
        plain = custom_mask_p is None and packed_custom_mask_p is None and q_scale is None and k_scale is None and \
            v_scale is None
        record = (q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, None, None, None, None, 0, 0,
                  3 if return_lse else 0) if plain else None
        (out_p, out_d), (lse_p, lse_d) = self._run_into(q_p, (k_p, v_p), q_d, paged_kv_cache_d, q_scale, k_scale,
                                                        v_scale, return_lse, enable_pdl, record=record,
                                                        key=bool(causal_p))
        if return_lse:
            return (out_p, out_d), (lse_p, lse_d)
        return out_p, out_d

    def _run_into(self, q_p, kv_p: tuple, q_d, paged_kv_cache_d, q_scale, k_scale, v_scale, return_lse, enable_pdl,
                  out_p=None, lse_p=None, out_d=None, lse_d=None, record=None, key=None) -> tuple:
        """The launch of the planned batch; outputs allocated, or the given tensors (rows of a
        mixed batch's outputs: BatchAttention). record, key: _launch's (run()'s fast path)."""
        if self._prefill.planned_backend == "fa3":
            scales = (q_scale, k_scale, v_scale)
            return self._run_sm90(q_p, kv_p, q_d, paged_kv_cache_d, scales, scales, return_lse, return_lse, out_p,
                                  lse_p, out_d, lse_d, record, key)
        spec = self._spec("paged", q_p, q_d)
        out_p, lse_p, p_args = self._prefill._resolved_args(q_p, *kv_p, q_scale, k_scale, v_scale, return_lse, None,
                                                            out_p, lse_p)
        out_d, lse_d, d_args = self._decode._resolved_args(q_d, paged_kv_cache_d, q_scale, k_scale, v_scale,
                                                           return_lse, out_d, lse_d)
        self._launch(spec, p_args, d_args, enable_pdl, record, key)
        return (out_p, out_d), (lse_p, lse_d)

    forward = run

