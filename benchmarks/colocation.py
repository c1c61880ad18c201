"""Where the time of a colocated RL step goes on one GPU, next to the limits and the naive ways.

    python benchmarks/colocation.py --out $OUT/colocation.json            # ~6 min on the H200

For the 1B OLMo-2 shape in bf16 with AdamW state (one real GRPO step first: ~8.9 GB on the GPU)
it measures, in this order:
  1. hardware limits: pinned host<->device and device<->device copy bandwidth;
  2. the naive-staging baseline: pageable .to("cpu"), torch.save to /dev/shm, three SHA-256
     passes, torch.load, .to("cuda");
  3. colo_rl's generator (one engine start): --steps steps with weight_sync=cuda_ipc, then
     --steps with weight_sync=file, each phase's median, the offloader's bandwidth and the GPU
     memory the sleeping engine keeps (these restore everything before the step goes on:
     trainer.memory.overlap_restore=false); then --overlap-pairs rounds of cuda_ipc steps followed by a
     GRPO train step, three arms each: the optimizer state restored inside the phase, in the
     background, and in the background with the restore before the engine's sleep
     (trainer.memory.restore_while_awake);
  4. a bare vllm.LLM.generate of the same prompts in a subprocess (benchmarks/bare_vllm.py; this
     process never imports vllm), so the generator's cost on generation is a ratio.
Prints a table at the end and writes every raw number to --out. Details: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing colo_rl

GIB = 2**30
GB = 1e9  # bandwidths in GB/s, as copy bandwidths are usually quoted


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="measured steps per weight-sync mode (median)")
    p.add_argument("--bandwidth-gib", type=int, default=4, help="size of the copy-bandwidth buffers")
    p.add_argument("--probe-steps", type=int, default=3,
                   help="cuda_ipc steps per restore probe (alloc_first, wait_first); 0 skips them")
    p.add_argument("--overlap-pairs", type=int, default=4,
                   help="pairs of steps + train, background restore off and on (ABBA order)")
    p.add_argument("--train-prompts", type=int, default=4,
                   help="prompts (each with its --n completions) in the overlap section's train steps")
    add_workload_arguments(p, gpu_memory_utilization=0.5)
    return p.parse_args(argv)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_workload_arguments(p: argparse.ArgumentParser, gpu_memory_utilization: float) -> None:
    """What both benchmarks generate, and with which engine settings (generate_ab.py shares them)."""
    p.add_argument("--out", required=True, type=Path, help="JSON file for every raw number")
    p.add_argument("--model", default="olmo2_1b_shape", help="a conf/model/NAME.yaml with source=embedded")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per completion")
    p.add_argument("--gpu-memory-utilization", type=float, default=gpu_memory_utilization,
                   help="the share of the GPU each engine may take while awake")
    p.add_argument("--in-process", choices=("auto", "true", "false"), default="auto",
                   help="generator.in_process: where vLLM's engine core runs (auto: colo_rl's default, "
                        "its own process on a GPU as in bare vLLM, inside the worker on CPU)")

    p.add_argument("--engine-kwargs", type=json_object, default={}, metavar="JSON",
                   help="more vllm.LLM keyword arguments for colo_rl's engine and bare vLLM alike "
                        "(generator.engine_kwargs), e.g. '{\"compilation_config\": "
                        "{\"max_cudagraph_capture_size\": 256}}'")


@contextmanager
def timed(into: dict, key: str):
    """Wall-clock seconds of the block into `into[key]`, with the GPU idle at both ends."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    torch.cuda.synchronize()
    into[key] = time.perf_counter() - start


def log(message: str, name: str = "colocation") -> None:
    """A timestamped progress line; the other benchmarks pass their own name."""
    print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- setup ----------------------------------------------------------------------------------

def model_config(name: str):
    from omegaconf import OmegaConf

    from colo_rl.config import ModelConfig

    path = ROOT / "conf" / "model" / f"{name}.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))
    if cfg.source != "embedded":
        raise SystemExit(f"--model {name}: model.source={cfg.source}; the benchmark builds random "
                         "weights and needs an embedded model (e.g. olmo2_1b_shape)")
    return cfg


def workload(args, vocab_size: int):
    """Fixed random token prompts and sampling with fixed lengths (ignore_eos): every step
    generates exactly prompts x n x max_tokens tokens."""
    from colo_rl.config import SamplingConfig

    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    return prompts, sampling


