"""A whole attention layer step in one CUDA graph (scripts/layer_step.py: RoPE + fp8
quantize + append, decode, prefill over the cache just written), captured once at a padded
size and replayed after plan() of other batches: fewer requests, other lengths, padding
tokens (batch_indices == -1), prefill requests with no new tokens, a side with no request.
Each replay equals the eager step (plain wrappers, tensors of the live size) on the same
data: the caches byte for byte, the outputs within bf16 rounding; the eager step equals a
float64 reference of attention over the cache, and the cache rows it wrote equal the
reference RoPE + fp8 quantization of the new keys and values."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from layer_step import FP8, PAGE, Batch, LayerStep, llama8b_batch, verify  # noqa: E402


def _rounds() -> list[Batch]:
    rnd = random.Random(5)
    return [
        llama8b_batch(rnd, decode=16, prefill=4, prefill_tokens=512),              # the captured size, full
        Batch([rnd.randint(1, 900) for _ in range(8)] + [20000],                   # fewer requests, one long
              [(300, 300), (150, 2150)]),
        Batch([1, 17, 33], [(0, 0), (17, 17), (0, 40), (129, 5000)]),              # qo_len 0 requests, padding
        Batch([rnd.randint(1, 4000) for _ in range(5)], []),                        # decode only
        Batch([], [(512, 4000)]),                                                   # prefill only
        llama8b_batch(rnd, decode=16, prefill=4, prefill_tokens=512),              # full again
    ]


@pytest.mark.gpu
def test_layer_step_graph_replays_equal_eager_after_replans():
    graph = LayerStep(graph=True, decode_cap=16, prefill_cap=4, prefill_tokens=512, seed=3)
    eager = LayerStep(graph=False, seed=3)  # the same seed: the same cache contents
    assert torch.equal(graph.k_cache.view(torch.uint8), eager.k_cache.view(torch.uint8))
    for i, batch in enumerate(_rounds()):
        graph.prepare(batch, seed=100 + i)
        eager.prepare(batch, seed=100 + i, pages=graph.pages, data=graph.data)
        before = (eager.k_cache.clone(), eager.v_cache.clone())
        graph.out.fill_(float("nan"))
        graph.q8.view(torch.uint8).fill_(0x7F)  # e4m3 NaN: padding rows must come out zero
        if graph.graph_obj is None:
            graph.capture()  # its warm-up runs the step once: the same writes as the replay
            graph.out.fill_(float("nan"))
        graph.replay()
        eager.run()
        torch.cuda.synchronize()
        what = f"round {i} ({len(batch.decode_kv)} decode, {len(batch.prefill)} prefill requests)"

        # the caches: the replay wrote what eager wrote, and that is RoPE + fp8 of the new rows
        assert torch.equal(graph.k_cache.view(torch.uint8), eager.k_cache.view(torch.uint8)), f"{what}: K cache"
        assert torch.equal(graph.v_cache.view(torch.uint8), eager.v_cache.view(torch.uint8)), f"{what}: V cache"
        verify(eager, before, what)

        # padding tokens: q comes out zero, the prefill rows past the live ones stay unwritten
        live = set(graph.live_rows())
        pad = torch.tensor([r for r in range(graph.tokens) if r not in live], dtype=torch.long, device=graph.device)
        assert not bool(graph.q8[pad].view(torch.uint8).any()), f"{what}: padding tokens' q not zero"
        tail = graph.decode_cap + sum(m for m, _ in batch.prefill)
        assert bool(graph.out[tail:].isnan().all()), f"{what}: prefill rows past the live ones written"

        # the outputs: replay == eager, eager == float64 attention over the cache
        out_graph, out_eager = graph.out_rows(), eager.out_rows()
        assert not bool(out_graph.isnan().any()), f"{what}: a live row left unwritten"
        torch.testing.assert_close(out_graph, out_eager, atol=1e-2, rtol=1e-2, msg=lambda m: f"{what}: {m}")


@pytest.mark.gpu
def test_layer_step_rejects_a_batch_over_its_capacity():
    step = LayerStep(graph=True, decode_cap=2, prefill_cap=1, prefill_tokens=16, pool_pages=64)
    with pytest.raises(ValueError, match="capacity"):
        step.prepare(Batch([5, 5, 5], []), seed=0)
    with pytest.raises(ValueError, match="capacity"):
        step.prepare(Batch([5], [(17, 17)]), seed=0)
    assert PAGE == 16 and FP8 == torch.float8_e4m3fn
