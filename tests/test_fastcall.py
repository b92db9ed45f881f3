"""fij_fastcall (flashinfer_jit/fastcall.py, csrc/fastcall.cc): run()'s C launch entries
called without ctypes. CPU tests: the extension builds into a cache root, and each of its
callers hands a C function of the entry's signature (csrc/fast_entry.h; here a ctypes
callback that records what it receives) exactly the addresses and scalars given, with
the entry's return value back; bad arguments raise. The GPU tests of decode and prefill
run the real entries through it (their fast paths)."""

from __future__ import annotations

import ctypes
import io
import sysconfig
import tarfile
from pathlib import Path

import pytest

from flashinfer_jit import fastcall, pack

pytestmark = pytest.mark.skipif(not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
                                reason="no Python.h: the extension cannot be built here (run() uses ctypes)")

PREFILL = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 7 + [ctypes.c_float] * 3 +
                                           [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]))
DECODE = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int,
                                                                   ctypes.c_void_p, ctypes.c_int]))


@pytest.fixture
def ext(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHINFER_JIT_CACHE_PATH", raising=False)
    fastcall.extension.cache_clear()
    module = fastcall.extension()
    yield module
    fastcall.extension.cache_clear()


def recorder(kind, seen, code=0):
    def entry(*args):
        seen.append(args)
        return code
    return kind(entry)


def test_built_into_the_cache_root_and_found_there(ext, tmp_path):
    assert ext is not None
    libs = list((tmp_path / "cache" / ".fastcall").glob("*/fij_fastcall*"))
    assert len(libs) == 1 and Path(ext.__file__) == libs[0]
    assert fastcall.find(libs[0].parent.name) == libs[0]
    assert fastcall.build() == libs[0]  # already built: the same library, nothing rebuilt


def test_prefill_caller_passes_every_argument(ext):
    seen = []
    cb = recorder(PREFILL, seen, code=7)
    call = fastcall.bind("prefill", cb)
    assert call is not cb  # through the extension
    big = 0x7F12_3456_7890
    code = call(big, big + 16, big + 32, big + 48, big + 64, 0, big + 80, 0.1, -2.5, 3.0, -1, big + 96, True)
    assert code == 7
    (got,) = seen
    f32 = lambda x: ctypes.c_float(x).value  # noqa: E731  (the entry takes float)
    assert got == (big, big + 16, big + 32, big + 48, big + 64, None, big + 80, f32(0.1), -2.5, 3.0, -1, big + 96, 1)
    call(1, 2, 3, 4, 5, 6, 7, 1, 0, 0.5, 128, 0, 0)  # ints where floats go; pdl off
    assert seen[1][7:] == (1.0, 0.0, 0.5, 128, None, 0)


def test_decode_caller_passes_every_argument(ext):
    seen = []
    cb = recorder(DECODE, seen)
    call = fastcall.bind("decode", cb)
    code = call(16, 32, 48, 64, 80, 96, 0.125, 2.0, 4095, 112, False)
    assert code == 0
    assert seen == [(16, 32, 48, 64, 80, 96, 0.125, 2.0, 4095, 112, 0)]


def test_bad_arguments_raise_before_the_call(ext):
    seen = []
    cb = recorder(PREFILL, seen)
    call = fastcall.bind("prefill", cb)
    with pytest.raises(TypeError, match="expected 14 arguments, got 13"):
        call(1, 2, 3, 4, 5, 6, 7, 1.0, 0.0, 1.0, -1, 0)
    with pytest.raises(OverflowError):
        call(-16, 2, 3, 4, 5, 6, 7, 1.0, 0.0, 1.0, -1, 0, 0)
    with pytest.raises(TypeError):
        call(1, 2, 3, 4, 5, 6, 7, "1.0", 0.0, 1.0, -1, 0, 0)
    with pytest.raises(ValueError, match="null entry"):
        ext.prefill(0, 1, 2, 3, 4, 5, 6, 7, 1.0, 0.0, 1.0, -1, 0, 0)
    with pytest.raises(ValueError, match="null entry"):
        ext.decode(0, 1, 2, 3, 4, 5, 6, 1.0, 1.0, -1, 0, 0)
    assert seen == []


def test_without_the_extension_bind_hands_back_the_ctypes_function(monkeypatch):
    monkeypatch.setattr(fastcall, "extension", lambda: None)
    cb = recorder(DECODE, [])
    assert fastcall.bind("decode", cb) is cb


def test_a_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    fastcall.extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="through ctypes"):
            assert fastcall.extension() is None
        assert fastcall.extension() is None  # remembered: no second warning, no second try
    finally:
        fastcall.extension.cache_clear()


def test_jit_disabled_loads_a_prebuilt_extension_and_never_builds(tmp_path, monkeypatch):
    prebuilt = tmp_path / "prebuilt"
    lib = fastcall.build(prebuilt)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", str(prebuilt))
    fastcall.extension.cache_clear()
    try:
        assert Path(fastcall.extension().__file__) == lib
        monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", "")
        fastcall.extension.cache_clear()
        with pytest.warns(RuntimeWarning, match="FLASHINFER_JIT_DISABLE_JIT"):
            assert fastcall.extension() is None
        assert not (tmp_path / "empty" / ".fastcall").exists()
    finally:
        fastcall.extension.cache_clear()


def test_pack_carries_the_extension(tmp_path):
    root = tmp_path / "root"
    lib = fastcall.build(root)
    report = pack.pack(root, tmp_path / "cache.tar.gz")
    rel = str(lib.relative_to(root))
    assert report.fastcall == [rel] and report.packed == []
    with tarfile.open(tmp_path / "cache.tar.gz") as tar:
        member = tar.getmember(rel)
        assert member.mode == 0o755 and tar.extractfile(member).read() == lib.read_bytes()
