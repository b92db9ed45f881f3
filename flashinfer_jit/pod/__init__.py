"""POD: a prefill and a batch of decodes in one launch, at FlashInfer's names
(`flashinfer.PODWithPagedKVCacheWrapper`, `flashinfer.BatchPODWithPagedKVCacheWrapper`,
`flashinfer.BatchAttention`).

spec.py: the module spec (PodSpec: one prefill and one decode configuration); wrapper.py:
the wrappers, which hold one wrapper of each family and launch both plans' work as one
kernel (csrc/pod/pod.cuh); batch_attention.py: BatchAttention, one mixed batch split into
the two sides. docs/pod.md describes them."""

from .batch_attention import BatchAttention  # noqa: F401
from .wrapper import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper  # noqa: F401

__all__ = ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper", "BatchAttention"]