def generator_config(args, **overrides):
    """colo_rl's engine settings for the workload; bare_engine_kwargs() gives bare vLLM the same."""
    from colo_rl.config import GeneratorConfig

    return GeneratorConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                           max_model_len=args.prompt_len + args.max_tokens,
                           max_num_seqs=max(256, args.prompts * args.n),
                           in_process={"auto": None, "true": True, "false": False}[args.in_process],
                           engine_kwargs=args.engine_kwargs, **overrides)


def bare_engine_kwargs(args, model_dir: Path, dtype: str, enforce_eager: bool) -> dict:
    """vllm.LLM arguments for bare vLLM: the same model, memory share, sizes and extra kwargs."""
    cfg = generator_config(args)
    return dict(model=str(model_dir), tokenizer=str(model_dir), load_format="dummy", dtype=dtype,
                gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=enforce_eager,
                max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, seed=0, **cfg.engine_kwargs)


def stepped_trainer(cfg, model_dir: Path, max_tokens: int):
    """The policy on the GPU after one real GRPO step, so that AdamW state exists."""
    from colo_rl.config import TrainerConfig
    from colo_rl.models import load_policy
    from colo_rl.trainer import GRPOTrainer

    policy = load_policy(cfg, model_dir, "cuda")
    trainer = GRPOTrainer(policy, TrainerConfig(lr=1e-6), pad_token_id=0, temperature=1.0,
                          max_tokens=max_tokens, device="cuda")
    rng = random.Random(1)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, cfg.embedded.vocab_size) for _ in range(k)]

    trainer.train_step([tokens(16), tokens(16)], [tokens(16) for _ in range(4)], [1.0, 0.0, 0.0, 1.0], 2)
    return trainer


def trainer_tensors(trainer) -> dict:
    """Every tensor of the trainer's state that lives on the GPU: params, buffers, AdamW state."""
    tensors = {f"param:{n}": p.detach() for n, p in trainer.model.named_parameters()}
    tensors.update({f"buffer:{n}": b for n, b in trainer.model.named_buffers()})
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        tensors.update({f"state:{names[id(p)]}:{k}": v for k, v in state.items() if v.is_cuda})
    return tensors


def staging_dir(needed_bytes: int) -> str:
    """/dev/shm when it has room for the file (container defaults can be 64 MB), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * needed_bytes:
        return str(shm)
    log(f"/dev/shm lacks {2 * needed_bytes / GIB:.1f} GiB free: staging in {tempfile.gettempdir()}")
    return tempfile.gettempdir()


# -- 1. hardware limits ---------------------------------------------------------------------

def copy_seconds(dst, src, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` copies src -> dst, timed with CUDA events on the stream."""
    import torch

    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def hardware_limits(size_gib: int) -> dict:
    import torch

    nbytes = size_gib * GIB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    other = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_seconds(device, host, repeats=1)  # warm-up
    seconds = {"h2d_pinned": copy_seconds(device, host), "d2h_pinned": copy_seconds(host, device),
               "d2d": copy_seconds(other, device)}
    del host, device, other
    torch.cuda.empty_cache()
    result = {"buffer_bytes": nbytes, "seconds": seconds}
    result.update({f"{kind}_gbps": nbytes / median(s) / GB for kind, s in seconds.items()})
    return result


# -- 2. naive staging -----------------------------------------------------------------------

def naive_staging(trainer, directory: str) -> dict:
    """The straightforward hand-over, each step timed: what colo_rl's design replaces."""
    import torch

    from colo_rl.generator.staging import sha256_of

    times: dict = {}
    on_gpu = trainer_tensors(trainer)
    with timed(times, "offload_pageable_s"):
        on_cpu = {key: t.to("cpu") for key, t in on_gpu.items()}
    weights = {key.removeprefix("param:"): t for key, t in on_cpu.items() if key.startswith("param:")}
    path = Path(directory) / f"colo_rl-naive-{time.time_ns()}.pt"
    try:
        with timed(times, "torch_save_s"):
            torch.save(weights, path)
        for i in range(3):
            with timed(times, f"sha256_pass{i + 1}_s"):
                for t in weights.values():
                    sha256_of(t)
        with timed(times, "torch_load_s"):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    finally:
        path.unlink(missing_ok=True)
    with timed(times, "restore_pageable_s"):
        back = {key: t.to("cuda") for key, t in on_cpu.items()}
    times["sha256_3x_s"] = sum(times[f"sha256_pass{i + 1}_s"] for i in range(3))
    times["total_s"] = sum(times[k] for k in ("offload_pageable_s", "torch_save_s", "sha256_3x_s",
                                              "torch_load_s", "restore_pageable_s"))
    times["state_bytes"] = float(sum(t.nbytes for t in on_cpu.values()))
    times["weight_bytes"] = float(sum(t.nbytes for t in weights.values()))
    del on_cpu, weights, loaded, back
    torch.cuda.empty_cache()
    return times


