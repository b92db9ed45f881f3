"""The README's Python examples, as written.

Every ```python block of README.md must compile (CPU, always) and, on a GPU, run to the
end in a fresh interpreter: each block is self-contained (it imports torch and
flashinfer_jit and makes its own tensors) and checks its own result with asserts.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 15  # the README promises short examples


def python_blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, source) of every ```python block of README.md."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if current is None:
            if stripped == "```python":
                current, start = [], number
        elif stripped.startswith("```"):
            blocks.append((start, "\n".join(current) + "\n"))
            current = None
        else:
            current.append(line)
    assert current is None, f"README.md: the ```python block opened at line {start} is never closed"
    return blocks


BLOCKS = python_blocks()
IDS = [f"README.md:{line}" for line, _ in BLOCKS]


def test_readme_has_the_three_examples():
    assert len(BLOCKS) >= 3, "README.md should show append, RoPE + fp8 + append and decode examples"


@pytest.mark.parametrize("line,source", BLOCKS, ids=IDS)
def test_readme_block_compiles(line, source):
    compile(source, f"README.md:{line}", "exec")  # a syntax error fails here, on any machine


@pytest.mark.parametrize("line,source", BLOCKS, ids=IDS)
def test_readme_block_is_self_contained_and_short(line, source):
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {"torch", "flashinfer_jit"} <= imported, \
        f"README.md:{line}: an example imports torch and flashinfer_jit itself"
    lines = source.rstrip("\n").count("\n") + 1
    assert lines <= MAX_LINES, f"README.md:{line}: {lines} lines, more than {MAX_LINES}"


@pytest.mark.gpu
@pytest.mark.parametrize("line,source", BLOCKS, ids=IDS)
def test_readme_block_runs(line, source):
    # A fresh interpreter per block: nothing leaks between examples, and a crash in one
    # cannot end pytest. The first run may compile the block's modules (the GPU check
    # prebuilds them with scripts/matrices/tests), hence the generous timeout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (
        f"README.md:{line} failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
