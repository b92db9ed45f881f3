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
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
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


def verify_entry(entry_dir: Path, manifest: dict | None = None) -> str | None:
    """None if every file listed in the manifest is present with its size and sha256;
    otherwise what is wrong."""
    manifest = manifest if manifest is not None else read_manifest(entry_dir)
    if manifest is None:
        return "no readable manifest.json"
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("library") not in files:
        return "manifest lists no library"
    for rel, meta in files.items():
        if not (isinstance(meta, dict) and "size" in meta and "sha256" in meta):
            return f"manifest entry of {rel} has no size and sha256"
        path = entry_dir / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel} is missing"
        if size != meta["size"]:
            return f"{rel} has {size} bytes, manifest says {meta['size']}"
        if sha256_file(path) != meta["sha256"]:
            return f"{rel} does not match its sha256"
    return None


def write_files(build_dir: Path, module: RenderedModule) -> None:
    """Sources and the headers they use, into a fresh private build folder."""
    for name, text in module.sources.items():
        (build_dir / name).write_text(text)
    for rel, data in module.headers.items():
        target = build_dir / "csrc" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def write_manifest(build_dir: Path, entry: Entry, module: RenderedModule, content: str,
                   flags: Flags, toolchain_identity: dict, seconds: float, built_by: str) -> dict:
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
        "family": module.spec.FAMILY,
        "spec": module.spec.canonical(),
        "archs": list(flags.archs),
        "debug": flags.debug,
        "toolchain": toolchain_identity,
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


def lookup_roots() -> list[Path]:
    """Where entries are looked for: the configured root, then the user cache (the
    fallback that builds go to when the configured root is not writable)."""
    roots = [env.cache_root()]
    user = env.user_cache_root()
    if user not in roots:
        roots.append(user)
    return roots


def build_root() -> Path:
    """The first writable root; a clear error if none is."""
    for root in lookup_roots():
        if _writable_dir(root) and _writable_dir(root / ".tmp") and _writable_dir(root / ".locks"):
            return root
    raise CacheError(
        f"no writable cache directory: tried {', '.join(map(str, lookup_roots()))}; "
        "set FLASHINFER_JIT_CACHE_DIR to a writable folder"
    )


def private_build_dir(root: Path, dirname: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{dirname}.", suffix=f".{os.getpid()}", dir=root / ".tmp"))


def discard(path: Path, root: Path) -> None:
    """Move `path` out of the way atomically, then delete it; a reader that already
    opened a file in it keeps its file."""
    trash = root / ".tmp" / f"discard-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.replace(path, trash)
    except FileNotFoundError:
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


def iter_entries(root: Path | None = None) -> Iterator[tuple[Path, dict | None]]:
    roots = [root] if root is not None else lookup_roots()
    seen = set()
    for r in roots:
        if r in seen or not r.is_dir():
            continue
        seen.add(r)
        for child in sorted(r.iterdir()):
            if child.is_dir() and not child.name.startswith("."):
                yield child, read_manifest(child)


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


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
