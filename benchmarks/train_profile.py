"""Where a GRPO train step's time goes (issue #24: MFU 23-26 % on the peer workload, target 55 %).

Builds the trainer exactly as a run does (`load_trainer_policy`, `GRPOTrainer`, the composed
config: precision, optimizer, micro-batch, log-prob chunking) on synthetic rollouts of the peer
workload's shape (benchmarks/workload.py; rewards drawn at random so every advantage is non-zero),
with no engine. Times `--steps` steps after a
warm-up, then profiles one with torch.profiler and prints its CUDA time by kernel class (matmul,
attention, the optimizer, casts and copies, other elementwise), the top kernels, and MFU by
colo_rl's own count (`perf/mfu`). Every number goes to --out as JSON.

    python benchmarks/train_profile.py --out $OUT/train_profile.json                      # GPU: 1B shape
    python benchmarks/train_profile.py --out $OUT/p.json -- trainer.perf.logprob_chunk=0       # any overrides
    python benchmarks/train_profile.py --smoke --out /tmp/p.json                          # CPU: tiny model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CLASSES = (  # the first pattern a kernel's name contains decides its class
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "addmm", "::mm", "bmm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cast/copy", ("copy", "cast", "convert", "to_copy")),
    ("reduction", ("reduce", "norm", "softmax", "logsumexp", "cross_entropy")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, patterns in CLASSES:
        if any(p in lowered for p in patterns):
            return label
    return "other elementwise"


def synthetic_batch(prompts: int, n: int, prompt_len: int, completion_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompt_ids = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    completion_ids = [[rng.randrange(3, vocab) for _ in range(completion_len)] for _ in range(prompts * n)]
    rewards = [rng.random() for _ in range(prompts * n)]
    return prompt_ids, completion_ids, rewards


def trace_ops(prof, names: list[str], cuda: bool) -> list[dict]:
    """Device time of the ops named, summed by who called them: the chain of enclosing operators
    (autograd nodes name the backward of what the forward did) and the innermost Python frames
    (none in backward, which runs on autograd's thread)."""
    rows: dict[tuple, list] = {}
    for event in prof.events():
        if event.name not in names or (cuda and event.device_type.name == "CUDA"):
            continue
        callers, parent = [], event.cpu_parent
        while parent is not None and len(callers) < 4:
            callers.append(f"{parent.name}{list(parent.input_shapes)[:2] if parent.input_shapes else ''}"[:120])
            parent = parent.cpu_parent
        stack = [frame for frame in (event.stack or []) if "torch/" not in frame][:4]
        key = (event.name, str(event.input_shapes)[:160], tuple(callers), tuple(stack))
        seconds = (event.device_time_total if cuda else event.cpu_time_total) / 1e6
        entry = rows.setdefault(key, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])
    return [{"s": s, "calls": c, "op": op, "shapes": shapes, "callers": list(callers), "stack": list(stack)}
            for (op, shapes, callers, stack), (s, c) in ordered[:40]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="model preset (default: the workload's)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--smoke", action="store_true", help="CPU: the workload's smoke form (benchmarks/workload.py)")
    p.add_argument("--per-micro-batch-casts", action="store_true",
                   help="autocast casts the weights in every micro-batch (no compute copies): the A/B")
    p.add_argument("--trace-ops", default="",
                   help="comma-separated aten ops (e.g. aten::cat,aten::fill_): their device time by the "
                        "chain of operators and autograd nodes that called them, and the Python stack")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = p.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir

    from colo_rl.config import register_configs, resolve_device, trainer_precision, validate
    from colo_rl.lora import load_trainer_policy
    from colo_rl.models import DTYPES, prepare_model_dir
    from colo_rl.trainer import GRPOTrainer
    from colo_rl.trainer.flops import peak_tflops, perf_metrics
    from colo_rl.trainer.logprobs import _target_logprobs_eager

    from workload import workload

    w = workload(args.smoke, args.model)
    prompts, n, prompt_len, completion_len, model = w.prompts, w.n, w.prompt_len, w.max_tokens, w.model
    register_configs()
    work = Path(tempfile.mkdtemp(prefix="colo_rl_train_profile_"))
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        settings = validate(compose("run", overrides=[*w.overrides(), f"output_dir={work}", *args.overrides]))
    device = resolve_device(settings.trainer.device)
    model_dir = prepare_model_dir(settings.model, work)
    torch.manual_seed(settings.trainer.seed)
    policy = load_trainer_policy(settings, model_dir, device)
    mixed = trainer_precision(settings) == "mixed"
    trainer = GRPOTrainer(policy, settings.trainer, pad_token_id=0, temperature=settings.sampling.temperature,
                          max_tokens=completion_len, device=device,
                          autocast_dtype=DTYPES[settings.model.dtype] if mixed else None)
    if args.per_micro_batch_casts:
        trainer.copies = None
    vocab = policy.config.vocab_size
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(seed: int) -> float:
        batch = synthetic_batch(prompts, n, prompt_len, completion_len, vocab, seed)
        sync()
        start = time.perf_counter()
        trainer.train_step(*batch, group_size=n)
        sync()
        return time.perf_counter() - start

    warmup_s = step(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [step(1 + i) for i in range(args.steps)]
    median = sorted(times)[len(times) // 2]
    peak = peak_tflops(settings.trainer.perf.peak_tflops, torch.device(device))
    result = {"model": model, "overrides": args.overrides, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "precision": trainer_precision(settings), "kernels": trainer.kernels,
              "compile": settings.trainer.perf.compile, "weight_copies": trainer.copies,
              "logprob_kernel": "compiled" if trainer.target_logprobs is not _target_logprobs_eager else "eager",
              "fused_head": trainer.head_ops is not None, "micro_batch_size": settings.trainer.micro_batch_size,
              "warmup_step_s": warmup_s, "step_s": times, "median_step_s": median,
              "model_tflop_per_step": trainer.last_step_flops / 1e12,
              **perf_metrics(trainer.last_step_flops, median, peak)}
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    traced = [op for op in args.trace_ops.split(",") if op]
    with profile(activities=activities, record_shapes=True, with_stack=bool(traced)) as prof:
        step(100)
    if traced:
        result["traced_ops"] = trace_ops(prof, traced, cuda)
        for row in result["traced_ops"][:16]:
            print(f"[train_profile] traced {row['s']:7.3f} s x{row['calls']:<5d} {row['op']} <- "
                  f"{' <- '.join(row['callers'])} | {' < '.join(row['stack'][:3])}", flush=True)
    by_class: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if device_us <= 0 or (cuda and event.device_type.name != "CUDA"):
            continue
        by_class[kernel_class(event.key)] += device_us / 1e6
        kernels.append((device_us / 1e6, event.count, event.key))
    kernels.sort(reverse=True)
    total = sum(by_class.values())
    result["profiled_device_s"] = total
    result["device_s_by_class"] = dict(sorted(by_class.items(), key=lambda kv: -kv[1]))
    result["top_kernels"] = [{"s": s, "calls": c, "name": name[:160]} for s, c, name in kernels[:30]]
    # The same device time by the operator that launched it, with its input shapes: which aten op
    # (a cast of what, an add of what) each kernel class comes from.
    ops = []
    for event in prof.key_averages(group_by_input_shape=True):
        if cuda and event.device_type.name == "CUDA":
            continue  # the kernels themselves, counted above
        device_us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if device_us > 0:
            ops.append((device_us / 1e6, event.count, event.key, str(event.input_shapes)[:200]))
    ops.sort(reverse=True)
    result["top_ops"] = [{"s": s, "calls": c, "op": op, "shapes": shapes} for s, c, op, shapes in ops[:60]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))

    print(f"[train_profile] {result['device']}, {model}, precision {result['precision']}, kernels "
          f"{result['kernels']}{', compiled' if result['compile'] else ''}: step "
          f"{median:.2f} s (warm-up {warmup_s:.2f} s), {result['model_tflop_per_step']:.0f} TFLOP a step"
          + (f", MFU {result['perf/mfu'] * 100:.1f} %" if "perf/mfu" in result else ""), flush=True)
    print(f"[train_profile] profiled step: {total:.2f} s of {'GPU' if cuda else 'CPU'} time", flush=True)
    for label, seconds in result["device_s_by_class"].items():
        print(f"[train_profile]   {label:18s} {seconds:7.3f} s  {seconds / total * 100:5.1f} %", flush=True)
    for k in result["top_kernels"][:12]:
        print(f"[train_profile]   {k['s']:7.3f} s  x{k['calls']:<5d} {k['name'][:100]}", flush=True)
    print("[train_profile] by operator and input shapes:", flush=True)
    for o in result["top_ops"][:20]:
        print(f"[train_profile]   {o['s']:7.3f} s  x{o['calls']:<5d} {o['op'][:40]:40s} {o['shapes'][:90]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
