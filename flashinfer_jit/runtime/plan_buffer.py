"""The packed plan buffer: everything one plan() ships to the device (work list, merge
index, page-table arrays), in one pinned host buffer and one host-to-device copy.

A family lays out its buffer (decode: decode._offsets) and fills a host slot; a PlanBuffer,
one per wrapper and so per device, owns the two pinned host slots, the device buffer and
the views of it. It runs in plan() on every step of a serving engine, so it keeps what it
can: the slots (pinning per plan() would cost more than the plan), the copy's source and
destination views, and the device views while the offsets stay. On a GPU the copy and the
event after it are one C call (the page-order module's ship, page_order.shipper): torch's
copy_ and Event.record took ~8 us of host time a plan buffer on the H200 host.
"""

from __future__ import annotations

import ctypes

import torch

from .capacity import cannot_grow, grown_size
from .device import new_event, raw_stream
from .page_order import shipper


_COPY_STEP = 2048  # int32s: ship() copies whole steps (8 KB)


class RawEvent:
    """A CUDA event of the page-order module's entries (page_order.shipper), which its ship
    records after a copy: the query() and synchronize() of torch's events."""

    __slots__ = ("handle", "entries")

    def __init__(self, entries, device: torch.device):
        out = ctypes.c_void_p()
        code = entries[1](device.index or 0, ctypes.byref(out))
        if code:
            raise RuntimeError(f"plan buffer: cudaEventCreate: CUDA error {code} ({entries[5](code).decode()})")
        self.handle, self.entries = out.value, entries

    def query(self) -> bool:
        code = self.entries[2](self.handle)
        if code in (0, _NOT_READY):
            return code == 0
        raise RuntimeError(f"plan buffer: cudaEventQuery: CUDA error {code} ({self.entries[5](code).decode()})")

    def synchronize(self) -> None:
        code = self.entries[3](self.handle)
        if code:
            raise RuntimeError(f"plan buffer: cudaEventSynchronize: CUDA error {code} "
                               f"({self.entries[5](code).decode()})")

    def __del__(self):
        try:
            self.entries[4](self.handle)
        except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone first
            pass


_NOT_READY = 600  # cudaErrorNotReady


class HostSlot:
    """A pinned host buffer (tensor, its numpy view and address), the event of the last
    copy from it (pending until seen complete) and that copy's source and destination views
    (and the destination's address, for the C copy)."""

    __slots__ = ("tensor", "array", "address", "event", "pending", "copy_end", "copy_buf", "copy_src", "copy_dst",
                 "copy_dst_address", "raw")


class PlanBuffer:
    """fixed (a CUDA-graph wrapper): the device buffer is sized at the first ship(), exactly,
    and cannot grow after it (see capacity)."""

    __slots__ = ("device", "fixed", "slots", "turn", "buf", "end", "views_key", "views_buf", "views_made")

    def __init__(self, device: torch.device, fixed: bool):
        self.device, self.fixed = device, fixed
        self.slots = [None, None]
        self.turn = 0
        self.buf = None  # the device side
        self.end = 0  # the last ship()'s end: what it holds of the plan (it may copy past it)
        self.views_key = self.views_buf = self.views_made = None

    def host(self, size: int) -> HostSlot:
        """One of the two pinned host slots, in turn, holding at least `size` int32s: plan()
        fills one while the copy from the other may still be in flight, so it waits only if
        the copy made two plans ago is still queued (the GPU more than a whole step behind)."""
        self.turn ^= 1
        slot = self.slots[self.turn]
        if slot is not None and slot.pending:
            if not slot.event.query():
                slot.event.synchronize()
            slot.pending = False
        if slot is None or slot.tensor.numel() < size:
            cuda = self.device.type == "cuda"
            slot = HostSlot()
            slot.tensor = torch.empty(grown_size(size), dtype=torch.int32, pin_memory=cuda)
            slot.array = slot.tensor.numpy()
            slot.address = slot.tensor.data_ptr()
            entries = shipper() if cuda else None
            slot.raw = entries[0] if entries is not None else None
            slot.event = (RawEvent(entries, self.device) if entries is not None else new_event(self.device)) \
                if cuda else None
            slot.pending, slot.copy_end, slot.copy_buf = False, None, None
            self.slots[self.turn] = slot
        return slot

    def regrow(self, size: int) -> HostSlot:
        """The slot host() gave last, again, holding at least `size` (a planner that found
        it too small)."""
        self.turn ^= 1
        return self.host(size)

    def give_back(self) -> None:
        """The slot host() gave last goes unused: the next host() gives it again."""
        self.turn ^= 1

    def ship(self, slot: HostSlot, end: int, non_blocking: bool) -> None:
        """The one host-to-device copy of plan(), of the slot's first `end` elements, between
        views kept while the size and the device buffer stay. The event tells a later plan()
        when the slot is free."""
        buf = self.buf
        if buf is None or buf.numel() < end:
            if self.fixed and buf is not None:
                raise cannot_grow("plan buffers")
            buf = self.buf = torch.empty(end if self.fixed else grown_size(end), dtype=torch.int32,
                                         device=self.device)
        # (the copy runs to the next _COPY_STEP boundary, within both buffers: its views then
        # stay while plans of one batch size differ in items, instead of two slices a plan,
        # ~3 us of host time on the GPU host; what lies past `end` is never read)
        if slot.copy_buf is not buf or not end <= slot.copy_end < end + _COPY_STEP:
            n = min(-(-end // _COPY_STEP) * _COPY_STEP, slot.tensor.numel(), buf.numel())
            slot.copy_end, slot.copy_buf, slot.copy_src, slot.copy_dst = n, buf, slot.tensor[:n], buf[:n]
            slot.copy_dst_address = buf.data_ptr()
        self.end = end
        if non_blocking and slot.raw is not None:  # the copy and its event in one C call
            index = self.device.index or 0
            code = slot.raw(slot.copy_dst_address, slot.address, 4 * slot.copy_end, raw_stream(index), index,
                            slot.event.handle)
            if code:
                raise RuntimeError(f"plan buffer: cudaMemcpyAsync: CUDA error {code} "
                                   f"({slot.event.entries[5](code).decode()})")
            slot.pending = True
            return
        slot.copy_dst.copy_(slot.copy_src, non_blocking=non_blocking)
        if non_blocking and slot.event is not None:
            if torch.cuda.current_device() == self.device.index:
                slot.event.record()
            else:  # the copy ran on the buffer's device's stream: record there, not on the current device's
                with torch.cuda.device(self.device):
                    slot.event.record()
            slot.pending = True

    def views(self, key, carve):
        """carve(device buffer, key): the family's views of the device buffer for a layout
        `key` (its offsets), made again only when the key or the buffer change (slicing a
        CUDA tensor costs 1.5 us on the GPU host)."""
        buf = self.buf
        if key != self.views_key or buf is not self.views_buf:
            self.views_made = carve(buf, key)
            self.views_key, self.views_buf = key, buf
        return self.views_made
