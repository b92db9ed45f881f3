"""Every family's module builds, links and imports without a GPU: one small module of each
family that no other test of the default run builds (RoPE, flatten, merge, decode, prefill;
the others' are built by test_cache.py, test_cli.py, test_decode*.py and test_pod.py), in one
`flashinfer-jit aot` run with two jobs, then each loaded and its ops looked up."""

from __future__ import annotations

import pytest

from flashinfer_jit import cli
from flashinfer_jit.pipeline import jit, toolchain
from flashinfer_jit.pipeline.errors import ToolchainError
from flashinfer_jit.pipeline.matrix import parse_matrix_text
from flashinfer_jit.specs import FAMILIES

# the smallest module of each (head_dim 64 where a family has one)
MATRIX = """\
rope     dtype_in=bfloat16  dtype_out=bfloat16
flatten  dtype_kv=bfloat16  dtype_out=bfloat16  head_dim=64
merge    dtype=bfloat16  head_dim=64
decode   dtype_q=float16  dtype_kv=float16  head_dim=64  group_tile=1
prefill  dtype_q=float16  dtype_kv=float16  dtype_o=float16  head_dim_qk=64  head_dim_vo=64  kv_source=ragged  mask=none
"""
# the Hopper prefill module and POD on Hopper's (sm_90a), built by their thorough test below
SM90_MATRIX = "prefill_sm90  dtype_q=float16  head_dim=64\npod_sm90  dtype_q=float16  head_dim=64  group_tile=1\n"
# built by the default run's other tests
ELSEWHERE = {"batch_indices", "append", "decode_plan", "prefill_plan", "page_order", "pod"}


def test_the_matrix_and_the_other_tests_cover_every_family():
    assert {s.FAMILY for s in parse_matrix_text(MATRIX + SM90_MATRIX)} | ELSEWHERE == set(FAMILIES)


def _build_and_load(text: str, tmp_path, capsys, arch: str) -> list:
    """`flashinfer-jit aot` of the matrix `text` with two jobs for `arch`, then each module
    loaded from the test's fresh cache with its ops looked up; the modules."""
    try:
        toolchain.get()
    except ToolchainError as exc:
        pytest.skip(f"needs nvcc, ninja and g++: {exc}")
    matrix = tmp_path / "matrix"
    matrix.write_text(text)
    specs = parse_matrix_text(text)
    assert cli.main(["aot", "--matrix", str(matrix), "-j", "2", "--arch", arch]) == 0
    assert f"built {len(specs)}, already cached 0, failed 0" in capsys.readouterr().out
    modules = []
    for spec in specs:
        module = jit.get_module(spec)
        for op in spec.op_schemas():
            assert callable(getattr(module, op)), f"{spec.name}: {op}"
        modules.append(module)
    return modules


@pytest.mark.slow
def test_one_module_of_each_family_builds_links_and_imports(fresh_cache, tmp_path, capsys):
    for module in _build_and_load(MATRIX, tmp_path, capsys, "9.0a"):
        assert module.path.is_relative_to(fresh_cache), module.path


@pytest.mark.slow
@pytest.mark.thorough
def test_hopper_prefill_module_builds_without_a_gpu(fresh_cache, tmp_path, capsys):
    """The Hopper prefill module and POD on Hopper's (sm_90a only: wgmma, setmaxnreg) build,
    link and import on a machine without a GPU, as an AOT image builds them, whatever --arch
    says. (Thorough: the default run stays under five minutes on two cores; CI runs it.)"""
    for module in _build_and_load(SM90_MATRIX, tmp_path, capsys, "8.0"):
        assert module.path.is_relative_to(fresh_cache), module.path
        assert "9.0a" in (module.path / "manifest.json").read_text()  # its own arch, not --arch's
