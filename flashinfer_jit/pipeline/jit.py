"""spec -> rendered sources -> key -> cached or freshly built entry -> loaded torch ops.

`load_or_build` is the lazy path (one module, first call of a configuration);
`build_many` is the AOT path (one ninja over many entries). Both publish entries the
same way (cache.publish under the entry's lock), so an AOT-built entry is an ordinary
cache hit at run time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import socket
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from . import build, cache, env, log, toolchain
from .errors import CacheError, JitDisabledError, ToolchainError
from .render import RenderedModule, render
from .spec import NAMESPACE_PLACEHOLDER, Spec


@dataclass
class Prepared:
    """A spec rendered and keyed against this machine's toolchain and targets."""

    module: RenderedModule
    flags: build.Flags
    content_key: str
    key: str | None  # None when no compiler is available (DISABLE_JIT images)
    compilers: dict = field(default_factory=dict)
    torch: dict = field(default_factory=dict)  # toolchain.torch_identity(), part of content_key
    # content_key as if built for no target arch: an entry with this and a superset of the
    # archs asked for serves them too (an AOT image's "8.0 9.0a" entry, on an H100's "9.0a")
    any_arch_key: str = ""

    @property
    def name(self) -> str:
        return self.module.name

    def entry(self, root: Path) -> cache.Entry:
        assert self.key is not None
        return cache.Entry(root, self.name, self.key)

    def namespace(self) -> str:
        return f"fij_{self.name}_{self.key[:12]}"

    def final_sources(self) -> dict[str, str]:
        ns = self.namespace()
        return {n: t.replace(NAMESPACE_PLACEHOLDER, ns) for n, t in self.module.sources.items()}

    def identity(self) -> dict:
        """The versions its manifest records (cache.write_manifest)."""
        return {"toolchain": self.compilers, "torch": self.torch}


def prepare(spec: Spec, archs: tuple[str, ...] | None = None) -> Prepared:
    module = render(spec)
    # host-only modules (no device code) build without target archs: one entry for every GPU
    archs = () if spec.HOST_ONLY else (spec.ARCHS or archs or env.target_archs())
    torch_id = toolchain.torch_identity()
    flags = build.make_flags(archs, env.debug(), torch_id["cxx11_abi"])
    content = cache.content_key(module, flags, torch_id)
    any_arch = content if not archs else \
        cache.content_key(module, build.make_flags((), env.debug(), torch_id["cxx11_abi"]), torch_id)
    try:
        compilers = toolchain.get().compiler_identity()
    except ToolchainError:
        if not env.jit_disabled():
            raise
        return Prepared(module, flags, content, None, torch=torch_id, any_arch_key=any_arch)
    return Prepared(module, flags, content, cache.full_key(content, compilers), compilers, torch_id, any_arch)


def find_published(prep: Prepared, roots: list[Path] | None = None) -> Path | None:
    """A published, verified entry for this module in `roots` (default: every lookup
    root, prebuilt ones first), or None. Reads only: no lock, no write."""
    for root in roots if roots is not None else cache.lookup_roots():
        candidates = [root / prep.entry(root).dirname] if prep.key is not None else []
        if (prep.key is None or env.jit_disabled()) and root.is_dir():
            # No compiler here, or none may run: an entry built from the same content by
            # another nvcc (the AOT image's) is as good, so match on the content key.
            candidates += sorted(root.glob(f"{prep.name}-*"), reverse=True)
        for path in candidates:
            manifest = cache.read_manifest(path)
            if manifest is None or manifest.get("content_key") != prep.content_key:
                continue
            if cache.verify_entry(path, manifest) is None:
                return path
    return _find_wider(prep, roots)


