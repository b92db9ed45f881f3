"""Test configuration: GPU tests are marked `gpu` and skipped where no GPU is visible.

Tests marked `exhaustive` (every supported spec combination rendered, tests/test_specs.py)
or `thorough` (the cache's slowest fault-injection and multi-process tests, each building
modules of its own) are deselected unless `--exhaustive` is given (CI gives it) or a `-m`
expression names the marker; the default run renders a fixed pairwise sample of the spec
combinations instead, and keeps a real build of every family (tests/test_families_build.py).

Without a GPU, modules are still rendered, compiled with nvcc, linked and imported; the
target defaults to Hopper (9.0a) unless FLASHINFER_JIT_CUDA_ARCH_LIST says otherwise.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# kv_helpers (shared by the test modules) asserts too: pytest's rewriting, as in a test module
pytest.register_assert_rewrite("kv_helpers", "race_helpers")

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")

# The same compile step runs the compiler once a session (tests/compile_cache.py): many tests
# build the same small module into caches of their own. FIJ_TEST_COMPILE_CACHE=0 turns it
# off; a FLASHINFER_JIT_COMPILER_LAUNCHER of the caller's own is kept.
if os.environ.get("FIJ_TEST_COMPILE_CACHE", "") != "0" and not os.environ.get("FLASHINFER_JIT_COMPILER_LAUNCHER"):
    import sys
    import tempfile

    import shlex

    _COMPILE_CACHE = tempfile.mkdtemp(prefix="fij-test-compiles-")
    os.environ["FIJ_TEST_COMPILE_CACHE"] = _COMPILE_CACHE
    os.environ["FLASHINFER_JIT_COMPILER_LAUNCHER"] = " ".join(
        shlex.quote(word) for word in (sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                   "compile_cache.py")))
else:
    _COMPILE_CACHE = None


def pytest_sessionfinish(session, exitstatus):
    if _COMPILE_CACHE:
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the tests marked exhaustive (every supported spec combination "
                          "rendered, ~22,000 tests) and thorough (the cache's slowest fault-injection "
                          "tests): about three minutes more on 2 cores")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--exhaustive"):
        named = config.getoption("markexpr") or ""
        left_out = [m for m in ("exhaustive", "thorough") if m not in named]
        deselected = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def workspace():
    """The float workspace of the batch decode and prefill wrappers in the GPU tests of
    test_decode.py and test_prefill.py (module scope: one per test module)."""
    return torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache root for this test, and a registry that has forgotten earlier loads."""
    from flashinfer_jit.pipeline import jit

    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # keep the user cache out of reach
    jit.clear_registry()
    yield root
    jit.clear_registry()


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> dict:
    """A private copy of csrc/ and templates/, made the package's source folders: a test may
    edit them. {"csrc": path, "templates": path}."""
    from flashinfer_jit.pipeline import env

    copies = {}
    for kind in ("csrc", "templates"):
        copies[kind] = tmp_path / kind
        shutil.copytree(env.source_dir(kind), copies[kind])
    monkeypatch.setattr(env, "source_dir", lambda kind: copies[kind])
    return copies
