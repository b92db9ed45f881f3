"""One frozen dataclass per kernel family; see base.Spec."""

from .append import AppendSpec, BatchIndicesSpec
from .base import Spec

FAMILIES: dict[str, type[Spec]] = {cls.FAMILY: cls for cls in (AppendSpec, BatchIndicesSpec)}

__all__ = ["Spec", "AppendSpec", "BatchIndicesSpec", "FAMILIES"]
