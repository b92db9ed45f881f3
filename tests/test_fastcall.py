"""fij_fastcall (flashinfer_jit/runtime/fastcall.py, csrc/runtime/fastcall.cc): run()'s C launch entries
called without ctypes. CPU tests: the extension builds into a cache root, and each of its
callers hands a C function of the entry's signature (csrc/runtime/fast_entry.h; here a ctypes
callback that records what it receives) exactly the addresses and scalars given, with
the entry's return value back; bad arguments raise. The GPU tests of decode and prefill
run the real entries through it (their fast paths)."""

from __future__ import annotations

import ctypes
import json
import sysconfig
import tarfile
from pathlib import Path

import pytest

from flashinfer_jit.pipeline import cache, pack
from flashinfer_jit.runtime import fastcall

pytestmark = pytest.mark.skipif(not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
                                reason="no Python.h: the extension cannot be built here (run() uses ctypes)")

PREFILL = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 7 + [ctypes.c_float] * 3 +
                                           [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]))
DECODE = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int,
                                                                   ctypes.c_void_p, ctypes.c_int]))
ORDER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
ORDER_PAIR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
PLAN = ctypes.CFUNCTYPE(ctypes.c_longlong, *([ctypes.c_void_p] * 4 + [ctypes.c_longlong, ctypes.c_void_p,
                                                                      ctypes.c_longlong, ctypes.c_void_p]))
DECODE_PLAN = ctypes.CFUNCTYPE(ctypes.c_longlong, *([ctypes.c_void_p] * 4 + [ctypes.c_longlong] * 3 +
                                                    [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]))
SHIP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int,
                        ctypes.c_void_p)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache root with the extension built once for this module's tests (10-30 s)."""
    root = tmp_path_factory.mktemp("fastcall") / "cache"
    return root, fastcall.build(root)


@pytest.fixture
def ext(built, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(built[0]))
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


def test_built_into_the_cache_root_and_found_there(ext, built):
    assert ext is not None
    libs = list((built[0] / ".fastcall").glob("*/fij_fastcall*"))
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


def test_order_pages_caller_passes_every_argument(ext):
    """plan()'s page order (flashinfer_jit/runtime/page_order.py) through the extension: params,
    stream (0: the default stream) and device reach the entry; a null entry or params raise."""
    seen = []
    cb = recorder(ORDER, seen, code=3)
    call = fastcall.bind("order_pages", cb)
    assert call is not cb
    assert call(0x7F00_0000_1000, 0, 1) == 3
    assert call(64, 0x7F00_0000_2000, 0) == 3
    assert seen == [(0x7F00_0000_1000, None, 1), (64, 0x7F00_0000_2000, 0)]
    with pytest.raises(ValueError, match="null entry or params"):
        call(0, 16, 0)
    with pytest.raises(TypeError, match="expected 4 arguments, got 3"):
        ext.order_pages(1, 2, 3)


def test_order_pages_pair_caller_passes_every_argument(ext):
    """POD plan()'s two page orders in one launch: both params, the stream and the device reach
    the entry; a null entry or params raise before it."""
    seen = []
    cb = recorder(ORDER_PAIR, seen, code=4)
    call = fastcall.bind("order_pages_pair", cb)
    assert call is not cb
    assert call(0x7F00_0000_1000, 0x7F00_0000_2000, 0, 1) == 4
    assert seen == [(0x7F00_0000_1000, 0x7F00_0000_2000, None, 1)]
    with pytest.raises(ValueError, match="null entry or params"):
        call(16, 0, 0, 0)
    with pytest.raises(TypeError, match="expected 5 arguments, got 4"):
        ext.order_pages_pair(1, 2, 3, 4)
    assert len(seen) == 1


def test_ship_caller_passes_every_argument(ext):
    """plan()'s copy of its packed buffer (flashinfer_jit/runtime/plan_buffer.py): dst, src,
    bytes, stream (0: the default), device and event (0: none) reach the entry; a null entry,
    dst or src, or negative bytes raise before it."""
    seen = []
    cb = recorder(SHIP, seen, code=5)
    call = fastcall.bind("ship", cb)
    assert call is not cb
    big = 0x7F00_0000_1000
    assert call(big, big + 64, 8192, 0, 1, big + 128) == 5
    assert call(16, 32, 0, big, 0, 0) == 5
    assert seen == [(big, big + 64, 8192, None, 1, big + 128), (16, 32, 0, big, 0, None)]
    with pytest.raises(ValueError, match="null entry, dst or src"):
        call(0, 32, 8, 0, 0, 0)
    with pytest.raises(ValueError, match="negative bytes"):
        call(16, 32, -8, 0, 0, 0)
    with pytest.raises(TypeError, match="expected 7 arguments, got 6"):
        ext.ship(1, 2, 3, 4, 5, 6)
    assert len(seen) == 2


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