# -- 3. colo_rl's generator -----------------------------------------------------------------

def recording_offloader(trainer):
    """colo_rl's Offloader, keeping the dicts its offload/restore return (the generator drops them)."""
    from colo_rl.trainer import Offloader

    class RecordingOffloader(Offloader):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls: list[tuple[str, dict]] = []
            self.probe: str | None = None  # see restore_probes()

        def offload(self, parts=("optimizer", "params")):
            result = super().offload(parts)
            self.calls.append(("offload", result))
            return result

        def restore(self):
            import torch

            probe = {}
            if self.probe == "alloc_first":  # one device block for everything, timed alone
                nbytes = sum(t.data.nbytes for part in self.offloaded for _, t, _ in self._moved[part])
                start = time.perf_counter()
                block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                torch.cuda.synchronize()
                probe["alloc_s"] = time.perf_counter() - start
                del block  # cached by torch's allocator: the restore below carves its tensors from it
            elif self.probe == "wait_first":
                time.sleep(1.0)
            result = {**super().restore(), **probe}
            self.calls.append(("restore", result))
            return result

    return RecordingOffloader(trainer.model, trainer.optimizer, "all")


def measured_step(generator, trainer, offloader, prompts, sampling):
    """One colocated step through the generator: its record, and its rollouts."""
    from colo_rl.switch import Switch

    offloader.calls.clear()
    rollouts = Switch(generator, trainer.model, offloader).generate(prompts, sampling, seed=0)
    return step_record(rollouts, offloader), rollouts


def step_record(rollouts, offloader) -> dict:
    """One step's generator metrics plus the offloader's own bytes and seconds."""
    record = dict(rollouts.metrics)
    record["ended_unix_s"] = time.time()  # to line steps up with a clock log (nvidia-smi -lms)
    for kind in ("offload", "restore"):
        calls = [r for k, r in offloader.calls if k == kind]
        record[f"offloader/{kind}_bytes"] = sum(r["bytes"] for r in calls)
        record[f"offloader/{kind}_s"] = sum(r["seconds"] for r in calls)
    record["offloader/restore_alloc_s"] = sum(r.get("alloc_s", 0.0) for k, r in offloader.calls if k == "restore")
    record["weight_sync_s"] = record.get("timing/stage_s", 0.0) + record["timing/weight_load_s"]
    record["switch_overhead_s"] = record["timing/generator_total_s"] - record["timing/generate_s"]
    record["completion_tokens_mean"] = record["rollout/mean_length"]
    return record


def free_gib() -> float:
    """Free GPU memory after emptying torch's cache (NaN without a GPU: CPU checks of the scripts)."""
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / GIB


