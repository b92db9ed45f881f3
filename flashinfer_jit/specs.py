"""The index of every family's spec (one frozen dataclass per family; see pipeline/spec.py):
what `flashinfer-jit aot --matrix` lines name, and what the tests import specs from."""

from .decode.spec import DecodePlanSpec, DecodeSpec
from .kvcache.append_spec import AppendSpec, BatchIndicesSpec
from .kvcache.flatten_spec import FlattenSpec
from .pipeline.spec import Spec
from .pod.spec import PodSm90Spec, PodSpec
from .prefill.spec import PrefillPlanSpec, PrefillSm90Spec, PrefillSpec
from .runtime.shared_specs import MergeSpec, PageOrderSpec, RopeSpec

FAMILIES: dict[str, type[Spec]] = {
    cls.FAMILY: cls for cls in (AppendSpec, BatchIndicesSpec, RopeSpec, FlattenSpec, DecodeSpec, MergeSpec, DecodePlanSpec,
                                PageOrderSpec, PrefillSpec, PrefillPlanSpec, PrefillSm90Spec, PodSpec,
                                PodSm90Spec)
}

__all__ = ["Spec", "AppendSpec", "BatchIndicesSpec", "RopeSpec", "FlattenSpec", "DecodeSpec", "MergeSpec", "DecodePlanSpec",
           "PageOrderSpec", "PrefillSpec", "PrefillPlanSpec", "PrefillSm90Spec", "PodSpec", "PodSm90Spec",
           "FAMILIES"]
