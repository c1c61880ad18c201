"""Peak memory and time of one GRPO forward+backward with the full-vocabulary logits
(trainer.perf.logprob_chunk=0) against the chunked output head (trainer.perf.logprob_chunk=N).

    python benchmarks/logprob_memory.py --out $OUT/logprob_memory.json                 # CPU, ~1 min
    python benchmarks/logprob_memory.py --device cuda --vocab 100352 --hidden 2048 --layers 16 \\
        --heads 16 --batch 16 --prompt 128 --completion 256 --out $OUT/logprob_memory_1b.json   # GPU

Each arm runs in its own subprocess (a fresh allocator) on a randomly initialised OLMo-2 of the
given shape: the trainer's `_update` over one micro-batch of `batch` sequences of prompt +
completion tokens, SGD at lr 0 (no optimizer state, so the number is the log-prob forward and
backward). Memory: on CUDA torch.cuda.max_memory_allocated over the step (bf16 weights under
`--precision mixed` = fp32 masters with bf16 autocast, as colo_rl trains); on a CPU the process's
peak resident set (getrusage ru_maxrss) minus its resident set just before the first step, which
includes the allocator's slack, so it is an upper bound of what the step held. Time: the median of
`--repeats` steps after the first.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file of every number")
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--chunks", default="0,1024,256", help="comma-separated trainer.perf.logprob_chunk values")
    p.add_argument("--precision", default="mixed", choices=["mixed", "fp32"],
                   help="mixed: fp32 weights, bf16 autocast (CUDA only); fp32: no autocast")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # the child's chunk
    return p.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_arm(args) -> dict:
    import torch
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from colo_rl.config import PerfConfig, TrainerConfig
    from colo_rl.trainer import GRPOTrainer

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = Olmo2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.prompt + args.completion,
                         tie_word_embeddings=False)
    model = Olmo2ForCausalLM(config).to(device)
    autocast = torch.bfloat16 if args.precision == "mixed" and device.type == "cuda" else None
    trainer = GRPOTrainer(model, TrainerConfig(perf=PerfConfig(logprob_chunk=args.arm), micro_batch_size=args.batch),
                          pad_token_id=0, temperature=1.0, max_tokens=args.completion, device=args.device,
                          autocast_dtype=autocast)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=g).tolist()
    completions = torch.randint(1, args.vocab, (args.batch, args.completion), generator=g).tolist()
    micro = trainer._micro_batches(prompts, completions, torch.linspace(-0.5, 1, args.batch), None)
    normalizer = float(args.batch * args.completion)

    def step():
        stats, _ = trainer._update(micro, None, [None], normalizer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return stats

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    start = time.perf_counter()
    stats = step()
    first_s = time.perf_counter() - start
    if device.type == "cuda":
        peak, how = torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated - before"
    else:
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, "ru_maxrss - rss before"
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"logprob_chunk": args.arm, "peak_step_mib": peak / 2**20, "memory_measure": how,
            "first_step_s": first_s, "median_step_s": statistics.median(times), "step_s": times,
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "device": args.device,
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return
    shape = {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "heads", "batch", "prompt",
                                           "completion", "precision", "device", "repeats")}
    full_logits_mib = args.batch * (args.prompt + args.completion) * args.vocab * 4 / 2**20
    arms = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--arm", str(chunk)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"logprob_chunk={chunk} failed:\n{proc.stderr[-3000:]}")
        arms.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        a = arms[-1]
        print(f"logprob_chunk={chunk:>5}: peak {a['peak_step_mib']:8.1f} MiB, step {a['median_step_s']:.3f} s "
              f"(median of {args.repeats}), loss {a['loss']:.6f}, grad_norm {a['grad_norm']:.6f}", flush=True)
    result = {"shape": shape, "fp32_full_logits_mib": full_logits_mib, "arms": arms}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