def colocated(args, trainer, model_dir: Path, prompts, sampling, log_dir: Path) -> dict:
    """One engine; a warm-up step that starts it, then --steps steps per weight-sync mode."""
    from colo_rl.generator import VLLMGenerator
    from colo_rl.switch import Switch

    offloader = recording_offloader(trainer)
    offloader.overlap_restore = False  # every byte back inside the restore phase; see overlap_section()
    weight_bytes = sum(p.nbytes for p in trainer.model.parameters())
    cfg = generator_config(args, weight_sync="cuda_ipc", enforce_eager=False,
                           staging_dir=staging_dir(weight_bytes))
    result = {"generator_config": dataclasses.asdict(cfg),
              "free_before_engine_start_gib": free_gib()}
    generator = VLLMGenerator(cfg, model_dir=model_dir, dtype="bfloat16", log_dir=log_dir)
    result["engine_log"] = str(generator.log_path)
    with generator:
        log(f"starting the engine (log: {generator.log_path}) and a warm-up step")
        offloader.calls.clear()
        warmup = Switch(generator, trainer.model, offloader).generate(prompts, sampling, seed=0)
        result["warmup"] = step_record(warmup, offloader)
        result["engine_info"] = generator.engine_info
        log(f"engine up in {warmup.metrics['timing/server_start_s']:.1f} s")
        result["free_engine_asleep_gib"] = free_gib()  # trainer state back on the GPU, as before the start
        for mode in ("cuda_ipc", "file"):
            generator.weight_sync = mode  # chosen per step: one engine serves both modes
            steps = []
            for step in range(args.steps):
                steps.append(measured_step(generator, trainer, offloader, prompts, sampling)[0])
                # The same restore again at once, the engine asleep and nothing just released by
                # it: in-step restores ran at 56-62% of the pinned bandwidth, isolated ones at 93%.
                offloader.offload()
                steps[-1]["offloader/restore_again_s"] = offloader.restore()["seconds"]
                log(f"{mode} step {step + 1}/{args.steps}: total {steps[-1]['timing/generator_total_s']:.2f} s, "
                    f"generate {steps[-1]['timing/generate_s']:.2f} s, "
                    f"{steps[-1]['rollout/tokens_per_s']:.0f} tokens/s, "
                    f"GC pauses in it {steps[-1]['generator/gc_pause_s']:.2f} s, "
                    f"restore {steps[-1]['offloader/restore_s']:.3f} s then {steps[-1]['offloader/restore_again_s']:.3f} s")
            result[mode] = {"steps": steps, "median": medians(steps)}
        if args.probe_steps:
            result["restore_probes"] = restore_probes(generator, trainer, offloader, prompts, sampling,
                                                      args.probe_steps)
        result["overlap"] = overlap_section(args, generator, trainer, offloader, prompts, sampling)
    result["engine_held_asleep_gib"] = result["free_before_engine_start_gib"] - result["free_engine_asleep_gib"]
    return result


def restore_probes(generator, trainer, offloader, prompts, sampling, steps: int = 3) -> dict:
    """Where does the in-step restore lose time (56-62% of the pinned bandwidth, against 93%
    when the trainer restores what it freed itself)? Extra cuda_ipc steps, outside the table:
    alloc_first allocates the device memory in one block, timed alone, before the copies;
    wait_first waits 1 s after the engine's sleep before restoring."""
    generator.weight_sync = "cuda_ipc"
    probes = {}
    for probe in ("alloc_first", "wait_first"):
        offloader.probe = probe
        records = []
        for _ in range(steps):
            records.append(measured_step(generator, trainer, offloader, prompts, sampling)[0])
        probes[probe] = {"steps": records, "median": medians(records)}
        m = probes[probe]["median"]
        log(f"restore probe {probe}: restore {m['offloader/restore_s']:.3f} s, "
            f"allocation {m['offloader/restore_alloc_s']:.3f} s")
    offloader.probe = None
    return probes


# (trainer.memory.overlap_restore, trainer.memory.restore_while_awake) of each arm of overlap_section()
OVERLAP_MODES = {"off": (False, False), "on": (True, False), "awake": (True, True)}


def overlap_section(args, generator, trainer, offloader, prompts, sampling) -> dict:
    """cuda_ipc steps each followed by a GRPO train step, as in a run, in rounds of three arms
    (forward, then reversed): the optimizer state restored inside the restore phase (off), or on a
    side stream under scoring and the train step's forward/backward (on), and that with the restore
    before the engine's sleep when the GPU has room (awake). Time the train step too, or the
    hidden copy only moves out of the measured window."""
    import torch

    generator.weight_sync = "cuda_ipc"
    k = min(args.train_prompts, len(prompts))
    rng = random.Random(2)
    records: dict[str, list[dict]] = {mode: [] for mode in OVERLAP_MODES}
    for pair in range(args.overlap_pairs):
        for mode in (list(OVERLAP_MODES) if pair % 2 == 0 else list(OVERLAP_MODES)[::-1]):
            offloader.overlap_restore, offloader.restore_while_awake = OVERLAP_MODES[mode]
            record, rollouts = measured_step(generator, trainer, offloader, prompts, sampling)
            torch.cuda.current_stream().synchronize()
            start = time.perf_counter()
            trainer.train_step(prompts[:k], rollouts.completion_ids[:k * sampling.n],
                               [float(rng.random() < 0.5) for _ in range(k * sampling.n)], sampling.n)
            torch.cuda.synchronize()
            record["train_s"] = time.perf_counter() - start
            record.update(offloader.background_stats())
            record["restore_and_train_s"] = record["timing/restore_s"] + record["train_s"]
            record["step_s"] = record["timing/generator_total_s"] + record["train_s"]
            records[mode].append(record)
            log(f"overlap {mode}: restore {record['timing/restore_s']:.3f} s, train {record['train_s']:.3f} s, "
                f"background copy {record.get('offloader/restore_background_s', 0.0):.3f} s, "
                f"switch overhead {record['switch_overhead_s']:.3f} s")
    offloader.overlap_restore, offloader.restore_while_awake = OVERLAP_MODES["off"]
    return {"train_sequences": k * sampling.n,
            **{mode: {"steps": steps, "median": medians(steps)} for mode, steps in records.items()}}


