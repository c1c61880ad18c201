"""Load: 200 short steps of the embedded default, each with a weight push, wake, generate and
sleep, must not leak host resources. The runner logs them every step (host/*); the bounds:

- open file descriptors and child processes of the trainer: exactly what they were at step 20;
- RSS of the trainer and of the engine worker: at most SOAK_RSS_BOUND_MIB above step 20
  (allocator noise; a leak of one staged weight file per step would be 200 x 1.4 MB = 270 MiB);
- every step generates exactly the tokens asked for (ignore_eos: prompts x n x max_tokens).
"""

from __future__ import annotations

import pytest

from colo_rl.run import train

from .conftest import compose_config, small_run_overrides

SOAK_STEPS = 200
WARMUP = 20
SOAK_RSS_BOUND_MIB = 64
PROMPTS, N, MAX_TOKENS = 2, 2, 4


@pytest.mark.slow
def test_200_steps_leak_no_descriptors_processes_or_memory(tmp_path, engine):
    result = train(compose_config(*small_run_overrides(
        tmp_path, "logger=none", f"trainer.steps={SOAK_STEPS}",
        f"trainer.prompts_per_step={PROMPTS}", f"sampling.n={N}",
        f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true")), engine)
    records = result.records
    assert [r["train/step"] for r in records] == list(range(SOAK_STEPS))
    assert all(r["rollout/tokens"] == PROMPTS * N * MAX_TOKENS for r in records)
    assert engine.pushes >= SOAK_STEPS
    warm, last = records[WARMUP], records[-1]
    print({k: (warm[k], last[k]) for k in warm if k.startswith("host/")})
    assert last["host/open_fds"] == warm["host/open_fds"]
    assert last["host/child_processes"] == warm["host/child_processes"]
    for key in ("host/trainer_rss_gib", "host/engine_rss_gib"):
        growth_mib = (last[key] - warm[key]) * 1024
        assert growth_mib < SOAK_RSS_BOUND_MIB, f"{key} grew {growth_mib:.0f} MiB in " \
                                                f"{SOAK_STEPS - WARMUP} steps"
