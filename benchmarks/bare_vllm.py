"""A bare vllm.LLM.generate of fixed token-id prompts: the yardstick for colo_rl's generator.

    python benchmarks/bare_vllm.py --json-in request.json --json-out result.json
    python benchmarks/bare_vllm.py --json-in request.json --serve     # for generate_ab.py

benchmarks/colocation.py runs it in a subprocess (the trainer's process never imports vllm) with
the same model directory, prompts and sampling as its colocated steps. request.json:
    {"engine_kwargs": {vllm.LLM keyword arguments}, "prompts": [[token ids], ...],
     "sampling": {vllm.SamplingParams keyword arguments}, "repeats": 3,
     "variants": {NAME: {SamplingParams keyword arguments over "sampling"}, ...}}   (optional;
     a variant's "seed" may be a list: one per prompt)
It times the engine start, one warm-up generate, then `repeats` generates, and writes the raw
seconds and token counts plus their median tokens/s to result.json; then the same for each
variant (e.g. with and without sampled-token log-probs), on the same engine, under "variants".
With --serve it starts the engine, runs the warm-up generate, prints `READY`, then times one
generate per `generate` line on stdin and answers each with a `RESULT {json}` line, until `quit`
or end of input. The prefix cache is reset before every generate, as colo_rl does after each
weight push: otherwise a repeat of the same prompts skips their prefill, which no RL step can.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-in", required=True, type=Path, help="the request (see above)")
    p.add_argument("--json-out", type=Path, help="where the timings go")
    p.add_argument("--serve", action="store_true", help="time one generate per stdin line (see above)")
    return p.parse_args(argv)


def timed_generate(llm, prompts, params) -> tuple[float, int]:
    """(seconds, generated tokens) of one generate call; it returns once every request is done."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for request in outputs for o in request.outputs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.serve and args.json_out is None:
        raise SystemExit("bare_vllm.py: give --json-out FILE, or --serve")
    request = json.loads(args.json_in.read_text())
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**request["engine_kwargs"])
    start_s = time.perf_counter() - start
    print(f"[bare_vllm] engine up in {start_s:.1f} s", flush=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    params = SamplingParams(**request["sampling"])
    warmup_s, _ = timed_generate(llm, prompts, params)
    if args.serve:
        print(f"READY {json.dumps({'vllm_version': vllm.__version__, 'start_s': start_s})}", flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            seconds, tokens = timed_generate(llm, prompts, params)
            print(f"RESULT {json.dumps({'generate_s': seconds, 'tokens': tokens})}", flush=True)
        return 0
    def timings(params) -> dict:
        runs = [timed_generate(llm, prompts, params) for _ in range(request.get("repeats", 3))]
        seconds, tokens = [s for s, _ in runs], [t for _, t in runs]
        return {"generate_s": seconds, "tokens": tokens, "generate_median_s": median(seconds),
                "tokens_per_s": median(t / s for s, t in runs),
                "completion_tokens_mean": median(tokens) / (len(prompts) * request["sampling"].get("n", 1))}

    result = {"vllm_version": vllm.__version__, "engine_kwargs": request["engine_kwargs"],
              "start_s": start_s, "warmup_generate_s": warmup_s, **timings(params), "variants": {}}
    print(f"[bare_vllm] generate median {result['generate_median_s']:.2f} s, "
          f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
    for name, overrides in request.get("variants", {}).items():
        merged = {**request["sampling"], **overrides}
        # a list of seeds: one per prompt, as colo_rl sends them (vLLM seeds each request's sampler)
        variant = ([SamplingParams(**{**merged, "seed": seed}) for seed in merged["seed"]]
                   if isinstance(merged.get("seed"), list) else SamplingParams(**merged))
        timed_generate(llm, prompts, variant)  # its own warm-up: another sampler path may compile
        result["variants"][name] = {"sampling": overrides, **timings(variant)}
        print(f"[bare_vllm] {name}: generate median {result['variants'][name]['generate_median_s']:.2f} s, "
              f"{result['variants'][name]['tokens_per_s']:.0f} tokens/s", flush=True)
    args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