def medians(steps: list[dict]) -> dict:
    return {key: median(s[key] for s in steps) for key in steps[0] if all(key in s for s in steps)}


# -- 4. bare vLLM ---------------------------------------------------------------------------

def bare_vllm(args, model_dir: Path, prompts, sampling_params: dict, work: Path) -> dict:
    """The same prompts and sampling through a plain vllm.LLM in a fresh process."""
    request = {"engine_kwargs": bare_engine_kwargs(args, model_dir, "bfloat16", enforce_eager=False),
               "prompts": prompts, "sampling": sampling_params, "repeats": 5}
    json_in, json_out = work / "bare_in.json", work / "bare_out.json"
    json_in.write_text(json.dumps(request))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bare_vllm.py"), "--json-in", str(json_in),
                    "--json-out", str(json_out)], check=True, timeout=600)
    return json.loads(json_out.read_text())


# -- report ---------------------------------------------------------------------------------

def summary_rows(results: dict) -> list[tuple[str, str, str]]:
    """(what, cuda_ipc, file) rows of the final table; baselines in the first column's label."""
    ipc, file = results["colocated"]["cuda_ipc"]["median"], results["colocated"]["file"]["median"]
    hw, naive, bare = results["hardware"], results["naive_staging"], results["bare_vllm"]
    phases = [("offload", "timing/offload_s"), ("stage (file only)", "timing/stage_s"),
              ("wake weights", "timing/wake_weights_s"), ("weight load", "timing/weight_load_s"),
              ("weight sync (stage + load)", "weight_sync_s"), ("wake KV", "timing/wake_kv_s"),
              ("generate", "timing/generate_s"),
              ("  llm.generate in the worker", "generator/engine_generate_s"),
              ("  GC pauses in it", "generator/gc_pause_s"),
              ("sleep", "timing/sleep_s"), ("restore", "timing/restore_s"),
              ("  restore again, engine long asleep", "offloader/restore_again_s"),
              ("generator total", "timing/generator_total_s"),
              ("switch overhead (total - generate)", "switch_overhead_s")]
    def seconds(m: dict, key: str) -> str:
        return f"{m[key]:.3f} s" if key in m else "-"

    rows = [(label, seconds(ipc, key), seconds(file, key)) for label, key in phases]
    rows.append(("generate tokens/s", f"{ipc['rollout/tokens_per_s']:.0f}", f"{file['rollout/tokens_per_s']:.0f}"))
    rows.append((f"  vs bare vLLM ({bare['tokens_per_s']:.0f} tokens/s, a later run: generate_ab.py pairs them)",
                 f"{ipc['rollout/tokens_per_s'] / bare['tokens_per_s']:.2f}x",
                 f"{file['rollout/tokens_per_s'] / bare['tokens_per_s']:.2f}x"))
    for kind, limit in (("offload", "d2h_pinned_gbps"), ("restore", "h2d_pinned_gbps")):
        rates = [m[f"offloader/{kind}_bytes"] / m[f"offloader/{kind}_s"] / GB for m in (ipc, file)]
        rows.append((f"{kind} GB/s (pinned limit {hw[limit]:.1f})",
                     *(f"{r:.1f} ({r / hw[limit]:.0%})" for r in rates)))
    for label, key in (("naive: pageable offload", "offload_pageable_s"), ("naive: torch.save", "torch_save_s"),
                       ("naive: 3 SHA-256 passes", "sha256_3x_s"), ("naive: torch.load", "torch_load_s"),
                       ("naive: pageable restore", "restore_pageable_s"), ("naive: total", "total_s")):
        rows.append((label, f"{naive[key]:.3f} s", ""))
    c = results["colocated"]
    rows.append((f"GPU memory the sleeping engine keeps (free {c['free_before_engine_start_gib']:.1f} GiB "
                 f"before it started, {c['free_engine_asleep_gib']:.1f} asleep)",
                 f"{c['engine_held_asleep_gib']:.2f} GiB", ""))
    rows.append(("device-to-device copy (GB/s)", f"{hw['d2d_gbps']:.0f}", ""))
    return rows


