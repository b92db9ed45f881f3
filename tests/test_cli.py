"""The `flashinfer-jit` commands, called in-process (`cli.main([...])`), plus one run of
`python -m flashinfer_jit doctor` for the module entry point.

Real nvcc builds cost ~10 s each here, so one module-scoped cache of two real modules
(`built_cache`) is built once and copied into each test's fresh cache root; the only
other build is a template that fails at once.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashinfer_jit import cli, env, render, toolchain
from flashinfer_jit.jit import BuildReport
from flashinfer_jit.specs import BatchIndicesSpec

REPO = Path(__file__).resolve().parent.parent
MATRIX = "batch_indices\nappend dtype_kv=bfloat16 head_dim=128  # one real kernel\n"
NAMES = {"batch_indices_i32", "append_bf16_hd128_nhd_csr"}


@pytest.fixture(autouse=True)
def user_cache_in_tmp(tmp_path, monkeypatch):
    """The user cache dir is a lookup root too: keep every command away from the real one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@dataclass
class Built:
    root: Path
    matrix: Path
    exit_code: int
    report: dict


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Built:
    """`aot` over a two-module matrix into a cache shared by the module's tests."""
    work = tmp_path_factory.mktemp("aot")
    matrix, report = work / "matrix", work / "report.json"
    matrix.write_text(MATRIX)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_JIT_CACHE_DIR", str(work / "cache"))
        mp.setenv("XDG_CACHE_HOME", str(work / "xdg"))
        code = cli.main(["aot", "--matrix", str(matrix), "-j", "2", "--arch", "9.0a",
                         "--json", str(report)])
    return Built(work / "cache", matrix, code, json.loads(report.read_text()))


@pytest.fixture
def cache_copy(built_cache, fresh_cache) -> Path:
    """This test's own copy of the built cache, to damage or clean as it likes."""
    shutil.copytree(built_cache.root, fresh_cache, symlinks=True)
    return fresh_cache


def entry_dir(root: Path, name: str) -> Path:
    (path,) = [p for p in root.iterdir() if p.name.startswith(name + "-")]
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- aot ------------------------------------------------------------------------------
def test_aot_builds_the_matrix(built_cache):
    assert built_cache.exit_code == 0
    report = built_cache.report
    assert set(report["built"]) == NAMES and report["cached"] == [] and report["failed"] == {}
    assert report["entries"] == 2 and report["archs"] == ["9.0a"] and report["seconds"] > 0
    assert {p.name.rsplit("-", 1)[0] for p in built_cache.root.iterdir()
            if not p.name.startswith(".")} == NAMES


def test_aot_second_run_finds_everything_cached(cache_copy, built_cache, capsys, tmp_path):
    report = tmp_path / "again.json"
    code, out, err = run(capsys, "aot", "--matrix", str(built_cache.matrix), "--arch", "9.0a",
                         "--json", str(report))
    assert code == 0
    assert "built 0, already cached 2, failed 0" in out
    assert "2 modules from" in err and "entries" not in err  # nothing to build: no bar
    assert set(json.loads(report.read_text())["cached"]) == NAMES


def test_aot_reports_a_failed_build_with_its_log(fresh_cache, monkeypatch, tmp_path, capsys):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "broken.cu.j2").write_text('#error "deliberately broken: {{ module_name }}"\n')
    real_source_dir = env.source_dir
    monkeypatch.setattr(env, "source_dir",
                        lambda kind: templates if kind == "templates" else real_source_dir(kind))
    monkeypatch.setattr(BatchIndicesSpec, "TEMPLATES",
                        {"kernel.cu": "broken.cu.j2", "binding.cc": "broken.cu.j2"})
    render._environment.cache_clear()
    try:
        matrix = tmp_path / "m"
        matrix.write_text("batch_indices\n")
        code, out, err = run(capsys, "aot", "--matrix", str(matrix), "-j", "2", "--arch", "9.0a")
    finally:
        render._environment.cache_clear()
    assert code == 1
    assert "built 0, already cached 0, failed 1" in out
    line = next(l for l in out.splitlines() if "FAILED batch_indices_i32" in l)
    log = Path(line.split("see ", 1)[1])
    assert log.is_file() and "deliberately broken" in log.read_text()


def test_summary_of_a_report():
    report = BuildReport(built=["a"], cached=["b", "c"], failed={"d": "/logs/d.log"}, seconds=3.14)
    lines = cli.summary_lines(report)
    assert lines[0] == "built 1, already cached 2, failed 1 in 3.1s"
    assert lines[1] == "  FAILED d: see /logs/d.log"
    doc = cli.report_json(report, "m", ("9.0a",), 4)
    assert doc["entries"] == 4 and doc["failed"] == {"d": "/logs/d.log"} and doc["seconds"] == 3.14


