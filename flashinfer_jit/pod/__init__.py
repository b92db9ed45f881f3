"""POD: a prefill and a batch of decodes in one launch, at FlashInfer's names
(`flashinfer.PODWithPagedKVCacheWrapper`, `flashinfer.BatchPODWithPagedKVCacheWrapper`).

spec.py: the module spec (PodSpec: one prefill and one decode configuration); wrapper.py:
the wrappers, which hold one wrapper of each family and launch both plans' work as one
kernel (csrc/pod/pod.cuh). docs/pod.md describes it."""

from .wrapper import *  # noqa: F401,F403
from .wrapper import __all__  # noqa: F401
