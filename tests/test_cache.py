"""The cache/build/load contracts (docs/architecture.md, build and load contracts), on a machine
without a GPU: nvcc compiles, ninja links, torch imports the module and registers its ops.

Budget: CI is a 2-core machine, and one module build takes 5-10 s there, so the whole
file builds BatchIndicesSpec (the cheapest module) six times in full: once for the shared
`built` entry (copied wherever a test needs a populated cache), once each for the race,
the rebuild after the killed build and the read-only fallback, and twice for the
corrupted entry. The killed build and the compile error stop half-way.

Processes: a loaded .so stays mapped for the life of a process and a torch op namespace
can be registered only once, so whatever must observe a *fresh* load (cache hits without
nvcc, rebuilds of a corrupted entry, the race) runs in a subprocess.

Counting compiles: `toolkit` is a CUDA_HOME of symlinks to the real toolkit whose
bin/nvcc is a wrapper that appends its arguments to a log before running the real nvcc.
Its version output is the real one, so keys equal those of the real toolkit (install
paths are not part of a key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from compile_cache import COUNTED_COMPILER
from race_helpers import run_together

from flashinfer_jit.pipeline import cache, env, jit, render, toolchain
from flashinfer_jit.pipeline.errors import BuildError, CacheError, JitDisabledError, ToolchainError
from flashinfer_jit.pipeline.spec import NAMESPACE_PLACEHOLDER
from flashinfer_jit.specs import AppendSpec, BatchIndicesSpec

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 300
SPEC = BatchIndicesSpec()
OP = "get_batch_indices_positions"
OTHER_NVCC = "Build cuda_99.9.r99.9/compiler.0_0"  # another toolkit's `nvcc --version`


def _have_toolchain() -> bool:
    try:
        toolchain.get()
        return True
    except ToolchainError:
        return False


needs_toolchain = pytest.mark.skipif(not _have_toolchain(), reason="needs nvcc, ninja and g++")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test sees the real user cache (a lookup root besides FLASHINFER_JIT_CACHE_DIR),
    nor a mode left over from the caller's environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for name in ("FLASHINFER_JIT_DISABLE_JIT", "FLASHINFER_JIT_DEBUG", "FLASHINFER_JIT_VERBOSE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fresh_toolchain():
    """Forget the probed toolchain before and after (tests that fake a missing tool)."""
    toolchain.get.cache_clear()
    toolchain.nvcc_version.cache_clear()
    yield
    toolchain.get.cache_clear()
    toolchain.nvcc_version.cache_clear()


# --- helpers ----------------------------------------------------------------------------
def entries(root: Path) -> list[Path]:
    """Published-looking folders of a cache root (what `flashinfer-jit list` shows)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []


def temp_dirs(root: Path) -> list[Path]:
    tmp = root / ".tmp"
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".locks", ".tmp"))
    return dst


def make_toolkit(tmp_path: Path) -> tuple[Path, Path]:
    """(CUDA_HOME, log) of a toolkit whose nvcc logs every invocation, one per line."""
    real_nvcc = Path(toolchain.find_nvcc()).resolve()
    real_home = real_nvcc.parent.parent
    home = tmp_path / "toolkit"
    (home / "bin").mkdir(parents=True)
    for child in real_home.iterdir():
        if child.name != "bin":
            (home / child.name).symlink_to(child)
    for child in real_nvcc.parent.iterdir():
        if child.name != "nvcc":
            (home / "bin" / child.name).symlink_to(child)
    log = tmp_path / "nvcc-calls.log"
    log.touch()
    wrapper = home / "bin" / "nvcc"
    # (the marker line: tests/compile_cache.py never answers for it, so every compile is counted)
    wrapper.write_text(f'#!/bin/sh\n# {COUNTED_COMPILER}\necho "$*" >> "{log}"\nexec "{real_nvcc}" "$@"\n')
    wrapper.chmod(0o755)
    return home, log


def compiles(log: Path) -> list[str]:
    """nvcc invocations that compile (anything but the --version probe)."""
    return [line for line in log.read_text().splitlines() if line.strip() != "--version"]


def needed_libraries(library: Path) -> list[str]:
    """The NEEDED entries of a shared object (readelf -d)."""
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return [line.split("[")[-1].rstrip("]") for line in dynamic.splitlines() if "NEEDED" in line]


def empty_path(tmp_path: Path) -> str:
    """A PATH with no tools at all (subprocesses start python by its full path)."""
    empty = tmp_path / "bin-without-tools"
    empty.mkdir(exist_ok=True)
    return str(empty)


def python_env(**overrides: str | None) -> dict[str, str]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    for name, value in overrides.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


# Loads BatchIndicesSpec, prints where from and whether its op is a registered torch op.
LOAD = textwrap.dedent(f"""
    import json, sys, torch
    from flashinfer_jit.pipeline import jit, toolchain
    from flashinfer_jit.specs import BatchIndicesSpec
    module = jit.get_module(BatchIndicesSpec())
    ops = getattr(torch.ops, module.namespace)
    print(json.dumps({{"path": str(module.path), "op": hasattr(ops, "{OP}"),
                      "schema": str(getattr(ops, "{OP}").default._schema),
                      "nvcc": toolchain.find_nvcc()}}))
""")