def test_progress_bar_lines_on_a_pipe_and_redraws_on_a_terminal():
    assert cli.progress_line(3, 12, 45.23, width=12) == "[###.........] 3/12 entries  45.2s"
    pipe = io.StringIO()
    bar = cli.ProgressBar(pipe)
    for done in range(3):
        bar(done, 2, done * 1.0)
    bar.close()
    assert pipe.getvalue().splitlines()[-1].endswith("2/2 entries  2.0s")
    assert len(pipe.getvalue().splitlines()) == 3

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = cli.ProgressBar(term)
    bar(0, 2, 0.0)
    bar(1, 2, 1.0)
    bar.close()  # interrupted before the end: the line is still finished
    assert term.getvalue().count("\r") == 2 and term.getvalue().endswith("\n")


def test_aot_bad_matrix_is_a_usage_error(fresh_cache, tmp_path, capsys):
    matrix = tmp_path / "m"
    matrix.write_text("# deployment\napend dtype_kv=float16\n")
    code, _, err = run(capsys, "aot", "--matrix", str(matrix), "--arch", "9.0a")
    assert code == 2 and f"{matrix}:2: unknown family 'apend'" in err


def test_aot_without_targets_says_how_to_give_them(fresh_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLASHINFER_JIT_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(env, "visible_gpu_archs", lambda: ())
    matrix = tmp_path / "m"
    matrix.write_text("batch_indices\n")
    code, _, err = run(capsys, "aot", "--matrix", str(matrix))
    assert code == 2 and "FLASHINFER_JIT_CUDA_ARCH_LIST" in err


# --- list -----------------------------------------------------------------------------
def test_list_json(cache_copy, capsys):
    code, out, _ = run(capsys, "list", "--json")
    rows = json.loads(out)
    assert code == 0 and {r["name"] for r in rows} == NAMES
    for row in rows:
        assert len(row["key"]) == 64 and row["path"].endswith(row["key"][:16])
        assert row["built_by"] == "aot" and row["archs"] == ["9.0a"]
        assert row["size_bytes"] > 0 and row["build_seconds"] > 0 and row["built_at"]


def test_list_table(cache_copy, capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["NAME", "KEY", "SIZE"]
    for name in NAMES:
        key = entry_dir(cache_copy, name).name.rsplit("-", 1)[1]
        assert any(l.startswith(name) and key in l and " aot " in l for l in out.splitlines())
    assert "2 entries" in out


def test_list_of_an_empty_cache(fresh_cache, capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.startswith("no entries in")


# --- verify ---------------------------------------------------------------------------
def test_verify_good_cache(cache_copy, capsys):
    code, out, _ = run(capsys, "verify")
    assert code == 0 and sum(l.startswith("OK   ") for l in out.splitlines()) == 2


def test_verify_detects_a_truncated_library_and_fix_removes_it(cache_copy, capsys):
    bad = entry_dir(cache_copy, "append_bf16_hd128_nhd_csr")
    library = bad / "append_bf16_hd128_nhd_csr.so"
    size = library.stat().st_size
    os.truncate(library, size // 2)

    code, out, _ = run(capsys, "verify")
    assert code == 1
    assert f"BAD  {bad.name}: {library.name} has {size // 2} bytes, manifest says {size}" in out
    assert f"OK   {entry_dir(cache_copy, 'batch_indices_i32').name}" in out
    assert bad.exists()  # verify alone changes nothing

    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "removed" in out and not bad.exists()
    assert (cache_copy / ".locks" / f"{bad.name}.lock").exists()
    assert run(capsys, "verify")[0] == 0


# --- clean ----------------------------------------------------------------------------
def make_side_files(root: Path) -> dict[str, Path]:
    """A temp folder of a build that died two hours ago, one of a live build, and a log."""
    hours_ago = time.time() - 2 * 3600
    stale = root / ".tmp" / "aot.dead.123"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "kernel.o").write_bytes(b"x")
    for path in (stale / "sub" / "kernel.o", stale / "sub", stale):
        os.utime(path, (hours_ago, hours_ago))
    live = root / ".tmp" / "aot.live.456"
    live.mkdir()
    log = root / ".logs" / "x-20260101-000000-1.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("error")
    return {"stale": stale, "live": live, "log": log}


def test_clean_all_keeps_lock_files(cache_copy, capsys):
    locks = sorted((cache_copy / ".locks").iterdir())
    assert locks
    side = make_side_files(cache_copy)
    code, out, _ = run(capsys, "clean", "--all")
    assert code == 0 and "removed 2 entries" in out
    assert [p for p in cache_copy.iterdir() if not p.name.startswith(".")] == []
    assert sorted((cache_copy / ".locks").iterdir()) == locks
    assert not side["stale"].exists() and side["live"].exists() and not side["log"].exists()


def test_clean_older_than_removes_only_old_entries(cache_copy, capsys):
    old = entry_dir(cache_copy, "batch_indices_i32")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["built_at"] = "2020-01-01T00:00:00+00:00"
    (old / "manifest.json").write_text(json.dumps(manifest))
    young = entry_dir(cache_copy, "append_bf16_hd128_nhd_csr")

    code, out, _ = run(capsys, "clean", "--older-than", "7d", "--dry-run")
    assert code == 0 and f"would remove {old}" in out and old.exists()

    code, out, _ = run(capsys, "clean", "--older-than", "7d")
    assert code == 0 and "removed 1 entry" in out
    assert not old.exists() and young.exists()


def test_clean_needs_to_be_told_what(capsys):
    code, _, err = run(capsys, "clean")
    assert code == 2 and "usage: flashinfer-jit clean" in err and "--older-than" in err


@pytest.mark.parametrize("text, seconds", [
    ("7d", 7 * 86400), ("12h", 12 * 3600), ("30m", 1800), ("90s", 90), ("1w", 604800),
    ("1d12h", 36 * 3600), ("0.5h", 1800)])
def test_parse_duration(text, seconds):
    assert cli.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "-1d", "7d garbage"])
def test_parse_duration_rejects(text):
    with pytest.raises(Exception, match="cannot read duration"):
        cli.parse_duration(text)


# --- doctor ---------------------------------------------------------------------------
def doctor_lines(out: str) -> dict[str, str]:
    """check name -> its line"""
    return {line.split()[1]: line for line in out.splitlines()
            if line.startswith(("OK", "PROBLEM"))}


def test_doctor_all_ok_without_a_gpu_when_archs_are_given(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT", raising=False)
    code, out, _ = run(capsys, "doctor")
    lines = doctor_lines(out)
    assert code == 0, out
    assert set(lines) == {"nvcc", "c++", "ninja", "torch", "archs", "jit", "cache", "gpus"}
    assert all(line.startswith("OK ") for line in lines.values()), out
    assert "release" in lines["nvcc"]
    assert "9.0a (from FLASHINFER_JIT_CUDA_ARCH_LIST)" in lines["archs"]
    assert str(fresh_cache) in lines["cache"] and "free" in lines["cache"]


def test_doctor_names_a_missing_nvcc_and_the_fix(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    code, out, _ = run(capsys, "doctor")
    line = doctor_lines(out)["nvcc"]
    assert code == 1 and line.startswith("PROBLEM") and "CUDA_HOME" in line


def test_doctor_without_targets(fresh_cache, monkeypatch, capsys):
    import torch

    monkeypatch.delenv("FLASHINFER_JIT_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(env, "visible_gpu_archs", lambda: ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "doctor")
    lines = doctor_lines(out)
    assert code == 1
    assert lines["archs"].startswith("PROBLEM")
    assert "FLASHINFER_JIT_CUDA_ARCH_LIST" in lines["archs"]
    assert lines["gpus"].startswith("PROBLEM") and "none visible" in lines["gpus"]


def test_doctor_low_disk_space(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(cli.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=1 << 30, used=1 << 30, free=1 << 20))
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "under 256.0 MiB free" in doctor_lines(out)["cache"]


def test_no_command_prints_help(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "doctor" in err and "aot" in err


def test_python_dash_m_doctor(tmp_path):
    python_path = [str(REPO), os.environ.get("PYTHONPATH")]
    environ = {**os.environ, "FLASHINFER_JIT_CACHE_DIR": str(tmp_path / "cache"),
               "XDG_CACHE_HOME": str(tmp_path / "xdg"), "FLASHINFER_JIT_CUDA_ARCH_LIST": "9.0a",
               "PYTHONPATH": os.pathsep.join(filter(None, python_path))}
    environ.pop("FLASHINFER_JIT_DISABLE_JIT", None)
    proc = subprocess.run([sys.executable, "-m", "flashinfer_jit", "doctor"], cwd=tmp_path,
                          env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK       nvcc" in proc.stdout and "everything needed to build" in proc.stdout