@pytest.mark.parametrize("how", ["not_run", "fails"])
def test_a_failed_build_raises_a_build_error_naming_the_extension(how, tmp_path, monkeypatch):
    """A compiler that cannot run, or that fails (a full disk, a broken toolchain): a
    BuildError with the extension's name, the log's path and the first error lines, not a
    TypeError from the error's own construction; nothing published."""
    import subprocess

    from flashinfer_jit.pipeline.errors import BuildError

    def run(cmd, **kwargs):
        if how == "not_run":
            raise OSError(28, "No space left on device")
        return subprocess.CompletedProcess(cmd, 1, "", "fastcall.cc:1: error: deliberately broken\n")

    monkeypatch.setattr(fastcall.subprocess, "run", run)
    root = tmp_path / "cache"
    with pytest.raises(BuildError) as info:
        fastcall.build(root)
    err = info.value
    assert err.module == fastcall.MODULE and fastcall.MODULE in str(err)
    if how == "fails":
        assert "deliberately broken" in str(err) and Path(err.log_path).is_file()
    else:
        assert "No space left on device" in str(err)
    assert not (root / fastcall.SUBDIR).exists() or not list((root / fastcall.SUBDIR).glob("*/*"))  # nothing published


def test_jit_disabled_loads_a_prebuilt_extension_and_never_builds(built, tmp_path, monkeypatch):
    prebuilt, lib = built
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


def test_pack_carries_the_extension(built, tmp_path):
    """Beside the entries it packs; a cache of the extension alone has no entry to deploy,
    and pack writes nothing for it."""
    root, lib = built
    assert not pack.pack(root, tmp_path / "alone.tar.gz").packed
    assert not (tmp_path / "alone.tar.gz").exists()
    entry = root / ("x-" + "0" * 16)  # a minimal complete entry
    entry.mkdir()
    (entry / "x.so").write_bytes(b"\x7fELF")
    so = {"size": 4, "sha256": cache.sha256_bytes(b"\x7fELF")}
    (entry / cache.MANIFEST).write_text(json.dumps({"name": "x", "key": "0" * 64, "content_key": "c" * 64,
                                                    "library": "x.so", "files": {"x.so": so}}))
    report = pack.pack(root, tmp_path / "cache.tar.gz")
    rel = str(lib.relative_to(root))
    assert report.fastcall == [rel] and report.packed == ["x-" + "0" * 16]
    with tarfile.open(tmp_path / "cache.tar.gz") as tar:
        member = tar.getmember(rel)
        assert member.mode == 0o755 and tar.extractfile(member).read() == lib.read_bytes()


def test_tensor_signature_tells_apart_what_the_kernel_depends_on(ext):
    import torch

    q = torch.randn(6, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 3, 16, 2, 64, dtype=torch.bfloat16)
    out = torch.empty(6, 4, 64, dtype=torch.bfloat16)
    sig = ext.tensor_signature(q, k, v, out)
    assert sig == ext.tensor_signature(q.clone(), k.clone(), v.clone(), torch.empty_like(out))  # values aside
    others = [
        (q.float(), k, v, out),  # dtype
        (q[:5], k, v, out),  # tokens
        (torch.randn(6, 5, 64, dtype=torch.bfloat16)[:, 1:], k, v, out),  # same shape, other strides
        (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, out),  # K's strides (HND as NHD)
        (q, k, v, out.view(6, 4, 2, 32)),  # dims
    ]
    for args in others:
        assert ext.tensor_signature(*args) != sig
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="plain torch.Tensor"):
        ext.tensor_signature(q, k, v, out.as_subclass(Sub))
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        ext.tensor_signature(q, k, v, 0)


def test_prefill_run_launches_only_for_the_recorded_signature(ext):
    """-1: not the signature (or misaligned), and nothing is called; -2: the signature, but
    not CUDA tensors (the caller's full checks decide; this machine has no GPU); the GPU
    tests cover the launch itself (test_prefill.py::test_run_quick_path_checks_what_the_op_recorded)."""
    import torch

    seen = []
    cb = recorder(PREFILL, seen)
    address = ctypes.cast(cb, ctypes.c_void_p).value
    q = torch.randn(6, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 12, 2, 64, dtype=torch.bfloat16)
    out = torch.empty(6, 4, 64, dtype=torch.bfloat16)
    sig = ext.tensor_signature(q, k, v, out)
    run = lambda *t: ext.prefill_run(address, 64, sig, *t, 1.0, 0.0, 1.0, -1, True)  # noqa: E731
    assert run(q, k, v, out) == -2
    assert run(q.half(), k, v, out) == -1
    assert run(q, k, v, out[:3]) == -1
    wide = torch.empty(q.numel() + 8, dtype=torch.bfloat16)
    assert run(wide[1:1 + q.numel()].view_as(q), k, v, out) == -1  # 2 bytes off
    assert run(q, k, v, "out") == -1
    assert seen == []
    with pytest.raises(TypeError, match="expected 12 arguments"):
        ext.prefill_run(address, 64, sig, q, k, v, out, 1.0, 0.0, 1.0, -1)
    with pytest.raises(TypeError, match="signature"):
        ext.prefill_run(address, 64, sig[:-8], q, k, v, out, 1.0, 0.0, 1.0, -1, True)
    with pytest.raises(ValueError, match="null entry"):
        ext.prefill_run(0, 64, sig, q, k, v, out, 1.0, 0.0, 1.0, -1, True)


