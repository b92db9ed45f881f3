"""The page ids a CUDA-graph wrapper's captured run() reads, for every attention family.

A graph holds the address of every tensor its launch reads, so a CUDA-graph wrapper keeps
its page ids (CSR indices, or block tables) in one fixed buffer and each plan() copies
that plan's ids into it. The rule is FlashInfer's: the caller's buffer where the
constructor takes one (decode's paged_kv_indices_buffer, prefill's paged_kv_indices_buf),
otherwise one allocated at the first plan, sized to it (its page count; block tables: its
capacity in rows, and its width), and never re-allocated: a later plan that does not fit
is a ValueError naming the argument. The copy is skipped where the ids given already are
the buffer's start (engines fill the buffer in place and pass a slice of it).
"""

from __future__ import annotations

import torch

from .checks import expect_page_table_buffer


class GraphPageIds:
    """A CUDA-graph wrapper's fixed page-id buffers (one per wrapper, on its device).
    given_indices: the constructor's indices buffer or None; buffer_arg: that argument's
    name, for the errors."""

    __slots__ = ("device", "indices", "block_tables", "buffer_arg", "given")

    def __init__(self, device: torch.device, given_indices: torch.Tensor | None, buffer_arg: str):
        self.device = device
        self.indices, self.given = given_indices, given_indices is not None
        self.buffer_arg = buffer_arg
        self.block_tables = None

    @classmethod
    def from_constructor(cls, device: torch.device, names: tuple, buffers: tuple) -> GraphPageIds:
        """The page-id buffers of a wrapper whose constructor took FlashInfer's three
        page-table buffers (indptr, indices, last_page_len; None where not given), each
        checked. Only the indices buffer is kept: the indptr and last_page_len arrays
        travel in the plan buffer, whose address the graph holds already."""
        for name, buf in zip(names, buffers):
            expect_page_table_buffer(buf, name, device)
        return cls(device, buffers[1], names[1])

    def fill_indices(self, ids: torch.Tensor, name: str) -> torch.Tensor:
        """The indices buffer holding `ids` (plan()'s argument `name`, any device) at its start."""
        fixed = self.indices
        if fixed is None:
            fixed = self.indices = torch.empty(ids.numel(), dtype=torch.int32, device=self.device)
        n = ids.numel()
        if n > fixed.numel():
            holder = self.buffer_arg if self.given else \
                f"the buffer of the first plan() (pass {self.buffer_arg} sized for the most pages a plan will use)"
            raise ValueError(f"{name}: {n} page ids exceed the {fixed.numel()} that {holder} holds")
        in_place = ids.data_ptr() == fixed.data_ptr() and ids.device == fixed.device and (n < 2 or ids.stride(0) == 1)
        if not in_place:
            fixed[:n].copy_(ids, non_blocking=True)
        return fixed

    def fill_block_tables(self, block_tables: torch.Tensor, capacity: int | None) -> torch.Tensor:
        """The block-table buffer holding `block_tables` ([batch, max_pages] or [batch, 2,
        max_pages], any device) in its first rows; allocated at the first plan with
        `capacity` rows (None: the plan's own)."""
        fixed = self.block_tables
        if fixed is None:
            rows = max(capacity or 0, block_tables.shape[0])
            fixed = self.block_tables = torch.zeros((rows, *block_tables.shape[1:]), dtype=torch.int32,
                                                    device=self.device)
        if block_tables.shape[1:] != fixed.shape[1:] or block_tables.shape[0] > fixed.shape[0]:
            raise ValueError(f"block_tables: shape {tuple(block_tables.shape)} does not fit the CUDA-graph buffer "
                             f"{tuple(fixed.shape)} of the first plan() (later plans may have fewer rows, of the "
                             "same width)")
        fixed[: block_tables.shape[0]].copy_(block_tables, non_blocking=True)
        return fixed
