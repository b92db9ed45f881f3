"""The Hopper building blocks (csrc/hopper/: mbarriers, TMA, wgmma) in three standalone programs:
- tests/hopper/wgmma_probe.cu: S = Q K^T from two TMA-loaded 128B-swizzled K-major tiles,
  O = P V with P in registers and V MN-major (the descriptor's LBO/SBO candidates reported),
  and the dense wgmma rate;
- tests/hopper/fp8_probe.cu: the e4m3 wgmma of FP8 attention: S = Q K^T from 8-bit TMA tiles,
  O = P V with P in registers (two candidate A-fragment layouts reported) and V^T K-major,
  and P packed where the softmax leaves it (S's accumulator layout) against V^T's keys
  permuted to match, on the host and by the transpose of V in shared memory
  (csrc/hopper/sm90_fp8.cuh); the e4m3 rate;
- tests/hopper/fp8_attn_probe.cu: the prefill kernel's FP8 form (q, K, V in e4m3) and its bf16
  form on the same values, launched on hand-made work lists, against a double reference, timed;
- tests/hopper/attn_probe.cu: the Hopper attention kernel's schedules around the library
  kernel's consumer blocks (csrc/hopper/prefill_sm90.cuh; bf16, head_dim 128, causal or not,
  GQA): six variants (plain, ping-pong, persistent in snake order or from an atomic counter,
  two or three stages), each against a double reference, then timed.
The CPU tests compile them for sm_90a (every wrapper's PTX assembles, no spills); the GPU
tests run them on an sm_90 device."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from flashinfer_jit.pipeline.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "tests" / "hopper"


def _build(tmp_path, name: str = "wgmma_probe") -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    exe = tmp_path / name
    cmd = [nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", f"-I{ROOT / 'csrc'}",
           "-Xptxas", "-v", "-o", str(exe), str(PROBES / f"{name}.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spill stores" in done.stderr and " 0 bytes spill stores" in done.stderr
    # ptxas' advisory C7513: a wgmma pipeline serialized (registers an in-flight wgmma reads
    # written before its wait); the overlapped consumer loop exists to avoid exactly that
    assert "C7513" not in done.stderr, done.stderr[-2000:]
    return exe


def _run_on_hopper(tmp_path, name: str, timeout: int = 120) -> tuple:
    """Builds probe `name`, runs it on an sm_90 device (else skips), prints its output: (the
    finished process, its "name value" lines as a dict)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma and TMA need an sm_90 device")
    exe = _build(tmp_path, name)
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    print(done.stdout)
    return done, dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


@pytest.mark.parametrize("name", ["wgmma_probe", "fp8_probe", "fp8_attn_probe",
                                  pytest.param("attn_probe", marks=pytest.mark.thorough)])
def test_probe_compiles_for_sm90a(tmp_path, name):
    _build(tmp_path, name)


@pytest.mark.gpu
def test_probe_on_hopper(tmp_path):
    done, results = _run_on_hopper(tmp_path, "wgmma_probe")
    assert float(results["qk_ss_kmajor_rel_err"]) < 1e-5, done.stdout
    assert any(float(v) < 1e-5 for k, v in results.items() if k.startswith("pv_rs_mnmajor")), done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
def test_fp8_probe_on_hopper(tmp_path):
    """The e4m3 building blocks: Q K^T to the fp8 MMA's accumulation, P V in one of the two candidate
    A-fragment layouts, and P V from S's layout (pack_p_e4m3) in that layout, against V^T's
    keys permuted on the host and against V transposed in shared memory (transpose_v_e4m3)."""
    done, results = _run_on_hopper(tmp_path, "fp8_probe")
    # (fp8 wgmma accumulates in about 13-14 bits: 2.4e-4 and 3.5e-4 on an H200, where a wrong
    # fragment layout is 0.58 off; fp8_probe.cu's kFp8Tol)
    tol = 2e-3
    assert float(results["fp8_qk_ss_rel_err"]) < tol, done.stdout
    layouts = [i for i in range(2) if float(results[f"fp8_pv_rs_layout{i}_rel_err"]) < tol]
    assert layouts == [0], done.stdout  # (H200, 2026-11-30: layout 0, pack_p_e4m3's default)
    assert float(results["fp8_pv_from_s_layout0_rel_err"]) < tol, done.stdout
    assert float(results["fp8_pv_transposed_layout0_rel_err"]) < tol, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


def test_fp8_transpose_model():
    """scripts/fp8_transpose_model.py (CPU): the V^T transpose's ldmatrix / stmatrix scheme moves
    every byte of a tile to its vt_key place, each unit once, every phase on 8 distinct bank
    groups, for the kernel's three transposing warps and for the probe's four; and P packed in
    place against that V^T gives P V."""
    for warps in (3, 4):
        done = subprocess.run(["python3", str(ROOT / "scripts" / "fp8_transpose_model.py"), "--warps", str(warps)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "transpose exact: True" in done.stdout and "worst bank multiplicity: 1" in done.stdout, done.stdout


@pytest.mark.gpu
def test_fp8_attention_probe_on_hopper(tmp_path):
    """The prefill kernel's FP8 form (q, K and V in e4m3, bf16 out) beside its bf16 form on the
    same values: every row of three small batches and a sample of three large ones against a
    double reference (outputs NaN-poisoned), then both forms timed (fp8_attn_probe.cu)."""
    done, results = _run_on_hopper(tmp_path, "fp8_attn_probe", timeout=300)
    errors = {k: float(v) for k, v in results.items() if k.endswith("_rel_err")}
    assert len(errors) == 12, done.stdout + done.stderr  # 6 cases x 2 forms
    # (P in e4m3 and the fp8 MMA's ~13-14-bit sums: a few percent; a wrong layout is O(1) off)
    assert all(v < (6e-2 if "_fp8_" in k else 1e-2) for k, v in errors.items()), done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
def test_attention_probe_on_hopper(tmp_path):
    done, _ = _run_on_hopper(tmp_path, "attn_probe", timeout=300)
    checks = [line.split() for line in done.stdout.splitlines() if line.startswith("check_")]
    assert len(checks) == 24 and all(float(v) < 2e-2 for _, v in checks), done.stdout + done.stderr  # 6 x 4
    assert done.returncode == 0, done.stdout + done.stderr
