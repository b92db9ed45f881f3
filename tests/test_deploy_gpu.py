"""scripts/deploy_check.py, the deployment check of an AOT matrix (README, Deployment).

CPU (no marker): every family of scripts/matrices/llama and scripts/matrices/tests has an
exerciser; each llama exerciser's arguments, run on CPU tensors up to the registry lookup
(CUDA-device checks relaxed, the registry replaced by a recorder that stops the call),
make the public API ask for exactly its spec; a family without an exerciser is a failure
naming it; the configuration outside the matrix raises JitDisabledError with its aot line.

GPU: deploy_check.py in a process that cannot find nvcc (PATH an empty folder, CUDA_HOME
a missing one), FLASHINFER_JIT_DISABLE_JIT=1, the prebuilt llama cache as
FLASHINFER_JIT_CACHE_PATH and an empty writable cache: exit 0, every entry loaded and
checked, nothing written to the writable cache. The prebuilt folder comes from
FIJ_PREBUILT_LLAMA (scripts/gpu_check.sh builds and exports it).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flashinfer_jit.pipeline import jit
from flashinfer_jit.pipeline.errors import JitDisabledError
from flashinfer_jit.pipeline.matrix import parse_matrix, spec_line
from flashinfer_jit.specs import PageOrderSpec

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import deploy_check  # noqa: E402 - from scripts/, put on sys.path just above

LLAMA = SCRIPTS / "matrices" / "llama"
LLAMA_SPECS = parse_matrix(LLAMA)


@pytest.mark.parametrize("matrix", [LLAMA, SCRIPTS / "matrices" / "tests"], ids=lambda path: path.name)
def test_every_family_of_the_matrices_has_an_exerciser(matrix):
    missing = sorted({spec.FAMILY for spec in parse_matrix(matrix)} - set(deploy_check.EXERCISERS))
    assert not missing, f"scripts/deploy_check.py has no exerciser for {missing} ({matrix.name})"


def test_a_family_without_an_exerciser_is_a_failure_naming_it(monkeypatch):
    monkeypatch.delitem(deploy_check.EXERCISERS, "merge")
    spec = next(s for s in LLAMA_SPECS if s.FAMILY == "merge")
    result = deploy_check.run_entry(spec, LLAMA_SPECS)
    assert not result["ok"] and "no exerciser for family 'merge'" in result["error"]


# --- which module the exercisers' arguments select (CPU) ---------------------------------------------
class Selected(Exception):
    """Raised by the recording registry: the API asked for `spec`."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.spec = spec


@pytest.fixture
def cpu_api(monkeypatch):
    """The exercisers on CPU tensors: deploy_check.DEVICE 'cpu', and the API's CUDA-device
    checks reduced to a same-device check (as tests/test_decode_host.py does), in every
    flashinfer_jit module that imported them."""
    for name in ("kvcache.append", "cascade", "decode", "kvcache.flatten", "prefill", "kvcache.rope",
                 "pod"):  # the public functions
        importlib.import_module(f"flashinfer_jit.{name}")
    monkeypatch.setattr(deploy_check, "DEVICE", "cpu")
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")  # nothing is built here
    for name, module in list(sys.modules.items()):
        if name.startswith("flashinfer_jit"):
            if hasattr(module, "same_cuda_device"):
                monkeypatch.setattr(module, "same_cuda_device", lambda ts: len({t.device for t in ts}) == 1)
            if hasattr(module, "expect_same_cuda_device"):
                monkeypatch.setattr(module, "expect_same_cuda_device", lambda named: None)
    # the Hopper prefill path's arch check (sm_90 only): passed, so that its exerciser reaches
    # the registry on the CPU too
    monkeypatch.setattr(importlib.import_module("flashinfer_jit.prefill.sm90"), "arch_error", lambda device: None)
    jit.clear_registry()
    with warnings.catch_warnings():  # a planner that cannot load: plan() says so and plans in numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
    monkeypatch.undo()
    jit.clear_registry()  # the planners' op caches hold None now
    deploy_check.workspace.cache_clear()


@pytest.fixture
def asked(cpu_api, monkeypatch):
    """The specs the API asks the registry for, in order; each ask raises Selected (the host
    planners' asks are swallowed by plan(), which then plans in numpy)."""
    specs = []

    def registry(spec, debug):
        specs.append(spec)
        raise Selected(spec)

    monkeypatch.setattr(jit, "_registry", registry)
    return specs


