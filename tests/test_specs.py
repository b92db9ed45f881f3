"""Specs and rendering: validation, readable names, grids, templates. No compiler runs.

A spec is the single source of truth of a family (STYLE.md, "What this means" 1): its
fields' allowed values drive validate(), the readable name and the Jinja context. These
tests check those derivations for every family and that every supported combination
renders, so a template that breaks for one value fails here, long before nvcc.

Rendering every supported combination is ~16,000 tests (most of the suite's count). The
default run renders a fixed sample of them, SAMPLE: for each family, combinations chosen
greedily until every value of every field and every pair of values of two fields that
some supported combination has is covered (about 180 in all; the choice depends only on
the specs, so it is the same on every run). The rest are marked `exhaustive`; they run
with `pytest --exhaustive` (tests/conftest.py), as CI does (.ci/run). Validation is cheap,
so every combination of every family is still validated in the default run.
"""

from __future__ import annotations

import heapq
import itertools
import os

import jinja2
import pytest
import torch

from flashinfer_jit.pipeline import env, render
from flashinfer_jit.pipeline.spec import NAMESPACE_PLACEHOLDER
from flashinfer_jit.specs import FAMILIES, AppendSpec, BatchIndicesSpec


def combinations(cls):
    """Every combination of a family's per-field supported values, valid or not."""
    supported = cls.supported()
    grid = itertools.product(*supported.values())
    return [cls(**dict(zip(supported, values))) for values in grid]


def is_valid(spec) -> bool:
    try:
        spec.validate()
        return True
    except ValueError:
        return False


def all_specs(cls):
    """Every supported configuration of a family (combinations its check() accepts)."""
    return [spec for spec in combinations(cls) if is_valid(spec)]


def value_pairs(spec) -> frozenset:
    """The spec's (field, value) items and every pair of them: what the sample must cover."""
    items = [(f.name, getattr(spec, f.name)) for f in spec.fields()]
    return frozenset(items) | frozenset(itertools.combinations(items, 2))


def pairwise_sample(specs: list) -> list:
    """A deterministic subset of `specs` that covers every (field, value) and every pair of
    them that occurs in `specs`: greedy, each step taking the spec that covers the most
    still-missing items (the first in `specs`' order on a tie). The heap is lazy (a spec's
    gain only falls), which picks exactly what a full scan would, in a fraction of the time."""
    covers = [value_pairs(spec) for spec in specs]
    missing = set().union(*covers)
    if not missing:  # a family without fields: its one spec
        return specs[:1]
    heap = [(-len(cover), i) for i, cover in enumerate(covers)]
    heapq.heapify(heap)
    chosen = []
    while missing:
        _, i = heapq.heappop(heap)
        gain = len(covers[i] & missing)
        if heap and (-gain, i) > heap[0]:
            heapq.heappush(heap, (-gain, i))  # stale: another spec may now cover more
            continue
        chosen.append(i)
        missing -= covers[i]
    return [specs[i] for i in sorted(chosen)]


ALL_SPECS = {cls: all_specs(cls) for cls in FAMILIES.values()}
EVERY_SPEC = [spec for specs in ALL_SPECS.values() for spec in specs]
SAMPLE = {cls: pairwise_sample(specs) for cls, specs in ALL_SPECS.items()}
IN_SAMPLE = {spec for specs in SAMPLE.values() for spec in specs}
# the default run renders SAMPLE; `--exhaustive` renders the rest too
RENDER_CASES = [spec if spec in IN_SAMPLE else pytest.param(spec, marks=pytest.mark.exhaustive)
                for spec in EVERY_SPEC]


# --- validate() -----------------------------------------------------------------------
@pytest.mark.parametrize("field, bad, listed", [
    ("head_dim", 96, ["64", "128", "256"]),
    ("dtype_kv", "float32", ["'float16'", "'bfloat16'", "'float8_e4m3fn'", "'float8_e5m2'"]),
    ("kv_layout", "XYZ", ["'NHD'", "'HND'"]),
    ("page_table", "coo", ["'csr'", "'block_table'", "'block_table_kv_separate'"]),
])
def test_validate_lists_supported_values(field, bad, listed):
    params = {"dtype_kv": "bfloat16", "head_dim": 128, field: bad}
    with pytest.raises(ValueError) as info:
        AppendSpec(**params).validate()
    message = str(info.value)
    assert f"{field}={bad!r}" in message
    for value in listed:
        assert value in message, message


@pytest.mark.parametrize("cls", list(FAMILIES.values()), ids=list(FAMILIES))
def test_every_family_has_valid_combinations_and_rejects_with_value_error(cls):
    """Cross-field rules (check()) reject with ValueError only, never another exception."""
    valid = set(ALL_SPECS[cls])  # a set: list membership made this quadratic (minutes)
    assert valid, f"{cls.__name__}: no supported configuration"
    for spec in combinations(cls):
        if spec not in valid:
            with pytest.raises(ValueError, match=cls.__name__):
                spec.validate()


def test_from_params_rejects_unknown_and_normalizes_torch_dtypes():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['head_size'\].*known: "):
        AppendSpec.from_params({"dtype_kv": "float16", "head_size": 128})
    spec = AppendSpec.from_params({"dtype_kv": torch.bfloat16, "head_dim": 128})
    assert spec == AppendSpec("bfloat16", 128, "NHD", "csr")
    with pytest.raises(ValueError, match="head_dim=100 is not supported"):
        AppendSpec.from_params({"dtype_kv": "float16", "head_dim": 100})


# --- names ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec, name", [
    (AppendSpec("bfloat16", 128), "append_bf16_hd128_nhd_csr"),
    (AppendSpec("float8_e4m3fn", 64, "HND", "block_table_kv_separate"),
     "append_e4m3_hd64_hnd_btkv"),
    (AppendSpec("float16", 256, "NHD", "block_table"), "append_f16_hd256_nhd_bt"),
    (BatchIndicesSpec(), "batch_indices_i32"),
])
def test_readable_names(spec, name):
    assert spec.name == name