def run_load(**overrides: str | None) -> dict:
    proc = subprocess.run([sys.executable, "-c", LOAD], env=python_env(**overrides), cwd=REPO,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache root holding one BatchIndicesSpec entry, built in this process.
    Tests copy it (copy_cache) instead of changing it."""
    if not _have_toolchain():
        pytest.skip("needs nvcc, ninja and g++")
    root = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
        mp.setenv("XDG_CACHE_HOME", str(root.parent / "xdg"))
        mp.delenv("FLASHINFER_JIT_DISABLE_JIT", raising=False)
        jit.clear_registry()
        module = jit.get_module(SPEC)
        prep = jit.prepare(SPEC)
        jit.clear_registry()
    return root, module, prep


# --- keys: stable and sensitive (no builds) -----------------------------------------------
@needs_toolchain
def test_key_is_stable():
    first, second = jit.prepare(SPEC), jit.prepare(BatchIndicesSpec())
    assert first.key == second.key and first.content_key == second.content_key
    assert len(first.key) == 64 and first.key != first.content_key
    assert jit.prepare(AppendSpec("float16", 64)).key != jit.prepare(AppendSpec("float16", 128)).key


@needs_toolchain
def test_key_ignores_dict_order(monkeypatch):
    spec = AppendSpec("bfloat16", 128, "HND", "csr")
    prep = jit.prepare(spec)
    module = prep.module
    reordered = render.RenderedModule(spec, dict(reversed(list(module.sources.items()))),
                                      dict(reversed(list(module.headers.items()))))
    torch_id = toolchain.torch_identity()
    assert cache.content_key(reordered, prep.flags, torch_id) == prep.content_key
    assert cache.content_key(module, prep.flags, dict(reversed(list(torch_id.items())))) \
        == prep.content_key
    canonical = spec.canonical()
    monkeypatch.setattr(AppendSpec, "canonical", lambda self: {
        "params": dict(reversed(list(canonical["params"].items()))), "family": canonical["family"]})
    assert cache.content_key(module, prep.flags, torch_id) == prep.content_key
    compilers = dict(reversed(list(prep.compilers.items())))
    assert cache.full_key(prep.content_key, compilers) == prep.key


@needs_toolchain
def test_key_changes_with_a_reached_header_only(source_copy):
    copies = source_copy
    append = AppendSpec("float16", 128)
    before, before_append = jit.prepare(SPEC), jit.prepare(append)

    # Modification times are not part of the key.
    header = copies["csrc"] / "common/common.cuh"
    os.utime(header, (time.time() + 3600, time.time() + 3600))
    assert jit.prepare(SPEC).key == before.key

    # page_table.cuh is reached by append's kernel only.
    with open(copies["csrc"] / "common/page_table.cuh", "a") as f:
        f.write("// a comment\n")
    assert jit.prepare(SPEC).key == before.key
    assert jit.prepare(append).key != before_append.key

    # One byte more in a header both reach: both keys change.
    with open(header, "a") as f:
        f.write("//\n")
    after = jit.prepare(SPEC)
    assert after.key != before.key and after.content_key != before.content_key
    assert after.module.headers["common/common.cuh"].endswith(b"//\n")

    # So does a template edit.
    template = copies["templates"] / "kvcache/batch_indices.cu.j2"
    template.write_text(template.read_text() + "// edited\n")
    assert jit.prepare(SPEC).key != after.key


@needs_toolchain
def test_key_changes_with_flags_and_archs(monkeypatch):
    base = jit.prepare(SPEC, ("9.0a",))
    monkeypatch.setenv("FLASHINFER_JIT_DEBUG", "1")
    debug = jit.prepare(SPEC, ("9.0a",))
    assert debug.flags.debug and "-G" in debug.flags.nvcc
    assert debug.key != base.key and debug.content_key != base.content_key
    monkeypatch.delenv("FLASHINFER_JIT_DEBUG")

    assert jit.prepare(SPEC, ("8.0",)).key != base.key
    assert jit.prepare(SPEC, ("8.0", "9.0a")).key not in (base.key, jit.prepare(SPEC, ("8.0",)).key)
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a 8.0")
    from_env = jit.prepare(SPEC)
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "8.0;9.0a")
    assert jit.prepare(SPEC).key == from_env.key == jit.prepare(SPEC, ("8.0", "9.0a")).key
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    assert jit.prepare(SPEC).key == base.key

    # nvcc --threads changes how fast, not what is built.
    monkeypatch.setenv("FLASHINFER_JIT_NVCC_THREADS", "4")
    assert jit.prepare(SPEC, ("9.0a",)).key == base.key


@needs_toolchain
def test_key_changes_with_toolchain_torch_and_package(monkeypatch):
    base = jit.prepare(SPEC)
    other_nvcc = dataclasses.replace(toolchain.get(), nvcc_version=OTHER_NVCC)
    monkeypatch.setattr(toolchain, "get", lambda: other_nvcc)
    moved = jit.prepare(SPEC)
    assert moved.content_key == base.content_key  # found by an image without nvcc
    assert moved.key != base.key  # but a build with another compiler is another entry
    assert cache.full_key(base.content_key, {**base.compilers, "cxx": "g++ (GCC) 99.1"}) != base.key
    assert cache.full_key(base.content_key, base.compilers) == base.key

    torch_id = {**toolchain.torch_identity(), "torch": "0.0.1"}
    assert cache.content_key(base.module, base.flags, torch_id) != base.content_key
    monkeypatch.setattr(cache, "__version__", "99.0.0")
    assert cache.content_key(base.module, base.flags, toolchain.torch_identity()) \
        != base.content_key


# --- a real module, built, linked and imported without a GPU --------------------------------
@pytest.mark.slow
def test_real_module_builds_links_and_registers_its_op(built):
    import torch

    root, module, prep = built
    assert hasattr(getattr(torch.ops, module.namespace), OP)
    ops = getattr(torch.ops, module.namespace)
    assert module.get_batch_indices_positions is getattr(ops, OP).default

    [entry] = entries(root)
    assert entry == module.path == root / f"{SPEC.name}-{prep.key[:16]}"
    manifest = cache.read_manifest(entry)
    assert manifest["key"] == prep.key and manifest["content_key"] == prep.content_key
    library = entry / f"{SPEC.name}.so"
    assert manifest["library"] == library.name
    assert manifest["files"][library.name] == {"size": library.stat().st_size,
                                               "sha256": cache.sha256_file(library)}
    assert {"kernel.cu", "binding.cc", "build.ninja", "csrc/common/common.cuh"} <= set(manifest["files"])
    kernel = (entry / "kernel.cu").read_text()
    assert f"namespace {module.namespace} " in kernel and NAMESPACE_PLACEHOLDER not in kernel
    assert cache.verify_entry(entry) is None
    leftovers = [p.name for p in entry.rglob("*")
                 if p.suffix in (".o", ".d") or p.name.startswith(".ninja")]
    assert leftovers == []
    assert temp_dirs(root) == []

    # Of the CUDA libraries only cudart is linked: CPU torch loads the same module.
    if shutil.which("readelf"):
        needed = needed_libraries(library)
        assert any(n.startswith("libcudart") for n in needed), needed
        assert not any("torch_cuda" in n or "c10_cuda" in n for n in needed), needed
        # ...and the C++ runtime is the process's shared one, no private copy of it.
        assert "libstdc++.so.6" in needed, needed


@pytest.mark.slow
def test_second_process_loads_without_compiling(built, tmp_path):
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    home, log = make_toolkit(tmp_path)
    result = run_load(FLASHINFER_JIT_CACHE_DIR=str(root), CUDA_HOME=str(home),
                      PATH=f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert result["nvcc"] == str(home / "bin" / "nvcc")
    assert "--version" in log.read_text()  # it used the wrapper to compute the key...
    assert compiles(log) == []  # ...and never compiled
    assert result["path"] == str(entry) and result["op"]
    assert entries(root) == [entry] and temp_dirs(root) == []


@pytest.mark.slow
def test_disable_jit_loads_without_any_nvcc(built, tmp_path):
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    manifest_before = (entry / cache.MANIFEST).read_bytes()
    result = run_load(FLASHINFER_JIT_CACHE_DIR=str(root), FLASHINFER_JIT_DISABLE_JIT="1",
                      CUDA_HOME=str(tmp_path / "no-cuda-here"), PATH=empty_path(tmp_path))
    assert result["nvcc"] is None
    assert result["path"] == str(entry) and result["op"]
    assert (entry / cache.MANIFEST).read_bytes() == manifest_before
    assert entries(root) == [entry] and temp_dirs(root) == []


@pytest.mark.slow
def test_disable_jit_accepts_an_entry_built_by_another_nvcc(built, tmp_path, monkeypatch):
    """A deployment image whose nvcc differs from the AOT builder's still hits (by content
    key) when JIT is disabled; with JIT enabled that nvcc would build its own entry."""
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    other = dataclasses.replace(toolchain.get(), nvcc_version=OTHER_NVCC)
    monkeypatch.setattr(toolchain, "get", lambda: other)
    prep = jit.prepare(SPEC)
    assert prep.key != built[2].key
    assert jit.find_published(prep) == entry
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT")
    assert jit.find_published(prep) is None


def test_disable_jit_miss_names_the_module(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    for spec in (SPEC, AppendSpec("bfloat16", 128)):
        with pytest.raises(JitDisabledError, match=spec.name) as info:
            jit.get_module(spec)
        assert "FLASHINFER_JIT_DISABLE_JIT" in str(info.value)
        assert "flashinfer-jit aot" in str(info.value)
    assert entries(fresh_cache) == [] and temp_dirs(fresh_cache) == []


# --- concurrency and faults ------------------------------------------------------------------
# Each racer imports everything, says it is ready, waits for the start signal, then asks.
RACER = textwrap.dedent(f"""
    import json, os, sys, time, torch
    from flashinfer_jit.pipeline import jit
    from flashinfer_jit.specs import BatchIndicesSpec
    ready, go = sys.argv[1], sys.argv[2]
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    module = jit.get_module(BatchIndicesSpec())
    ops = getattr(torch.ops, module.namespace)
    print(json.dumps({{"path": str(module.path), "op": hasattr(ops, "{OP}")}}))
