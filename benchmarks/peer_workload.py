"""A real `python -m colo_rl.run` on the workload TRL 1.16's GRPOTrainer was measured on (issue #10).

    python benchmarks/peer_workload.py --out $OUT/peer_workload.json            # H200: ~4 min an arm
    python benchmarks/peer_workload.py --arm 'mixed=' --arm 'offload_none=trainer.memory.offload=none'
    python benchmarks/peer_workload.py --leave-gib 24 --arm 'lora_24gib=trainer.lora.rank=16 ...'   # README of benchmarks/

The workload is benchmarks/workload.py's (`--smoke`: its CPU form). Each arm is one run in its own
process (its own engine), with the arm's Hydra overrides on top. Per arm it reports the medians of
steps 2.. (the first step pays for the pinned buffers), the peak GPU memory of the whole device
(nvidia-smi every 100 ms, engine and trainer together, as TRL's figure was taken), and the fraction of the policy's weights that the
run changed: the final checkpoint against the seeded initial weights (under LoRA: the merged
weights the engine gets, in model.dtype). `--leave-gib N` runs every arm beside a second process
that holds all but N GiB of the GPU (benchmarks/hold_memory.py: an emulated N GiB card); the
device's memory before the arm's process started is then `baseline_gpu_used_gib`, and
`peak_gpu_used_gib - baseline_gpu_used_gib` is what the run itself took. Every number is in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from contextlib import nullcontext
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing colo_rl

from hold_memory import holding  # noqa: E402  (benchmarks/ is this script's own directory)
from workload import workload  # noqa: E402
KEYS = ["timing/step_s", "timing/generate_s", "timing/train_s", "timing/generator_total_s", "timing/offload_s",
        "timing/weight_load_s", "timing/wake_s", "timing/sleep_s", "timing/restore_s", "timing/score_s",
        "rollout/tokens_per_s", "memory/trainer_peak_gib", "sync/cast_gib", "train/loss", "train/grad_norm",
        "perf/train_tflops", "perf/mfu", "train/engine_logprob_gap"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file of every number")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the runs' directories go (checkpoints: 18 GB for the 1B shape); default beside --out")
    p.add_argument("--arm", action="append", default=[],
                   help="NAME=OVERRIDES (space-separated Hydra overrides on top of the workload); "
                        "default: one arm 'mixed' with colo_rl's defaults")
    p.add_argument("--model", default=None, help="model preset (default: the workload's)")
    p.add_argument("--smoke", action="store_true", help="the workload's CPU form (benchmarks/workload.py)")
    p.add_argument("--timeout-s", type=float, default=560, help="per arm")
    p.add_argument("--no-weights", action="store_true", help="skip the changed-weights fraction")
    p.add_argument("--leave-gib", type=float, default=None,
                   help="hold all but this much GPU memory in a second process during each arm")
    return p.parse_args(argv)


def run_arm(name: str, base: list[str], overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    """One run in its own process, with nvidia-smi sampling the device's memory meanwhile."""
    smi_log = run_dir.with_suffix(".smi.csv")
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(smi_log, "w") as smi_out:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=smi_out, stderr=subprocess.DEVNULL) if has_smi() else None
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "colo_rl.run", *base, *overrides, f"output_dir={run_dir}"]
    metrics = run_dir / "metrics.jsonl"
    first_record_s = None  # command to the first step's record (its end), polled every 50 ms
    with open(run_dir.with_suffix(".log"), "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def stop(signum, frame):  # the run is in a session of its own: a SIGTERM here must reach it
            os.killpg(proc.pid, signal.SIGTERM)  # it checkpoints and stops its engine
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, stop)
        code = None
        while code is None:
            if first_record_s is None and metrics.exists() and metrics.stat().st_size > 0:
                first_record_s = time.perf_counter() - start
            if time.perf_counter() - start > timeout_s:
                os.killpg(proc.pid, signal.SIGTERM)  # the run's own group: it checkpoints and stops its engine
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                code = "timeout"
                break
            time.sleep(0.05)
            code = proc.poll()
        signal.signal(signal.SIGTERM, previous)
        log.seek(0)
        tail = log.read()[-3000:]
    wall_s = time.perf_counter() - start
    if smi is not None:
        smi.terminate()
        smi.wait()
    used = [int(line) for line in smi_log.read_text().split() if line.strip().isdigit()]
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steady = records[1:] or records
    med = {k: median(r[k] for r in steady if k in r) for k in KEYS if any(k in r for r in steady)}
    if "timing/generator_total_s" in med:
        med["switch_s"] = median(r["timing/generator_total_s"] - r["timing/generate_s"] for r in steady)
    from colo_rl.metrics import predicted_vs_measured

    # the start-up memory plan against the run (colo_rl.planner): [key, predicted GiB, measured GiB]
    planned = [list(row) for row in predicted_vs_measured(records)]
    return {"name": name, "overrides": overrides, "exit_code": code, "wall_s": wall_s, "planned_memory": planned,
            "engine_start_s": records[0].get("timing/server_start_s") if records else None,
            "command_to_first_record_s": first_record_s,
            # the first step's start, counted from the command: its record is written when it ends
            "command_to_first_step_s": first_record_s - records[0]["timing/step_s"]
            if first_record_s is not None and records and "timing/step_s" in records[0] else None,
            "setup_s": {k: v for k, v in records[0].items() if k.startswith("setup/")} if records else {},
            "peak_gpu_used_gib": max(used) / 1024 if used else None,
            "baseline_gpu_used_gib": used[0] / 1024 if used else None, "median_steps_2_on": med,
            "steps": records, "output_tail": tail if code != 0 else ""}


