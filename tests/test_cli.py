"""The `flashinfer-jit` commands, called in-process (`cli.main([...])`), plus one run of
`python -m flashinfer_jit doctor` for the module entry point.

Real nvcc builds cost ~10 s each here, so one module-scoped cache of three real modules
(`built_cache`, built by `aot --out`) is built once and copied into each test's fresh
cache root; the only other build is a template that fails at once.
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

from flashinfer_jit import cli
from flashinfer_jit.pipeline import cache, env, render, toolchain
from flashinfer_jit.pipeline.jit import BuildReport
from flashinfer_jit.specs import BatchIndicesSpec

REPO = Path(__file__).resolve().parent.parent
# decode_plan: host code only (no target arch), and an op that runs without a GPU
MATRIX = "batch_indices\nappend dtype_kv=bfloat16 head_dim=128  # one real kernel\ndecode_plan\n"
NAMES = {"batch_indices_i32", "append_bf16_hd128_nhd_csr", "decode_plan"}


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
    default_root: Path  # FLASHINFER_JIT_CACHE_DIR while it was built (--out went elsewhere)


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Built:
    """`aot --out` over a three-module matrix into a cache shared by the module's tests."""
    work = tmp_path_factory.mktemp("aot")
    matrix, report = work / "matrix", work / "report.json"
    matrix.write_text(MATRIX)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_JIT_CACHE_DIR", str(work / "default"))
        mp.setenv("XDG_CACHE_HOME", str(work / "xdg"))
        code = cli.main(["aot", "--matrix", str(matrix), "-j", "2", "--arch", "9.0a",
                         "--out", str(work / "cache"), "--json", str(report)])
    return Built(work / "cache", matrix, code, json.loads(report.read_text()), work / "default")


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


def listing(folder: Path) -> list[tuple] | None:
    """Every path under `folder` (itself included) with its kind, size and modification
    time, which a write there would change; None if it does not exist."""
    if not folder.exists():
        return None
    return [(str(p.relative_to(folder)), p.is_dir(), p.lstat().st_size if p.is_file() else 0,
             p.lstat().st_mtime_ns) for p in [folder, *sorted(folder.rglob("*"))]]


# --- aot ------------------------------------------------------------------------------
def test_aot_builds_the_matrix(built_cache):
    assert built_cache.exit_code == 0
    report = built_cache.report
    assert set(report["built"]) == NAMES and report["cached"] == [] and report["failed"] == {}
    assert report["entries"] == 3 and report["archs"] == ["9.0a"] and report["seconds"] > 0
    assert {p.name.rsplit("-", 1)[0] for p in built_cache.root.iterdir()
            if not p.name.startswith(".")} == NAMES
    assert not built_cache.default_root.exists()  # --out, not FLASHINFER_JIT_CACHE_DIR


def test_aot_second_run_finds_everything_cached(cache_copy, built_cache, capsys, tmp_path):
    report = tmp_path / "again.json"
    code, out, err = run(capsys, "aot", "--matrix", str(built_cache.matrix), "--arch", "9.0a",
                         "--json", str(report))
    assert code == 0
    assert "built 0, already cached 3, failed 0" in out
    assert "3 modules from" in err and "entries" not in err  # nothing to build: no bar
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
    report.hint = "out of disk space? (the build log says 'No space left on device'). Free space ..."
    assert cli.summary_lines(report)[-1] == report.hint  # instead of "fix the compiler errors"


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
        assert row["built_by"] == "aot" and row["archs"] == ([] if row["name"] == "decode_plan" else ["9.0a"])
        assert row["size_bytes"] > 0 and row["build_seconds"] > 0 and row["built_at"]
        assert row["stale"] is None and row["prebuilt"] is False and row["last_used"]


