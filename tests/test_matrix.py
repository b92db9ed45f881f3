"""AOT matrix files: expansion, defaults, comments, continuation, located errors, and
the matrices shipped in scripts/matrices/."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashinfer_jit.pipeline.matrix import (
    MatrixError,
    convert_value,
    parse_line,
    parse_matrix,
    parse_matrix_text,
    spec_line,
)
from flashinfer_jit.pipeline.spec import choice
from flashinfer_jit.specs import FAMILIES, AppendSpec, BatchIndicesSpec, Spec

MATRICES = Path(__file__).resolve().parent.parent / "scripts" / "matrices"
DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def test_a_line_expands_to_every_combination():
    specs = parse_matrix_text(
        "append  dtype_kv=float16,bfloat16,float8_e4m3fn,float8_e5m2  head_dim=64,128,256  "
        "kv_layout=NHD,HND  page_table=csr")
    assert len(specs) == 4 * 3 * 2
    got = {(s.dtype_kv, s.head_dim, s.kv_layout, s.page_table) for s in specs}
    assert got == set(itertools.product(DTYPES, (64, 128, 256), ("NHD", "HND"), ("csr",)))


def test_values_take_the_field_type_and_missing_fields_their_default():
    spec, indices = parse_matrix_text("append dtype_kv=bfloat16 head_dim=128\nbatch_indices")
    assert spec == AppendSpec(dtype_kv="bfloat16", head_dim=128, kv_layout="NHD", page_table="csr")
    assert isinstance(spec.head_dim, int)
    assert indices == BatchIndicesSpec()


def test_bool_values_read_true_and_false():
    assert convert_value("causal", "true", (False, True)) is True
    assert convert_value("causal", "False", (False, True)) is False
    with pytest.raises(ValueError, match="'yes' is not true or false"):
        convert_value("causal", "yes", (False, True))


@dataclass(frozen=True)
class ToySpec(Spec):
    """A family with a bool field and a rule across fields, independent of real kernels."""

    FAMILY = "toy"
    TEMPLATES = {}

    width: int = choice(1, 2, 4)
    fast: bool = choice(False, True, tag="fast", default=False)

    def check(self) -> None:
        if self.fast and self.width == 1:
            raise ValueError("ToySpec: fast needs width 2 or 4")


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", ToySpec)


def test_bool_fields_expand_from_true_and_false(toy):
    specs = parse_matrix_text("toy width=2,4 fast=false,TRUE")
    assert specs == [ToySpec(2, False), ToySpec(2, True), ToySpec(4, False), ToySpec(4, True)]


def test_a_rule_across_fields_fails_with_its_line(toy):
    with pytest.raises(MatrixError, match=r"^m:2: ToySpec: fast needs width 2 or 4$"):
        parse_matrix_text("toy width=1\ntoy width=1,2 fast=true", source="m")


def test_comments_blank_lines_and_continuations():
    text = """
# a comment line

append dtype_kv=float16 \\
       head_dim=64,128 \\   # a comment after the backslash
       kv_layout=HND          # and at the end
   # indented comment
