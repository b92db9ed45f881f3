"""AOT matrix files: which modules to prebuild, as families x parameter lists.

One family per line, its name (a key of `flashinfer_jit.specs.FAMILIES`) followed by `param=v1,v2,...`
items; every combination of the lists is one module, fields not given take their
defaults. `#` starts a comment, blank lines are ignored, and a line ending in a
backslash continues on the next one:

    # fp16/bf16 caches for two head dims, both KV layouts (8 modules)
    append  dtype_kv=float16,bfloat16  head_dim=64,128 \\
            kv_layout=NHD,HND
    batch_indices

Every problem (unknown family, parameter or value, an unsupported combination) raises
`MatrixError`, a ValueError whose message starts with `file:line:`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Iterator

from .spec import Spec


def _families() -> dict[str, type[Spec]]:
    """Every family's spec by name. The pipeline names no family: it finds them in the
    package's spec index (flashinfer_jit/specs.py), imported here on first use, so the
    build layer stays below the families that it builds."""
    import importlib

    return importlib.import_module(__package__.rpartition(".")[0] + ".specs").FAMILIES

# `head_dim = 64, 128` reads as `head_dim=64,128`.
_SPACES_AROUND_SEPARATORS = re.compile(r"\s*([=,])\s*")


class MatrixError(ValueError):
    """A matrix file problem, located: `source:line: problem`."""

    def __init__(self, source: str, line: int, problem: str):
        self.source = source
        self.line = line
        self.problem = problem
        super().__init__(f"{source}:{line}: {problem}")


def shipped_matrices() -> list[str]:
    """The names of the matrix files that ship with the package (env.matrix_dir())."""
    from . import env

    folder = env.matrix_dir()
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith((".", "_"))) \
        if folder.is_dir() else []


def resolve_matrix(name_or_path: str | Path) -> Path:
    """A matrix file given by its path, or by the name of one that ships with the package
    (`llama`, `tests`); a ValueError naming both ways when it is neither."""
    from . import env

    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = env.matrix_dir() / str(name_or_path)
    if "/" not in str(name_or_path) and shipped.is_file():
        return shipped
    raise ValueError(f"matrix {str(name_or_path)!r}: no such file, nor a shipped matrix "
                     f"(shipped: {', '.join(shipped_matrices()) or 'none'})")


def parse_matrix(path: str | Path) -> list[Spec]:
    """The modules a matrix file names (a path, or a shipped matrix's name), deduplicated,
    in file order."""
    path = resolve_matrix(path)
    return parse_matrix_text(path.read_text(), source=str(path))


def parse_matrix_text(text: str, source: str = "<string>") -> list[Spec]:
    specs: dict[Spec, None] = {}  # an ordered set
    for line_no, line in logical_lines(text, source):
        try:
            for spec in parse_line(line):
                specs.setdefault(spec)
        except ValueError as exc:
            raise MatrixError(source, line_no, str(exc)) from None
    return list(specs)


def logical_lines(text: str, source: str) -> Iterator[tuple[int, str]]:
    """(number of the first physical line, text) of each non-empty logical line;
    comments removed, continuation lines joined."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        continued = line.endswith("\\")
        pending.append(line[:-1] if continued else line)
        if continued:
            continue
        joined = " ".join(part.strip() for part in pending).strip()
        pending = []
        if joined:
            yield start, joined
    if pending:
        raise MatrixError(source, start, "the last line ends with '\\' but no line follows it")


def parse_line(line: str) -> list[Spec]:
    """'append head_dim=64,128' -> the specs of every combination."""
    family, *items = _SPACES_AROUND_SEPARATORS.sub(r"\1", line).split()
    cls = family_class(family)
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, values = parse_item(cls, item)
        if name in grid:
            raise ValueError(f"{name} is given twice; put all its values in one list")
        grid[name] = values
    missing = [f.name for f in cls.fields() if f.name not in grid and _is_required(f)]
    if missing:
        raise ValueError(f"{cls.FAMILY} needs {', '.join(missing)} (no default); e.g. "
                         + "  ".join(f"{n}={_show(cls.supported()[n][0])}" for n in missing))
    return cls.expand(grid)


def spec_line(spec: Spec) -> str:
    """The one-module matrix line of `spec`, every field spelled out (defaults too, so the
    line keeps naming this module if a default changes): parse_line(spec_line(s)) == [s]."""
    items = [f"{f.name}={_show(getattr(spec, f.name))}" for f in spec.fields()]
    return " ".join([spec.FAMILY, *items])


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def family_class(family: str) -> type[Spec]:
    families = _families()
    if family in families:
        return families[family]
    raise ValueError(f"unknown family {family!r}{_did_you_mean(family, families)}; "
                     f"families: {', '.join(sorted(families))}")


def parse_item(cls: type[Spec], item: str) -> tuple[str, list[Any]]:
    """'head_dim=64,128' -> ('head_dim', [64, 128]), each value checked against the
    field's allowed values."""
    name, sep, text = item.partition("=")
    if not sep or not name:
        raise ValueError(f"expected param=v1,v2,... but found {item!r}")
    supported = cls.supported()
    if name not in supported:
        raise ValueError(f"{cls.FAMILY} has no parameter {name!r}{_did_you_mean(name, supported)}; "
                         f"parameters: {', '.join(supported)}")
    words = text.split(",")
    if not all(words):
        raise ValueError(f"{name}: empty value in {text!r}; expected e.g. "
                         f"{name}={','.join(map(_show, supported[name][:2]))}")
    return name, [convert_value(name, word, supported[name]) for word in words]


def convert_value(name: str, word: str, allowed: tuple) -> Any:
    """A word of the file as the field's type (int, bool from true/false, str; none for a
    field that allows None), which must be one of `allowed`."""
    if word.lower() == "none" and None in allowed:
        return None
    kind = type(allowed[0])
    if kind is bool:
        if word.lower() not in ("true", "false"):
            raise ValueError(f"{name}: {word!r} is not true or false")
        value: Any = word.lower() == "true"
    elif kind is int:
        try:
            value = int(word)
        except ValueError:
            raise ValueError(f"{name}: {word!r} is not an integer") from None
    else:
        value = word
    if value not in allowed:
        raise ValueError(f"{name}={word} is not supported; supported: "
                         f"{', '.join(map(_show, allowed))}")
    return value


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
