"""The shared host layer on the CPU (no GPU, no build): the packed plan buffer's host slots
and device buffer (plan_buffer), the buffer-size and CUDA-graph capacity rules (capacity),
the ctypes loading of C entry points (native) and the device facts' CPU answers (device).
Decode's tests cover them again through plan() and run()."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from flashinfer_jit.runtime import capacity, device, native
from flashinfer_jit.runtime.plan_buffer import PlanBuffer

CPU = torch.device("cpu")


class FakeEvent:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True


def test_host_slots_alternate_and_grow():
    pb = PlanBuffer(CPU, fixed=False)
    a, b = pb.host(10), pb.host(10)
    assert a is not b and pb.host(10) is a and pb.host(10) is b
    assert a.tensor.numel() == 4096 and a.event is None and not a.tensor.is_pinned()
    assert a.address == a.tensor.data_ptr() and a.array.shape == (4096,)
    grown = pb.host(5000)  # a's turn: a new slot of the next power of two takes its place
    assert grown is not a and grown.tensor.numel() == 8192 and pb.slots == [b, grown]
    again = pb.regrow(20000)  # the slot just given, grown; the turn stays
    assert again.tensor.numel() == 32768 and pb.slots == [b, again]
    assert pb.host(10) is b


def test_host_slot_waits_only_for_a_copy_still_queued():
    pb = PlanBuffer(CPU, fixed=False)
    a, b = pb.host(10), pb.host(10)
    a.event, a.pending = FakeEvent(done=True), True
    b.event, b.pending = FakeEvent(done=False), True
    assert pb.host(10) is a and not a.pending and not a.event.waited
    assert pb.host(10) is b and not b.pending and b.event.waited


def test_ship_copies_into_a_device_buffer_that_grows_unless_fixed():
    pb = PlanBuffer(CPU, fixed=False)
    slot = pb.host(6000)
    slot.array[:6000] = range(6000)
    pb.ship(slot, 10, non_blocking=True)
    first = pb.buf
    assert first.numel() == 4096 and torch.equal(first[:10], torch.arange(10, dtype=torch.int32))
    pb.ship(slot, 5000, non_blocking=False)
    assert pb.buf is not first and pb.buf.numel() == 8192 and int(pb.buf[4999]) == 4999

    fixed = PlanBuffer(CPU, fixed=True)
    slot = fixed.host(20)
    fixed.ship(slot, 12, non_blocking=True)
    assert fixed.buf.numel() == 12
    fixed.ship(slot, 12, non_blocking=True)  # the same size: the same buffer
    with pytest.raises(ValueError, match="cannot grow its plan buffers after the first plan"):
        fixed.ship(slot, 13, non_blocking=True)


def test_views_are_carved_again_only_for_a_new_key_or_buffer():
    pb = PlanBuffer(CPU, fixed=False)
    carved = []

    def carve(buf, key):
        carved.append(key)
        return buf[: key[0]], buf[key[0]: key[1]]

    slot = pb.host(10)
    pb.ship(slot, 10, non_blocking=False)
    first = pb.views((2, 5), carve)
    assert pb.views((2, 5), carve) is first and carved == [(2, 5)] and pb.views_key == (2, 5)
    assert pb.views((3, 5), carve)[0].numel() == 3 and len(carved) == 2
    pb.ship(pb.host(9000), 9000, non_blocking=False)  # a new device buffer
    views = pb.views((3, 5), carve)
    assert len(carved) == 3 and views[0].data_ptr() == pb.buf.data_ptr()


def test_capacity_rules():
    assert [capacity.grown_size(n) for n in (0, 1, 4096, 4097)] == [4096, 4096, 4096, 8192]
    assert capacity.grown_size(3, floor=1024) == 1024
    assert capacity.graph_capacity(None, 7) == 7 and capacity.graph_capacity(7, 3) == 7
    with pytest.raises(ValueError, match="batch size 8 exceeds the 7 requests"):
        capacity.graph_capacity(7, 8)
    assert "merge counters" in str(capacity.cannot_grow("merge counters"))


class Mirror(ctypes.Structure):
    _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_int64)]


class FakeModule:
    def __init__(self, struct_bytes: int):
        self.struct_bytes = struct_bytes

    def params_bytes(self):
        return self.struct_bytes


class FakeLibrary:
    class ns_run:  # stands for a ctypes function: takes argtypes / restype
        pass


def test_ctypes_entry_checks_the_struct_size_against_the_mirror(monkeypatch):
    monkeypatch.setattr(native, "module_library", lambda spec: (FakeLibrary, "ns"))
    monkeypatch.setattr(native, "get_module", lambda spec: FakeModule(ctypes.sizeof(Mirror)))
    fn = native.ctypes_entry("spec", "run", [ctypes.c_void_p], ctypes.c_int, Mirror, "params_bytes")
    assert fn is FakeLibrary.ns_run and fn.argtypes == [ctypes.c_void_p] and fn.restype is ctypes.c_int
    monkeypatch.setattr(native, "get_module", lambda spec: FakeModule(ctypes.sizeof(Mirror) + 8))
    with pytest.raises(RuntimeError, match=f"24 bytes, the ctypes mirror Mirror {ctypes.sizeof(Mirror)}"):
        native.ctypes_entry("spec", "run", [ctypes.c_void_p], ctypes.c_int, Mirror, "params_bytes")


def test_optional_entry_warns_and_falls_back():
    assert native.optional_entry(lambda: 3, "plan() does without", "the helper") == 3

    def broken():
        raise RuntimeError("no compiler")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.optional_entry(broken, "plan() runs its numpy path", "the C++ planner x") is None
    assert [str(w.message) for w in caught] == [
        "flashinfer_jit: plan() runs its numpy path (the C++ planner x is unavailable: RuntimeError: no compiler)"]
    assert caught[0].category is RuntimeWarning


def test_device_facts_on_the_cpu():
    assert not device.supports_pdl(CPU) and not device.supports_clusters("cpu")
    assert device.peak_dram_bytes_per_s(CPU) is None
    empty = device.empty_f32(CPU)
    assert device.empty_f32(CPU) is empty and empty.numel() == 0 and empty.dtype == torch.float32


def test_remembered_checks_once_per_typed_argument_set():
    from flashinfer_jit.runtime.checks import remembered

    calls = []

    def check(*args):
        calls.append(args)
        return object()

    cache = {}
    first = remembered(cache, (1, "NONE"), check, limit=2)
    assert remembered(cache, (1, "NONE"), check, limit=2) is first and len(calls) == 1
    assert remembered(cache, (True, "NONE"), check, limit=2) is not first  # 1 == True, but not the same type
    remembered(cache, ([1], "NONE"), check, limit=2)  # unhashable: checked, not cached
    assert len(calls) == 3 and len(cache) == 2
    remembered(cache, (2, "NONE"), check, limit=2)  # past the limit: the cache starts over
    assert len(cache) == 1


def test_sm_count_off_cuda_is_the_h100s():
    assert device.sm_count(CPU) == device.CPU_SMS == 132


def test_dtype_arguments_parse_once_for_every_family():
    from flashinfer_jit.runtime.checks import as_dtype

    assert as_dtype(torch.bfloat16, "q_data_type") is torch.bfloat16
    assert as_dtype("float16", "q_data_type") is as_dtype("torch.float16", "q_data_type") is torch.float16
    assert as_dtype(None, "kv_data_type", torch.float8_e4m3fn) is torch.float8_e4m3fn
    assert as_dtype(None, "q_data_type", "bfloat16") is torch.bfloat16
    assert as_dtype(None, "data_type") is None
    for bad in ("float17", 3, "cuda", object()):  # not a dtype: TypeError, as FlashInfer's canonicalize_torch_dtype
        with pytest.raises(TypeError, match="q_data_type: expected a torch dtype or its name"):
            as_dtype(bad, "q_data_type")


def test_both_families_reject_a_non_dtype_with_one_type():
    import flashinfer_jit as fij

    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(TypeError, match="q_data_type"):
        fij.BatchDecodeWithPagedKVCacheWrapper(ws).plan(i32([0, 1]), i32([0]), i32([1]), 8, 8, 128, 16,
                                                        q_data_type="float17")
    with pytest.raises(TypeError, match="q_data_type"):
        fij.BatchPrefillWithRaggedKVCacheWrapper(ws).plan(i32([0, 1]), i32([0, 1]), 8, 8, 128,
                                                          q_data_type="float17")


def test_split_buffers_views_counters_and_graph_rule():
    from flashinfer_jit.runtime.split_kv import SplitBuffers

    ws = torch.zeros(3 * 8 * (64 + 1) * 4 + 10, dtype=torch.uint8)
    split = SplitBuffers(ws, graph=False)
    assert split.rows(8, 64) == 3  # o [8, 64] and lse [8] of float32 a row, the LSEs counted too
    o, lse = split.views(3, 8, 64)
    assert o.shape == (3, 8, 64) and o.dtype == torch.float32 and o.data_ptr() == ws.data_ptr()
    assert lse.shape == (3, 8) and lse.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr()
    counters = split.merge_counters(10)
    assert split.merge_counters(10) is counters and counters.numel() >= 10 and not counters.any()
    assert split.merge_counters(capacity.grown_size(10) + 1) is not counters  # grown where eager
    fixed = SplitBuffers(ws, graph=True)
    fixed.views(2, 8, 64)
    fixed.merge_counters(10)
    with pytest.raises(ValueError, match="head configuration"):
        fixed.views(3, 8, 64)
    with pytest.raises(ValueError, match="merge counters"):
        fixed.merge_counters(capacity.grown_size(10) + 1)
    assert SplitBuffers(torch.zeros(64, 64, dtype=torch.uint8)[:, ::2], graph=False).rows(8, 64) == 0


def test_graph_page_ids_take_the_callers_buffer_or_one_of_the_first_plan():
    from flashinfer_jit.runtime.graph_ids import GraphPageIds

    given = torch.zeros(8, dtype=torch.int32)
    ids = GraphPageIds(CPU, given, "paged_kv_indices_buffer")
    assert ids.fill_indices(torch.arange(5, dtype=torch.int32), "indices") is given
    assert given[:5].tolist() == list(range(5))
    with pytest.raises(ValueError, match=r"indices: 9 page ids exceed the 8 that paged_kv_indices_buffer holds"):
        ids.fill_indices(torch.arange(9, dtype=torch.int32), "indices")
    own = GraphPageIds(CPU, None, "paged_kv_indices_buf")
    first = own.fill_indices(torch.arange(6, dtype=torch.int32), "paged_kv_indices")
    assert own.fill_indices(torch.arange(4, dtype=torch.int32), "paged_kv_indices") is first  # never re-allocated
    with pytest.raises(ValueError, match="paged_kv_indices: 7 page ids exceed the 6 .*paged_kv_indices_buf"):
        own.fill_indices(torch.arange(7, dtype=torch.int32), "paged_kv_indices")
    tables = own.fill_block_tables(torch.ones(2, 5, dtype=torch.int32), capacity=4)
    assert tables.shape == (4, 5) and own.fill_block_tables(torch.ones(4, 5, dtype=torch.int32), 4) is tables
    for bad in (torch.ones(5, 5, dtype=torch.int32), torch.ones(2, 6, dtype=torch.int32)):
        with pytest.raises(ValueError, match="block_tables: shape .* does not fit"):
            own.fill_block_tables(bad, 4)


def test_block_tables_parse_once_for_every_family():
    from flashinfer_jit.runtime.page_table import expect_one_page_table, parse_block_tables

    seq = torch.tensor([3, 4], dtype=torch.int32)
    layout, bt = parse_block_tables(torch.zeros(2, 3, dtype=torch.int64), seq)
    assert layout == "block_table" and bt.dtype == torch.int32
    assert parse_block_tables(torch.zeros(2, 2, 3, dtype=torch.int32), seq)[0] == "block_table_kv_separate"
    with pytest.raises(ValueError, match="block_tables: expected .*2, max_pages"):
        parse_block_tables(torch.zeros(2, 3, 3, dtype=torch.int32), seq)
    with pytest.raises(ValueError, match="max_pages dimension must be contiguous"):
        parse_block_tables(torch.zeros(2, 6, dtype=torch.int32)[:, ::2], seq)
    with pytest.raises(ValueError, match=r"seq_lens: expected \[3\]"):
        parse_block_tables(torch.zeros(3, 2, dtype=torch.int32), seq)
    with pytest.raises(TypeError, match="block_tables"):
        parse_block_tables([[0, 1]], seq)
    with pytest.raises(ValueError, match="give either indptr/indices/last_page_len or block_tables/seq_lens"):
        expect_one_page_table("indptr/indices/last_page_len", True)


def test_prefill_graph_wrapper_allocates_its_page_ids_without_a_buffer():
    """FlashInfer's rule in both families: the constructor's paged_kv_indices_buf where given,
    else a buffer of the first plan, which a later plan must fit."""
    import flashinfer_jit as fij

    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w = fij.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), use_cuda_graph=True)
    args = (32, 8, 128, 16)
    w.plan(i32([0, 3, 6]), i32([0, 2, 4]), i32([5, 6, 7, 8]), i32([5, 5]), *args, causal=True)
    assert w._plan.args[0][1] is w._graph_ids.indices and w._graph_ids.indices.tolist() == [5, 6, 7, 8]
    w.plan(i32([0, 3]), i32([0, 1]), i32([9]), i32([5]), *args, causal=True)
    assert w._plan.args[0][1] is w._graph_ids.indices and w._graph_ids.indices[0] == 9
    with pytest.raises(ValueError, match="paged_kv_indices: 5 page ids exceed the 4"):
        w.plan(i32([0, 3, 6]), i32([0, 2, 5]), i32(list(range(5))), i32([5, 5]), *args, causal=True)
