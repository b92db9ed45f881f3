"""The spec: one frozen dataclass per kernel family, the single source of truth.

A spec's fields are the template parameters. Each field declares its allowed values and
how it appears in the readable module name (`choice(...)`). From the fields alone the
base class derives: `validate()`, the readable `name` (every field reaches it, checked
by construction), the op namespace, the canonical JSON that goes into the cache key,
and the Jinja context. A family adds only what is its own: the templates it renders,
the ops it registers (schemas), and combination rules in `check()`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

# Dtype names as torch spells them, with the C++ type and the short tag used in names.
DTYPES: dict[str, tuple[str, str]] = {
    "float16": ("half", "f16"),
    "bfloat16": ("nv_bfloat16", "bf16"),
    "float8_e4m3fn": ("__nv_fp8_e4m3", "e4m3"),
    "float8_e5m2": ("__nv_fp8_e5m2", "e5m2"),
    "float32": ("float", "f32"),
    "int32": ("int32_t", "i32"),
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# K/V cache dtypes and head dims every paged family takes
PAGED_KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
HEAD_DIMS = (64, 128, 256)
KV_LAYOUTS = ("NHD", "HND")
PAGE_TABLES = ("csr", "block_table", "block_table_kv_separate")
NAMESPACE_PLACEHOLDER = "FIJ_MODULE_NAMESPACE"
PAGE_TABLE_TAGS = {"csr": "csr", "block_table": "bt", "block_table_kv_separate": "btkv"}


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 or 'bfloat16' -> 'bfloat16'."""
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def choice(*values: Any, tag: str = "{}", default: Any = dataclasses.MISSING, name_default: bool = True):
    """A spec field restricted to `values`; `tag` formats it in the readable name
    ('hd{}' -> 'hd128'). Dtype values are tagged with their short names. name_default=False
    leaves the default value out of the name (a field added to a family later, so that
    existing names read as before)."""
    return field(default=default, metadata={"choices": tuple(values), "tag": tag, "name_default": name_default})


@dataclass(frozen=True)
class Spec:
    FAMILY: ClassVar[str]
    # output file name -> template file (under templates/)
    TEMPLATES: ClassVar[dict[str, str]]
    # True: the module has host code only (its kernel.cu holds no device code), so it
    # builds for no target arch and one entry serves every GPU
    HOST_ONLY: ClassVar[bool] = False
    # None: the module builds for the target archs (FLASHINFER_JIT_CUDA_ARCH_LIST, else the
    # visible GPUs'); a tuple: for these archs only, whatever the targets (code that no other
    # arch can run: sm_90a's wgmma)
    ARCHS: ClassVar[tuple[str, ...] | None] = None

    # --- what a family provides -------------------------------------------------
    def check(self) -> None:
        """Rules across fields; raise ValueError listing what is supported."""

    def op_schemas(self) -> dict[str, str]:
        """op name -> torch schema arguments and return, e.g. '(Tensor a) -> Tensor'."""
        raise NotImplementedError

    def extra_context(self) -> dict[str, Any]:
        return {}

    # --- derived, the same for every family ----------------------------------------
    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def supported(cls) -> dict[str, tuple]:
        return {f.name: f.metadata["choices"] for f in cls.fields()}

    def validate(self) -> "Spec":
        for f in self.fields():
            value = getattr(self, f.name)
            allowed = f.metadata["choices"]
            if value not in allowed:
                raise ValueError(
                    f"{type(self).__name__}: {f.name}={value!r} is not supported; "
                    f"supported: {', '.join(map(repr, allowed))}"
                )
        self.check()
        return self

    @property
    def name(self) -> str:
        parts = [self.FAMILY]
        for f in self.fields():
            value = getattr(self, f.name)
            if isinstance(value, bool):
                if value:
                    parts.append(f.metadata["tag"].format("").strip("_") or f.name)
                continue
            if not f.metadata.get("name_default", True) and value == f.default:
                continue
            if isinstance(value, str):
                value = DTYPES[value][1] if value in DTYPES else PAGE_TABLE_TAGS.get(value, value)
                value = value.lower()
            parts.append(f.metadata["tag"].format(value))
        return "_".join(parts)

    def fake_impls(self) -> dict[str, Any]:
        """op name -> fake (meta) implementation for torch.compile; ops that only
        mutate their arguments need none."""
        return {}

    def canonical(self) -> dict[str, Any]:
        return {"family": self.FAMILY, "params": {f.name: getattr(self, f.name) for f in self.fields()}}

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def context(self) -> dict[str, Any]:
        ctx: dict[str, Any] = {f.name: getattr(self, f.name) for f in self.fields()}
        ctx.update(
            family=self.FAMILY,
            module_name=self.name,
            # The real namespace holds the content key, which is only known once the
            # sources are rendered; cache.finalize_sources substitutes it.
            namespace=NAMESPACE_PLACEHOLDER,
            op_schemas=self.op_schemas(),
            spec_json=self.canonical_json(),
        )
        ctx.update(self.extra_context())
        return ctx

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Spec":
        known = {f.name for f in cls.fields()}
        unknown = set(params) - known
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown parameter(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        normalized = {k: dtype_name(v) if "dtype" in k and v is not None else v for k, v in params.items()}
        return cls(**normalized).validate()

    @classmethod
    def expand(cls, grid: dict[str, Iterable[Any]]) -> list["Spec"]:
        """Every combination of a parameter grid (lists of values per field); fields left
        out take their default. Invalid combinations raise."""
        import itertools

        names = list(grid)
        specs = []
        for values in itertools.product(*(list(grid[n]) for n in names)):
            specs.append(cls.from_params(dict(zip(names, values))))
        return specs
