"""Environment variables and the locations derived from them.

Every function here reads the environment when it is called, never at import, so a
process may change a variable between two calls (tests do). Nothing here touches the
GPU; `visible_gpu_archs` is the only function that may, and only when asked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # flashinfer_jit/


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

# os.environ.get of a variable that is not set costs ~0.7 us (the mapping raises and catches a
# KeyError), and plan() / run() ask the switches on every call: read os.environ's own dict (what
# os.environ.get reads, so os.environ's changes and monkeypatch.setenv show) where CPython has it.
_ENVIRON = getattr(os.environ, "_data", None)
_KEYS: dict = {}


def _getenv(name: str) -> str | None:
    """os.environ.get(name), without the exception an unset variable costs there."""
    if _ENVIRON is None or not isinstance(_ENVIRON, dict):
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
    raw = _ENVIRON.get(key)
    return None if raw is None else os.environ.decodevalue(raw)


def _switch(name: str, default: bool) -> bool:
    """A yes/no variable: `default` when unset or empty, on for 1 / true / yes / on, off for
    0 / false / no / off (any case); anything else is a SettingError naming the variable (a
    value such as "maybe" must not turn a switch on or off by accident)."""
    raw = _getenv(name)
    if not raw:  # (unset, the common case: plan() and run() ask some of these every call)
        return default
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    from .errors import SettingError

    raise SettingError(f"{name}={raw!r}: expected one of {', '.join(_ON + _OFF)} (or leave it unset)")


def _flag(name: str) -> bool:
    """A switch that is off unless set (see _switch)."""
    return _switch(name, False)


def _on_unless_off(name: str) -> bool:
    """A switch that is on unless set to 0 / false / no / off (see _switch)."""
    return _switch(name, True)


def source_dir(kind: str) -> Path:
    """`csrc` or `templates`: the checkout's top-level folder, else the installed copy."""
    checkout = PACKAGE_DIR.parent / kind
    if checkout.is_dir() and (PACKAGE_DIR.parent / "pyproject.toml").is_file():
        return checkout
    return PACKAGE_DIR / kind


def matrix_dir() -> Path:
    """The AOT matrix files that ship with the package (`flashinfer-jit aot --matrix llama`):
    the checkout's scripts/matrices, else the installed copy."""
    checkout = PACKAGE_DIR.parent / "scripts" / "matrices"
    if checkout.is_dir() and (PACKAGE_DIR.parent / "pyproject.toml").is_file():
        return checkout
    return PACKAGE_DIR / "matrices"


def checkout_root() -> Path | None:
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "csrc").is_dir():
        return root
    return None


