"""The `flashinfer_jit` logger: what a first-use build says, and where it goes.

The first call with a new configuration compiles a module (10-60 s); a serving engine
that prints nothing meanwhile looks hung. So jit.load_or_build announces at INFO a
build that a call waits for (module, first use, expected time) and its end (seconds),
and a wait on another process's build; a cache hit is DEBUG. AOT builds log nothing:
the CLI shows its own progress.

Visible by default, quiet when configured. An application that configured no handler
these records would reach (none on this logger, none on the root or another ancestor it
propagates to) would never see an INFO record, so `configure()` then attaches one stderr
handler and sets the level to INFO; once the application has configured a handler of its
own, both are taken back and the application's configuration decides.
FLASHINFER_JIT_LOG_LEVEL (e.g. WARNING, DEBUG) sets the level either way.
"""

from __future__ import annotations

import logging
import threading

from . import env

logger = logging.getLogger("flashinfer_jit")

_lock = threading.Lock()
_handler: logging.Handler | None = None  # the stderr handler, while attached
_default_level: int | None = None  # the level configure() set by default, to take back


def configure() -> logging.Logger:
    """Bring the logger in line with the application's logging and the environment as they
    are now. Runs at every registry miss (once per configuration and process), never per
    call; importing the package configures nothing."""
    global _handler, _default_level
    with _lock:
        if _handler is not None:
            logger.removeHandler(_handler)
            _handler = None
        if _default_level is not None and logger.level == _default_level:
            logger.setLevel(logging.NOTSET)
        _default_level = None
        level = env.log_level()
        if not logger.hasHandlers():
            _handler = logging.StreamHandler()  # sys.stderr as it is now
            _handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(_handler)
            if level is None and logger.level == logging.NOTSET:
                level = _default_level = logging.INFO
        if level is not None:
            logger.setLevel(level)
    return logger


def expected_time(typical: tuple[float, int] | None) -> str:
    """'about 12 s (the median of 3 earlier builds of this family here)', or the range
    measured on the H100 host and a 2-core CI box when no earlier build says."""
    if typical is None:
        return "about 10-60 s"
    seconds, count = typical
    return (f"about {seconds:.0f} s (the median of {count} earlier build{'s' if count > 1 else ''} of "
            "this family in this cache)")