""")


@pytest.mark.thorough
@pytest.mark.slow
@needs_toolchain
def test_eight_processes_one_compile(tmp_path):
    root = tmp_path / "cache"
    home, log = make_toolkit(tmp_path)
    environ = python_env(FLASHINFER_JIT_CACHE_DIR=str(root), CUDA_HOME=str(home),
                         FLASHINFER_JIT_VERBOSE="1")
    outputs = run_together(tmp_path, RACER, [environ] * 8, REPO, SUBPROCESS_TIMEOUT, SUBPROCESS_TIMEOUT)
    loads = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    [entry] = entries(root)
    assert all(r["path"] == str(entry) and r["op"] for r in loads), loads
    kernel_compiles = [c for c in compiles(log) if " -c " in f" {c} " and "kernel.cu" in c]
    assert len(kernel_compiles) == 1, compiles(log)
    building = [text for text in outputs if "flashinfer_jit: building" in text]
    assert len(building) == 1, building  # the other seven waited on the lock and loaded
    assert cache.verify_entry(entry) is None
    assert temp_dirs(root) == [] and not (root / ".logs").exists()
    assert (root / ".locks" / f"{entry.name}.lock").exists()  # locks are never deleted


@pytest.mark.slow
@needs_toolchain
def test_killed_build_publishes_nothing(fresh_cache, tmp_path):
    root = fresh_cache
    home, log = make_toolkit(tmp_path)
    environ = python_env(FLASHINFER_JIT_CACHE_DIR=str(root), CUDA_HOME=str(home))
    builder = subprocess.Popen([sys.executable, "-c", LOAD], cwd=REPO, env=environ,
                               start_new_session=True,  # its own process group: ninja, nvcc
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while not any("kernel.cu" in c for c in compiles(log)):  # nvcc is running
            assert builder.poll() is None, builder.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "nvcc never started"
            time.sleep(0.02)
        assert temp_dirs(root), "the build runs in a private folder under .tmp"
        time.sleep(0.2)
        os.killpg(builder.pid, signal.SIGKILL)  # the builder, ninja and nvcc, mid-compile
    finally:
        if builder.poll() is None:
            os.killpg(builder.pid, signal.SIGKILL)
        builder.wait(timeout=SUBPROCESS_TIMEOUT)
    assert builder.returncode == -signal.SIGKILL
    assert entries(root) == []
    [leftover] = temp_dirs(root)
    assert not (leftover / cache.MANIFEST).exists()
    assert jit.find_published(jit.prepare(SPEC)) is None
    assert list(cache.iter_entries(root)) == []

    module = jit.get_module(SPEC)  # builds anew; the leftover is not an entry
    assert hasattr(module, OP)
    [entry] = entries(root)
    assert entry.name.startswith(f"{SPEC.name}-") and cache.verify_entry(entry) is None
    assert jit.find_published(jit.prepare(SPEC)) == entry
    assert temp_dirs(root) == [leftover]
    assert [path for path, _ in cache.iter_entries(root)] == [entry]


@pytest.mark.thorough
@pytest.mark.slow
def test_corrupted_entry_is_detected_and_rebuilt(built, tmp_path):
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    library = entry / f"{SPEC.name}.so"
    size = library.stat().st_size
    home, log = make_toolkit(tmp_path)
    overrides = dict(FLASHINFER_JIT_CACHE_DIR=str(root), CUDA_HOME=str(home))

    # Same size, other bytes: caught by the sha256.
    binding = entry / "binding.cc"
    original = binding.read_bytes()
    binding.write_bytes(original.replace(b"namespace", b"nAmespace", 1))
    assert "binding.cc does not match its sha256" == cache.verify_entry(entry)
    binding.write_bytes(original)
    assert cache.verify_entry(entry) is None

    # A truncated library: reported, then rebuilt (not loaded) by the next process.
    with open(library, "r+b") as f:
        f.truncate(size // 2)
    assert cache.verify_entry(entry) == \
        f"{library.name} has {size // 2} bytes, manifest says {size}"
    result = run_load(**overrides)
    assert result["path"] == str(entry) and result["op"]
    assert len([c for c in compiles(log) if "kernel.cu" in c]) == 1
    assert cache.verify_entry(entry) is None and library.stat().st_size > size // 2
    assert temp_dirs(root) == []  # the bad entry was moved aside and deleted

    # A deleted manifest: the entry no longer counts; rebuilt.
    (entry / cache.MANIFEST).unlink()
    assert cache.verify_entry(entry) == "no readable manifest.json"
    result = run_load(**overrides)
    assert result["path"] == str(entry) and result["op"]
    assert len([c for c in compiles(log) if "kernel.cu" in c]) == 2
    assert cache.verify_entry(entry) is None and temp_dirs(root) == []


def test_verify_entry_reports_malformed_manifests(tmp_path):
    entry = tmp_path / "x-0123456789abcdef"
    entry.mkdir()
    (entry / "x.so").write_bytes(b"\x7fELF")
    for text, problem in [("", "no readable manifest.json"), ("[]", "no readable manifest.json"),
                          ('{"library": "x.so", "files": 3}', "manifest lists no library"),
                          ('{"library": "x.so", "files": {"x.so": {}}}', "no size and sha256")]:
        (entry / cache.MANIFEST).write_text(text)
        assert problem in cache.verify_entry(entry)
    so = {"size": 4, "sha256": cache.sha256_bytes(b"\x7fELF")}
    base = {"name": "x", "key": "0123456789abcdef" + "0" * 48, "content_key": "c" * 64, "library": "x.so",
            "files": {"x.so": so}}
    for change, problem in [({"name": None}, "no name, key or content_key"),
                            ({"key": "fedcba9876543210" + "0" * 48}, "do not match the folder"),
                            ({"library": "y.so", "files": {"y.so": so}}, "manifest's library is 'y.so'")]:
        (entry / cache.MANIFEST).write_text(json.dumps({**base, **change}))
        assert problem in cache.verify_entry(entry)
    (entry / cache.MANIFEST).write_text(json.dumps(base))
    assert cache.verify_entry(entry) is None


def test_an_edited_manifest_key_or_archs_is_caught_and_rebuilt(built, tmp_path, monkeypatch):
    """The manifest fields that decide whether an entry serves a request are derived again:
    a key edited to another value (same folder) no longer matches full_key(content_key,
    toolchain), so verify reports it and the next load rebuilds; an archs list edited to
    claim 8.0 for a 9.0a binary no longer matches the content key of those archs, so a
    process asking for 8.0 does not take it."""
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    path = entry / cache.MANIFEST
    original = json.loads(path.read_text())
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))

    path.write_text(json.dumps({**original, "key": original["key"][:16] + "f" * 48}))
    assert "key is not the key of its content_key and toolchain" in cache.verify_entry(entry)
    assert jit.find_published(jit.prepare(SPEC)) is None  # a miss: the next get_module rebuilds it
    path.write_text(json.dumps(original))
    assert jit.find_published(jit.prepare(SPEC)) == entry

    if not original["archs"]:
        pytest.skip("a host-only entry has no archs")
    wider = sorted(set(original["archs"]) | {"8.0"})
    path.write_text(json.dumps({**original, "archs": wider}))
    assert cache.verify_entry(entry) is None  # files and key agree: only the archs claim is false
    assert jit.find_published(jit.prepare(SPEC, ("8.0",))) is None


@pytest.mark.slow
@needs_toolchain
def test_compile_error_raises_build_error(fresh_cache, source_copy):
    copies = source_copy
    template = copies["templates"] / "kvcache/batch_indices.cu.j2"
    template.write_text(template.read_text() + "this is not C++ at all;\n")

    with pytest.raises(BuildError) as info:
        jit.get_module(SPEC)
    error = info.value
    message = str(error)
    assert error.module == SPEC.name and repr(SPEC.name) in message
    log = Path(error.log_path)
    assert log.is_file() and str(log) in message and log.parent == fresh_cache / ".logs"
    assert error.first_errors and any("error" in line for line in error.first_errors)
    assert error.first_errors[0] in message
    assert "kernel.cu" in "\n".join(error.first_errors)
    assert "this is not C++" in log.read_text()
    assert entries(fresh_cache) == [] and temp_dirs(fresh_cache) == []


@needs_toolchain
def test_read_only_cache_dir_falls_back_to_user_cache_chmod(tmp_path, monkeypatch):
    root = tmp_path / "readonly"
    root.mkdir()
    root.chmod(0o555)
    try:
        writable = os.access(root, os.W_OK) or cache._writable_dir(root)
        if writable:  # root (CI containers) writes through chmod 0o555
            pytest.skip("chmod 0o555 does not stop this user from writing")
        monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))
        fallback = (tmp_path / "xdg" / "flashinfer_jit").resolve()
        assert cache.build_root() == env.user_cache_root() == fallback
    finally:
        root.chmod(0o755)


@pytest.mark.slow
@needs_toolchain
def test_unwritable_cache_dir_falls_back_then_fails_clearly(tmp_path, monkeypatch):
    """A cache root below a regular file cannot be created, even by root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(blocker / "cache"))
    jit.clear_registry()
    module = jit.get_module(SPEC)
    user_root = tmp_path / "xdg" / "flashinfer_jit"
    [entry] = entries(user_root)
    assert cache.verify_entry(entry) is None and hasattr(module, OP)
    assert jit.find_published(jit.prepare(SPEC)) == entry  # later lookups find it there

    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "xdg"))
    jit.clear_registry()
    with pytest.raises(CacheError, match="no writable cache directory.*FLASHINFER_JIT_CACHE_DIR"):
        jit.get_module(SPEC)
    jit.clear_registry()


