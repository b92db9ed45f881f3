"""The package's layers (docs/architecture.md): the build pipeline at the bottom, the shared
runtime above it, the kernel families above both, and the package's front (its lazy API,
FlashInfer's module paths, the spec index, the CLI) on top. A module imports its own layer
and the ones below, never one above, and a family never imports another family; POD, which
fuses the decode and prefill families' work into one launch, sits above both. The
PyTorch references (reference/) follow the same rule: one module a family, over one
shared helper module (reference/common.py).
Checked statically over every import statement (function-level ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashinfer_jit"
FAMILIES = ("kvcache", "decode", "prefill")
# POD runs the decode and prefill families' work in one launch: it imports both (their
# specs, planners and resolved op arguments), and no family imports it.
FUSED = ("pod",)
RANK = {"pipeline": 0, "runtime": 1, "family": 2, "reference": 2, "fused": 3, "front": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> tuple[str, str]:
    """(layer, unit): unit tells families (and references) apart."""
    parts = module.split(".")[1:]
    top = parts[0] if parts else ""
    if top in ("pipeline", "runtime"):
        return top, top
    if top in FAMILIES:
        return "family", top
    if top in FUSED:
        return "fused", top
    if top == "reference":
        name = parts[1] if len(parts) > 1 else "__init__"
        if name == "__init__":  # the references' index re-exports them all
            return "front", "front"
        family = {"append": "kvcache", "rope": "kvcache", "flatten": "kvcache"}.get(name, name)
        return "reference", "reference.common" if name == "common" else f"reference.{family}"
    return "front", "front"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every flashinfer_jit import in the file."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("flashinfer_jit"):
                continue
            if node.module is None or node.level and not node.module:  # from . import a, b: submodules
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append((node.lineno, sub if (PACKAGE.parent / sub.replace(".", "/")).exists()
                                  or (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else target))
            else:
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("flashinfer_jit")]
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        my_layer, my_unit = layer(me)
        for line, target in imports(path):
            if target == "flashinfer_jit.pipeline" or target.startswith("flashinfer_jit.pipeline."):
                their_layer, their_unit = "pipeline", "pipeline"
            else:
                their_layer, their_unit = layer(target)
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if RANK[their_layer] > RANK[my_layer]:
                bad.append(f"{where}: {their_layer} is above {my_layer}")
            elif my_layer in ("family", "reference") and their_layer == my_layer and their_unit != my_unit \
                    and their_unit != "reference.common":
                bad.append(f"{where}: one family imports another ({my_unit} -> {their_unit})")
            elif my_layer == "family" and their_layer == "reference":
                bad.append(f"{where}: a family imports a test reference")
    return bad


def violations_in(fake: Path) -> list[str]:
    """violations() of a fake package tree (the check's own tests)."""
    global PACKAGE
    saved, PACKAGE = PACKAGE, fake
    try:
        return violations()
    finally:
        PACKAGE = saved


def test_layers_import_only_downward_and_families_stay_apart():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path):
    """The check itself: a runtime module importing a family, and a family importing
    another, are both caught."""
    fake = tmp_path / "flashinfer_jit"
    (fake / "runtime").mkdir(parents=True)
    (fake / "decode").mkdir()
    (fake / "prefill").mkdir()
    (fake / "runtime" / "x.py").write_text("from ..decode import wrapper\n")
    (fake / "prefill" / "y.py").write_text("from ..decode.spec import DecodeSpec\n")
    (fake / "decode" / "spec.py").write_text("")
    (fake / "decode" / "wrapper.py").write_text("")
    found = violations_in(fake)
    assert any("runtime/x.py" in v and "above" in v for v in found), found
    assert any("prefill/y.py" in v and "another" in v for v in found), found


def test_a_family_importing_pod_is_caught(tmp_path):
    fake = tmp_path / "flashinfer_jit"
    for d in ("decode", "pod"):
        (fake / d).mkdir(parents=True)
    (fake / "decode" / "z.py").write_text("from ..pod import wrapper\n")
    (fake / "pod" / "wrapper.py").write_text("from ..decode import z\n")
    found = violations_in(fake)
    assert [v for v in found if "decode/z.py" in v and "above" in v], found
    assert not [v for v in found if "pod/wrapper.py" in v], found


@pytest.mark.parametrize("family", FAMILIES + FUSED)
def test_every_family_has_its_folder(family):
    assert (PACKAGE / family / "__init__.py").is_file()