def _find_wider(prep: Prepared, roots: list[Path] | None) -> Path | None:
    """An entry of the same sources, flags and torch built for more target archs than
    `prep` asks for (a fat binary: an image's "8.0 9.0a" entry serves an H100's "9.0a"),
    and, where JIT may run, by the same compilers. Only consulted on a miss, before a build."""
    if not prep.flags.archs or not prep.any_arch_key:
        return None
    wanted = set(prep.flags.archs)
    # with a compiler that may run, only its own builds count (as for the exact key)
    same_compilers = prep.key is not None and not env.jit_disabled()
    for root in roots if roots is not None else cache.lookup_roots():
        if not root.is_dir():
            continue
        for path in sorted(root.glob(f"{prep.name}-*"), reverse=True):
            manifest = cache.read_manifest(path)
            if manifest is None or manifest.get("any_arch_key") != prep.any_arch_key or \
                    not wanted <= set(manifest.get("archs") or ()) or \
                    (same_compilers and manifest.get("toolchain") != prep.compilers):
                continue
            # the archs it claims, derived again: the content key of these sources for
            # exactly those archs must be the one it was built under (an edited list that
            # adds 8.0 to a 9.0a binary is not)
            archs = tuple(manifest.get("archs") or ())
            claimed = cache.content_key(prep.module, build.make_flags(archs, prep.flags.debug, prep.torch["cxx11_abi"]),
                                        prep.torch)
            if claimed != manifest.get("content_key"):
                continue
            if cache.verify_entry(path, manifest) is None:
                return path
    return None


# --- loading --------------------------------------------------------------------------
class LoadedModule:
    """A loaded entry: its ops as attributes (`module.append_paged_kv_cache(...)`)."""

    def __init__(self, spec: Spec, path: Path, manifest: dict):
        import torch

        self.spec = spec
        self.path = path
        self.manifest = manifest
        self.namespace = f"fij_{spec.name}_{manifest['key'][:12]}"
        ops = getattr(torch.ops, self.namespace)
        for op in spec.op_schemas():
            setattr(self, op, getattr(ops, op).default)

    def __repr__(self) -> str:
        return f"<flashinfer_jit module {self.spec.name} at {self.path}>"


_load_lock = threading.Lock()
_loaded: dict[str, LoadedModule] = {}  # namespace -> module


class EntryVanished(CacheError):
    """A published entry disappeared between its lookup and its load: another process
    removed it (`flashinfer-jit clean`, a deleted cache folder)."""


def load(spec: Spec, path: Path) -> LoadedModule:
    import torch

    manifest = cache.read_manifest(path)
    if manifest is None:
        raise EntryVanished(f"module {spec.name}: its cache entry {path} was removed while it was being loaded")
    namespace = f"fij_{spec.name}_{manifest['key'][:12]}"
    with _load_lock:
        if namespace in _loaded:  # one key = one namespace = loaded once per process
            return _loaded[namespace]
        library = path / manifest["library"]
        try:
            torch.ops.load_library(str(library))
        except OSError as exc:
            if library.exists():
                raise
            raise EntryVanished(f"module {spec.name}: its library {library} was removed while it was being "
                                "loaded") from exc
        for op, fake in spec.fake_impls().items():
            torch.library.register_fake(f"{namespace}::{op}", fake)
        module = LoadedModule(spec, path, manifest)
        _loaded[namespace] = module
        return module


# --- building -------------------------------------------------------------------------
def _stage(prep: Prepared, build_dir: Path) -> None:
    cache.write_files(build_dir, RenderedModule(prep.module.spec, prep.final_sources(),
                                                prep.module.headers))
    build.write_entry_ninja(build_dir, toolchain.get(), prep.flags, f"{prep.name}.so")


def _build_one(prep: Prepared, entry: cache.Entry, jobs: int | None = None) -> None:
    """Build into a private folder and publish. Caller holds the entry's lock. A write
    that fails (a full disk) is a CacheError saying so; nothing is published either way."""
    build_dir = None
    try:
        build_dir = cache.private_build_dir(entry.root, entry.dirname)
        _stage(prep, build_dir)
        code, output, seconds = build.run_ninja(toolchain.get(), build_dir, jobs)
        log = build.collect_logs(build_dir, output)
        if code != 0:
            build.raise_build_error(prep.name, _save_failed_log(entry.root, entry.dirname, log), log,
                                    cache.out_of_space_hint(entry.root, log))
        (build_dir / cache.BUILD_LOG).write_text(log)
        cache.write_manifest(build_dir, entry, prep.module, prep.content_key, prep.flags,
                             prep.identity(), seconds, "jit", prep.any_arch_key)
        cache.publish(build_dir, entry)
    except OSError as exc:
        raise cache.write_error(prep.name, entry.root, exc) from exc
    finally:
        if build_dir is not None and build_dir.exists():
            shutil.rmtree(build_dir, ignore_errors=True)


