"""CPU checks of the tuning and benchmark scripts that nothing else imports: the read
ceiling's CUDA source still compiles, and variants_decode.py reads edits from a file."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_read_ceiling_source_compiles():
    import bench_read_ceiling

    exe = bench_read_ceiling.build("90a")
    assert exe.is_file() and exe.stat().st_size > 0
    shutil.rmtree(exe.parent)


def test_variant_edits_from_a_file(tmp_path):
    import variants_decode as vd

    edits = [["csrc/decode_mma.cuh", "a; b", "c; d"]]
    f = tmp_path / "v.json"
    f.write_text(json.dumps(edits))
    assert vd.parse_variant(f"x=@{f}") == ("x", [("csrc/decode_mma.cuh", "a; b", "c; d")])
    assert vd.parse_variant("y=csrc/f.cuh:old=>new;csrc/g.cuh:p=>q") == \
        ("y", [("csrc/f.cuh", "old", "new"), ("csrc/g.cuh", "p", "q")])
    f.write_text(json.dumps([["only", "two"]]))
    with pytest.raises(argparse.ArgumentTypeError, match="list of"):
        vd.parse_variant(f"x=@{f}")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        vd.parse_variant(f"x=@{tmp_path / 'missing.json'}")
