"""The config reference (docs/config.md) is generated from the schema: every key has its one
description, where it is declared, and the page is what `python -m colo_rl.docs` writes now."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from colo_rl.config import RunConfig, described
from colo_rl.config_moves import OLD_KEYS
from colo_rl.docs import config_reference, sections, undescribed
from .test_comments import FORBIDDEN

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config.md"


def test_every_config_key_has_a_description():
    assert undescribed() == [], "describe these keys in colo_rl/config.py: described(default, help=...)"


def test_a_key_without_a_description_is_reported():
    @dataclasses.dataclass
    class Inner:
        told: int = described(1, "what it does")
        untold: int = 2

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        blank: str = described("x", " ")

    assert undescribed(Outer) == ["inner.untold", "blank"]


def test_no_description_names_a_gpu_results_md_or_a_date():
    found = [(key.path, what) for _, _, keys in sections() for key in keys
             for what, pattern in FORBIDDEN.items() if pattern.search(key.help)]
    assert found == []


def test_the_reference_has_one_row_per_key_and_the_old_to_new_table():
    page = config_reference()
    keys_part, _, moved_part = page.partition("## Old -> new key names")
    leaves = [key.path for _, _, keys in sections(RunConfig) for key in keys]
    rows = [line.split("`")[1] for line in keys_part.splitlines() if line.startswith("| `")]
    assert rows == leaves and len(leaves) == len(set(leaves)) > 100
    assert "| `trainer.lora.rank` | int | `0` |" in page
    # the default a run gets, not the schema's (conf/generator/default.yaml sets auto)
    assert "| `generator.gpu_memory_utilization` | float or auto | `auto` |" in page
    assert page.index("## Old -> new key names") > page.index("## Run-wide keys")
    # the old -> new table: one row per moved key, in OLD_KEYS' order, each new key a key above
    # and no old key one any more
    table = moved_part[moved_part.index("| old key | new key |\n|---|---|\n"):]
    moved = [tuple(cell.strip("` ") for cell in line.strip("|").split("|"))
             for line in table.splitlines()[2:] if line.startswith("| `")]
    assert moved == list(OLD_KEYS.items()) and len(moved) >= 40
    assert all(new in leaves and old not in leaves for old, new in moved)
    assert page.rstrip().endswith(f"| `{moved[-1][0]}` | `{moved[-1][1]}` |")


def test_docs_config_md_is_what_the_generator_writes_now():
    out = subprocess.run([sys.executable, "-m", "colo_rl.docs"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out == config_reference()
    assert PAGE.read_text() == out, ("docs/config.md is out of date: run "
                                     "`python -m colo_rl.docs > docs/config.md` and commit it")


def test_the_readme_is_short_and_its_links_to_this_repository_resolve():
    """A newcomer's page: at most 250 lines; the rest lives in docs/ and benchmarks/, linked."""
    import re

    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target
