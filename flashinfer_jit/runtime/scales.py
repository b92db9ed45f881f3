"""The softmax's logit scale as the attention kernels take it (decode and prefill alike).

The kernels exponentiate with exp2, so without a soft cap the logits are scaled into log2
units (x log2 e). With a soft cap c the kernel computes c * tanh(logits / c) first, so the
scale is divided by c instead, and the cap itself is passed in log2 units (prefill's
soft_cap_log2; decode's kernel applies log2 e after the tanh itself).
"""

from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e)


def logit_scale(sm_scale: float, soft_cap: float, q_scale, k_scale) -> float:
    """sm_scale x q_scale x k_scale (None: 1), over the soft cap where there is one (> 0),
    else in log2 units. fp8 caches fold k_scale in here."""
    scale = sm_scale * (1.0 if q_scale is None else float(q_scale)) * (1.0 if k_scale is None else float(k_scale))
    return scale / soft_cap if soft_cap else scale * LOG2E


def soft_cap_log2(soft_cap: float) -> float:
    """The soft cap in log2 units, 0.0 without one."""
    return soft_cap * LOG2E if soft_cap > 0 else 0.0
