"""Exceptions raised by the JIT pipeline."""

from __future__ import annotations


class JitError(RuntimeError):
    """Base class of everything the build and load pipeline raises."""


class ToolchainError(JitError):
    """nvcc, ninja or a host compiler is missing or unusable."""


class SettingError(JitError, ValueError):
    """An environment variable holds a value the package does not accept; the message names
    the variable and the values it takes."""


class BuildError(JitError):
    """A module failed to compile or link.

    Carries the module name, the path of the full build log and the first lines of
    the compiler's errors, so the message alone usually says what went wrong.
    """

    def __init__(self, module: str, log_path: str, first_errors: list[str], hint: str | None = None):
        self.module = module
        self.log_path = log_path
        self.first_errors = first_errors
        self.hint = hint
        shown = "\n".join("    " + line for line in first_errors) or "    (no error lines found)"
        super().__init__(
            f"building module {module!r} failed\n  full log: {log_path}\n"
            f"  first compiler errors:\n{shown}" + (f"\n  {hint}" if hint else "")
        )


class JitDisabledError(JitError):
    """FLASHINFER_JIT_DISABLE_JIT is set and the module is not in the cache. A miss of one
    module carries its name, its line for a matrix file and the `flashinfer-jit aot`
    command that builds it."""

    def __init__(self, message: str, module: str | None = None, matrix_line: str | None = None,
                 aot_command: str | None = None):
        super().__init__(message)
        self.module = module
        self.matrix_line = matrix_line
        self.aot_command = aot_command


class CacheError(JitError):
    """The cache directory cannot be used (read-only, full, or corrupt beyond repair)."""