# --- the C++ runtime: one shared libstdc++ per process ------------------------------------------
# A compiler whose library path holds only libstdc++.a (a relocated GCC, like the H100
# machine's /opt/gcc) links a private libstdc++ into each module; its iostreams crash on
# the process's locale as soon as a TORCH_CHECK message formats a number.
STATIC_ONLY_CXX = """#!/bin/sh
# g++ as a toolchain with only libstdc++.a would behave: no libstdc++.so on its path.
for a in "$@"; do
  case "$a" in -print-file-name=libstdc++.so) echo libstdc++.so; exit 0;; esac
done
case " $* " in *" -shared "*) exec "{real}" -static-libstdc++ "$@";; esac
exec "{real}" "$@"
"""
FORMATS_A_NUMBER = "#include <sstream>\n#include <string>\n" \
    "std::string message(long n) { std::ostringstream s; s << \"n = \" << n; return s.str(); }\n"
OSTREAM_INSERT_LONG = "_ZNSo9_M_insertIlEERSoT_"  # std::ostream::_M_insert<long>


def static_only_cxx(tmp_path: Path) -> str:
    real = shutil.which(toolchain.find_cxx() or "g++")
    wrapper = tmp_path / "static-only-g++"
    wrapper.write_text(STATIC_ONLY_CXX.format(real=real))
    wrapper.chmod(0o755)
    return str(wrapper)


def dynamic_symbols(library: Path) -> tuple[set[str], list[str]]:
    """(defined dynamic symbols, NEEDED libraries) of a shared object."""
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                        check=True).stdout
    return {line.split()[-1] for line in nm.splitlines() if line.strip()}, needed_libraries(library)


needs_binutils = pytest.mark.skipif(not (shutil.which("nm") and shutil.which("readelf")),
                                    reason="needs nm and readelf")


