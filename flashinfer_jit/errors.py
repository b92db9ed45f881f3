"""Exceptions raised by the JIT pipeline."""

from __future__ import annotations


class JitError(RuntimeError):
    """Base class of everything the build and load pipeline raises."""


class ToolchainError(JitError):
    """nvcc, ninja or a host compiler is missing or unusable."""


class BuildError(JitError):
    """A module failed to compile or link.

    Carries the module name, the path of the full build log and the first lines of
    the compiler's errors, so the message alone usually says what went wrong.
    """

    def __init__(self, module: str, log_path: str, first_errors: list[str]):
        self.module = module
        self.log_path = log_path
        self.first_errors = first_errors
        shown = "\n".join("    " + line for line in first_errors) or "    (no error lines found)"
        super().__init__(
            f"building module {module!r} failed\n  full log: {log_path}\n"
            f"  first compiler errors:\n{shown}"
        )


class JitDisabledError(JitError):
    """FLASHINFER_JIT_DISABLE_JIT is set and the module is not in the cache."""


class CacheError(JitError):
    """The cache directory cannot be used (read-only, full, or corrupt beyond repair)."""