def has_smi() -> bool:
    from shutil import which

    return which("nvidia-smi") is not None


def changed_fraction(run_dir: Path, base: list[str], overrides: list[str]) -> dict:
    """The final checkpoint's policy against the seeded initial weights of the same model."""
    import torch

    from hydra import compose, initialize_config_dir

    from colo_rl.config import register_configs, resolve_device, trainer_dtype, validate
    from colo_rl.lora import hf_parameters, load_trainer_policy, merged_weight
    from colo_rl.trainer import GRPOTrainer, load_checkpoint

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = validate(compose("run", overrides=[*base, *overrides, f"output_dir={run_dir}"]))
    dtype = trainer_dtype(cfg)
    # the init on the device the run built it on (a GPU's seeded init differs from the CPU's)
    init_device = resolve_device(cfg.trainer.device)
    policy = load_trainer_policy(cfg, run_dir / "embedded_model", init_device).to("cpu")

    def weights() -> dict:  # the trainer's parameters; under LoRA the merged weights the engine gets
        return {name: merged_weight(p, layer, p.dtype) if layer is not None else p.detach().clone()
                for name, p, layer in hf_parameters(policy)}

    start = weights()
    load_checkpoint(run_dir / "checkpoint", GRPOTrainer(policy, cfg.trainer, pad_token_id=0, temperature=1.0,
                                                        max_tokens=8, device="cpu"))
    changed = total = 0
    norms_changed = norms_total = 0
    with torch.no_grad():
        for name, b in weights().items():
            a = start[name]
            diff = int((a != b).sum())
            changed, total = changed + diff, total + a.numel()
            if "norm" in name:
                norms_changed, norms_total = norms_changed + diff, norms_total + a.numel()
    return {"trainer_dtype": dtype, "changed_frac": changed / total,
            "norm_weights_changed_frac": norms_changed / max(norms_total, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = [a.partition("=") for a in args.arm] or [("mixed", "=", "")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    overrides = workload(args.smoke, args.model).overrides()
    results = {"workload": overrides, "arms": []}
    for name, _, arm_overrides in arms:
        run_dir = (args.work_dir or args.out.parent) / f"peer_{name}"
        with holding(args.leave_gib) if args.leave_gib else nullcontext() as held:
            arm = run_arm(name, overrides, arm_overrides.split(), run_dir, args.timeout_s)
        arm["held"] = held
        if not args.no_weights and (run_dir / "checkpoint").exists():
            arm["weights"] = changed_fraction(run_dir, overrides, arm_overrides.split())
        results["arms"].append(arm)
        args.out.write_text(json.dumps(results, indent=1))  # a cut call still leaves the arms done
        med = arm["median_steps_2_on"]
        print(f"{name}: exit {arm['exit_code']}, wall {arm['wall_s']:.0f} s, first step starts at "
              f"{arm['command_to_first_step_s']} s, engine start {arm['engine_start_s']}, "
              f"peak {arm['peak_gpu_used_gib']} GiB, weights {arm.get('weights')}", flush=True)
        for key, value in med.items():
            print(f"  {key:32s} {value:10.3f}", flush=True)
        for key, predicted, measured in arm["planned_memory"]:
            print(f"  {key:32s} predicted {predicted:.2f} GiB, measured {measured:.2f} GiB "
                  f"({measured / predicted - 1:+.1%})", flush=True)
        if arm["exit_code"] != 0:
            print(arm["output_tail"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
