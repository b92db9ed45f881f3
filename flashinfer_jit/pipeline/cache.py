"""The on-disk module cache: content keys, entries, locks, publishing, verification.

Lifecycle contract (what every function here keeps):
- An entry is `<root>/<name>-<key16>/` and is either absent or complete: it is built in a
  private temp folder under `<root>/.tmp/` and published with one `os.replace` of the
  folder, its manifest (file sizes and sha256) written before the move. A build killed
  at any point leaves at most a stray temp folder, which nothing loads.
- The key is a sha256 over the spec, the rendered sources, the bytes of every csrc
  header they reach, the flags, target archs, toolchain versions and the package
  version. Nothing depends on modification times.
- Loading verifies the entry against its manifest first; an entry that does not match
  (truncated .so, edited source) is moved aside and rebuilt, never loaded.
- Builders take a per-entry file lock (`<root>/.locks/<dirname>.lock`, never deleted),
  then look again: a process that waited on the lock loads what the holder built.
- `try_load`-style lookups never raise on a bad entry; they report a miss.
- Prebuilt roots (FLASHINFER_JIT_CACHE_PATH) are searched first and only read: a lookup
  there takes no lock and writes nothing (no lock file, no temp folder, no last-use
  mark); an entry there that does not verify is skipped, not moved, and the module is
  built in the writable root.
- A load marks the entry used (the manifest's modification time) for
  `flashinfer-jit clean --keep-size`; that order is policy, never correctness.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import __version__, env
from .build import Flags
from .errors import CacheError
from .render import RenderedModule

KEY_FORMAT = 1
MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
BUILD_FILE = "build.ninja"
# Entry.dirname: the module's name, then the first 16 hex digits of its sha256 key.
ENTRY_DIRNAME = re.compile(r"(?P<name>.+)-(?P<key16>[0-9a-f]{16})")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def content_key(module: RenderedModule, flags: Flags, torch_identity: dict) -> str:
    """Everything but the compilers' versions: what a deployment image without nvcc can
    still compute to find an entry built elsewhere."""
    payload = {
        "format": KEY_FORMAT,
        "package": __version__,
        "spec": module.spec.canonical(),
        "sources": {n: sha256_bytes(t.encode()) for n, t in sorted(module.sources.items())},
        "headers": {n: sha256_bytes(b) for n, b in module.headers.items()},
        "flags": flags.identity(),
        "torch": torch_identity,
    }
    return sha256_bytes(_json(payload).encode())


def full_key(content: str, compiler_identity: dict) -> str:
    return sha256_bytes(_json({"content": content, "compilers": compiler_identity}).encode())


@dataclass(frozen=True)
class Entry:
    root: Path
    name: str
    key: str

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.key[:16]}"

    @property
    def path(self) -> Path:
        return self.root / self.dirname

    @property
    def library(self) -> Path:
        return self.path / f"{self.name}.so"

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def lock_path(self) -> Path:
        return self.root / ".locks" / f"{self.dirname}.lock"


def read_manifest(entry_dir: Path) -> dict | None:
    """The entry's manifest, or None if it is missing or not a JSON object."""
    try:
        manifest = json.loads((entry_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def verify_entry(entry_dir: Path, manifest: dict | None = None,
                 contents: dict[str, bytes] | None = None) -> str | None:
    """None if every file listed in the manifest is present with its size and sha256;
    otherwise what is wrong. Given a `contents` dict, the bytes checked are put there
    (`rel path -> bytes`): what a caller copies is then exactly what was verified."""
    manifest = manifest if manifest is not None else read_manifest(entry_dir)
    if manifest is None:
        return "no readable manifest.json"
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("library") not in files:
        return "manifest lists no library"
    unlisted = next((r for r, m in files.items() if not (isinstance(m, dict) and "size" in m and "sha256" in m)),
                    None)
    if unlisted is not None:
        return f"manifest entry of {unlisted} has no size and sha256"
    wrong = manifest_inconsistency(entry_dir, manifest)
    if wrong is not None:
        return wrong
    return files_mismatch(entry_dir, files, contents)


def files_mismatch(folder: Path, files: dict, contents: dict[str, bytes] | None = None) -> str | None:
    """None if every file of a manifest's `files` ({rel: {size, sha256}}) is in `folder`
    with its size and sha256, else the first that is not (verify_entry; the fastcall
    extension's folder). `contents`: as verify_entry's."""
    for rel, meta in files.items():
        path = folder / rel
        try:
            data = path.read_bytes() if contents is not None else None
            size = path.stat().st_size if data is None else len(data)
        except OSError:
            return f"{rel} is missing"
        if size != meta.get("size"):
            return f"{rel} has {size} bytes, manifest says {meta.get('size')}"
        if (sha256_file(path) if data is None else sha256_bytes(data)) != meta.get("sha256"):
            return f"{rel} does not match its sha256"
        if contents is not None:
            contents[rel] = data
    return None


def manifest_inconsistency(entry_dir: Path, manifest: dict) -> str | None:
    """What does not add up among the manifest's fields that decide whether the entry serves
    a request, derived again where they can be: the name and key against the folder's name
    (`<name>-<key[:16]>`), and the key against the content key and the compilers it was
    built with (full_key). None: they agree. (The archs are checked against the content key
    by whoever renders the module: archs_inconsistency.)"""
    name, key, content = manifest.get("name"), manifest.get("key"), manifest.get("content_key")
    if not all(isinstance(v, str) and v for v in (name, key, content)):
        return "manifest has no name, key or content_key"
    if entry_dir.name != f"{name}-{key[:16]}":
        return f"manifest's name and key ({name}, {key[:16]}...) do not match the folder {entry_dir.name}"
    compilers = manifest.get("toolchain")
    if isinstance(compilers, dict) and full_key(content, compilers) != key:
        return "manifest's key is not the key of its content_key and toolchain (the manifest was edited)"
    if manifest.get("library") != f"{name}.so":
        return f"manifest's library is {manifest.get('library')!r}, not {name}.so"
    return None


# --- run()'s fij_fastcall extension (flashinfer_jit/runtime/fastcall.py) ---------------------
# Not a module entry: `.fastcall/<key>/` of a root, its library and a manifest of its own
# (its size and sha256, its key), checked before it is loaded, packed and verified as an
# entry is.
def write_extension_manifest(folder: Path, name: str, key: str, library: str) -> None:
    lib = folder / library
    manifest = {"name": name, "key": key, "library": library, "kind": "extension",
                "files": {library: {"size": lib.stat().st_size, "sha256": sha256_file(lib)}}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def verify_extension_folder(folder: Path) -> str | None:
    """None if `folder` (.fastcall/<key>/) holds the library its manifest lists, byte for
    byte, under the key of the folder's name; otherwise what is wrong."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "no readable manifest.json"
    if manifest.get("key") != folder.name:
        return f"manifest's key is not the folder's name {folder.name}"
    files, library = manifest.get("files"), manifest.get("library")
    if not isinstance(files, dict) or not isinstance(library, str) or not isinstance(files.get(library), dict):
        return "manifest lists no library"
    return files_mismatch(folder, {library: files[library]})


def extension_folders(root: Path, subdir: str = ".fastcall") -> list[Path]:
    base = root / subdir
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink()) if base.is_dir() else []


def write_files(build_dir: Path, module: RenderedModule) -> None:
    """Sources and the headers they use, into a fresh private build folder."""
    for name, text in module.sources.items():
        (build_dir / name).write_text(text)
    for rel, data in module.headers.items():
        target = build_dir / "csrc" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def write_manifest(build_dir: Path, entry: Entry, module: RenderedModule, content: str,
                   flags: Flags, identity: dict, seconds: float, built_by: str, any_arch_key: str = "") -> dict:
    """`identity`: {"toolchain": compiler versions, "torch": torch's part of the key}, the
    versions `flashinfer-jit list` compares with the installation's (stale_reason).
    `any_arch_key`: the content key as if built for no arch (jit.Prepared), by which a
    process asking for some of this entry's archs finds it."""
    files = {}
    for path in sorted(build_dir.rglob("*")):
        rel = path.relative_to(build_dir).as_posix()
        if path.is_file() and not rel.startswith(".ninja") and not rel.endswith((".o", ".d")) \
                and rel not in (MANIFEST, BUILD_LOG):
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {
        "format": KEY_FORMAT,
        "name": entry.name,
        "key": entry.key,
        "content_key": content,
        "any_arch_key": any_arch_key or content,
        "family": module.spec.FAMILY,
        "spec": module.spec.canonical(),
        "archs": list(flags.archs),
        "debug": flags.debug,
        "toolchain": identity["toolchain"],
        "torch": identity["torch"],
        "package_version": __version__,
        "library": entry.library.name,
        "files": files,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 3),
        "built_by": built_by,
        "host": socket.gethostname(),
    }
    tmp = build_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, build_dir / MANIFEST)
    return manifest


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def writable_roots() -> list[Path]:
    """The roots builds may go to: the configured root, then the user cache (the fallback
    when the configured root is not writable). Both are also looked up."""
    roots = [env.cache_root()]
    user = env.user_cache_root()
    if user not in roots:
        roots.append(user)
    return roots


def prebuilt_roots() -> list[Path]:
    """FLASHINFER_JIT_CACHE_PATH's read-only roots, in order."""
    return env.cache_path()


def lookup_roots() -> list[Path]:
    """Where entries are looked for, in order: the prebuilt roots, then the writable ones."""
    roots: list[Path] = []
    for root in prebuilt_roots() + writable_roots():
        if root not in roots:
            roots.append(root)
    return roots


def is_prebuilt(entry_dir: Path) -> bool:
    return entry_dir.parent in prebuilt_roots()


def usable_build_root(root: Path) -> bool:
    return _writable_dir(root) and _writable_dir(root / ".tmp") and _writable_dir(root / ".locks")


def build_root(strict: bool = False) -> Path:
    """The first writable root; a clear error if none is. A FLASHINFER_JIT_CACHE_DIR that
    cannot be built into: with `strict` (a deployment build, `aot` without --out) a
    CacheError naming it; else the user cache, said once on the logger."""
    explicit = os.environ.get("FLASHINFER_JIT_CACHE_DIR")
    for i, root in enumerate(writable_roots()):
        if usable_build_root(root):
            if i > 0 and explicit:
                if strict:
                    raise CacheError(f"FLASHINFER_JIT_CACHE_DIR={explicit!r}: {_why_unusable(writable_roots()[0])}; "
                                     f"fix it (or pass --out DIR) rather than build elsewhere")
                _warn_fallback(writable_roots()[0], root)
            return root
        if strict and explicit:
            raise CacheError(f"FLASHINFER_JIT_CACHE_DIR={explicit!r}: {_why_unusable(root)}; fix it (or pass --out "
                             f"DIR) rather than build elsewhere")
    raise CacheError(
        f"no writable cache directory: tried {', '.join(map(str, writable_roots()))}; "
        "set FLASHINFER_JIT_CACHE_DIR to a writable folder"
    )


def _why_unusable(root: Path) -> str:
    if root.exists() and not root.is_dir():
        return f"{root} is a file, not a folder"
    return f"{root} (or its .tmp/.locks) cannot be written by this user"


_warned_fallbacks: set[tuple[Path, Path]] = set()


def _warn_fallback(configured: Path, used: Path) -> None:
    if (configured, used) not in _warned_fallbacks:
        _warned_fallbacks.add((configured, used))
        from .log import logger

        logger.warning("FLASHINFER_JIT_CACHE_DIR: %s; building into the user cache %s instead",
                       _why_unusable(configured), used)


def may_write(path: Path) -> bool:
    """Whether this process could create or write the folder `path`, asked without
    writing anything (build_root probes by writing): the nearest existing folder at or
    above it is a folder this user may write and search (os.access, which also sees a
    read-only mount)."""
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    return False


def planned_build_root() -> Path | None:
    """The root build_root() would pick, found without creating or writing anything
    (`flashinfer-jit doctor` only reads); None if no root could be written."""
    for root in writable_roots():
        if all(may_write(path) for path in (root, root / ".tmp", root / ".locks")):
            return root
    return None


def mark_used(entry_dir: Path) -> None:
    """Record that this entry was loaded now: the manifest's modification time, which
    `clean --keep-size` orders by (least recently used first). One syscall; an entry of a
    prebuilt root is never touched, and a root this process cannot write keeps its time."""
    if is_prebuilt(entry_dir):
        return
    try:
        os.utime(entry_dir / MANIFEST)
    except OSError:
        pass


def last_used(entry_dir: Path) -> float:
    """When the entry was last loaded or built (epoch seconds; see mark_used); a folder
    without a manifest, its own modification time; 0.0 if it is gone."""
    for path in (entry_dir / MANIFEST, entry_dir):
        try:
            return path.stat().st_mtime
        except OSError:
            continue
    return 0.0


def write_error(module: str, root: Path, exc: OSError) -> CacheError:
    """A build that could not write its files (full disk, quota, read-only folder)."""
    where = f" ({exc.filename})" if exc.filename else ""
    return CacheError(f"building module {module!r} in {root} failed: {exc.strerror or exc}{where}; "
                      f"nothing was published. {space_advice(root)}")


# Compiler and shell messages of a write that failed for want of space.
_NO_SPACE = ("No space left on device", "Disk quota exceeded", "File too large",
             "File size limit exceeded")
# Under this much free space a failed build is blamed on the disk: a module's build folder
# peaks at a few MiB (sources, csrc copy, objects, .so).
LOW_SPACE_BYTES = 64 << 20


def space_advice(root: Path) -> str:
    return (f"Free space under {root} (e.g. `flashinfer-jit clean --keep-size 1G`) or set "
            "FLASHINFER_JIT_CACHE_DIR to a folder on another disk.")


def out_of_space_hint(root: Path, log: str) -> str | None:
    """Why a failed build was probably the disk's fault, or None. On a full disk the
    compilers often cannot even write their error output, so the free space counts too."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    said = next((text for text in _NO_SPACE if text in log), None)
    if said is None and (free is None or free >= LOW_SPACE_BYTES):
        return None
    why = f"the build log says {said!r}" if said else f"only {free >> 10} KiB are free there"
    return f"out of disk space? ({why}). {space_advice(root)}"


def private_build_dir(root: Path, dirname: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{dirname}.", suffix=f".{os.getpid()}", dir=root / ".tmp"))


def discard(path: Path, root: Path) -> None:
    """Move `path` out of the way atomically, then delete it; a reader that already
    opened a file in it keeps its file. An OSError (a read-only root) leaves `path`
    whole, and is raised."""
    trash = root / ".tmp" / f"discard-{path.name}-{uuid.uuid4().hex[:8]}"
    trash.parent.mkdir(exist_ok=True)  # a root copied without its .tmp/
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        if os.path.lexists(path):  # not the entry that is gone: the move itself failed
            raise
        return
    shutil.rmtree(trash, ignore_errors=True)


def publish(build_dir: Path, entry: Entry) -> None:
    """Atomically make `build_dir` the entry. Caller holds the entry's lock.

    Object files and ninja's state go first (the .so is all that is loaded; keeping the
    cache small matters when it is carried between machines)."""
    for path in list(build_dir.rglob("*")):
        if path.is_file() and (path.suffix in (".o", ".d") or path.name.startswith(".ninja")):
            path.unlink()
    os.chmod(build_dir, 0o755)  # mkdtemp made it private; entries are shared
    if entry.path.exists():
        discard(entry.path, entry.root)
    os.replace(build_dir, entry.path)


def save_failed_log(root: Path, dirname: str, log: str) -> Path:
    logs = root / ".logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = logs / f"{dirname}-{stamp}-{os.getpid()}.log"
    path.write_text(log)
    return path


def iter_entries(root: Path | None = None,
                 roots: list[Path] | None = None) -> Iterator[tuple[Path, dict | None]]:
    """(folder, manifest or None) of every folder of `root`, else of `roots`, else of
    every lookup root, but those whose name starts with a dot (locks, temp folders, logs,
    .fastcall). A folder listed here may still be no entry at all (is_entry_dir)."""
    roots = [root] if root is not None else (roots if roots is not None else lookup_roots())
    seen = set()
    for r in roots:
        if r in seen or not r.is_dir():
            continue
        seen.add(r)
        for child in sorted(r.iterdir()):
            if child.is_dir() and not child.name.startswith("."):
                yield child, read_manifest(child)


def is_entry_dir(path: Path) -> bool:
    """Whether `path` is provably an entry of a cache, so that `verify --fix` and `clean`
    may remove it: a real folder (not a link) named as Entry.dirname names it
    (`<name>-<16 hex digits>`) that holds a manifest.json or a file only a build of that
    name makes (`<name>.so`, build.ninja, build.log). A folder some person or tool put in
    the root is none of these, however broken it looks, and is left alone."""
    match = ENTRY_DIRNAME.fullmatch(path.name)
    if match is None or path.is_symlink() or not path.is_dir():
        return False
    return any((path / name).is_file()
               for name in (MANIFEST, f"{match['name']}.so", BUILD_FILE, BUILD_LOG))


def typical_build_seconds(root: Path, family: str, limit: int = 16) -> tuple[float, int] | None:
    """(median seconds, count) of the lazy builds of `family` published under `root`, from
    at most `limit` manifests; None if there are none. AOT manifests are left out: their
    seconds are compile steps summed, not the wall time a waiting call sees."""
    seconds = []
    for path in sorted(root.glob(f"{family}_*"))[:limit]:
        manifest = read_manifest(path)
        if manifest and manifest.get("family") == family and manifest.get("built_by") == "jit":
            seconds.append(float(manifest.get("build_seconds", 0.0)))
    if not seconds:
        return None
    return sorted(seconds)[len(seconds) // 2], len(seconds)


def stale_reason(manifest: dict | None, here: dict) -> str | None:
    """Why an entry was built for another installation, or None. `here` is what an entry
    built now would record: "package_version", "torch" and, where a compiler may run,
    "toolchain" (see write_manifest). Another package or torch version (or torch's CUDA, or
    its C++ ABI) changes the content key, and another compiler the full key, so such an
    entry is never loaded here. Versions a manifest does not record are not held against it."""
    if not manifest:
        return None
    differences = []
    if manifest.get("package_version") not in (None, here["package_version"]):
        differences.append(f"package {manifest['package_version']} (here {here['package_version']})")
    built_torch = manifest.get("torch")
    if isinstance(built_torch, dict):
        for name, value in here["torch"].items():
            if name in built_torch and built_torch[name] != value:
                differences.append(f"{name} {built_torch[name]} (here {value})")
    built_tools = manifest.get("toolchain")
    if "toolchain" in here and isinstance(built_tools, dict) and built_tools != here["toolchain"]:
        for name in sorted(set(built_tools) | set(here["toolchain"])):
            if built_tools.get(name) != here["toolchain"].get(name):
                differences.append(f"{name} {built_tools.get(name)} (here {here['toolchain'].get(name)})")
    return "built for " + ", ".join(differences) if differences else None


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
