"""Render a spec's templates into CUDA/C++ sources, and collect the csrc headers they use.

Templates are thin (includes, constants from the spec, instantiations); the Jinja
environment is strict, so a template naming a value the spec does not provide fails at
render time instead of producing wrong code.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from . import env
from .specs.base import DTYPES, Spec

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class RenderedModule:
    spec: Spec
    sources: dict[str, str]  # file name in the build dir -> text
    headers: dict[str, bytes]  # csrc-relative path -> bytes, every header reached

    @property
    def name(self) -> str:
        return self.spec.name


def _enum(prefix: str, value: str, names: dict[str, str]) -> str:
    return f"{prefix}::{names[value]}"


@functools.cache
def _environment():
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(env.source_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["ctype"] = lambda dtype: DTYPES[dtype][0]
    environment.filters["kv_layout_enum"] = lambda v: _enum(
        "fij::KVLayout", v, {"NHD": "kNHD", "HND": "kHND"}
    )
    environment.filters["page_table_enum"] = lambda v: _enum(
        "fij::PageTableLayout",
        v,
        {"csr": "kCSR", "block_table": "kBlockTable", "block_table_kv_separate": "kBlockTableKVSeparate"},
    )
    environment.filters["cbool"] = lambda v: "true" if v else "false"
    return environment


def included_headers(sources: dict[str, str], csrc: Path) -> dict[str, bytes]:
    """Every csrc header reached from the sources through `#include "..."`, transitively.
    System and torch headers (`<...>`) are covered by the toolchain part of the key."""
    found: dict[str, bytes] = {}
    pending = [m for text in sources.values() for m in _INCLUDE.findall(text)]
    while pending:
        rel = pending.pop()
        if rel in found:
            continue
        path = csrc / rel
        if not path.is_file():
            raise FileNotFoundError(f"csrc header {rel!r} included by a template does not exist in {csrc}")
        data = path.read_bytes()
        found[rel] = data
        pending.extend(_INCLUDE.findall(data.decode()))
    return dict(sorted(found.items()))


def render(spec: Spec) -> RenderedModule:
    spec.validate()
    environment = _environment()
    context = spec.context()
    sources = {
        out_name: environment.get_template(template).render(**context)
        for out_name, template in spec.TEMPLATES.items()
    }
    return RenderedModule(spec, sources, included_headers(sources, env.source_dir("csrc")))
