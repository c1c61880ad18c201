"""The engine worker's reading of vLLM's per-token log-probs, in both layouts vLLM returns."""

from __future__ import annotations

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from colo_rl.generator.worker import sampled_logprobs

SAMPLED = [7, 3, 9]
# each position: the sampled token first, then the top-2 (which may include it again)
POSITIONS = [{7: Logprob(-1.5, rank=4), 1: Logprob(-0.2, rank=1), 2: Logprob(-0.9, rank=2)},
             {3: Logprob(-0.1, rank=1), 5: Logprob(-2.5, rank=2)},
             {9: Logprob(-3.0, rank=9), 4: Logprob(-0.3, rank=1), 6: Logprob(-1.0, rank=2)}]


def test_flat_logprobs_give_each_sampled_tokens_logprob():
    flat = FlatLogprobs()
    flat.extend(POSITIONS)
    assert sampled_logprobs(SAMPLED, flat) == [-1.5, -0.1, -3.0]


def test_list_of_dicts_gives_the_same():
    assert sampled_logprobs(SAMPLED, POSITIONS) == [-1.5, -0.1, -3.0]


def test_flat_logprobs_that_do_not_start_with_the_sampled_token_are_refused():
    flat = FlatLogprobs()
    flat.extend([{1: Logprob(-0.2)}, {3: Logprob(-0.1)}, {9: Logprob(-3.0)}])
    with pytest.raises(RuntimeError, match="sampled token"):
        sampled_logprobs(SAMPLED, flat)
