"""Archives of a cache folder for deployment images (`flashinfer-jit pack DIR`).

An archive holds the complete entries of DIR (and run()'s fij_fastcall extension, where
DIR has it built) and nothing else: of each entry, the files
its manifest lists, checked against their sizes and sha256 as they are read (so an entry
damaged or replaced while it is packed is left out, never packed half old, half new),
its build log, and its manifest, written after the entry's other files as a publish
writes it. Lock files, temp folders, failed-build logs and folders without a manifest
that verifies stay behind. Paths are relative to DIR, so `tar -xf ARCHIVE -C ROOT` makes
ROOT a cache root (for FLASHINFER_JIT_CACHE_DIR, or read-only in FLASHINFER_JIT_CACHE_PATH).

Compression: gzip (`.tar.gz`) unless the archive is named `.tar.zst` (through the `zstd`
program: Python 3.11's tarfile has no zstd). gzip is the default because the image that
unpacks the archive may have no zstd (the H100 machines of this project's GPU checks have
none: `tar -xf X.tar.zst` fails there); zstd makes the archive about 2/3 the size. Members carry the entry's build
time, owner 0 and fixed modes, so packing the same entries twice gives the same tar.
"""

from __future__ import annotations

import datetime
import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

from . import cache

SUFFIXES = {".tar.zst": "zstd", ".tar.gz": "gzip", ".tgz": "gzip"}


@dataclass
class PackReport:
    archive: Path
    compression: str
    packed: list[str] = field(default_factory=list)  # entry folder names
    skipped: dict[str, str] = field(default_factory=dict)  # folder name -> why
    fastcall: list[str] = field(default_factory=list)  # fij_fastcall libraries (paths relative to the root)
    size_bytes: int = 0  # of the archive (0: none was written)


def zstd_program() -> str | None:
    return shutil.which("zstd")


def default_archive(root: Path) -> Path:
    """`<DIR>.tar.gz` beside DIR (any image can unpack it)."""
    return root.parent / (root.name + ".tar.gz")


def compression_of(archive: Path) -> str:
    """'zstd' or 'gzip', from the archive's name; a ValueError for anything else, or for
    .tar.zst without the zstd program."""
    kind = next((k for suffix, k in SUFFIXES.items() if archive.name.endswith(suffix)), None)
    if kind is None:
        raise ValueError(f"cannot tell the format of {archive.name!r}: name it *.tar.zst or *.tar.gz")
    if kind == "zstd" and zstd_program() is None:
        raise ValueError(f"{archive.name}: zstd is not on PATH; install it or name the archive *.tar.gz")
    return kind


def pack(root: Path, archive: Path) -> PackReport:
    """Write the complete entries of `root` to `archive` (through a temp file beside it,
    renamed into place at the end: a failed pack leaves no partial archive). Where no
    entry is complete (an empty root, or every entry left out) nothing is written and an
    `archive` already there is untouched: `report.packed` is then empty."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    report = PackReport(archive, compression_of(archive))
    folders = list(cache.iter_entries(root))
    if not folders:
        return report
    tmp = archive.parent / f".{archive.name}.{os.getpid()}.tmp"
    try:
        with _compressed(tmp, report.compression) as stream, \
                tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path, _ in folders:
                raw = _read(path / cache.MANIFEST)
                manifest = _parse(raw)
                contents: dict[str, bytes] = {}
                reason = ("no readable manifest.json" if manifest is None
                          else cache.verify_entry(path, manifest, contents))
                if reason is not None:
                    report.skipped[path.name] = reason
                    continue
                _add_entry(tar, path, manifest, raw, contents)
                report.packed.append(path.name)
            if report.packed:  # (the extension alone serves nothing)
                report.fastcall.extend(_add_fastcall(tar, root))
        if report.packed:
            os.replace(tmp, archive)
    finally:
        tmp.unlink(missing_ok=True)
    report.size_bytes = archive.stat().st_size if report.packed else 0
    return report


@contextmanager
def _compressed(path: Path, compression: str) -> Iterator[IO[bytes]]:
    """A binary stream whose bytes land compressed in `path`."""
    if compression == "gzip":
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            yield gz
        return
    with open(path, "wb") as raw:
        proc = subprocess.Popen([zstd_program(), "-q", "-T0", "-c"], stdin=subprocess.PIPE, stdout=raw)
        try:
            yield proc.stdin
        finally:
            proc.stdin.close()
            code = proc.wait()
    if code != 0:
        raise OSError(f"zstd exited with status {code} writing {path}")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _parse(raw: bytes | None) -> dict | None:
    """The manifest whose bytes are `raw` (the bytes verified are the bytes packed)."""
    try:
        manifest = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None


def _add_entry(tar: tarfile.TarFile, path: Path, manifest: dict, manifest_bytes: bytes,
               contents: dict[str, bytes]) -> None:
    mtime = _built_at(manifest)
    folders = sorted({str(Path(rel).parent) for rel in contents} - {"."})
    for folder in ["", *folders]:
        info = tarfile.TarInfo(f"{path.name}/{folder}".rstrip("/"))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, mtime
        tar.addfile(info)
    files = dict(sorted(contents.items()))
    log = _read(path / cache.BUILD_LOG)
    if log is not None:  # the log is for people; an entry without one is still complete
        files[cache.BUILD_LOG] = log
    files[cache.MANIFEST] = manifest_bytes  # last, as publish writes it
    for rel, data in files.items():
        info = tarfile.TarInfo(f"{path.name}/{rel}")
        info.size, info.mtime = len(data), mtime
        info.mode = 0o755 if rel == manifest["library"] else 0o644
        tar.addfile(info, io.BytesIO(data))


def _add_fastcall(tar: tarfile.TarFile, root: Path) -> list[str]:
    """The built fij_fastcall extensions of `root` (.fastcall/<key>/<library>, see
    flashinfer_jit/runtime/fastcall.py): run()'s caller of the C launch entries, which a root
    without them replaces by ctypes."""
    added = []
    for folder in cache.extension_folders(root):
        if cache.verify_extension_folder(folder) is not None:
            continue  # damaged or half unpacked: not carried into an image
        manifest = folder / cache.MANIFEST
        lib = folder / json.loads(manifest.read_text())["library"]
        data, meta = _read(lib), _read(manifest)
        if data is None or meta is None or cache.sha256_bytes(data) != fastcall_sha(meta, lib.name):
            continue
        rel = lib.relative_to(root)
        for sub in (rel.parent.parent, rel.parent):
            info = tarfile.TarInfo(str(sub))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, body, mode in ((rel, data, 0o755), (rel.parent / cache.MANIFEST, meta, 0o644)):
            info = tarfile.TarInfo(str(path))
            info.size, info.mode = len(body), mode
            tar.addfile(info, io.BytesIO(body))
        added.append(str(rel))
    return added


def fastcall_sha(manifest_bytes: bytes, library: str) -> str | None:
    """The sha256 the extension's manifest records for its library."""
    try:
        return json.loads(manifest_bytes)["files"][library]["sha256"]
    except (ValueError, KeyError, TypeError):
        return None


def _built_at(manifest: dict) -> int:
    try:
        return int(datetime.datetime.fromisoformat(manifest["built_at"]).timestamp())
    except (KeyError, TypeError, ValueError):
        return 0
