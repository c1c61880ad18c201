"""The embedded demo (`make demo`: `python -m colo_rl.run logger.mode=offline`, 30 steps) against
its metrics at commit b259d2e on CPU (tests/fixtures/demo_b259d2e.json): a refactor of the loop
must leave every step's reward and the metric keys of every record exactly as they were."""

from __future__ import annotations

import json
from pathlib import Path

from colo_rl.run import train

from .conftest import compose_config

FIXTURE = Path(__file__).parent / "fixtures" / "demo_b259d2e.json"


def test_the_demo_reproduces_b259d2e_bit_for_bit(tmp_path):
    """With its own engine, as `make demo` runs: the first record's keys depend on the engine's
    history (a restart of the shared one adds its start-up time)."""
    expected = json.loads(FIXTURE.read_text())
    result = train(compose_config(f"output_dir={tmp_path}", "logger.mode=offline", "logger.progress=false"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in records if "reward/mean" in r] == expected["reward_mean"]
    assert [sorted(r) for r in records] == expected["record_keys"]
    assert sorted(set().union(*records)) == expected["keys"]
    assert result.records == records