# page_order is asked for only where plan() runs on a CUDA device (it sorts pages there);
# the GPU test sees it loaded.
@pytest.mark.parametrize("spec", [s for s in LLAMA_SPECS if not isinstance(s, PageOrderSpec)],
                         ids=lambda spec: spec.name)
def test_exerciser_arguments_select_their_spec(spec, asked):
    with pytest.raises(Selected) as info:
        deploy_check.EXERCISERS[spec.FAMILY](spec, LLAMA_SPECS)
    if spec.HOST_ONLY:  # asked by plan(); the call then stops at its partner's module
        assert spec in asked, f"asked for {[s.name for s in asked]}"
    else:
        assert info.value.spec == spec, f"asked for {info.value.spec.name}"


TESTS_POD_SPECS = [s for s in parse_matrix(SCRIPTS / "matrices" / "tests") if s.FAMILY == "pod"]


@pytest.mark.parametrize("spec", TESTS_POD_SPECS, ids=lambda spec: spec.name)
def test_pod_exerciser_arguments_select_their_spec(spec, asked):
    """The POD modules of the tests matrix (the llama matrix has none): exercise_pod's
    arguments ask for exactly that module."""
    with pytest.raises(Selected) as info:
        deploy_check.EXERCISERS["pod"](spec, [])
    assert info.value.spec == spec, f"asked for {info.value.spec.name}"


def test_outside_configuration_raises_its_aot_line(cpu_api, fresh_cache):
    outside = deploy_check.outside_spec(LLAMA_SPECS)
    assert outside not in LLAMA_SPECS
    with pytest.raises(JitDisabledError) as info:
        deploy_check.exercise_decode(outside, LLAMA_SPECS)
    assert info.value.matrix_line == spec_line(outside)
    assert spec_line(outside) in str(info.value) and "flashinfer-jit aot" in str(info.value)
    assert deploy_check.check_outside(LLAMA_SPECS)["ok"]


# --- the check itself, without a compiler (GPU) --------------------------------------------------------
def published(root: Path) -> list[str]:
    """Entry folders of a cache root (hidden ones, .locks and .tmp, are not entries)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


@pytest.mark.gpu
def test_deploy_check_runs_the_llama_matrix_from_a_prebuilt_cache_without_nvcc(tmp_path):
    prebuilt = os.environ.get("FIJ_PREBUILT_LLAMA")
    if not prebuilt:
        pytest.skip("set FIJ_PREBUILT_LLAMA to a folder built by `flashinfer-jit aot --matrix scripts/matrices/llama "
                    "--out DIR` (scripts/gpu_check.sh builds one)")
    no_tools = tmp_path / "bin-without-tools"  # PATH: python is started by its full path
    no_tools.mkdir()
    writable, user = tmp_path / "cache", tmp_path / "xdg"
    report = tmp_path / "deploy.json"
    environ = dict(os.environ, PATH=str(no_tools), CUDA_HOME=str(tmp_path / "no-cuda-here"),
                   FLASHINFER_JIT_DISABLE_JIT="1", FLASHINFER_JIT_CACHE_PATH=prebuilt,
                   FLASHINFER_JIT_CACHE_DIR=str(writable), XDG_CACHE_HOME=str(user),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    environ.pop("CUDA_PATH", None)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "deploy_check.py"), "--matrix", str(LLAMA),
                           "--json", str(report)], env=environ, cwd=REPO, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(report.read_text())
    assert result["nvcc"] is None, "the check found an nvcc"
    assert result["ok"] and not result["never_loaded"] and result["outside"]["ok"]
    assert [e["name"] for e in result["entries"] if e["ok"]] == [s.name for s in LLAMA_SPECS]
    root = Path(prebuilt).resolve()
    outside = [e["name"] for e in result["entries"] if Path(e["module_path"]).parent != root]
    assert not outside, f"loaded from outside the prebuilt root {root}: {outside}"
    assert published(writable) == [] and published(user / "flashinfer_jit") == [], "the check wrote cache entries"


TESTS_SM90_SPECS = [s for s in parse_matrix(SCRIPTS / "matrices" / "tests") if s.FAMILY == "prefill_sm90"]


@pytest.mark.parametrize("spec", TESTS_SM90_SPECS, ids=lambda spec: spec.name)
def test_prefill_sm90_exerciser_arguments_select_their_spec(spec, asked):
    """The Hopper prefill modules of the tests matrix (both key tiles at head_dim 128):
    exercise_prefill_sm90's arguments ask for exactly that module."""
    with pytest.raises(Selected) as info:
        deploy_check.EXERCISERS["prefill_sm90"](spec, [])
    assert info.value.spec == spec, f"asked for {info.value.spec.name}"