def test_list_table(cache_copy, capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["NAME", "KEY", "SIZE"]
    for name in NAMES:
        key = entry_dir(cache_copy, name).name.rsplit("-", 1)[1]
        assert any(l.startswith(name) and key in l and "aot" in l.split() for l in out.splitlines())
    assert "3 entries" in out and "stale" not in out


def test_list_of_an_empty_cache(fresh_cache, capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.startswith("no entries in")


# --- verify ---------------------------------------------------------------------------
def test_verify_good_cache(cache_copy, capsys):
    code, out, _ = run(capsys, "verify")
    entries_ok = [l for l in out.splitlines() if l.startswith("OK   ") and ".fastcall/" not in l]
    assert code == 0 and len(entries_ok) == 3
    assert any(l.startswith("OK   .fastcall/") for l in out.splitlines())  # run()'s extension, built by aot


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


def test_verify_and_pack_of_an_empty_cache_say_no_entries_and_write_nothing(fresh_cache, tmp_path, capsys):
    """As `list` says it: no "every entry matches" over nothing, and no archive of nothing
    (nor a temp file, nor a change to an archive already there)."""
    for argv in (["verify"], ["verify", "--fix"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0 and out.startswith("no entries in ") and "matches its manifest" not in out
    assert not fresh_cache.exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    earlier = tmp_path / "earlier.tar.gz"
    earlier.write_bytes(b"an archive packed before")
    before = listing(tmp_path)
    for argv in (["pack", str(empty)], ["pack", str(empty), "--out", str(earlier)]):
        code, out, err = run(capsys, *argv)
        assert code == 1 and f"flashinfer-jit pack: no entries in {empty}: nothing written" in err
        assert "packed" not in out and "unpack with" not in out
    assert listing(tmp_path) == before  # not even a temp file came and went

    (empty / "junk_folder").mkdir()  # no entry is complete: the archive would hold nothing
    code, out, err = run(capsys, "pack", str(empty), "--out", str(earlier))
    assert code == 1 and "skipped junk_folder: no readable manifest.json" in out
    assert f"no complete entry (1 folder left out) in {empty}: nothing written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.tar.gz", "empty"]
    assert earlier.read_bytes() == b"an archive packed before"


def test_verify_fix_and_clean_remove_only_entries_of_this_cache(cache_copy, tmp_path, capsys):
    """A folder is removed only when it is provably an entry (named `<name>-<16 hex>`, holding
    a manifest or a file of that name's build); anything else is named and left whole."""
    junk = cache_copy / "junk_folder"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    lookalike = cache_copy / "notes-0123456789abcdef"  # an entry's name, none of its files
    lookalike.mkdir()
    (lookalike / "draft.txt").write_text("mine too")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("{")
    link = cache_copy / "linked-0123456789abcdef"  # a link is never one of our entries
    link.symlink_to(elsewhere)
    strangers = [junk, lookalike, link]
    bad = entry_dir(cache_copy, "append_bf16_hd128_nhd_csr")
    os.truncate(bad / "append_bf16_hd128_nhd_csr.so", 100)
    unfinished = cache_copy / "decode_plan-fedcba9876543210"  # a build's log, no manifest: ours
    unfinished.mkdir()
    (unfinished / "build.log").write_text("ninja: build stopped")

    code, out, _ = run(capsys, "verify")
    assert code == 1
    for path in strangers:
        assert f"SKIP {path}: not an entry of this cache: left alone" in out
    assert f"BAD  {bad.name}: append_bf16_hd128_nhd_csr.so has 100 bytes" in out
    assert f"BAD  {unfinished.name}: no readable manifest.json" in out

    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 0 and "2 bad entries, 2 removed, 0 kept" in out
    assert out.count("left alone") == 3 and not bad.exists() and not unfinished.exists()
    assert (junk / "notes.txt").read_text() == "mine" and (lookalike / "draft.txt").read_text() == "mine too"
    assert link.is_symlink() and (elsewhere / "manifest.json").read_text() == "{"
    assert list((cache_copy / ".tmp").iterdir()) == []  # each removal went whole

    code, out, _ = run(capsys, "clean", "--all")
    assert code == 0 and "removed 2 entries" in out
    for path in strangers:
        assert f"left alone {path}: not an entry of this cache" in out
    assert sorted(p for p in cache_copy.iterdir() if not p.name.startswith(".")) == sorted(strangers)
    assert (junk / "notes.txt").exists() and (lookalike / "draft.txt").exists() and link.is_symlink()

    code, out, _ = run(capsys, "verify")
    assert code == 0 and "no entries in" in out and out.count("SKIP ") == 3
    code, out, _ = run(capsys, "list")  # the same judgement
    assert code == 0 and out.startswith("no entries in ")
    assert f"not entries of this cache, so not listed: {junk}, {link}, {lookalike}" in out
    assert json.loads(run(capsys, "list", "--json")[1]) == []


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
    assert code == 0 and "removed 3 entries" in out
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
            if line.startswith(("OK", "NOTE", "PROBLEM"))}


def test_doctor_all_ok_without_a_gpu_when_archs_are_given(fresh_cache, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT", raising=False)
    code, out, _ = run(capsys, "doctor")
    lines = doctor_lines(out)
    assert code == 0, out
    assert set(lines) == {"nvcc", "c++", "ninja", "torch", "archs", "jit", "cache", "gpus"}
    gpu = torch.cuda.is_available()
    assert all(line.startswith("OK ") for name, line in lines.items() if gpu or name != "gpus"), out
    if not gpu:  # information, not a problem
        assert lines["gpus"].startswith("NOTE ") and "cannot run on this host" in lines["gpus"]
    assert "release" in lines["nvcc"]
    assert "9.0a (from FLASHINFER_JIT_CUDA_ARCH_LIST)" in lines["archs"]
    assert str(fresh_cache) in lines["cache"] and "free" in lines["cache"]


def test_doctor_names_a_missing_nvcc_and_the_fix(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    code, out, _ = run(capsys, "doctor")
    line = doctor_lines(out)["nvcc"]
    assert code == 1 and line.startswith("PROBLEM") and "CUDA_HOME" in line


@pytest.mark.parametrize("root_exists", [False, True])
def test_doctor_on_a_cpu_only_host_notes_it_and_writes_nothing(fresh_cache, tmp_path, monkeypatch, capsys,
                                                               root_exists):
    """The README's CPU host (no GPU, FLASHINFER_JIT_CUDA_ARCH_LIST unset): archs and gpus are
    NOTEs, not problems, and the exit code is 0. doctor only reads: a cache root that does not
    exist stays absent; one that does gets no .locks/, .tmp/ or probe file; the user cache gets
    no compiler-version memo."""
    import torch

    monkeypatch.delenv("FLASHINFER_JIT_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT", raising=False)
    monkeypatch.setattr(env, "visible_gpu_archs", lambda: ())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if root_exists:
        (fresh_cache / "decode_plan-0123456789abcdef").mkdir(parents=True)
        (fresh_cache / "decode_plan-0123456789abcdef" / "decode_plan.so").write_bytes(b"\x7fELF")
        old = time.time() - 3600  # a write now would show in the listing
        for path in (fresh_cache / "decode_plan-0123456789abcdef", fresh_cache):
            os.utime(path, (old, old))
    before = listing(tmp_path)

    code, out, _ = run(capsys, "doctor")
    lines = doctor_lines(out)
    assert code == 0, out
    assert lines["archs"].startswith("NOTE ") and "FLASHINFER_JIT_CUDA_ARCH_LIST='9.0a'" in lines["archs"]
    assert lines["gpus"].startswith("NOTE ") and "no GPU visible" in lines["gpus"]
    assert "can be built with FLASHINFER_JIT_CUDA_ARCH_LIST" in lines["gpus"] and "not run" in lines["gpus"]
    assert not any(line.startswith("PROBLEM") for line in lines.values()), out
    assert "everything needed to build modules is in place (see the NOTE on archs, gpus)" in out
    assert ("1 entry" if root_exists else "created by the first build") in lines["cache"]
    assert listing(tmp_path) == before
    assert not (tmp_path / "xdg").exists() and fresh_cache.exists() == root_exists


def test_doctor_names_a_bad_arch_list(fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "hopper")
    code, out, _ = run(capsys, "doctor")
    line = doctor_lines(out)["archs"]
    assert code == 1 and line.startswith("PROBLEM") and "cannot read 'hopper'" in line
    assert "1 problem(s) (archs)" in out


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


# --- aot --entry / --out ----------------------------------------------------------------
def test_aot_needs_a_matrix_or_an_entry(fresh_cache, capsys):
    code, _, err = run(capsys, "aot", "--arch", "9.0a")
    assert code == 2 and "--matrix FILE and/or --entry LINE" in err
    code, _, err = run(capsys, "aot", "--entry", "batch_indices", "--entry", "apend head_dim=128")
    assert code == 2 and "--entry 2:1: unknown family 'apend'" in err


def test_aot_out_must_be_writable(fresh_cache, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run(capsys, "aot", "--entry", "decode_plan", "--out", str(blocker / "cache"))
    assert code == 1 and f"cannot build into {blocker / 'cache'}: not a writable folder" in err


def test_aot_out_counts_only_its_own_entries(built_cache, tmp_path, monkeypatch, capsys):
    """An entry elsewhere (here: the default root) does not make `--out DIR` complete."""
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(built_cache.root))
    code, out, _ = run(capsys, "aot", "--entry", "decode_plan")
    assert code == 0 and "built 0, already cached 1" in out
    out_dir = tmp_path / "image-cache"
    code, out, err = run(capsys, "aot", "--entry", "decode_plan", "--out", str(out_dir))
    assert code == 0 and "built 1, already cached 0" in out and "for the host" in err
    assert [p.name.rsplit("-", 1)[0] for p in out_dir.iterdir() if not p.name.startswith(".")] == ["decode_plan"]


# --- pack -----------------------------------------------------------------------------
LOAD_PACKED = """
import json, sys
from flashinfer_jit.pipeline import jit
from flashinfer_jit.specs import BatchIndicesSpec, DecodePlanSpec
indices, plan = jit.get_module(BatchIndicesSpec()), jit.get_module(DecodePlanSpec())
print(json.dumps({"paths": [str(indices.path), str(plan.path)], "config_bytes": plan.config_bytes()}))
"""


def subprocess_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    environ = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    environ.update(overrides)
    return environ


def unpack(archive: Path, root: Path) -> None:
    """As the deployment notes say: mkdir -p ROOT && tar -xf ARCHIVE -C ROOT."""
    root.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(archive), "-C", str(root)], check=True, timeout=120)


FORMATS = ["tar.gz", pytest.param("tar.zst", marks=pytest.mark.skipif(
    shutil.which("zstd") is None, reason="zstd is not on PATH"))]


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")
@pytest.mark.parametrize("suffix", FORMATS)
def test_pack_holds_only_complete_entries_and_unpacks_into_a_cache_that_loads(
        built_cache, tmp_path, capsys, suffix):
    src = tmp_path / "src"
    shutil.copytree(built_cache.root, src, symlinks=True)
    bad = entry_dir(src, "append_bf16_hd128_nhd_csr")
    library = bad / "append_bf16_hd128_nhd_csr.so"
    os.truncate(library, library.stat().st_size // 2)
    (src / "half-copied-0123456789abcdef").mkdir()  # no manifest: not an entry
    (src / "half-copied-0123456789abcdef" / "x.so").write_bytes(b"\x7fELF")
    (src / ".tmp" / "aot.dead.1").mkdir(parents=True)
    (src / ".logs").mkdir()
    (src / ".logs" / "x.log").write_text("error")
    good = {entry_dir(src, "batch_indices_i32").name, entry_dir(src, "decode_plan").name}

    archive = tmp_path / f"cache.{suffix}"
    code, out, _ = run(capsys, "pack", str(src), "--out", str(archive))
    assert code == 1  # something was left out
    assert f"packed 2 entries of {src} into {archive} ({'zstd' if suffix == 'tar.zst' else 'gzip'}" in out
    assert f"skipped {bad.name}: {library.name} has" in out
    assert "skipped half-copied-0123456789abcdef: no readable manifest.json" in out

    dst = tmp_path / "dst"
    unpack(archive, dst)
    # no locks, temp folders or logs; run()'s fij_fastcall extension comes along where aot built it
    fastcall_libs = sorted(str(p.relative_to(src)) for p in src.glob(".fastcall/*/fij_fastcall*"))
    assert {p.name for p in dst.iterdir()} == good | ({".fastcall"} if fastcall_libs else set())
    assert sorted(str(p.relative_to(dst)) for p in dst.glob(".fastcall/*/fij_fastcall*")) == fastcall_libs
    if fastcall_libs:
        assert f"with run()'s fij_fastcall extension ({fastcall_libs[0]}" in out
    for name in good:
        assert cache.verify_entry(dst / name) is None
        assert sorted(p.name for p in (dst / name).iterdir()) == sorted(p.name for p in (src / name).iterdir())

    # a deployment image: the archive as a read-only root, no nvcc, JIT disabled
    proc = subprocess.run([sys.executable, "-c", LOAD_PACKED], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=subprocess_env(
                              tmp_path, FLASHINFER_JIT_CACHE_PATH=str(dst),
                              FLASHINFER_JIT_CACHE_DIR=str(tmp_path / "writable"), FLASHINFER_JIT_DISABLE_JIT="1",
                              CUDA_HOME=str(tmp_path / "no-cuda"), PATH=str(tmp_path / "no-tools")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["paths"]) == sorted(str(dst / name) for name in good)
    assert result["config_bytes"] > 0


def test_pack_member_order_and_defaults(built_cache, tmp_path, capsys, monkeypatch):
    """Each entry's manifest comes after its files (a half-extracted entry does not load);
    members carry no owner; the same cache packs to the same bytes; without --out the
    archive lands beside DIR, .tar.gz when zstd is missing."""
    import tarfile

    from flashinfer_jit.pipeline import pack

    monkeypatch.setattr(pack, "zstd_program", lambda: None)
    src = tmp_path / "src"
    shutil.copytree(built_cache.root, src, symlinks=True)
    code, out, _ = run(capsys, "pack", str(src))
    archive = tmp_path / "src.tar.gz"
    assert code == 0 and f"packed 3 entries of {src} into {archive} (gzip" in out
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    for name in NAMES:
        own = [m.name for m in members if m.name.split("/")[0].startswith(name + "-")]
        assert own[-1].endswith("/manifest.json") and len(own) > 5, own
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    first = archive.read_bytes()
    assert run(capsys, "pack", str(src))[0] == 0 and archive.read_bytes() == first

    code, _, err = run(capsys, "pack", str(src), "--out", str(tmp_path / "x.tar.zst"))
    assert code == 2 and "zstd is not on PATH; install it or name the archive *.tar.gz" in err
    code, _, err = run(capsys, "pack", str(src), "--out", str(tmp_path / "x.zip"))
    assert code == 2 and "name it *.tar.zst or *.tar.gz" in err
    code, _, err = run(capsys, "pack", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in err
    assert not (tmp_path / "x.zip").exists() and not list(tmp_path.glob(".*.tmp"))


# --- list / clean --stale -------------------------------------------------------------
def edit_manifest(entry: Path, **changes) -> None:
    """Change manifest fields (not covered by its own file list: the entry still verifies)."""
    path = entry / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, value in changes.items():
        manifest[name] = {**manifest[name], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(manifest))


def test_list_marks_entries_of_another_installation_stale_and_clean_stale_removes_them(
        cache_copy, capsys, monkeypatch):
    other_torch = entry_dir(cache_copy, "batch_indices_i32")
    edit_manifest(other_torch, torch={"torch": "2.1.0+cu121", "torch_cuda": "12.1"})
    other_package = entry_dir(cache_copy, "decode_plan")
    edit_manifest(other_package, package_version="0.0.1")
    other_nvcc = entry_dir(cache_copy, "append_bf16_hd128_nhd_csr")
    edit_manifest(other_nvcc, toolchain={"nvcc": "Build cuda_11.8.r11.8/compiler.31833905_0"})

    rows = {r["name"]: r for r in json.loads(run(capsys, "list", "--json")[1])}
    import torch

    assert rows["batch_indices_i32"]["stale"] == (
        f"built for torch 2.1.0+cu121 (here {torch.__version__}), torch_cuda 12.1 (here {torch.version.cuda})")
    assert rows["decode_plan"]["stale"] == "built for package 0.0.1 (here 0.1.0)"
    assert rows["append_bf16_hd128_nhd_csr"]["stale"].startswith("built for nvcc Build cuda_11.8")
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.count("STALE: built for") == 3
    assert "3 stale (never loaded by this installation): `flashinfer-jit clean --stale`" in out

    # Without a compiler that may run, entries are found by content key: another nvcc is fine.
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    rows = {r["name"]: r for r in json.loads(run(capsys, "list", "--json")[1])}
    assert rows["append_bf16_hd128_nhd_csr"]["stale"] is None and rows["decode_plan"]["stale"]
    code, out, _ = run(capsys, "clean", "--stale", "--dry-run")
    assert code == 0 and "would remove 2 entries" in out and other_torch.exists()
    code, out, _ = run(capsys, "clean", "--stale")
    assert code == 0 and f"removed {other_torch} (stale: built for torch 2.1.0+cu121" in out
    assert not other_torch.exists() and not other_package.exists() and other_nvcc.exists()
    assert "0 logs" in out  # --stale leaves failed-build logs alone


def test_stale_reason_ignores_what_a_manifest_does_not_record():
    here = {"package_version": "0.1.0", "torch": {"torch": "2.13.0", "torch_cuda": "None", "cxx11_abi": True},
            "toolchain": {"nvcc": "n1", "cxx": "g1"}}
    assert cache.stale_reason(None, here) is None
    assert cache.stale_reason({"package_version": "0.1.0"}, here) is None  # made before torch was recorded
    assert cache.stale_reason({"torch": {"cxx11_abi": False}}, here) == "built for cxx11_abi False (here True)"
    assert cache.stale_reason({"toolchain": {"nvcc": "n1", "cxx": "g1", "cxx_runtime": "x"}}, here) == \
        "built for cxx_runtime x (here None)"
    assert cache.stale_reason({"toolchain": {"nvcc": "n0", "cxx": "g1"}},
                              {k: v for k, v in here.items() if k != "toolchain"}) is None


# --- clean --keep-size ----------------------------------------------------------------
def set_last_used(entry: Path, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    os.utime(entry / "manifest.json", (when, when))


def test_clean_keep_size_removes_the_least_recently_used(cache_copy, capsys):
    entries = {name: entry_dir(cache_copy, name) for name in NAMES}
    sizes = {name: cache.dir_size(path) for name, path in entries.items()}
    for name, ago in [("batch_indices_i32", 300), ("decode_plan", 200), ("append_bf16_hd128_nhd_csr", 100)]:
        set_last_used(entries[name], ago)
    keep = sizes["append_bf16_hd128_nhd_csr"] + sizes["decode_plan"]
    side = make_side_files(cache_copy)

    code, out, _ = run(capsys, "clean", "--keep-size", str(keep), "--dry-run")
    assert code == 0 and f"would remove {entries['batch_indices_i32']} (least recently used)" in out
    assert all(path.exists() for path in entries.values())

    code, out, _ = run(capsys, "clean", "--keep-size", str(keep))
    assert code == 0 and "removed 1 entry" in out
    assert not entries["batch_indices_i32"].exists()
    assert entries["decode_plan"].exists() and entries["append_bf16_hd128_nhd_csr"].exists()
    assert not side["stale"].exists() and side["live"].exists() and side["log"].exists()

    set_last_used(entries["decode_plan"], 0)  # used just now: append is now the oldest
    code, out, _ = run(capsys, "clean", "--keep-size", f"{-(-sizes['decode_plan'] // 1024)}K")  # rounded up
    assert code == 0 and "removed 1 entry" in out
    assert entries["decode_plan"].exists() and not entries["append_bf16_hd128_nhd_csr"].exists()

    code, out, _ = run(capsys, "clean", "--keep-size", "0")
    assert code == 0 and "removed 1 entry" in out and "the entries take 0 B" in out
    assert [p for p in cache_copy.iterdir() if not p.name.startswith(".")] == []
    assert list((cache_copy / ".tmp").iterdir()) == [side["live"]]  # no half-removed entry left


# Holds an entry's build lock (a build in progress) until told to stop.
HOLD_LOCK = """
import sys
from filelock import FileLock
with FileLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.readline()
"""

# Loads decode_plan from the cache, then calls into it again after its files are gone.
USE_MODULE = """
import json, sys
from flashinfer_jit.pipeline import jit
from flashinfer_jit.specs import DecodePlanSpec
module = jit.get_module(DecodePlanSpec())
print(json.dumps({"path": str(module.path), "config_bytes": module.config_bytes()}), flush=True)
sys.stdin.readline()
mapped = [line for line in open("/proc/self/maps") if "decode_plan.so" in line]
print(json.dumps({"config_bytes": module.config_bytes(), "deleted": all("(deleted)" in l for l in mapped)}))
"""


def test_clean_never_tears_out_an_entry_being_built_or_in_use(cache_copy, tmp_path, capsys):
    """clean --keep-size 0 with one entry's lock held (a build in progress) and another
    loaded by a running process: the locked one stays whole; the loaded one goes, and the
    process keeps calling into its .so."""
    locked = entry_dir(cache_copy, "batch_indices_i32")
    environ = subprocess_env(tmp_path, FLASHINFER_JIT_CACHE_DIR=str(cache_copy))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(cache_copy / ".locks" / f"{locked.name}.lock")],
                              env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    user = subprocess.Popen([sys.executable, "-c", USE_MODULE], env=environ, cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = user.stdout.readline()
        assert line, user.stderr.read()[-4000:]
        loaded = json.loads(line)
        assert loaded["path"] == str(entry_dir(cache_copy, "decode_plan"))

        code, out, _ = run(capsys, "clean", "--keep-size", "0")
        assert code == 0 and f"kept {locked}: a build holds its lock" in out
        assert [p for p in cache_copy.iterdir() if not p.name.startswith(".")] == [locked]
        assert cache.verify_entry(locked) is None
        assert list((cache_copy / ".tmp").iterdir()) == []

        out, err = user.communicate("go\n", timeout=120)
        assert user.returncode == 0, err[-4000:]
        after = json.loads(out.strip().splitlines()[-1])
        assert after == {"config_bytes": loaded["config_bytes"], "deleted": True}
    finally:
        for proc in (holder, user):
            if proc.poll() is None:
                proc.communicate("\n", timeout=60)


@pytest.mark.parametrize("text, size", [
    ("5G", 5 << 30), ("500M", 500 << 20), ("1.5G", 3 << 29), ("64k", 64 << 10), ("2T", 2 << 40),
    ("5GiB", 5 << 30), ("5GB", 5 << 30), ("1024", 1024), ("0", 0), (" 3 M ", 3 << 20)])
def test_parse_size(text, size):
    assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "5X", "-1G", "5 G B", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception, match="cannot read size"):
        cli.parse_size(text)


def test_clean_all_goes_alone(capsys):
    code, _, err = run(capsys, "clean", "--all", "--stale")
    assert code == 2 and "--all removes every entry; it does not go with --stale" in err


# --- verify --fix ---------------------------------------------------------------------
def test_verify_fix_removes_unreadable_entries_and_reports_prebuilt_ones(
        cache_copy, built_cache, tmp_path, monkeypatch, capsys):
    no_manifest = cache_copy / "decode_plan-0123456789abcdef"
    no_manifest.mkdir()
    (no_manifest / "decode_plan.so").write_bytes(b"\x7fELF")
    garbled = entry_dir(cache_copy, "batch_indices_i32")
    (garbled / "manifest.json").write_text("{")
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(built_cache.root, prebuilt, ignore=shutil.ignore_patterns(".locks", ".tmp"))
    damaged = entry_dir(prebuilt, "append_bf16_hd128_nhd_csr")
    os.truncate(damaged / "append_bf16_hd128_nhd_csr.so", 100)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", str(prebuilt))
    listing = sorted(str(p) for p in prebuilt.rglob("*"))

    code, out, _ = run(capsys, "verify")
    assert code == 1 and out.count("BAD  ") == 3
    assert f"BAD  {no_manifest.name}: no readable manifest.json" in out
    assert f"BAD  {garbled.name}: no readable manifest.json" in out

    code, out, _ = run(capsys, "verify", "--fix")
    assert code == 1 and "3 bad entries, 2 removed, 1 kept" in out
    assert "kept: a prebuilt read-only root (FLASHINFER_JIT_CACHE_PATH)" in out
    assert not no_manifest.exists() and not garbled.exists()
    assert sorted(str(p) for p in prebuilt.rglob("*")) == listing  # nothing written there

    monkeypatch.delenv("FLASHINFER_JIT_CACHE_PATH")
    code, out, _ = run(capsys, "verify")
    assert code == 0 and out.count("OK   ") - out.count("OK   .fastcall/") == 2


# --- settings from the environment -------------------------------------------------------------
@pytest.mark.parametrize("name", ["MAX_JOBS", "FLASHINFER_JIT_NVCC_THREADS"])
@pytest.mark.parametrize("value", ["-3", "0", "abc", "2.5"])
def test_a_bad_count_setting_is_named_before_anything_runs(name, value, monkeypatch, capsys, tmp_path):
    """MAX_JOBS / FLASHINFER_JIT_NVCC_THREADS that are not positive integers: one message
    naming the variable and what it takes (not an int() traceback, nor a count that reaches
    ninja as a 'compile failure'); aot exits 2 and builds nothing."""
    from flashinfer_jit.pipeline.errors import SettingError

    monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SettingError, match=f"{name}='{value}': expected a positive integer"):
        env.max_jobs() if name == "MAX_JOBS" else env.nvcc_threads()
    if name == "MAX_JOBS":  # (aot reads the other one when it keys the first entry)
        assert cli.main(["aot", "--entry", "batch_indices", "--arch", "9.0a"]) == 2
        assert f"{name}='{value}'" in capsys.readouterr().err
        assert not (tmp_path / "cache").exists() or not [p for p in (tmp_path / "cache").iterdir()
                                                         if not p.name.startswith(".")]


def test_count_settings_unset_or_valid(monkeypatch):
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.delenv("FLASHINFER_JIT_NVCC_THREADS", raising=False)
    assert env.max_jobs() is None and env.nvcc_threads() == 1
    monkeypatch.setenv("MAX_JOBS", " 3 ")
    monkeypatch.setenv("FLASHINFER_JIT_NVCC_THREADS", "2")
    assert env.max_jobs() == 3 and env.nvcc_threads() == 2
