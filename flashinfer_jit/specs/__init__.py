"""One frozen dataclass per kernel family; see base.Spec."""

from .append import AppendSpec, BatchIndicesSpec
from .base import Spec
from .decode import DecodePlanSpec, DecodeSpec, MergeSpec, PageOrderSpec
from .flatten import FlattenSpec
from .prefill import PrefillPlanSpec, PrefillSpec
from .rope import RopeSpec

FAMILIES: dict[str, type[Spec]] = {
    cls.FAMILY: cls for cls in (AppendSpec, BatchIndicesSpec, RopeSpec, FlattenSpec, DecodeSpec, MergeSpec, DecodePlanSpec,
                PageOrderSpec, PrefillSpec, PrefillPlanSpec)
}

__all__ = ["Spec", "AppendSpec", "BatchIndicesSpec", "RopeSpec", "FlattenSpec", "DecodeSpec", "MergeSpec", "DecodePlanSpec",
           "PageOrderSpec", "PrefillSpec", "PrefillPlanSpec", "FAMILIES"]
