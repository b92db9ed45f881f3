"""`flashinfer-jit aot`'s progress and interrupts (flashinfer_jit/pipeline/jit.py, cli.py):
the bar moves with ninja's compile steps from the first one, an entry counts as done only
when its link step ended without a failure, and an interrupt (Ctrl-C, or a signal that
stopped ninja alone) ends in one line, keeping every entry whose link had finished and
publishing nothing else. No compiler runs here: ninja is replaced by a function that writes
what a run would have written."""

from __future__ import annotations

import io

import pytest

from flashinfer_jit import cli
from flashinfer_jit.pipeline import build, cache, jit
from flashinfer_jit.specs import DecodePlanSpec, PrefillPlanSpec


def test_progress_counts_steps_and_only_links_that_succeeded():
    seen = []
    watch = jit._NinjaProgress(lambda *a: seen.append(a), 2, 0.0)
    for line in ["[1/6] CXX a-0123/kernel.o\n", "[2/6] LINK a-0123/a.so\n", "FAILED: a-0123/a.so\n",
                 "ld: error\n", "[3/6] CXX b-4567/kernel.o\n", "[4/6] LINK b-4567/b.so\n"]:
        watch(line)
    assert watch.done == 0 and watch.steps == (4, 6)  # b's link: done once the next line says so
    watch.finish()
    assert watch.done == 1
    assert seen[-1][0] == 1 and seen[-1][1] == 2 and seen[-1][3:] == (4, 6)


def test_progress_line_shows_steps_once_known():
    assert cli.progress_line(0, 12, 3.0, width=10) == "[..........] 0/12 entries  3.0s"
    assert cli.progress_line(0, 12, 3.0, width=10, steps=(57, 190)) == \
        "[###.......] 0/12 entries, 57/190 steps  3.0s"


def test_a_pipe_gets_a_line_per_entry_and_one_while_quiet(monkeypatch):
    pipe = io.StringIO()
    bar = cli.ProgressBar(pipe, quiet_line=30.0)
    now = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    bar(0, 2, 0.0, 1, 50)
    bar(0, 2, 1.0, 2, 50)   # no entry done, not 30 s quiet: no line
    now[0] += 31
    bar(0, 2, 32.0, 30, 50)  # 30 s without a line: one
    bar(1, 2, 33.0, 31, 50)  # an entry done: one
    bar.close()
    lines = pipe.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].endswith("1/2 entries, 31/50 steps  33.0s")


@pytest.mark.parametrize("how", ["python", "ninja"], ids=["ctrl-c", "signal-to-ninja"])
def test_an_interrupted_build_keeps_finished_entries_only(how, tmp_path, monkeypatch):
    """Two host-only modules; ninja 'finishes' the first one's link, then is interrupted
    (Ctrl-C in this process, or ninja's own 'interrupted by user'). The first is published
    whole, the second not at all, and the report says so."""
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    specs = [DecodePlanSpec(), PrefillPlanSpec()]
    first = jit.prepare(specs[0])

    def fake_ninja(tc, build_dir, jobs=None, on_line=None):
        sub = next(p for p in build_dir.iterdir() if p.name.startswith(first.name + "-"))
        (sub / f"{first.name}.so").write_bytes(b"\x7fELF fake")
        (build_dir / ".ninja_log").write_text(f"# ninja log v6\n0\t900\t0\t{sub.name}/{first.name}.so\tabc\n")
        if on_line:
            on_line(f"[1/4] LINK {sub.name}/{first.name}.so\n")
            on_line("[2/4] CXX prefill_plan-x/kernel.o\n")
        if how == "python":
            raise KeyboardInterrupt
        return 130, "ninja: build stopped: interrupted by user.\n", 1.0

    monkeypatch.setattr(build, "run_ninja", fake_ninja)
    with pytest.raises(jit.BuildInterrupted) as info:
        jit.build_many(specs, archs=())
    report = info.value.report
    assert report.built == [first.name] and not report.failed
    assert info.value.unfinished == [specs[1].name]
    root = cache.build_root()
    published = sorted(p.name.rsplit("-", 1)[0] for p in root.iterdir() if not p.name.startswith("."))
    assert published == [first.name]


def test_aot_says_one_line_on_an_interrupt(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        report = jit.BuildReport(built=["decode_plan"])
        raise jit.BuildInterrupted(report, ["prefill_plan", "page_order"])

    monkeypatch.setattr(jit, "build_many", interrupted)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    code = cli.main(["aot", "--entry", "decode_plan", "--entry", "prefill_plan"])
    out, err = capsys.readouterr()
    assert code == 130
    assert "interrupted; 1 entry complete and kept, 2 not built: run the same command again" in err
    assert "Traceback" not in err and "fastcall" not in out + err


HOLDER = """
import sys, time
from filelock import FileLock
from pathlib import Path
from flashinfer_jit.pipeline import jit
path = Path(sys.argv[1])
lock = FileLock(str(path))
jit.acquire_lock(lock, path, "decode_plan", "aot (a test's holder)")
print("held", flush=True)
time.sleep(60)
"""


def test_aot_names_the_lock_holder_and_honours_lock_timeout(tmp_path, monkeypatch, caplog):
    """Another process holds decode_plan's lock: build_many announces the wait (who holds it,
    what it waits for) and gives up after lock_timeout with a CacheError naming the holder;
    `aot --lock-timeout` turns that into one line and exit 1."""
    import subprocess
    import sys

    from flashinfer_jit.pipeline.errors import CacheError

    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "LOCK_NOTICE_SECONDS", 0.2)
    spec = DecodePlanSpec()
    entry = jit.prepare(spec).entry(cache.build_root())
    entry.lock_path.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(entry.lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level("WARNING", logger="flashinfer_jit"):
            with pytest.raises(CacheError, match=rf"gave up after 1 s waiting for the lock of decode_plan .* held by "
                                                 rf"process {holder.pid} on .*aot \(a test's holder\)"):
                jit.build_many([spec], archs=(), lock_timeout=1.0)
        assert f"held by process {holder.pid}" in caplog.text and "waits to build (aot) it" in caplog.text
        assert cli.main(["aot", "--entry", "decode_plan", "--lock-timeout", "0.5"]) == 1
    finally:
        holder.kill()
        holder.wait()
    # the holder gone, the same build takes the lock at once
    assert jit.build_many([spec], archs=(), lock_timeout=5.0).built == [spec.name]


def test_lock_timeout_must_be_seconds(capsys):
    with pytest.raises(SystemExit):
        cli.main(["aot", "--entry", "decode_plan", "--lock-timeout", "soon"])
    assert "expected a number of seconds >= 0" in capsys.readouterr().err


def test_aot_refuses_an_unusable_cache_dir_and_lazy_builds_say_where_they_go(tmp_path, monkeypatch, capsys, caplog):
    """FLASHINFER_JIT_CACHE_DIR under a regular file: `aot` (no --out) fails naming it
    instead of building into the user cache; a lazy build still falls back, and says so."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    code = cli.main(["aot", "--entry", "decode_plan"])
    err = capsys.readouterr().err
    assert code == 1 and f"FLASHINFER_JIT_CACHE_DIR='{blocker / 'cache'}'" in err and "--out" in err
    assert not (tmp_path / "xdg" / "flashinfer_jit").exists()  # nothing built elsewhere
    cache._warned_fallbacks.clear()
    with caplog.at_level("WARNING", logger="flashinfer_jit"):
        assert cache.build_root() == tmp_path / "xdg" / "flashinfer_jit"
    assert "building into the user cache" in caplog.text