def test_prefill_plan_calls_the_planner_for_the_common_form_only(ext):
    """plan()'s caller of the C++ planner (csrc/runtime/plan_entry.h): the index vectors' data and
    the batch for contiguous 1-D int32 CPU tensors of the batch's lengths, the planner's
    status back; -1 and no call for any other form (plan() then converts and checks them
    in Python, with its errors)."""
    import torch

    seen = []
    cb = recorder(PLAN, seen, code=3)
    address = ctypes.cast(cb, ctypes.c_void_p).value
    i32 = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    qo, indptr, last, lens = i32(0, 2, 5), i32(0, 1, 3), i32(4, 16), i32(7, 9)
    plan = lambda side, q, a, b: ext.prefill_plan(address, 64, side, q, a, b, 4096, 100, 8192)  # noqa: E731
    assert plan(0, qo, indptr, last) == 3  # csr: indptr [B + 1], last_page_len [B]
    assert plan(1, qo, lens, None) == 3  # seq_lens [B]
    assert plan(2, qo, indptr, "not read") == 3  # ragged: kv_indptr [B + 1]
    assert seen == [(64, qo.data_ptr(), indptr.data_ptr(), last.data_ptr(), 2, 4096, 100, 8192),
                    (64, qo.data_ptr(), lens.data_ptr(), None, 2, 4096, 100, 8192),
                    (64, qo.data_ptr(), indptr.data_ptr(), None, 2, 4096, 100, 8192)]
    seen.clear()

    class Sub(torch.Tensor):
        pass

    others = [
        (0, qo.long(), indptr, last),  # int64
        (0, qo, indptr, last.long()),
        (0, qo, indptr, None),  # csr without last_page_len
        (0, qo, indptr[:2], last),  # lengths
        (0, qo, indptr, last[:1]),
        (1, qo, indptr, None),
        (2, qo, lens, None),
        (0, i32(0, 0, 2, 0, 5)[::2], indptr, last),  # not contiguous
        (0, qo.view(1, 3), indptr, last),  # 2-D
        (0, i32(), i32(0), i32()),  # no batch
        (0, [0, 2, 5], indptr, last),  # not a tensor
        (0, qo.as_subclass(Sub), indptr, last),
    ]
    for args in others:
        assert plan(*args) == -1, args
    assert seen == []
    with pytest.raises(TypeError, match="expected 9 arguments"):
        ext.prefill_plan(address, 64, 0, qo, indptr, last, 4096, 100)
    with pytest.raises(ValueError, match="null planner"):
        ext.prefill_plan(0, 64, 0, qo, indptr, last, 4096, 100, 8192)
    with pytest.raises(ValueError, match="side"):
        ext.prefill_plan(address, 64, 3, qo, indptr, last, 4096, 100, 8192)
    with pytest.raises(OverflowError):
        ext.prefill_plan(address, 64, 0, qo, indptr, last, -4096, 100, 8192)
    assert seen == []


