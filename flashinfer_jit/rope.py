"""FlashInfer's `flashinfer.rope` path (`from flashinfer.rope import apply_rope`, with
`flashinfer_jit` in its place). The RoPE kernels live in the KV-cache family,
kvcache/rope.py."""

from .kvcache.rope import *  # noqa: F401,F403
from .kvcache.rope import __all__  # noqa: F401