def overlap_rows(results: dict) -> list[tuple[str, ...]]:
    """(what, off, on, awake) rows for the background restore: the medians of overlap_section()."""
    section = results["colocated"].get("overlap")
    if not section or not section["on"]["steps"]:
        return []
    arms = [section[mode]["median"] for mode in OVERLAP_MODES if mode in section]
    keys = [("restore (waited for)", "timing/restore_s"),
            ("  copied in the background", "offloader/restore_background_s"),
            ("  before the engine's sleep (share of steps)", "generator/restored_awake"),
            ("sleep", "timing/sleep_s"),
            (f"train step ({section['train_sequences']} sequences)", "train_s"),
            ("restore + train", "restore_and_train_s"),
            ("switch overhead (total - generate)", "switch_overhead_s"),
            ("generator total + train", "step_s")]
    return [(label, *((f"{m[key]:.2f}" if key == "generator/restored_awake" else f"{m[key]:.3f} s") if key in m else "-"
                      for m in arms)) for label, key in keys]


def print_table(rows, columns=("cuda_ipc", "file")) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}" + "".join(f"  {c:>18}" for c in columns))
    for label, *cells in rows:
        print(f"{label:{width}}" + "".join(f"  {c:>18}" for c in cells))


def save(path: Path, results: dict) -> None:
    """Written after every section: a run cut off by a time limit keeps what it measured."""
    path.write_text(json.dumps(results, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from colo_rl.generator import VLLMGenerator
    from colo_rl.models import write_embedded_model

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/colocation.py needs a CUDA GPU (and vLLM built for it): "
                         "run it on the lent H200, see benchmarks/README.md")
    cfg = model_config(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / f"{args.out.stem}_logs"
    prompts, sampling = workload(args, cfg.embedded.vocab_size)
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                     "gpu_total_gib": torch.cuda.mem_get_info()[1] / GIB,
                     "sampling": VLLMGenerator._sampling_params(sampling, 0)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="colo_rl-bench-") as tmp:
        work = Path(tmp)
        log(f"building {args.model} ({cfg.dtype}) and one GRPO step for AdamW state")
        model_dir = write_embedded_model(cfg, work / "model")
        trainer = stepped_trainer(cfg, model_dir, args.max_tokens)
        state = trainer_tensors(trainer)
        results["trainer_state_bytes"] = float(sum(t.nbytes for t in state.values()))
        results["parameters"] = sum(p.numel() for p in trainer.model.parameters())
        del state
        log(f"trainer state {results['trainer_state_bytes'] / GB:.2f} GB; measuring copy bandwidth")
        results["hardware"] = hardware_limits(args.bandwidth_gib)
        save(args.out, results)
        log("naive staging baseline")
        weight_bytes = sum(p.nbytes for p in trainer.model.parameters())
        results["naive_staging"] = naive_staging(trainer, staging_dir(weight_bytes))
        save(args.out, results)
        results["colocated"] = colocated(args, trainer, model_dir, prompts, sampling, log_dir)
        save(args.out, results)
        del trainer
        torch.cuda.empty_cache()
        log("bare vLLM in a subprocess")
        results["bare_vllm"] = bare_vllm(args, model_dir, prompts, results["sampling"], work)
    results["wall_s"] = time.perf_counter() - started
    save(args.out, results)
    print_table(summary_rows(results))
    if overlap_rows(results):
        print_table(overlap_rows(results), columns=("overlap off", "overlap on", "on + while awake"))
    log(f"done in {results['wall_s']:.0f} s; raw numbers in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
