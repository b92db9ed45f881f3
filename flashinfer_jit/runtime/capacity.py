"""Buffer sizes of a wrapper, and the CUDA-graph rules on them.

A graph captured around run() keeps the address and size of every buffer its launch reads.
So a CUDA-graph wrapper sizes its buffers at its first plan() (that plan's batch is its
capacity) and later plans fill them, never grow or move them. Other wrappers grow theirs to
the next power of two, so a growing batch reallocates a few times only.
"""

from __future__ import annotations


def grown_size(need: int, floor: int = 4096) -> int:
    """Elements of a buffer that may grow and must hold `need`: a power of two, >= floor."""
    return max(floor, 1 << max(need - 1, 0).bit_length())


def graph_capacity(capacity: int | None, batch: int) -> int:
    """A CUDA-graph wrapper's capacity after a plan of `batch` requests (capacity: before
    it, None until the first plan)."""
    if capacity is None:
        return batch
    if batch > capacity:
        raise ValueError(f"batch size {batch} exceeds the {capacity} requests this CUDA-graph wrapper was first "
                         "planned (captured) with")
    return capacity


def cannot_grow(what: str) -> ValueError:
    return ValueError(f"a CUDA-graph wrapper cannot grow its {what} after the first plan()")


def heads_fixed() -> ValueError:
    """A plan whose heads need other buffer sizes than the captured ones."""
    return ValueError("a CUDA-graph wrapper keeps its head configuration; make a new wrapper")