def test_every_field_reaches_the_name():
    """Distinct specs never share a name (a name shared by two configurations would be
    confusing in `flashinfer-jit list` even though keys still differ)."""
    names = [spec.name for spec in EVERY_SPEC]
    assert len(set(names)) == len(names)
    for cls in FAMILIES.values():
        for base in all_specs(cls)[:3]:
            for f in cls.fields():
                for value in cls.supported()[f.name]:
                    other = cls(**{**base.canonical()["params"], f.name: value})
                    if is_valid(other):
                        assert (other.name == base.name) == (other == base), (f.name, value)


# --- expand() -------------------------------------------------------------------------
def test_expand_counts_and_defaults():
    grid = {"dtype_kv": ["float16", "bfloat16"], "head_dim": [64, 128, 256]}
    specs = AppendSpec.expand(grid)
    assert len(specs) == 6
    assert {(s.kv_layout, s.page_table) for s in specs} == {("NHD", "csr")}  # defaults
    full = AppendSpec.expand(AppendSpec.supported())
    assert len(full) == 4 * 3 * 2 * 3 == len(set(full))
    assert len(BatchIndicesSpec.expand({})) == 1
    with pytest.raises(ValueError, match="head_dim=96"):
        AppendSpec.expand({"dtype_kv": ["float16"], "head_dim": [64, 96]})


# --- rendering ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", list(FAMILIES.values()), ids=list(FAMILIES))
def test_the_sample_covers_every_value_and_pair_of_every_family(cls):
    """SAMPLE, what the default run renders, covers every (field, value) and every pair of
    two fields' values that a supported combination has, and is the same on every run."""
    specs, sample = ALL_SPECS[cls], SAMPLE[cls]
    assert sample and set(sample) <= set(specs)
    assert set().union(*map(value_pairs, sample)) == set().union(*map(value_pairs, specs))
    for f in cls.fields():
        assert {getattr(s, f.name) for s in sample} == {getattr(s, f.name) for s in specs}, f.name
    assert pairwise_sample(specs) == sample
    assert len(sample) <= max(40, len(specs) // 50) or len(sample) == len(specs), len(sample)


@pytest.mark.parametrize("spec", RENDER_CASES, ids=lambda s: s.name)
def test_every_combination_renders(spec):
    module = render.render(spec)
    assert set(module.sources) == set(spec.TEMPLATES)
    for name, text in module.sources.items():
        assert NAMESPACE_PLACEHOLDER in text, name  # replaced by the keyed namespace at build
        assert "{{" not in text and "{%" not in text, name
        assert spec.name in text, name
    binding = module.sources["binding.cc"]
    for op in spec.op_schemas():
        assert f'm.def("{op}' in binding
    assert "common/common.cuh" in module.headers


def test_render_is_deterministic():
    spec = AppendSpec("float8_e5m2", 256, "HND", "block_table")
    assert render.render(spec) == render.render(spec)


def test_render_rejects_invalid_spec_before_templates():
    with pytest.raises(ValueError, match="head_dim=96"):
        render.render(AppendSpec("float16", 96))


def test_strict_undefined_fails_at_render(source_copy):
    copies = source_copy
    template = copies["templates"] / "kvcache/batch_indices.cu.j2"
    template.write_text(template.read_text() + "constexpr int kX = {{ not_a_spec_field }};\n")
    with pytest.raises(jinja2.UndefinedError, match="not_a_spec_field"):
        render.render(BatchIndicesSpec())


def test_included_headers_follow_includes_transitively():
    module = render.render(BatchIndicesSpec())
    # kernel.cu -> batch_indices.cuh -> append_params.h -> page_table_params.h;
    # binding.cc -> append_host.h -> torch_binding.h
    for header in ("kvcache/batch_indices.cuh", "kvcache/append_params.h", "common/page_table_params.h", "common/common.cuh",
                   "runtime/launch_error.cuh", "kvcache/append_host.h", "runtime/torch_binding.h"):
        assert header in module.headers, header
    csrc = env.source_dir("csrc")
    assert module.headers["common/common.cuh"] == (csrc / "common/common.cuh").read_bytes()
    assert "kvcache/append.cuh" not in module.headers  # not reached: not part of this module's key
    assert "kvcache/append.cuh" in render.render(AppendSpec("float16", 64)).headers


def test_included_headers_cycles_system_headers_and_missing(tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.h").write_text('#pragma once\n#include "b.h"\n#include <cstdint>\n')
    (csrc / "b.h").write_text('#pragma once\n  #  include "c.h"\n')
    (csrc / "c.h").write_text('#pragma once\n#include "a.h"\n')  # a cycle ends
    found = render.included_headers({"k.cu": '#include "a.h"\n'}, csrc)
    assert list(found) == ["a.h", "b.h", "c.h"]
    with pytest.raises(FileNotFoundError, match="missing.h"):
        render.included_headers({"k.cu": '#include "missing.h"\n'}, csrc)


def test_template_edit_is_seen_even_with_the_same_mtime(source_copy):
    """Nothing depends on modification times: an edit that keeps the file's mtime (a
    coarse file system, a checkout tool) still reaches the rendered source."""
    copies = source_copy
    template = copies["templates"] / "kvcache/batch_indices.cu.j2"
    stamp = template.stat()
    assert "// edited" not in render.render(BatchIndicesSpec()).sources["kernel.cu"]
    template.write_text(template.read_text() + "// edited\n")
    os.utime(template, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert "// edited" in render.render(BatchIndicesSpec()).sources["kernel.cu"]
