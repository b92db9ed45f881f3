"""Batch decode over the paged KV cache, at FlashInfer's path `flashinfer.decode`.

spec.py: the module spec (DecodeSpec, DecodePlanSpec) and its pure policy functions;
wrapper.py: the wrappers and functional calls users import from here, and plan()'s
numpy twin of the C++ planner (csrc/decode/decode_plan.h)."""

from .wrapper import *  # noqa: F401,F403
from .wrapper import __all__  # noqa: F401