@needs_toolchain
@needs_binutils
def test_a_static_only_compiler_links_the_shared_libstdcxx(tmp_path):
    """The simulated compiler does link a private libstdc++ on its own (so the check
    below can fail); with shared_libstdcxx's inputs the library takes every C++ runtime
    symbol from libstdc++.so.6 instead."""
    cxx = static_only_cxx(tmp_path)
    (tmp_path / "m.cc").write_text(FORMATS_A_NUMBER)
    subprocess.run([cxx, "-fPIC", "-c", str(tmp_path / "m.cc"), "-o", str(tmp_path / "m.o")], check=True)
    subprocess.run([cxx, str(tmp_path / "m.o"), "-shared", "-o", str(tmp_path / "private.so")], check=True)
    defined, needed = dynamic_symbols(tmp_path / "private.so")
    assert OSTREAM_INSERT_LONG in defined and "libstdc++.so.6" not in needed

    runtime = toolchain.shared_libstdcxx(cxx)
    assert len(runtime) == 1 and os.path.basename(runtime[0]).startswith("libstdc++.so.6"), runtime
    subprocess.run([cxx, str(tmp_path / "m.o"), "-shared", *runtime, "-o", str(tmp_path / "shared.so")],
                   check=True)
    defined, needed = dynamic_symbols(tmp_path / "shared.so")
    assert OSTREAM_INSERT_LONG not in defined and "libstdc++.so.6" in needed
    # A compiler that finds libstdc++.so links it shared by itself: nothing to add. (The
    # H100 machine's CXX is itself static-only: there it gets the library too.)
    real = shutil.which(toolchain.find_cxx())
    found = toolchain._print_file_name(real, "libstdc++.so")
    assert toolchain.shared_libstdcxx(real) == (() if found else runtime)


@needs_toolchain
def test_doctor_names_the_shared_libstdcxx_of_a_static_only_compiler(tmp_path, monkeypatch):
    from flashinfer_jit import cli

    monkeypatch.setenv("CXX", static_only_cxx(tmp_path))
    check = cli.check_cxx()
    assert check.ok and "no libstdc++.so, so modules link" in check.detail and "libstdc++.so.6" in check.detail


@pytest.mark.thorough
@pytest.mark.slow
@needs_toolchain
@needs_binutils
def test_module_built_by_a_static_only_compiler_shares_libstdcxx(fresh_cache, fresh_toolchain, tmp_path,
                                                                monkeypatch):
    """A real module built with CXX set to such a compiler: its key says so (entries
    linked the old way are not reused) and its library holds no libstdc++ of its own."""
    plain, plain_marked = jit.prepare(SPEC).key, "cxx_runtime" in toolchain.get().compiler_identity()
    toolchain.get.cache_clear()
    monkeypatch.setenv("CXX", static_only_cxx(tmp_path))
    assert toolchain.get().compiler_identity()["cxx_runtime"]
    prep = jit.prepare(SPEC)
    # (Where CXX is already static-only, as on the H100 machine, both keys carry the mark.)
    assert (prep.key != plain) == (not plain_marked)
    module = jit.get_module(SPEC)
    defined, needed = dynamic_symbols(module.path / f"{SPEC.name}.so")
    assert not any(name.startswith(("_ZNSo", "_ZNSt7num_put", "_ZNSt6locale")) for name in defined)
    assert "libstdc++.so.6" in needed
    jit.clear_registry()


# --- missing tools ---------------------------------------------------------------------------
def test_missing_ninja_says_how_to_fix(fresh_toolchain, monkeypatch):
    monkeypatch.setattr(toolchain, "find_ninja", lambda: None)
    with pytest.raises(ToolchainError, match="ninja not found.*pip install ninja"):
        toolchain.get()
    jit.clear_registry()
    with pytest.raises(ToolchainError, match="ninja not found"):
        jit.get_module(SPEC)
    jit.clear_registry()


