"""pytest plugin of scripts/flashinfer_tests/run.py (loaded with -p): the runner's case
selection and its record of the modules a run found missing.

FIJ_FI_EXCLUDE  regex over node ids: cases left out (deselected), e.g. NVFP4, the profiler
FIJ_FI_SAMPLE   N: a fixed sample of at most N cases per test file (seeded by FIJ_FI_SEED)
FIJ_FI_MISSES   file: where a case that stopped on a module missing from the cache (under
                FLASHINFER_JIT_DISABLE_JIT) appends that module's matrix line"""

import os
import random
import re

import pytest


def pytest_collection_modifyitems(config, items):
    exclude = os.environ.get("FIJ_FI_EXCLUDE")
    keep, dropped = [], []
    for item in items:
        (dropped if exclude and re.search(exclude, item.nodeid) else keep).append(item)
    sample = int(os.environ.get("FIJ_FI_SAMPLE", "0") or 0)
    if sample > 0:
        rng = random.Random(int(os.environ.get("FIJ_FI_SEED", "0")))
        by_file = {}
        for item in keep:
            by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
        chosen = set()
        for file_items in by_file.values():
            ids = sorted(i.nodeid for i in file_items)
            chosen.update(rng.sample(ids, min(sample, len(ids))))
        dropped += [i for i in keep if i.nodeid not in chosen]
        keep = [i for i in keep if i.nodeid in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _missing_module_line(exc):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        line = getattr(exc, "matrix_line", None)
        if line:
            return line
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    path = os.environ.get("FIJ_FI_MISSES")
    if path and call.excinfo is not None:
        line = _missing_module_line(call.excinfo.value)
        if line:
            with open(path, "a") as f:
                f.write(line + "\n")
