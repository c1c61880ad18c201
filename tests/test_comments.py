"""No comment or docstring in colo_rl/ quotes where or when something was measured: numbers go
stale in code, so they live in benchmarks/RESULTS.md. Data tables that record provenance (the
peak TFLOP/s per device, the planner's calibration) are the exception, allowed by file and symbol."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "colo_rl"

GPU_MODEL = r"\b(?:[AHV]100|H200|H20|B100|B200|GB200|GH200|A10G?|A30|A40|A6000|L4|L40S?|T4|RTX|MI\d{3}X?)\b"
FORBIDDEN = {
    "a GPU model": re.compile(GPU_MODEL),
    "RESULTS.md": re.compile(r"RESULTS\.md", re.IGNORECASE),
    "a date": re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d"),
}
# (file, top-level symbol) whose statement and the comments right above it may name devices and
# dates: they are data with provenance, not prose about a run.
ALLOWED = {
    ("colo_rl/trainer/flops.py", "PEAK_BF16_TFLOPS"),
    ("colo_rl/planner.py", "CALIBRATION"),
    ("colo_rl/planner.py", "Fitted"),
}


def _names(node: ast.stmt) -> list[str]:
    """The names a top-level statement defines (a class, a function, an assignment's targets)."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
        return [node.name]
    return [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]


def _allowed_lines(rel: str, tree: ast.Module, lines: list[str]) -> set[int]:
    """Line numbers of the allowed symbols' statements and of the comment block right above each."""
    allowed = set()
    for node in tree.body:
        if not any((rel, name) in ALLOWED for name in _names(node)):
            continue
        allowed.update(range(node.lineno, node.end_lineno + 1))
        above = node.lineno - 1
        while above >= 1 and lines[above - 1].lstrip().startswith("#"):
            allowed.add(above)
            above -= 1
    return allowed


def _prose(source: str, tree: ast.Module):
    """(line, text) of every comment and docstring of a module."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                for i, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + i, line


def violations(package: Path = PACKAGE) -> list[str]:
    """`file:line: names WHAT: text` for each comment or docstring line that names a GPU model,
    RESULTS.md or a date outside the allowed data tables."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        source = path.read_text()
        tree = ast.parse(source)
        allowed = _allowed_lines(rel, tree, source.splitlines())
        for line, text in _prose(source, tree):
            if line in allowed:
                continue
            for what, pattern in FORBIDDEN.items():
                if pattern.search(text):
                    found.append(f"{rel}:{line}: names {what}: {text.strip()}")
    return found


def test_no_comment_or_docstring_names_a_gpu_results_md_or_a_date():
    found = violations()
    assert not found, ("comments and docstrings say why, without where or when it was measured "
                       "(numbers go to benchmarks/RESULTS.md):\n" + "\n".join(found))


def test_every_allowed_symbol_exists():
    """An allow-list entry whose table was renamed or moved would silently allow nothing."""
    for rel, symbol in ALLOWED:
        tree = ast.parse((ROOT / rel).read_text())
        assert symbol in {name for node in tree.body for name in _names(node)}, (rel, symbol)


@pytest.mark.parametrize("text", ["# on the H100 it ran faster", "# see benchmarks/RESULTS.md",
                                  "# measured 2026-12-06", '"""An RTX 4090 fits it."""'])
def test_the_scan_finds_each_kind_of_violation(tmp_path, text):
    """The scan is not vacuous: a module with one such comment or docstring line is reported."""
    package = tmp_path / "colo_rl"
    package.mkdir()
    (package / "mod.py").write_text(f"{text}\nx = 1\n")
    assert len(violations(package)) == 1


def test_the_allowed_data_tables_may_name_devices_and_dates_elsewhere_not(tmp_path):
    table = "# from the data sheets, 2026-12-06\nPEAK_BF16_TFLOPS = [\n    ('H100', 989.0),  # H100 SXM\n]\n"
    package = tmp_path / "colo_rl"
    (package / "trainer").mkdir(parents=True)
    (package / "trainer" / "flops.py").write_text(table)
    (package / "other.py").write_text(table)
    assert [v.split(":")[0] for v in violations(package)] == ["colo_rl/other.py"] * 2