def test_missing_nvcc_says_how_to_fix(fresh_toolchain, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(toolchain, "find_nvcc", lambda: None)
        with pytest.raises(ToolchainError, match="nvcc not found.*CUDA_HOME"):
            toolchain.get()
    toolchain.get.cache_clear()
    toolchain.nvcc_version.cache_clear()
    # The same from the environment alone: no CUDA_HOME toolkit, no nvcc on PATH.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda-here"))
    monkeypatch.setenv("PATH", empty_path(tmp_path))
    assert toolchain.find_nvcc() is None
    jit.clear_registry()
    with pytest.raises(ToolchainError, match="nvcc not found.*CUDA_HOME.*PATH"):
        jit.get_module(SPEC)
    jit.clear_registry()


# --- import ------------------------------------------------------------------------------------
IMPORT = textwrap.dedent("""
    import json, time
    start = time.perf_counter()
    import torch
    after_torch = time.perf_counter()
    import flashinfer_jit
    after_package = time.perf_counter()
    flashinfer_jit.get_module, flashinfer_jit.specs  # resolving names is lazy too
    print(json.dumps({"torch": after_torch - start, "package": after_package - after_torch,
                      "cuda_initialized": torch.cuda.is_initialized()}))
""")


def test_import_touches_neither_gpu_nor_disk(tmp_path):
    root = tmp_path / "cache"
    checkout_cache = REPO / "cache"
    before = sorted(checkout_cache.rglob("*")) if checkout_cache.is_dir() else []
    proc = subprocess.run([sys.executable, "-c", IMPORT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT,
                          env=python_env(FLASHINFER_JIT_CACHE_DIR=str(root),
                                         XDG_CACHE_HOME=str(tmp_path / "xdg"),
                                         PYTHONDONTWRITEBYTECODE="1"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["cuda_initialized"]
    assert result["package"] < 0.5, result
    assert not root.exists() and not (tmp_path / "xdg").exists()
    assert (sorted(checkout_cache.rglob("*")) if checkout_cache.is_dir() else []) == before


# --- deployment: prebuilt read-only roots (FLASHINFER_JIT_CACHE_PATH) ---------------------------
def snapshot(root: Path) -> list[tuple]:
    """Everything about a folder a write would change: each path's kind, size, mode and
    modification time, the root's own included."""
    paths = [root, *sorted(root.rglob("*"))]
    return [(str(p.relative_to(root)), p.is_dir(), p.lstat().st_size if p.is_file() else 0,
             p.lstat().st_mode, p.lstat().st_mtime_ns) for p in paths]


# Mount scripts for in_private_mounts; "$0" is the folder.
READ_ONLY_BIND = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0"'  # even root cannot write
TINY_TMPFS = 'mount -t tmpfs -o size=96k tmpfs "$0"'  # room for a module's sources, not its objects


def in_private_mounts(script: str, folder: Path) -> list[str] | None:
    """A command prefix that runs `script` in a private mount namespace (as root, or in a
    user namespace), then `exec "$@"`, the command that follows; None where that does not
    work here (tried once per script on a scratch folder). Absolute paths: the commands
    may run with PATH emptied."""
    unshare = _unshare_for(script)
    if unshare is None:
        return None
    script = script.replace("mount ", f"{shutil.which('mount')} ")
    return [*unshare, shutil.which("sh"), "-c", script + ' && exec "$@"', str(folder)]


@functools.cache
def _unshare_for(script: str) -> tuple[str, ...] | None:
    unshare, sh, mount = shutil.which("unshare"), shutil.which("sh"), shutil.which("mount")
    if not (unshare and sh and mount):
        return None
    with tempfile.TemporaryDirectory() as scratch:
        for cmd in ((unshare, "-m"), (unshare, "-Urm")):
            probe = [*cmd, sh, "-c", script.replace("mount ", f"{mount} ") + ' && exec "$@"', scratch, "true"]
            try:
                if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                    return cmd
            except (OSError, subprocess.SubprocessError):
                continue
    return None


@contextlib.contextmanager
def read_only(root: Path):
    """`root` made read-only for the subprocesses run through the prefix this yields:
    chmod a-w (which root ignores), plus a read-only bind mount where mount namespaces
    work. The tests compare listings before and after as well."""
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")]}
    for path in modes:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        yield in_private_mounts(READ_ONLY_BIND, root) or []
    finally:
        for path, mode in modes.items():
            path.chmod(mode)


def run_load_in(prefix: list[str], **overrides: str | None) -> dict:
    proc = subprocess.run([*prefix, sys.executable, "-c", LOAD], env=python_env(**overrides), cwd=REPO,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def truncate_library(entry: Path) -> None:
    library = entry / f"{SPEC.name}.so"
    os.truncate(library, library.stat().st_size // 2)


def no_tools(tmp_path: Path) -> dict[str, str]:
    """Overrides for an image without nvcc, with JIT disabled."""
    return dict(FLASHINFER_JIT_DISABLE_JIT="1", CUDA_HOME=str(tmp_path / "no-cuda-here"),
                PATH=empty_path(tmp_path))


def fake_entry(root: Path, name: str, damaged: bool = False) -> Path:
    """A published-looking entry, no build needed: `<name>.so` and a manifest that lists
    it (one byte off in size when `damaged`). What verify, clean and pack look at."""
    entry = root / f"{name}-0123456789abcdef"
    entry.mkdir(parents=True)
    library = entry / f"{name}.so"
    library.write_bytes(b"\x7fELF not really")
    files = {library.name: {"size": library.stat().st_size + damaged, "sha256": cache.sha256_file(library)}}
    (entry / cache.MANIFEST).write_text(json.dumps({"name": name, "library": library.name, "files": files}))
    return entry


@pytest.mark.parametrize("command, said_by", [("clean --all", "clean"), ("verify --fix", "verify --fix")])
def test_clean_and_verify_fix_on_a_read_only_cache_say_why_and_change_nothing(tmp_path, command, said_by):
    """A cache this user may not write (a read-only mount; or chmod a-w, which root
    ignores): one line naming the entry and the file refused, exit 1, no traceback, and
    the cache exactly as it was. Writable again, the same command removes the entry."""
    root = tmp_path / "cache"
    (root / ".locks").mkdir(parents=True)  # a cache in use has these; the entry has no lock file yet
    (root / ".tmp").mkdir()
    entry = fake_entry(root, "decode_plan", damaged=True)  # bad: verify --fix wants it gone too
    environ = python_env(FLASHINFER_JIT_CACHE_DIR=str(root), XDG_CACHE_HOME=str(tmp_path / "xdg"),
                         FLASHINFER_JIT_CACHE_PATH=None)
    argv = [sys.executable, "-m", "flashinfer_jit", *command.split()]
    with read_only(root) as prefix:
        if not prefix and os.access(root, os.W_OK):
            pytest.skip("no read-only bind mount here (no mount namespace) and chmod does not "
                        "stop this user (root) from writing")
        before = snapshot(root)
        proc = subprocess.run([*prefix, *argv], env=environ, cwd=tmp_path, capture_output=True,
                              text=True, timeout=SUBPROCESS_TIMEOUT)
        assert snapshot(root) == before
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    lock = root / ".locks" / f"{entry.name}.lock"
    assert line.startswith(f"flashinfer-jit {said_by}: cannot remove {entry}: {lock}: "), line
    assert ("Read-only file system" if prefix else "Permission denied") in line

    proc = subprocess.run(argv, env=environ, cwd=tmp_path, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not entry.exists() and lock.exists() and list((root / ".tmp").iterdir()) == []


def test_cache_path_lists_prebuilt_roots_before_the_writable_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "rw"))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", os.pathsep.join(
        [str(tmp_path / "a"), "", str(tmp_path / "b" / ".." / "b"), str(tmp_path / "rw")]))
    assert cache.prebuilt_roots() == [tmp_path / "a", tmp_path / "b", tmp_path / "rw"]
    assert cache.writable_roots() == [tmp_path / "rw", tmp_path / "xdg" / "flashinfer_jit"]
    assert cache.lookup_roots() == [tmp_path / "a", tmp_path / "b", tmp_path / "rw",
                                    tmp_path / "xdg" / "flashinfer_jit"]
    assert cache.build_root() == tmp_path / "rw"  # never a root only listed in CACHE_PATH
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    monkeypatch.delenv("FLASHINFER_JIT_CACHE_PATH")
    assert cache.prebuilt_roots() == [] and cache.lookup_roots() == cache.writable_roots()


@pytest.mark.slow
def test_prebuilt_root_is_searched_first_and_never_written(built, tmp_path):
    """With nothing writable anywhere (cache dir and user cache below a regular file) and no
    nvcc, a prebuilt root serves the module; with JIT and a compiler it is still a hit. Either
    way no lock, temp folder or last-use mark lands in it."""
    prebuilt = copy_cache(built[0], tmp_path / "prebuilt")
    [entry] = entries(prebuilt)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home, log = make_toolkit(tmp_path)
    before = snapshot(prebuilt)
    with read_only(prebuilt) as prefix:
        result = run_load_in(prefix, FLASHINFER_JIT_CACHE_PATH=str(prebuilt),
                             FLASHINFER_JIT_CACHE_DIR=str(blocker / "cache"),
                             XDG_CACHE_HOME=str(blocker / "xdg"), **no_tools(tmp_path))
        assert result["path"] == str(entry) and result["op"] and result["nvcc"] is None
        # JIT enabled, a writable root with an older copy of the same entry: the prebuilt wins
        writable = copy_cache(built[0], tmp_path / "writable")
        result = run_load_in(prefix, FLASHINFER_JIT_CACHE_PATH=str(prebuilt),
                             FLASHINFER_JIT_CACHE_DIR=str(writable), CUDA_HOME=str(home))
        assert result["path"] == str(entry) and compiles(log) == []
    assert snapshot(prebuilt) == before
    assert not (prebuilt / ".locks").exists() and not (prebuilt / ".tmp").exists()


@pytest.mark.slow
def test_prebuilt_entry_that_fails_verification_is_skipped_not_deleted(built, tmp_path):
    bad_root = copy_cache(built[0], tmp_path / "bad")
    [bad] = entries(bad_root)
    truncate_library(bad)
    good_root = copy_cache(built[0], tmp_path / "good")
    [good] = entries(good_root)
    writable = tmp_path / "writable"
    home, log = make_toolkit(tmp_path)
    before = snapshot(bad_root)
    with read_only(bad_root) as prefix:
        # a later prebuilt root holds a good copy: that one loads, nothing is built
        result = run_load_in(prefix, FLASHINFER_JIT_CACHE_PATH=os.pathsep.join(map(str, [bad_root, good_root])),
                             FLASHINFER_JIT_CACHE_DIR=str(writable), **no_tools(tmp_path))
        assert result["path"] == str(good)
        # none does: the module is built in the writable root, the bad entry stays as it was
        result = run_load_in(prefix, FLASHINFER_JIT_CACHE_PATH=str(bad_root),
                             FLASHINFER_JIT_CACHE_DIR=str(writable), CUDA_HOME=str(home))
    [built_here] = entries(writable)
    assert result["path"] == str(built_here) and built_here.name == bad.name
    assert len([c for c in compiles(log) if "kernel.cu" in c]) == 1
    assert cache.verify_entry(built_here) is None and cache.verify_entry(bad) is not None
    assert snapshot(bad_root) == before


@pytest.mark.slow
def test_a_load_marks_the_entry_used_except_in_prebuilt_roots(built, tmp_path, monkeypatch):
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    long_ago = time.time() - 30 * 86400
    os.utime(entry / cache.MANIFEST, (long_ago, long_ago))
    run_load(FLASHINFER_JIT_CACHE_DIR=str(root))
    assert cache.last_used(entry) > time.time() - 300

    os.utime(entry / cache.MANIFEST, (long_ago, long_ago))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", str(root))
    cache.mark_used(entry)
    assert cache.last_used(entry) == pytest.approx(long_ago)


# --- deployment: a miss with JIT disabled names the aot line that builds it ----------------------
@pytest.mark.slow
@pytest.mark.thorough  # (80 s on two cores: it builds the module the printed command names)
@needs_toolchain
def test_disable_jit_miss_gives_the_aot_command_that_builds_exactly_it(fresh_cache, monkeypatch, capsys):
    import shlex

    from flashinfer_jit import cli

    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError) as info:
        jit.get_module(SPEC)
    error = info.value
    assert error.module == SPEC.name and error.matrix_line == "batch_indices index_dtype=int32"
    assert error.aot_command in str(error) and error.matrix_line in str(error)
    argv = shlex.split(error.aot_command)
    assert argv[:2] == ["flashinfer-jit", "aot"]
    assert argv[argv.index("--out") + 1] == str(fresh_cache)
    assert argv[argv.index("--arch") + 1] == " ".join(jit.prepare(SPEC).flags.archs)

    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT")
    assert cli.main(argv[1:]) == 0
    assert "built 1, already cached 0, failed 0" in capsys.readouterr().out
    [entry] = entries(fresh_cache)
    assert entry.name.startswith(f"{SPEC.name}-")

    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    assert jit.find_published(jit.prepare(SPEC)) == entry  # the miss is now a hit


def test_disable_jit_miss_of_a_debug_build_says_so(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    monkeypatch.setenv("FLASHINFER_JIT_DEBUG", "1")
    spec = AppendSpec("bfloat16", 128, "HND", "block_table")
    with pytest.raises(JitDisabledError) as info:
        jit.get_module(spec)
    assert info.value.aot_command.startswith("FLASHINFER_JIT_DEBUG=1 flashinfer-jit aot --entry ")
    assert info.value.matrix_line == "append dtype_kv=bfloat16 head_dim=128 kv_layout=HND page_table=block_table"
    assert entries(fresh_cache) == [] and temp_dirs(fresh_cache) == []


# --- faults ---------------------------------------------------------------------------------------
@needs_toolchain
def test_entry_from_another_arch_or_torch_is_never_loaded(built, tmp_path, monkeypatch):
    """An entry built for 9.0a and one torch, copied (even renamed to the other
    configuration's folder name) into a cache used for 8.0, or by another torch: its key
    differs, and where its folder name says otherwise its manifest disagrees."""
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(root))

    def never_loaded(prep: jit.Prepared) -> None:
        shutil.copytree(entry, root / prep.entry(root).dirname)  # posing as the other's entry
        for disabled in ("", "1"):
            monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", disabled)
            assert jit.find_published(prep) is None
        jit.clear_registry()
        with pytest.raises(JitDisabledError, match=SPEC.name):
            jit.get_module(SPEC)  # refused, not loaded (JIT enabled would build its own)
        jit.clear_registry()
        monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT")

    other_arch = jit.prepare(SPEC, ("8.0",))
    assert other_arch.content_key != built[2].content_key
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "8.0")
    never_loaded(other_arch)
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")

    other_torch = {**toolchain.torch_identity(), "torch": "2.0.0+cu118", "torch_cuda": "11.8"}
    monkeypatch.setattr(toolchain, "torch_identity", lambda: other_torch)
    other = jit.prepare(SPEC)
    assert other.content_key != built[2].content_key
    never_loaded(other)


@pytest.mark.thorough
@pytest.mark.slow
@needs_toolchain
def test_an_entry_built_for_more_archs_serves_each_of_them(tmp_path, monkeypatch):
    """An AOT image's entry built for "8.0 9.0a" (one fat binary) is found by a process
    that asks for 9.0a alone, or 8.0 alone, with JIT disabled and enabled (nothing built);
    one asking for an arch the entry lacks (8.6) misses."""
    root = tmp_path / "image"
    proc = subprocess.run([sys.executable, "-m", "flashinfer_jit", "aot", "--entry", "batch_indices", "--arch",
                           "8.0 9.0a", "--out", str(root)], cwd=REPO, env=python_env(), capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [fat] = entries(root)
    assert cache.read_manifest(fat)["archs"] == ["8.0", "9.0a"]
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_PATH", str(root))
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "writable"))
    for disabled in ("1", ""):
        monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", disabled)
        for arch in ("9.0a", "8.0"):
            prep = jit.prepare(SPEC, (arch,))
            assert prep.content_key != cache.read_manifest(fat)["content_key"]
            assert jit.find_published(prep) == fat, (disabled, arch)
        assert jit.find_published(jit.prepare(SPEC, ("8.6",))) is None
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE_JIT", "1")
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    jit.clear_registry()
    assert jit.get_module(SPEC).path == fat
    jit.clear_registry()
    assert not (tmp_path / "writable").exists() or entries(tmp_path / "writable") == []


