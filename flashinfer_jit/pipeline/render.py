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
from .spec import DTYPES, Spec

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


def _content_loader_class():
    import jinja2

    class ContentLoader(jinja2.FileSystemLoader):
        """Jinja reuses a parsed template while its file's modification time is unchanged;
        an edit within the file system's time resolution would then render stale sources
        under a stale key. This loader's templates stay valid while their text is."""

        def get_source(self, environment, template):
            source, filename, _ = super().get_source(environment, template)

            def uptodate() -> bool:
                try:
                    return Path(filename).read_text(encoding="utf-8") == source
                except OSError:
                    return False

            return source, filename, uptodate

    return ContentLoader


@functools.cache
def _environment(templates_dir: str):
    """One Jinja environment per templates folder (keyed by it, so a process that points
    env.source_dir elsewhere, as tests do, renders from there and not from a stale one)."""
    import jinja2

    environment = jinja2.Environment(
        loader=_content_loader_class()(templates_dir),
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
    environment.filters["pos_encoding_enum"] = lambda v: _enum(
        "fij::PosEncoding", v, {"none": "kNone", "rope_llama": "kRopeLlama", "alibi": "kAlibi"}
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
    environment = _environment(str(env.source_dir("templates")))
    context = spec.context()
    sources = {
        out_name: environment.get_template(template).render(**context)
        for out_name, template in spec.TEMPLATES.items()
    }
    return RenderedModule(spec, sources, included_headers(sources, env.source_dir("csrc")))
