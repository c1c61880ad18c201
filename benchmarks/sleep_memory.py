"""What a sleeping engine keeps on the GPU, per CUDA-graph setting, and what the setting costs.

    python benchmarks/sleep_memory.py --out $OUT/sleep_memory.json        # ~100 s per variant on the H200

Issue #6 asks that free GPU memory while the engine sleeps be within 1 GiB of free memory before
it started. With CUDA graphs the 1B shape's engine kept 1.19 GiB asleep, eager 0.83 GiB: vLLM's
sleep releases the weights and the KV cache, not the CUDA-graph memory pool. For each variant
(`--variants`, vllm.LLM keyword arguments merged into generator.engine_kwargs) this starts colo_rl's
engine with the policy on the GPU (no optimizer, nothing offloaded), runs --steps generate steps
after the one that starts it, and records free memory before the start, after each step's sleep
(and, after the last step, again once the engine's torch cache has handed back its free blocks:
`empty_cache`, which colo_rl does not do by itself) and after the engine is closed, the engine
start time (graph capture included) and tokens/s.
The first variant's reading also holds what the trainer process took at its first push and kept
(0.09 GiB on the H200; not torch's cache, which every reading empties): `engine_process_gib`,
NVML's total for the engine process, is the engine's own share. On a machine without a GPU
(`--model tiny --variants '{"eager": {}}'`) it only checks that the script runs: memory is NaN there.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

import colocation  # benchmarks/ is on sys.path when this file runs
from colocation import free_gib, save

VARIANTS = {
    "default": {},  # colo_rl's GPU default: CUDA graphs up to 512 tokens, FULL_AND_PIECEWISE
    "capture_256": {"compilation_config": {"max_cudagraph_capture_size": 256}},
    "full_decode_only": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
}


log = functools.partial(colocation.log, name="sleep_memory")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="generate steps per variant after the first")
    p.add_argument("--variants", type=json.loads, default=VARIANTS, metavar="JSON",
                   help='{"name": {vllm.LLM kwargs}, ...}; {} for the defaults (default: %(default)s)')
    colocation.add_workload_arguments(p, gpu_memory_utilization=0.5)
    return p.parse_args(argv)


def measure(args, name: str, engine_kwargs: dict, policy, model_dir: Path, prompts, sampling,
            results: dict) -> dict:
    """One variant, kept in results["variants"][name] and saved after every step (a run cut off
    by a time limit keeps the steps it measured)."""
    from colo_rl.generator import VLLMGenerator
    from colo_rl.switch import Switch

    settings = argparse.Namespace(**{**vars(args), "engine_kwargs": {**args.engine_kwargs, **engine_kwargs}})
    import torch

    on_gpu = torch.cuda.is_available()
    cfg = colocation.generator_config(settings, weight_sync="cuda_ipc" if on_gpu else "file",
                                      enforce_eager=not on_gpu)
    result = {"engine_kwargs": cfg.engine_kwargs, "free_before_engine_start_gib": free_gib(), "steps": []}
    results["variants"][name] = result
    generator = VLLMGenerator(cfg, model_dir=model_dir, dtype="bfloat16",
                              log_dir=args.out.parent / f"{args.out.stem}_logs" / name)
    with generator:
        for step in range(args.steps + 1):
            rollouts = Switch(generator, policy).generate(prompts, sampling, seed=0)
            m = rollouts.metrics
            record = {"generate_s": m["timing/generate_s"], "tokens_per_s": m["rollout/tokens_per_s"],
                      "engine_generate_s": m.get("generator/engine_generate_s"),
                      "sleep_skipped": m["generator/sleep_skipped"], "free_asleep_gib": free_gib(),
                      "engine_memory": generator.process.request("memory", timeout=60)}
            if step == 0:
                result["first_step"] = record
                result["server_start_s"] = m.get("timing/server_start_s")
            else:
                result["steps"].append(record)
            save(args.out, results)
            log(f"{name} step {step}: {record['tokens_per_s']:.0f} tokens/s, "
                f"{result['free_before_engine_start_gib'] - record['free_asleep_gib']:.2f} GiB held asleep")
        try:  # last, so that a failure here costs none of the steps' readings
            report = generator.process.request("memory", timeout=60, empty_cache=True)
            result["empty_cache"] = {"engine_memory": report, "free_asleep_gib": free_gib()}
        except Exception as exc:
            result["empty_cache"] = {"error": repr(exc)}
        save(args.out, results)
    result["free_after_close_gib"] = free_gib()
    steps = result["steps"] or [result["first_step"]]
    result["held_asleep_gib"] = result["free_before_engine_start_gib"] - median(s["free_asleep_gib"] for s in steps)
    result["held_after_empty_cache_gib"] = (result["free_before_engine_start_gib"]
                                            - result["empty_cache"].get("free_asleep_gib", float("nan")))
    result["tokens_per_s"] = median(s["tokens_per_s"] for s in steps)
    result["engine_process_gib"] = median(s["engine_memory"].get("process_used_gib", float("nan")) for s in steps)
    after = result["empty_cache"].get("engine_memory", {}).get("after_empty_cache", {})
    result["engine_process_after_empty_cache_gib"] = after.get("process_used_gib", float("nan"))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from colo_rl.models import load_policy, write_embedded_model

    cfg = colocation.model_config(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prompts, sampling = colocation.workload(args, cfg.embedded.vocab_size)
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "variants": {}}
    with tempfile.TemporaryDirectory(prefix="colo_rl-sleep-") as tmp:
        model_dir = write_embedded_model(cfg, Path(tmp) / "model")
        policy = load_policy(cfg, model_dir, "cuda" if torch.cuda.is_available() else "cpu")
        for name, engine_kwargs in args.variants.items():
            log(f"{name}: {engine_kwargs}")
            measure(args, name, engine_kwargs, policy, model_dir, prompts, sampling, results)
            save(args.out, results)
    print(f"\n{'variant':20} {'held asleep':>12} {'after empty_cache':>18} {'engine process':>15} "
          f"{'engine start':>13} {'tokens/s':>10}")
    for name, r in results["variants"].items():
        print(f"{name:20} {r['held_asleep_gib']:>8.2f} GiB {r['held_after_empty_cache_gib']:>14.2f} GiB "
              f"{r['engine_process_gib']:>11.2f} GiB "
              f"{r.get('server_start_s', float('nan')):>11.1f} s {r['tokens_per_s']:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