def no_space(path: Path, *args, **kwargs):
    raise OSError(28, "No space left on device", str(path))


@needs_toolchain
def test_a_full_disk_while_staging_a_build_is_a_clear_error(fresh_cache, monkeypatch):
    monkeypatch.setattr(cache, "write_files", lambda build_dir, module: no_space(build_dir / "kernel.cu"))
    with pytest.raises(CacheError) as info:
        jit.get_module(SPEC)
    message = str(info.value)
    assert SPEC.name in message and "No space left on device" in message
    assert "nothing was published" in message and "FLASHINFER_JIT_CACHE_DIR" in message
    assert entries(fresh_cache) == [] and temp_dirs(fresh_cache) == []
    jit.clear_registry()
    with pytest.raises(CacheError, match="No space left on device.*nothing unfinished was published"):
        jit.build_many([SPEC], archs=("9.0a",))
    assert entries(fresh_cache) == [] and temp_dirs(fresh_cache) == []


# Builds BatchIndicesSpec under a file-size limit just above its largest source (the
# compiler's objects do not fit, as on a full disk), then lists the cache root.
FULL_DISK = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    from flashinfer_jit.pipeline import jit
    from flashinfer_jit.specs import BatchIndicesSpec
    limit = int(sys.argv[1])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        jit.get_module(BatchIndicesSpec())
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    root = Path(os.environ["FLASHINFER_JIT_CACHE_DIR"])
    listing = lambda p: sorted(c.name for c in p.iterdir()) if p.is_dir() else []
    print(json.dumps({"error": error, "entries": [n for n in listing(root) if not n.startswith(".")],
                      "temp": listing(root / ".tmp")}))