def test_decode_plan_calls_the_planner_for_the_common_form_only(ext):
    """batch decode's planner (csrc/decode/decode_plan.h) through the extension: a CSR table of
    contiguous 1-D int32 host indptr [B + 1] and last_page_len [B], int32 page ids on any device
    (their count the limit): the planner's status back; None and no call for any other form
    (plan() then converts and checks in Python)."""
    import torch

    seen = []
    cb = recorder(DECODE_PLAN, seen, code=-3)
    address = ctypes.cast(cb, ctypes.c_void_p).value
    i32 = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    indptr, last, ids = i32(0, 1, 3), i32(4, 16), i32(*range(9))
    plan = lambda a, b, c, capacity=0: ext.decode_plan(address, 64, a, b, c, capacity, 4096, 100, 8192)  # noqa: E731
    assert plan(indptr, last, ids) == -3
    assert plan(indptr, last, ids[:5], 6) == -3
    assert seen == [(64, indptr.data_ptr(), last.data_ptr(), None, 2, 9, 0, 4096, 100, 8192),
                    (64, indptr.data_ptr(), last.data_ptr(), None, 2, 5, 6, 4096, 100, 8192)]
    seen.clear()
    others = [
        (indptr.long(), last, ids), (indptr, last.long(), ids), (indptr, last, ids.long()),  # int64
        (indptr, last[:1], ids), (indptr[:1], last, ids),  # lengths
        (i32(0, 0, 1, 0, 3)[::2], last, ids),  # not contiguous
        (indptr, last, ids.view(3, 3)),  # 2-D ids
        (i32(), i32(), ids),  # no batch
        (indptr, None, ids), (indptr, last, None), ([0, 1, 3], last, ids),  # not tensors
    ]
    for args in others:
        assert plan(*args) is None, args
    assert seen == []
    with pytest.raises(TypeError, match="expected 9 arguments"):
        ext.decode_plan(address, 64, indptr, last, ids, 0, 4096, 100)
    with pytest.raises(ValueError, match="null planner"):
        ext.decode_plan(0, 64, indptr, last, ids, 0, 4096, 100, 8192)
    with pytest.raises(ValueError, match="negative capacity"):
        ext.decode_plan(address, 64, indptr, last, ids, -1, 4096, 100, 8192)
    assert seen == []


# --- the extension's manifest: checked before it is loaded, packed, verified, cleaned ---------------
def _copy_root(built, tmp_path) -> tuple[Path, Path]:
    """A copy of the built root to damage: (root, the extension's library in it)."""
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(built[0], root, symlinks=True)
    [lib] = root.glob(".fastcall/*/fij_fastcall*")
    return root, lib


def test_the_extension_has_a_manifest_and_its_lock(built):
    root, lib = built
    folder = lib.parent
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["key"] == folder.name and manifest["library"] == lib.name
    assert manifest["files"][lib.name]["sha256"] == cache.sha256_file(lib)
    assert cache.verify_extension_folder(folder) is None
    assert (root / ".locks" / f"fij_fastcall-{folder.name}.lock").exists()  # builders took the per-key lock


@pytest.mark.parametrize("damage", ["bytes", "half-unpacked", "key"])
def test_a_damaged_extension_is_not_loaded_and_is_rebuilt(built, tmp_path, monkeypatch, damage):
    """Other bytes, an unpack that stopped before the manifest, or a manifest naming another
    key: find() warns and removes the folder of a writable root (nothing loads it), and the
    next build puts a good one back."""
    root, lib = _copy_root(built, tmp_path)
    k = lib.parent.name
    if damage == "bytes":
        data = bytearray(lib.read_bytes())
        data[len(data) // 2] ^= 0xFF
        lib.write_bytes(bytes(data))
    elif damage == "half-unpacked":
        (lib.parent / "manifest.json").unlink()
    else:
        manifest = json.loads((lib.parent / "manifest.json").read_text())
        (lib.parent / "manifest.json").write_text(json.dumps({**manifest, "key": "0" * 20}))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.delenv("FLASHINFER_JIT_CACHE_PATH", raising=False)
    with pytest.warns(RuntimeWarning, match="removed, to be built again"):
        assert fastcall.find(k) is None
    assert not lib.parent.exists()
    rebuilt = fastcall.build(root)
    assert rebuilt == lib and cache.verify_extension_folder(lib.parent) is None


def test_a_damaged_prebuilt_extension_is_skipped_not_touched(built, tmp_path, monkeypatch):
    root, lib = _copy_root(built, tmp_path)
    (lib.parent / "manifest.json").unlink()
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", str(root))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "writable"))
    with pytest.warns(RuntimeWarning, match="skipped \\(a prebuilt root"):
        assert fastcall.find(lib.parent.name) is None
    assert lib.is_file()


def test_verify_clean_and_pack_cover_the_extension(built, tmp_path, monkeypatch, capsys):
    from flashinfer_jit import cli

    root, lib = _copy_root(built, tmp_path)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FLASHINFER_JIT_CACHE_PATH", raising=False)
    assert cli.main(["verify"]) == 0
    assert f"OK   .fastcall/{lib.parent.name}" in capsys.readouterr().out
    lib.write_bytes(lib.read_bytes()[:-1])
    assert cli.main(["verify"]) == 1
    assert "BAD  .fastcall/" in capsys.readouterr().out
    assert not pack.pack(root, tmp_path / "x.tar.gz").fastcall  # a damaged extension is not carried
    assert cli.main(["verify", "--fix"]) == 0
    assert not lib.parent.exists() and "removed; run() builds it again" in capsys.readouterr().out
    fastcall.build(root)
    assert cli.main(["clean", "--all"]) == 0
    assert not list(root.glob(".fastcall/*")) and "removed" in capsys.readouterr().out