batch_indices   # trailing comment
"""
    specs = parse_matrix_text(text)
    assert [s.name for s in specs] == [
        "append_f16_hd64_hnd_csr", "append_f16_hd128_hnd_csr", "batch_indices_i32"]


def test_spaces_around_equals_and_commas_are_allowed():
    specs = parse_matrix_text("append dtype_kv = float16, bfloat16  head_dim=64")
    assert [s.dtype_kv for s in specs] == ["float16", "bfloat16"]


def test_duplicates_are_dropped_and_order_kept():
    specs = parse_matrix_text(
        "batch_indices\nappend dtype_kv=bfloat16 head_dim=128,64\n"
        "append dtype_kv=bfloat16 head_dim=64 kv_layout=NHD\nbatch_indices")
    assert [s.name for s in specs] == [
        "batch_indices_i32", "append_bf16_hd128_nhd_csr", "append_bf16_hd64_nhd_csr"]


@pytest.mark.parametrize("text, line, message", [
    ("apend dtype_kv=float16", 1, "unknown family 'apend' (did you mean 'append'?)"),
    ("\n\nappend head_dims=64", 3,
     "append has no parameter 'head_dims' (did you mean 'head_dim'?)"),
    ("append dtype_kv=float16 head_dim=96", 1,
     "head_dim=96 is not supported; supported: 64, 128, 256"),
    ("append dtype_kv=float32 head_dim=64", 1, "dtype_kv=float32 is not supported"),
    ("append dtype_kv=float16 head_dim=big", 1, "head_dim: 'big' is not an integer"),
    ("append dtype_kv=float16", 1, "append needs head_dim (no default)"),
    ("append dtype_kv=float16 head_dim=64,,128", 1, "empty value"),
    ("append dtype_kv=float16 head_dim=64 head_dim=128", 1, "head_dim is given twice"),
    ("append dtype_kv=float16 head_dim", 1, "expected param=v1,v2,... but found 'head_dim'"),
    ("# c\nbatch_indices\nappend dtype_kv=float16 \\\n head_dim=7", 3,
     "head_dim=7 is not supported"),
    ("batch_indices\nappend dtype_kv=float16 head_dim=64 \\", 2, "no line follows"),
])
def test_errors_name_the_line_and_the_problem(text, line, message):
    with pytest.raises(MatrixError) as info:
        parse_matrix_text(text, source="m.txt")
    assert info.value.line == line
    assert str(info.value).startswith(f"m.txt:{line}: ")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_matrix_names_the_file(tmp_path):
    path = tmp_path / "deploy"
    path.write_text("batch_indices\n\nappend dtype_kv=int8 head_dim=128\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: dtype_kv=int8 is not supported"):
        parse_matrix(path)


def test_tests_matrix_covers_every_dtype_head_dim_and_page_table():
    specs = parse_matrix(MATRICES / "tests")
    appends = [s for s in specs if isinstance(s, AppendSpec)]
    assert len(specs) == len(set(specs))
    assert len(appends) == 17
    assert BatchIndicesSpec() in specs
    nhd_csr = {(s.dtype_kv, s.head_dim) for s in appends
               if (s.kv_layout, s.page_table) == ("NHD", "csr")}
    assert nhd_csr == set(itertools.product(DTYPES, (64, 128, 256)))
    layouts = {(s.kv_layout, s.page_table) for s in appends
               if (s.dtype_kv, s.head_dim) == ("bfloat16", 128)}
    assert layouts == set(itertools.product(
        ("NHD", "HND"), ("csr", "block_table", "block_table_kv_separate")))


def test_llama_matrix():
    specs = parse_matrix(MATRICES / "llama")
    assert BatchIndicesSpec() in specs
    appends = {(s.dtype_kv, s.head_dim, s.kv_layout, s.page_table)
               for s in specs if isinstance(s, AppendSpec)}
    assert appends == set(itertools.product(("bfloat16", "float8_e4m3fn"), (128,), ("NHD",),
                                            ("csr", "block_table")))


def test_spec_line_names_exactly_its_spec():
    """The line a JIT-disabled miss prints: every field spelled out, read back as the same
    module, for every module of the shipped matrices."""
    specs = parse_matrix(MATRICES / "tests") + parse_matrix(MATRICES / "llama")
    assert {type(s) for s in specs} == set(FAMILIES.values())
    for spec in specs:
        line = spec_line(spec)
        assert parse_line(line) == [spec], line
        assert len(line.split()) == 1 + len(spec.fields())
    assert spec_line(AppendSpec("float8_e4m3fn", 64, "HND", "block_table")) == \
        "append dtype_kv=float8_e4m3fn head_dim=64 kv_layout=HND page_table=block_table"


# --- matrices that ship with the package -----------------------------------------------------
def test_a_shipped_matrix_is_found_by_its_name_from_any_directory(tmp_path, monkeypatch):
    """`flashinfer-jit aot --matrix llama` works away from the checkout: the matrices ship
    as package data (pyproject: flashinfer_jit.matrices), and a name that is no file is
    looked up among them."""
    from flashinfer_jit.pipeline import env, matrix

    repo = Path(__file__).resolve().parent.parent
    assert matrix.shipped_matrices() == sorted(p.name for p in (repo / "scripts" / "matrices").iterdir())
    monkeypatch.chdir(tmp_path)
    for name in ("llama", "tests"):
        assert matrix.resolve_matrix(name) == env.matrix_dir() / name
        assert matrix.parse_matrix(name) == matrix.parse_matrix(repo / "scripts" / "matrices" / name)
    with pytest.raises(ValueError, match=r"'nope': no such file, nor a shipped matrix \(shipped: llama, tests\)"):
        matrix.parse_matrix("nope")
    (tmp_path / "llama").write_text("batch_indices\n")  # a file of that name wins: it is what the user named
    assert matrix.parse_matrix("llama") == [BatchIndicesSpec()]
    assert '"flashinfer_jit.matrices" = "scripts/matrices"' in (repo / "pyproject.toml").read_text()