""")


def largest_staged_file(prep: jit.Prepared) -> int:
    return max(len(data) for data in [*(t.encode() for t in prep.module.sources.values()),
                                      *prep.module.headers.values()])


@pytest.mark.slow
@needs_toolchain
@pytest.mark.parametrize("how", ["file-size limit", "tiny filesystem"])
def test_a_full_disk_during_compilation_publishes_nothing(fresh_cache, tmp_path, how):
    limit = largest_staged_file(jit.prepare(SPEC)) + 8192
    prefix = []
    if how == "tiny filesystem":
        prefix = in_private_mounts(TINY_TMPFS, fresh_cache)
        if prefix is None:
            pytest.skip("no mount namespace here for a private tmpfs")
        fresh_cache.mkdir()
    proc = subprocess.run([*prefix, sys.executable, "-c", FULL_DISK, str(limit if how == "file-size limit" else 0)],
                          env=python_env(FLASHINFER_JIT_CACHE_DIR=str(fresh_cache)), cwd=REPO,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, "the build succeeded: the limit is too generous"
    kind, message = result["error"]
    assert kind in ("BuildError", "CacheError"), message
    assert SPEC.name in message and "FLASHINFER_JIT_CACHE_DIR" in message
    assert "out of disk space?" in message or "No space left on device" in message, message
    assert result["entries"] == [] and result["temp"] == []


LOCK_HOLDER = textwrap.dedent("""
    import sys, time
    from filelock import FileLock
    lock = FileLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_killed_lock_holder_does_not_block_the_next(tmp_path):
    """A builder SIGKILLed while holding an entry's lock: the process waiting on that lock
    proceeds at once (the OS drops the dead process's lock), and the lock file stays."""
    import threading

    root = tmp_path / "cache"
    (root / ".locks").mkdir(parents=True)
    entry = cache.Entry(root, SPEC.name, "0" * 64)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(entry.lock_path)],
                              env=python_env(), stdout=subprocess.PIPE, text=True)
    acquired = threading.Event()
    try:
        assert holder.stdout.readline().strip() == "held"

        def wait_for_lock() -> None:
            with jit._entry_lock(entry, SPEC.name):
                acquired.set()

        waiter = threading.Thread(target=wait_for_lock, daemon=True)
        waiter.start()
        assert not acquired.wait(1.0), "the lock was taken while its holder lived"
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=30) == -signal.SIGKILL
        assert acquired.wait(10.0), "the lock of a killed process was never released"
        waiter.join(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert entry.lock_path.exists()


# Loads BatchIndicesSpec after another "process" removed its entry between the lookup and the
# load (cache.mark_used, called in between, stands in for it: it deletes the entry first).
LOAD_AFTER_REMOVAL = textwrap.dedent(f"""
    import json, shutil, torch
    from flashinfer_jit.pipeline import cache, jit
    from flashinfer_jit.pipeline.errors import JitDisabledError
    from flashinfer_jit.specs import BatchIndicesSpec
    removed = []
    def remove_then_mark(path):
        shutil.rmtree(path)
        removed.append(str(path))
    cache.mark_used = remove_then_mark
    try:
        module = jit.get_module(BatchIndicesSpec())
    except JitDisabledError as exc:
        print(json.dumps({{"removed": removed, "error": str(exc)}}))
    else:
        ops = getattr(torch.ops, module.namespace)
        print(json.dumps({{"removed": removed, "path": str(module.path), "op": hasattr(ops, "{OP}")}}))
""")


@pytest.mark.thorough
def test_an_entry_removed_while_loading_is_rebuilt_or_named(built, tmp_path):
    root = copy_cache(built[0], tmp_path / "cache")
    [entry] = entries(root)
    home, log = make_toolkit(tmp_path)
    overrides = dict(FLASHINFER_JIT_CACHE_DIR=str(root), CUDA_HOME=str(home))

    def run(**more):
        proc = subprocess.run([sys.executable, "-c", LOAD_AFTER_REMOVAL], env=python_env(**overrides, **more),
                              cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # JIT on: the load finds the entry gone, looks again, builds it once and loads it
    result = run()
    assert result["removed"] == [str(entry)]
    assert result["path"] == str(entry) and result["op"]
    assert len([c for c in compiles(log) if "kernel.cu" in c]) == 1
    assert cache.verify_entry(entry) is None and temp_dirs(root) == []

    # JIT off: a miss that names the module, not a crash on a missing file
    result = run(FLASHINFER_JIT_DISABLE_JIT="1")
    assert result["removed"] == [str(entry)]
    assert SPEC.name in result["error"] and "aot" in result["error"]
    assert not entry.exists()
