"""Test configuration: GPU tests are marked `gpu` and skipped where no GPU is visible.

Without a GPU, modules are still rendered, compiled with nvcc, linked and imported; the
target defaults to Hopper (9.0a) unless FLASHINFER_JIT_CUDA_ARCH_LIST says otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache root for this test, and a registry that has forgotten earlier loads."""
    from flashinfer_jit import jit

    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # keep the user cache out of reach
    jit.clear_registry()
    yield root
    jit.clear_registry()
