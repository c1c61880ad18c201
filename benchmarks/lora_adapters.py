"""vLLM's own LoRA adapters against colo_rl's merged pushes (issue #25): what each costs a step.

    python benchmarks/lora_adapters.py --out $OUT/lora_adapters.json                  # H200, 1B shape: ~3 min
    python benchmarks/lora_adapters.py --model olmo2_7b_shape --out $OUT/lora_7b.json
    python benchmarks/lora_adapters.py --smoke --out /tmp/lora.json                   # CPU: the smoke workload

colo_rl pushes a LoRA policy as merged weights: each adapted weight is base + B @ A, computed on the
GPU into an engine-dtype copy and loaded like a full push (`timing/weight_load_s` of a LoRA run);
the engine then generates at its plain speed. The alternative is vLLM's `enable_lora`: each step
the trainer writes the adapter (PEFT format, a few MB) and the engine loads it as a new
LoRARequest, then generates through its LoRA kernels on every adapted layer. This script measures
the second on one engine (`enable_lora=True`, seeded random base weights): per round it writes a new
adapter (seeded random A and B, rank --rank on every decoder linear), generates with it (its first
use: vLLM loads it), generates with it again (loaded), and generates with no adapter (the base: the
speed merged weights get). The prompts and sampling are the peer workload's (benchmarks/workload.py:
distinct prompts of random token ids, EOS ignored, unseeded). It reports the medians over
rounds after the first, as JSON; compare `adapter_step_s` (write + first generate) with a merged
push's `timing/weight_load_s` + `base_generate_s`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file of every number")
    p.add_argument("--model", default=None, help="model preset (conf/model; default: the workload's)")
    p.add_argument("--smoke", action="store_true", help="the workload's CPU form (benchmarks/workload.py)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, help="default: the workload's")
    p.add_argument("--n", type=int, help="default: the workload's")
    p.add_argument("--prompt-len", type=int, help="default: the workload's")
    p.add_argument("--max-tokens", type=int, help="default: the workload's")
    p.add_argument("--gpu-memory-utilization", type=float, help="default: the workload's")
    args = p.parse_args(argv)
    from workload import workload

    w = workload(args.smoke, args.model)
    for key, value in (("model", w.model), ("prompts", w.prompts), ("n", w.n), ("prompt_len", w.prompt_len),
                       ("max_tokens", w.max_tokens), ("gpu_memory_utilization", w.gpu_memory_utilization)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def adapter_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(in, out) features of every decoder linear LoRA adapts, by module name (meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS}


def write_adapter(directory: Path, model_dir: Path, shapes: dict, rank: int, seed: int) -> float:
    """A PEFT adapter directory with seeded random A and B (B non-zero, so the adapter changes
    the output); returns the seconds it took, what a trainer would pay each step."""
    import peft
    import torch
    from safetensors.torch import save_file

    start = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).bfloat16()
        tensors[f"base_model.model.{name}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).bfloat16()
    directory.mkdir(parents=True, exist_ok=True)
    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LINEARS), task_type="CAUSAL_LM",
                    base_model_name_or_path=str(model_dir)).save_pretrained(str(directory))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from peer_trl import build_model, model_config

    cuda = torch.cuda.is_available()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="colo_rl_lora_adapters_"))  # the model files and adapters
    cfg = model_config(args.model)
    # seeded random weights, saved (vLLM's dummy weights give every token the same logit, so no
    # adapter could change an output: the check below needs real ones)
    model_dir = build_model(args.model, work / "model", cfg.dtype)
    shapes = adapter_shapes(model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.embedded.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]

    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=cfg.dtype,
              max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=256, seed=0,
              enforce_eager=not cuda, enable_lora=True, max_lora_rank=args.rank, max_loras=1, max_cpu_loras=2,
              # on the CPU vLLM reserves this fraction of the host's memory (its default, 0.92, fails
              # beside any other process): the workload's fraction there too
              gpu_memory_utilization=args.gpu_memory_utilization)
    start_s = time.perf_counter() - start
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def generate(lora=None) -> tuple[float, int]:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.generate(token_prompts, params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.token_ids) for r in outputs for o in r.outputs)

    generate()  # warm-up (the sampler's kernels)
    # that vLLM applies the adapter at all: greedy tokens with and without it differ
    check = work / "adapter_check"
    write_adapter(check, model_dir, shapes, args.rank, seed=1000)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base_tokens = [o.outputs[0].token_ids for o in llm.generate(token_prompts[:4], greedy, use_tqdm=False)]
    adapted = [o.outputs[0].token_ids for o in llm.generate(token_prompts[:4], greedy, use_tqdm=False,
                                                             lora_request=LoRARequest("check", 10_000, str(check)))]
    applied = base_tokens != adapted
    print(f"[lora_adapters] the adapter changes greedy tokens: {applied}", flush=True)
    rounds = []
    for i in range(args.rounds):
        directory = work / f"adapter_{i}"
        write_s = write_adapter(directory, model_dir, shapes, args.rank, seed=i)
        request = LoRARequest(f"step{i}", i + 1, str(directory))
        first_s, tokens = generate(request)
        again_s, _ = generate(request)
        base_s, base_tokens = generate()
        rounds.append({"write_s": write_s, "first_generate_s": first_s, "loaded_generate_s": again_s,
                       "base_generate_s": base_s, "tokens": tokens, "base_tokens": base_tokens})
        print(f"[lora_adapters] round {i}: write {write_s:.3f} s, generate with the new adapter {first_s:.2f} s, "
              f"again {again_s:.2f} s, base {base_s:.2f} s ({tokens} tokens)", flush=True)
    steady = rounds[1:] or rounds
    med = {k: median(r[k] for r in steady) for k in ("write_s", "first_generate_s", "loaded_generate_s",
                                                      "base_generate_s")}
    tokens = steady[0]["tokens"]
    result = {"vllm_version": vllm.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "args": {k: str(v) for k, v in vars(args).items()},
              "adapted_linears": len(shapes), "adapter_changes_greedy_tokens": applied,
              "adapter_parameters": sum(args.rank * (a + b) for a, b in shapes.values()),
              "engine_start_s": start_s, "rounds": rounds, "median_rounds_2_on": med,
              "adapter_step_s": med["write_s"] + med["first_generate_s"],
              "lora_tokens_per_s": tokens / med["loaded_generate_s"],
              "base_tokens_per_s": tokens / med["base_generate_s"],
              "lora_speed_vs_base": med["base_generate_s"] / med["loaded_generate_s"],
              "adapter_load_s": med["first_generate_s"] - med["loaded_generate_s"]}
    args.out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(f"[lora_adapters] {len(shapes)} adapted linears, rank {args.rank}: write {med['write_s']:.3f} s, "
          f"load ~{result['adapter_load_s']:.3f} s, generate {result['lora_tokens_per_s']:.0f} tok/s with the "
          f"adapter vs {result['base_tokens_per_s']:.0f} without ({result['lora_speed_vs_base']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