def _save_failed_log(root: Path, dirname: str, log: str) -> str:
    """Where the failed build's log went; on a full disk, why it went nowhere (the
    error that follows matters more than its log)."""
    try:
        return str(cache.save_failed_log(root, dirname, log))
    except OSError as exc:
        return f"(not saved: {exc})"


def load_or_build(spec: Spec) -> LoadedModule:
    logger = log.configure()
    prep = prepare(spec)
    path = find_published(prep)
    if path is not None:
        logger.debug("loading %s from the cache (%s)", prep.name, path)
        cache.mark_used(path)
        try:
            return load(spec, path)
        except EntryVanished as exc:
            # removed by another process between the lookup and the load (a loaded library
            # stays valid; one not yet loaded is gone): look again, else build it below
            logger.info("%s; looking again", exc)
            path = find_published(prep)
            if path is not None:
                return load(spec, path)
    if env.jit_disabled():
        raise _jit_disabled_miss(prep)
    entry = prep.entry(cache.build_root())
    with _entry_lock(entry, prep.name):
        # Someone may have published it while we waited for the lock.
        manifest = cache.read_manifest(entry.path)
        if manifest is None or cache.verify_entry(entry.path, manifest) is not None:
            # only here: a process that waited and loads builds nothing
            logger.info("building %s on first use (not in the cache at %s); expect %s, once: later "
                        "calls and processes load it from the cache", prep.name, entry.root,
                        log.expected_time(cache.typical_build_seconds(entry.root, spec.FAMILY)))
            start = time.perf_counter()
            _build_one(prep, entry)
            logger.info("built %s in %.1f s", prep.name, time.perf_counter() - start)
        # (loaded under the lock: a `clean` takes it before removing the entry)
        return load(spec, entry.path)


def aot_command(prep: Prepared) -> tuple[str, str]:
    """(matrix line, shell command) that builds exactly this module where this process
    looks: every spec field spelled out, its archs, debug mode and the writable cache root.
    Run with the same torch and package and JIT enabled, it gives the same content key."""
    from .matrix import spec_line

    line = spec_line(prep.module.spec)
    words = ["flashinfer-jit", "aot", "--entry", line]
    if prep.flags.archs:
        words += ["--arch", " ".join(prep.flags.archs)]
    words += ["--out", str(env.cache_root())]
    command = " ".join(shlex.quote(word) for word in words)
    return line, ("FLASHINFER_JIT_DEBUG=1 " if prep.flags.debug else "") + command


def _jit_disabled_miss(prep: Prepared) -> JitDisabledError:
    line, command = aot_command(prep)
    return JitDisabledError(
        f"module {prep.name!r} (content key {prep.content_key[:16]}) is not in the cache "
        f"({', '.join(map(str, cache.lookup_roots()))}) and FLASHINFER_JIT_DISABLE_JIT is set. "
        "Build it with JIT enabled (the same torch and flashinfer_jit; nvcc needed):\n"
        f"  {command}\n"
        f"or add this line to the deployment matrix:\n  {line}",
        module=prep.name, matrix_line=line, aot_command=command)


LOCK_NOTICE_SECONDS = 5.0  # a wait for another process's lock is announced after this long


def _holder_path(lock_path: Path) -> Path:
    return Path(str(lock_path) + ".holder")


def _say_holder(lock_path: Path, what: str) -> None:
    """Beside a lock just taken: who holds it (a waiter's message reads it). Best effort."""
    with contextlib.suppress(OSError):
        _holder_path(lock_path).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                       "what": what, "since": time.time()}))


