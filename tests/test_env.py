"""Settings from the environment (flashinfer_jit/pipeline/env.py): every yes/no variable
takes 1/0, true/false, yes/no, on/off (any case) or nothing, and anything else is a
SettingError naming the variable, read when used. A bad value never changes which code path
runs: the native planners' fallback (runtime/native.py optional_entry) passes a
SettingError on instead of falling back to the numpy planner."""

from __future__ import annotations

import pytest

from flashinfer_jit.pipeline import env
from flashinfer_jit.pipeline.errors import SettingError
from flashinfer_jit.runtime.native import optional_entry

SWITCHES = [  # (variable, reader, default when unset)
    ("FLASHINFER_JIT_VERBOSE", env.verbose, False),
    ("FLASHINFER_JIT_DEBUG", env.debug, False),
    ("FLASHINFER_JIT_DISABLE_JIT", env.jit_disabled, False),
    ("FLASHINFER_JIT_DECODE_CLUSTERS", env.decode_clusters, True),
    ("FLASHINFER_JIT_NATIVE_PLAN", env.native_decode_plan, True),
    ("FLASHINFER_JIT_NATIVE_PLAN", env.native_prefill_plan, True),
]
IDS = [f"{name}-{reader.__name__}" for name, reader, _ in SWITCHES]


@pytest.mark.parametrize("name, reader, default", SWITCHES, ids=IDS)
def test_switches_read_the_accepted_values(name, reader, default, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert reader() is default
    for value, expected in (("", default), ("  ", default), ("1", True), ("TRUE", True), ("yes", True),
                            (" On ", True), ("0", False), ("false", False), ("No", False), ("OFF", False)):
        monkeypatch.setenv(name, value)
        assert reader() is expected, value


@pytest.mark.parametrize("name, reader, default", SWITCHES, ids=IDS)
@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "-1"])
def test_a_switch_with_another_value_is_an_error_naming_it(name, reader, default, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=f"{name}='{value}': expected one of 1, true, yes, on, 0, false, no, off"):
        reader()


@pytest.mark.parametrize("value, level", [("DEBUG", 10), ("warning", 30), ("20", 20), ("", None)])
def test_log_level_reads_names_and_numbers(value, level, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", value)
    assert env.log_level() == level


def test_a_bad_log_level_is_a_setting_error(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", "LOUD")
    with pytest.raises(SettingError, match="FLASHINFER_JIT_LOG_LEVEL='LOUD': expected DEBUG, INFO"):
        env.log_level()


@pytest.mark.parametrize("value", ["9.0b", "hopper", "9"])
def test_a_bad_arch_list_is_a_setting_error(value, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", value)
    with pytest.raises(SettingError, match="FLASHINFER_JIT_CUDA_ARCH_LIST"):
        env.target_archs()


def test_a_setting_error_is_not_a_reason_to_fall_back():
    """A native helper whose load fails falls back with a warning; a bad setting raised
    while loading it (LOG_LEVEL=LOUD at the planner module's first build, say) reaches the
    caller instead of sending plan() onto its numpy path."""
    def broken():
        raise OSError("no such library")

    with pytest.warns(RuntimeWarning, match="the numpy planner runs"):
        assert optional_entry(broken, "the numpy planner runs", "the C++ planner") is None

    def bad_setting():
        raise SettingError("FLASHINFER_JIT_LOG_LEVEL='LOUD': expected DEBUG, ...")

    with pytest.raises(SettingError, match="LOUD"):
        optional_entry(bad_setting, "the numpy planner runs", "the C++ planner")


def test_decode_plan_with_a_bad_log_level_raises_instead_of_falling_back(monkeypatch, tmp_path):
    """End to end on the CPU: a decode plan() whose planner module is not loaded yet, with
    FLASHINFER_JIT_LOG_LEVEL=LOUD, raises the SettingError (it used to warn and run the
    numpy planner)."""
    import torch

    import flashinfer_jit as fi
    from flashinfer_jit.pipeline.jit import clear_registry

    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHINFER_JIT_LOG_LEVEL", "LOUD")
    clear_registry()
    try:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
        with pytest.raises(SettingError, match="FLASHINFER_JIT_LOG_LEVEL"):
            w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                   torch.tensor([1], dtype=torch.int32), 8, 8, 128, 16)
    finally:
        monkeypatch.delenv("FLASHINFER_JIT_LOG_LEVEL")
        clear_registry()


def test_compiler_launcher_reads_a_command_and_rejects_what_is_not_one(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_JIT_COMPILER_LAUNCHER", "")
    assert env.compiler_launcher() == ()
    monkeypatch.setenv("FLASHINFER_JIT_COMPILER_LAUNCHER", "env -u NOTHING")
    assert env.compiler_launcher() == ("env", "-u", "NOTHING")
    for value in ("no-such-launcher-here", str(tmp_path), "'unclosed"):
        monkeypatch.setenv("FLASHINFER_JIT_COMPILER_LAUNCHER", value)
        with pytest.raises(SettingError, match="FLASHINFER_JIT_COMPILER_LAUNCHER"):
            env.compiler_launcher()


def test_compiler_launcher_is_put_before_each_compile_step_not_the_link(monkeypatch):
    from flashinfer_jit.pipeline import build, toolchain

    monkeypatch.setenv("FLASHINFER_JIT_COMPILER_LAUNCHER", "env")
    rules = build.ninja_rules(toolchain.get(), build.make_flags(("9.0a",), False, True))
    assert "launcher = env\n" in rules
    commands = [line.strip() for line in rules.splitlines() if line.strip().startswith("command =")]
    assert [c.split()[2] for c in commands] == ["$launcher", "$launcher", "$cxx"]  # nvcc, cxx; link


def test_an_aot_entry_compiles_with_its_own_archs(tmp_path):
    """One AOT build.ninja holds entries of other flags: a host-only module (no archs) first
    must not leave the next entry's kernel compiled for nvcc's default arch (which stopped
    ptxas at the first cp.async), and the other way round."""
    import shutil
    import subprocess

    from flashinfer_jit.pipeline import build, toolchain

    tc = toolchain.get()
    host, device = build.make_flags((), False, True), build.make_flags(("9.0a",), False, True)
    text = build.ninja_rules(tc, host) + build.ninja_builds("h/", "h.so") + \
        build.ninja_builds("d/", "d.so", tc, device)
    (tmp_path / "build.ninja").write_text(text)
    ninja = shutil.which("ninja") or pytest.skip("no ninja on PATH")
    commands = {}
    for lib in ("h/h.so", "d/d.so"):
        out = subprocess.run([ninja, "-C", str(tmp_path), "-t", "commands", lib], capture_output=True, text=True,
                             check=True).stdout
        commands[lib] = next(line for line in out.splitlines() if "kernel.o" in line and " -c " in line)
    assert "code=sm_90a" in commands["d/d.so"], commands["d/d.so"]
    assert "-gencode" not in commands["h/h.so"], commands["h/h.so"]
