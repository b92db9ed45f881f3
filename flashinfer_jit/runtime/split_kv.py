"""Where split-KV's partial states and merge counters live, for every attention family.

A request whose keys plan() splits into chunks writes one partial output and LSE per
chunk (a partial row: per query token, or (token, head) row, and chunk), merged into the
output afterwards, inside the kernel by the last block of the request to finish: that
block is found through int32 counters, zero between launches (the kernel resets them).

- Partial outputs: float32 [rows, heads, head_dim], a view of the caller's
  float_workspace_buffer (FlashInfer's meaning of that buffer); the rows a plan may use are
  as many as the workspace holds of output and LSE together (rows()), so a larger
  workspace allows longer splits.
- Partial LSEs: float32 [rows, heads] in a buffer of the wrapper's own, not in the
  workspace: a run() under torch.compile hands the op both as mutated inputs, and two
  mutated views of one buffer become a synthetic base that the graph copies whole (and,
  seen with torch 2.11's inductor, read past its end).
- Merge counters: zeros. The LSE buffer and the counters grow to the next power of two and
  are kept from plan to plan.

A CUDA-graph wrapper sizes the LSE buffer and the counters at its first plan and cannot
grow them later (capacity.py): a captured launch holds their addresses.
"""

from __future__ import annotations

import torch

from .capacity import cannot_grow, grown_size, heads_fixed


class SplitBuffers:
    """A wrapper's partial states and merge counters (one per wrapper, on its device)."""

    __slots__ = ("_workspace", "_device", "_graph", "_lse", "counters")

    def __init__(self, float_workspace_buffer: torch.Tensor, graph: bool):
        ws = float_workspace_buffer
        nbytes = ws.numel() * ws.element_size()
        # the workspace as float32 (None where it is not contiguous: no partial rows)
        self._workspace = ws.reshape(-1).view(torch.uint8)[: nbytes // 4 * 4].view(torch.float32) \
            if ws.is_contiguous() else None
        self._device, self._graph = ws.device, graph
        self._lse = None
        self.counters = None  # the merge counters, allocated at the first plan that needs them

    def rows(self, heads: int, head_dim: int) -> int:
        """Partial rows the workspace holds: float32 o [heads, head_dim] and lse [heads] each
        (the LSEs are counted though they live apart, so a plan is the same whatever buffer
        holds them)."""
        if self._workspace is None:
            return 0
        return self._workspace.numel() // (heads * (head_dim + 1))

    def views(self, rows: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial o [rows, heads, head_dim] in the workspace, partial lse [rows, heads]);
        rows at most rows(heads, head_dim)."""
        ws = self._workspace if self._workspace is not None else torch.empty(0, device=self._device)
        o = ws[: rows * heads * head_dim].view(rows, heads, head_dim)
        need = rows * heads
        lse = self._lse
        if lse is None or lse.numel() < need:
            if lse is not None and self._graph:
                raise heads_fixed()
            size = need if self._graph else grown_size(need)
            lse = self._lse = torch.empty(size, dtype=torch.float32, device=self._device)
        return o, lse[:need].view(rows, heads)

    def merge_counters(self, size: int) -> torch.Tensor:
        """Zeroed int32 counters, at least `size` (one per split tile or request and KV head,
        as the family's op checks), the same tensor from plan to plan while it is large
        enough (the kernel leaves them at zero)."""
        counters = self.counters
        if counters is None or counters.numel() < size:
            if counters is not None and self._graph:
                raise cannot_grow("merge counters")
            counters = self.counters = torch.zeros(grown_size(size), dtype=torch.int32, device=self._device)
        return counters