def lock_holder(lock_path: Path) -> str:
    """'process 4242 on host-a (aot, for 12 s)', or 'another process' where it did not say."""
    try:
        info = json.loads(_holder_path(lock_path).read_text())
        return (f"process {info['pid']} on {info['host']} ({info['what']}, for "
                f"{max(0.0, time.time() - float(info['since'])):.0f} s)")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def acquire_lock(lock: FileLock, lock_path: Path, name: str, what: str, timeout: float | None = None) -> None:
    """Takes an entry's lock. A wait of more than LOCK_NOTICE_SECONDS is announced once on
    the flashinfer_jit logger, naming the holder and what this process waits for; after
    `timeout` seconds (None: no limit) a CacheError says the same and gives up."""
    start = time.perf_counter()
    try:
        lock.acquire(timeout=0 if timeout == 0 else min(LOCK_NOTICE_SECONDS, timeout or LOCK_NOTICE_SECONDS))
    except Timeout:
        holder = lock_holder(lock_path)
        limit = "" if timeout is None else f"; giving up after {timeout:g} s (--lock-timeout)"
        log.logger.warning("waiting for the lock of %s (%s), held by %s: it builds or removes that entry, and "
                           "this process waits to %s it%s", name, lock_path, holder, what, limit)
        left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - start))
        try:
            lock.acquire(timeout=-1 if left is None else left)
        except Timeout:
            raise CacheError(f"gave up after {timeout:g} s waiting for the lock of {name} ({lock_path}), held by "
                             f"{lock_holder(lock_path)}; let that process finish, or end it if it is stuck") \
                from None
        log.logger.info("waited %.1f s for %s", time.perf_counter() - start, name)
    _say_holder(lock_path, what)


@contextmanager
def _entry_lock(entry: cache.Entry, name: str):
    """The entry's file lock; a wait for another process's build is announced."""
    lock = FileLock(str(entry.lock_path))
    acquire_lock(lock, entry.lock_path, name, "build")
    try:
        yield
    finally:
        lock.release()


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> log path
    seconds: float = 0.0
    hint: str | None = None  # why the failures were probably the disk's


class BuildInterrupted(KeyboardInterrupt):
    """An AOT build stopped by an interrupt (Ctrl-C, or a signal that reached ninja alone).
    `report`: what was complete and published before it (built), and what was not."""

    def __init__(self, report: BuildReport, unfinished: list[str]):
        super().__init__(f"interrupted: {len(report.built)} entries complete and kept, {len(unfinished)} not built")
        self.report = report
        self.unfinished = unfinished


class _NinjaProgress:
    """Reads ninja's status lines (NINJA_STATUS "[finished/total] "; on a pipe ninja prints
    one as each step ends) into progress: steps done of all, and entries whose link step
    ended without a failure (a LINK line followed by ninja's FAILED: line is a failure)."""

    def __init__(self, progress, total: int, start: float):
        self.progress, self.total, self.start = progress, total, start
        self.done = 0
        self.steps = (0, 0)
        self.pending_link: str | None = None  # a link step's output, until the next line says how it ended

    def __call__(self, line: str) -> None:
        if self.pending_link is not None:
            failed = line.startswith("FAILED:") and self.pending_link in line
            self.pending_link = None
            if not failed:
                self.done += 1
        if line.startswith("["):
            head, _, rest = line.partition("]")
            finished, _, total = head[1:].partition("/")
            if finished.isdigit() and total.isdigit():
                self.steps = (int(finished), int(total))
            if rest.lstrip().startswith("LINK ") and ".so" in rest:
                self.pending_link = rest.split()[-1]
        self.report()

    def finish(self) -> None:
        if self.pending_link is not None:
            self.pending_link = None
            self.done += 1
        self.report()

    def report(self) -> None:
        if self.progress:
            self.progress(self.done, self.total, time.perf_counter() - self.start, *self.steps)