def cache_root() -> Path:
    """FLASHINFER_JIT_CACHE_DIR, else `cache/` of a source checkout, else the user cache."""
    explicit = os.environ.get("FLASHINFER_JIT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().resolve()
    root = checkout_root()
    if root is not None and os.access(root, os.W_OK):
        return root / "cache"
    return user_cache_root()


def cache_path() -> list[Path]:
    """FLASHINFER_JIT_CACHE_PATH: prebuilt, read-only cache roots (os.pathsep-separated, e.g.
    an image's `/opt/fij-cache`), searched in order before the writable root; nothing is
    ever written there. Empty items are skipped."""
    value = os.environ.get("FLASHINFER_JIT_CACHE_PATH", "")
    return [Path(item).expanduser().resolve() for item in value.split(os.pathsep) if item.strip()]


def user_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().resolve() / "flashinfer_jit"


def verbose() -> bool:
    return _flag("FLASHINFER_JIT_VERBOSE")


def debug() -> bool:
    """Debug builds (-G -lineinfo, device bounds checks) and host-side value checks."""
    return _flag("FLASHINFER_JIT_DEBUG")


def jit_disabled() -> bool:
    return _flag("FLASHINFER_JIT_DISABLE_JIT")


_LOG_LEVELS = {"CRITICAL": 50, "ERROR": 40, "WARNING": 30, "WARN": 30, "INFO": 20, "DEBUG": 10}


def log_level() -> int | None:
    """FLASHINFER_JIT_LOG_LEVEL: the level of the `flashinfer_jit` logger (a name such as
    WARNING or DEBUG, or a number); None when unset."""
    value = os.environ.get("FLASHINFER_JIT_LOG_LEVEL", "").strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    if value.upper() in _LOG_LEVELS:
        return _LOG_LEVELS[value.upper()]
    from .errors import SettingError

    raise SettingError(f"FLASHINFER_JIT_LOG_LEVEL={value!r}: expected DEBUG, INFO, WARNING, ERROR, CRITICAL or a "
                       "number (or leave it unset)")


def decode_clusters() -> bool:
    """FLASHINFER_JIT_DECODE_CLUSTERS=0 keeps batch decode off its thread-block-cluster split
    (small batches then split with partial states in the workspace, as before sm_90)."""
    return _on_unless_off("FLASHINFER_JIT_DECODE_CLUSTERS")


def native_decode_plan() -> bool:
    """FLASHINFER_JIT_NATIVE_PLAN=0 keeps batch decode's plan() on its numpy path (the
    reference the C++ planner is tested against) instead of the C++ planner module."""
    return _on_unless_off("FLASHINFER_JIT_NATIVE_PLAN")


def native_prefill_plan() -> bool:
    """The same switch for batch prefill's plan() (csrc/prefill/prefill_plan.h or its numpy twin)."""
    return _on_unless_off("FLASHINFER_JIT_NATIVE_PLAN")


def _positive_int(name: str) -> int | None:
    """A variable that holds a count: None when unset or empty, else a positive integer;
    anything else is a SettingError naming the variable (a bad value never changes what
    runs, nor reaches ninja or nvcc as a number they misread)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        from .errors import SettingError

        raise SettingError(f"{name}={value!r}: expected a positive integer (or leave it unset)")
    return number


def max_jobs() -> int | None:
    """MAX_JOBS: parallel compile jobs; None: the CPU count."""
    return _positive_int("MAX_JOBS")


def nvcc_threads() -> int:
    """FLASHINFER_JIT_NVCC_THREADS: nvcc --threads (default 1)."""
    return _positive_int("FLASHINFER_JIT_NVCC_THREADS") or 1


def compiler_launcher() -> tuple[str, ...]:
    """FLASHINFER_JIT_COMPILER_LAUNCHER: a command put before every nvcc and host-compiler
    step of a module build (and of the fastcall extension's), e.g. "ccache" (as CMake's
    <LANG>_COMPILER_LAUNCHER). Unset or empty: none. Its first word must be an executable
    (a path, or a name on PATH); anything else is a SettingError naming the variable. It
    does not enter cache keys: a launcher must produce the compiler's output."""
    import shlex

    raw = os.environ.get("FLASHINFER_JIT_COMPILER_LAUNCHER", "").strip()
    if not raw:
        return ()
    try:
        words = tuple(shlex.split(raw))
    except ValueError as exc:  # an unclosed quote
        words, why = (), str(exc)
    else:
        command = words[0] if words else ""
        runnable = bool(command) and (shutil.which(command) is not None
                                      or (os.path.isfile(command) and os.access(command, os.X_OK)))
        why = "" if runnable else f"{command!r} is not an executable file or a command on PATH"
    if why:
        from .errors import SettingError

        raise SettingError(f"FLASHINFER_JIT_COMPILER_LAUNCHER={raw!r}: {why} (e.g. 'ccache', or leave it unset)")
    return words


def cuda_home() -> Path | None:
    """CUDA_HOME (or CUDA_PATH), else the toolkit above `nvcc` on PATH, else /usr/local/cuda.

    An `nvcc` on PATH that is a wrapper script (not inside a toolkit) is skipped."""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(name)
        if value:
            return Path(value)
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "include" / "cuda_runtime.h").is_file():
            return home
    default = Path("/usr/local/cuda")
    return default if default.is_dir() else None


def parse_arch_list(text: str, source: str = "FLASHINFER_JIT_CUDA_ARCH_LIST") -> tuple[str, ...]:
    """'8.0 9.0a;9.0+PTX' -> ('8.0', '9.0+PTX', '9.0a'), validated and sorted."""
    archs = []
    for item in text.replace(";", " ").replace(",", " ").split():
        base = item[:-4] if item.endswith("+PTX") else item
        major, _, minor = base.partition(".")
        suffix = minor.lstrip("0123456789")
        digits = minor[: len(minor) - len(suffix)]
        if not (major.isdigit() and digits.isdigit() and suffix in ("", "a", "f")):
            from .errors import SettingError

            raise SettingError(
                f"{source}: cannot read {item!r}; "
                "expected items like '8.0', '9.0a' or '9.0+PTX'"
            )
        archs.append(item)
    if not archs:
        from .errors import SettingError

        raise SettingError(f"{source} is empty; expected e.g. '9.0a'")
    return tuple(sorted(set(archs)))


def visible_gpu_archs() -> tuple[str, ...]:
    """Architectures of the visible GPUs; Hopper gets its arch-specific '9.0a'."""
    import torch

    if not torch.cuda.is_available():
        return ()
    archs = set()
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        archs.add(f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else ""))
    return tuple(sorted(archs))


def target_archs() -> tuple[str, ...]:
    """FLASHINFER_JIT_CUDA_ARCH_LIST, else the visible GPUs; an error if neither says."""
    explicit = os.environ.get("FLASHINFER_JIT_CUDA_ARCH_LIST")
    if explicit:
        return parse_arch_list(explicit)
    archs = visible_gpu_archs()
    if not archs:
        from .errors import ToolchainError

        raise ToolchainError(
            "no target architecture: no GPU is visible and FLASHINFER_JIT_CUDA_ARCH_LIST "
            "is unset; set it, e.g. FLASHINFER_JIT_CUDA_ARCH_LIST='9.0a' for H100/H200"
        )
    return archs
