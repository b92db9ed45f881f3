"""Processes started together (tests/test_cache.py's eight racers on one build,
tests/test_multi_gpu.py's one process per GPU): each imports what it needs, creates its
`ready` file, waits for the `go` file, then runs; the caller starts them all at once.

Not a test module; imported by name, as tests/ is on sys.path under pytest.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def run_together(tmp_path: Path, script: str, envs: list[dict], cwd: Path, start_timeout: float,
                 run_timeout: float, name: str = "racer") -> list[str]:
    """`python -c script READY GO` once per environment in `envs`, released together once
    all are ready. Outputs go to files, not pipes (no one blocks on a full pipe). Returns
    each process's output (stdout and stderr); asserts each exited 0."""
    go = tmp_path / "go"
    procs = []  # (ready file, output file, process)
    for i, env in enumerate(envs):
        ready, output = tmp_path / f"ready-{i}", tmp_path / f"{name}-{i}.txt"
        with open(output, "w") as out:
            procs.append((ready, output, subprocess.Popen([sys.executable, "-c", script, str(ready), str(go)],
                                                          env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)))
    try:
        deadline = time.monotonic() + start_timeout
        while not all(ready.exists() for ready, _, _ in procs):
            assert time.monotonic() < deadline, f"{name}s did not start"
            for _, output, p in procs:
                assert p.poll() is None, f"a {name} died before the start:\n{output.read_text()}"
            time.sleep(0.05)
        go.touch()  # all at once
        codes = [p.wait(timeout=run_timeout) for _, _, p in procs]
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
    outputs = [output.read_text() for _, output, _ in procs]
    for code, text in zip(codes, outputs):
        assert code == 0, text[-4000:]
    return outputs