def _completed_outputs(build_dir: Path) -> set[str]:
    """The outputs of the steps ninja finished successfully (its .ninja_log records only
    those): an interrupted build's complete entries."""
    try:
        lines = (build_dir / ".ninja_log").read_text().splitlines()
    except OSError:
        return set()
    return {parts[3] for parts in (line.split("\t") for line in lines) if len(parts) >= 4 and parts[0].isdigit()}


def build_many(specs: list[Spec], jobs: int | None = None, archs: tuple[str, ...] | None = None,
               progress: Callable[..., None] | None = None,
               root: Path | None = None, lock_timeout: float | None = None, strict_root: bool = False) -> BuildReport:
    """Build every spec not yet cached through one ninja invocation (AOT).

    `root`: the cache root to build into, and the only one looked in (`aot --out`: a
    folder that must end up holding the whole matrix); default: the writable root, and
    an entry found in any lookup root counts as cached.
    Locks of the entries to build are taken in sorted order (no deadlock with another
    AOT run), then each is looked up again; a wait for one is announced after a few
    seconds, and `lock_timeout` seconds of it end in a CacheError (None: no limit). Failed
    entries get their own log. `strict_root`: an unusable FLASHINFER_JIT_CACHE_DIR is a
    CacheError, not a build into the user cache (a deployment build must land where asked).
    """
    start = time.perf_counter()
    preps = {}
    for spec in specs:
        prep = prepare(spec, archs)
        preps.setdefault(prep.key, prep)
    if env.jit_disabled():
        raise JitDisabledError("FLASHINFER_JIT_DISABLE_JIT is set; unset it to build")
    if root is None:
        root, look_in = cache.build_root(strict_root), None
    elif cache.usable_build_root(root.resolve()):
        root = root.resolve()
        look_in = [root]
    else:
        raise CacheError(f"cannot build into {root}: not a writable folder")
    try:
        report = _build_missing(list(preps.values()), root, look_in, jobs, progress, lock_timeout)
    except OSError as exc:  # a full disk: entries published before it are complete
        raise CacheError(f"building into {root} failed: {exc}; nothing unfinished was published. "
                         f"{cache.space_advice(root)}") from exc
    report.seconds = time.perf_counter() - start
    return report


def _build_missing(preps: list[Prepared], root: Path, look_in: list[Path] | None, jobs: int | None,
                   progress: Callable[..., None] | None, lock_timeout: float | None = None) -> BuildReport:
    """build_many once the root is known: look up, lock, build what is still missing."""
    report = BuildReport()
    start = time.perf_counter()
    todo = []
    for prep in preps:
        if find_published(prep, look_in) is not None:
            report.cached.append(prep.name)
        else:
            todo.append(prep)
    todo.sort(key=lambda p: p.entry(root).dirname)
    if not todo:
        return report
    tc = toolchain.get()
    with ExitStack() as stack:
        locked = []
        for prep in todo:
            entry = prep.entry(root)
            lock = FileLock(str(entry.lock_path))
            acquire_lock(lock, entry.lock_path, prep.name, "build (aot)", lock_timeout)
            stack.callback(lock.release)
            if cache.verify_entry(entry.path) is None:
                report.cached.append(prep.name)
            else:
                locked.append(prep)
        if not locked:
            return report
        top = Path(cache.private_build_dir(root, "aot"))
        try:
            rules = build.ninja_rules(tc, locked[0].flags)
            parts = [rules]
            for prep in locked:
                sub = top / prep.entry(root).dirname
                sub.mkdir()
                _stage(prep, sub)
                own = prep.flags if prep.flags != locked[0].flags else None
                parts.append(build.ninja_builds(f"{sub.name}/", f"{prep.name}.so", tc, own))
            (top / "build.ninja").write_text("".join(parts))
            total = len(locked)
            watch = _NinjaProgress(progress, total, start)
            watch.report()
            interrupted = False
            try:
                code, log, _ = build.run_ninja(tc, top, jobs or env.max_jobs() or os.cpu_count(), watch)
            except KeyboardInterrupt:  # Ctrl-C reached this process (and ninja, in its process group)
                interrupted, code, log = True, -2, ""
            watch.finish()
            # ninja stopped by a signal that reached it alone: an interrupt, not a compile failure
            interrupted = interrupted or "build stopped: interrupted by user" in log or code in (-2, 130, -15, 143)
            (top / "aot.log").write_text(log)
            per_entry = _split_failures(log)
            step_seconds = _ninja_step_seconds(top)
            complete = _completed_outputs(top) if interrupted else None
            unfinished = []
            for prep in locked:
                entry = prep.entry(root)
                sub = top / entry.dirname
                if complete is not None and f"{entry.dirname}/{prep.name}.so" not in complete:
                    unfinished.append(prep.name)  # (its link never finished: nothing of it is kept)
                    continue
                if (sub / f"{prep.name}.so").is_file() and entry.dirname not in per_entry:
                    seconds = step_seconds.get(entry.dirname, 0.0)
                    (sub / cache.BUILD_LOG).write_text(build.collect_logs(sub))
                    cache.write_manifest(sub, entry, prep.module, prep.content_key, prep.flags,
                                         prep.identity(), seconds, "aot", prep.any_arch_key)
                    cache.publish(sub, entry)
                    report.built.append(prep.name)
                else:
                    text = per_entry.get(entry.dirname) or log
                    report.failed[prep.name] = _save_failed_log(root, entry.dirname, text)
            if report.failed:
                report.hint = cache.out_of_space_hint(root, log)
            if interrupted:
                raise BuildInterrupted(report, unfinished)
        finally:
            shutil.rmtree(top, ignore_errors=True)
    return report


