"""Batch prefill over the paged KV cache or ragged K/V, at FlashInfer's path
`flashinfer.prefill`.

spec.py: the module specs (PrefillSpec, PrefillPlanSpec); wrapper.py: the wrappers and
functional calls users import from here, and plan()'s numpy twin of the C++ planner
(csrc/prefill/prefill_plan.h)."""

from .wrapper import *  # noqa: F401,F403
from .wrapper import __all__  # noqa: F401
