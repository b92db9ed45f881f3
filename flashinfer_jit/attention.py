"""FlashInfer's `flashinfer.attention` path: BatchAttention (flashinfer_jit/pod/batch_attention.py)."""

from .pod.batch_attention import BatchAttention

__all__ = ["BatchAttention"]