def _ninja_step_seconds(build_dir: Path) -> dict[str, float]:
    """dirname -> seconds its compile and link steps took, from ninja's own log
    (start_ms, end_ms, mtime, output, hash per line): an AOT entry's build time, not the
    whole run's."""
    seconds: dict[str, float] = {}
    try:
        lines = (build_dir / ".ninja_log").read_text().splitlines()
    except OSError:
        return seconds
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit():
            top = parts[3].split("/")[0]
            seconds[top] = seconds.get(top, 0.0) + (int(parts[1]) - int(parts[0])) / 1000
    return seconds


def _split_failures(log: str) -> dict[str, str]:
    """dirname -> the output ninja printed under each `FAILED:` line of that entry."""
    failures: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines(keepends=True):
        if line.startswith("FAILED:"):
            target = line.split()[1] if len(line.split()) > 1 else ""
            current = target.split("/")[0]
            failures.setdefault(current, []).append(line)
        elif line.startswith("[") or line.startswith("ninja:"):
            current = None
        elif current is not None:
            failures[current].append(line)
    return {k: "".join(v) for k, v in failures.items()}


def get_module(spec: Spec) -> LoadedModule:
    """The registry: one lookup per (spec, debug mode) per process; later calls cost a
    dict hit. Debug mode is part of the key because it selects another build."""
    return _registry(spec, env.debug())


@functools.cache
def _registry(spec: Spec, debug: bool) -> LoadedModule:
    return load_or_build(spec)


_op_caches: list = []


def op_cache(fn):
    """functools.cache for the public functions' hot path: configuration -> bound op.
    Registered here so clear_registry() forgets them along with the modules."""
    cached = functools.cache(fn)
    _op_caches.append(cached)
    return cached


def traced_op(namespace: str, op: str):
    """The op `op` of the loaded module whose namespace is `namespace`, for a wrapper that
    torch.compile traces. Dynamo cannot trace the registry (a cache around file locks and a
    build), so each family resolves the namespace in a function marked
    torch.compiler.assume_constant_result, which runs once, at trace time, and enters the
    graph as a constant string; the op is then an attribute chain Dynamo follows."""
    import torch

    return getattr(getattr(torch.ops, namespace), op).default


def clear_registry() -> None:
    _registry.cache_clear()
    for cached in _op_caches:
        cached.cache_clear()
