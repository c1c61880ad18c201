# One call (~4 min): trainer.fp32_activations=false against the default on whole runs of the peer
# workload (issue #24's fastest arm, before it can become a default): the engine/trainer log-prob
# gap every step (vLLM computes with a bf16 residual stream, as bf16 activations do; autocast keeps
# it fp32), the loss, and the fraction of the weights that 6 steps at lr 1e-6 moved. Both at
# micro-batch 32 with the plan's engine budget, so the GPU peaks compare with TRL's 59.1 GiB.
source benchmarks/lease/common.sh
# the GPU's clocks, power and throttle reasons every 250 ms, to line up with each step's ended_unix_s:
# does the engine's generate time vary between steps (1.36-2.45 s on 2026-12-06e) with the clocks?
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,nounits -lms 250 > $OUT/activations_smi.csv 2>&1 & smi=$!
common="sampling.logprobs_every=1 generator.gpu_memory_utilization=auto trainer.micro_batch_size=32"
timeout 500 python benchmarks/peer_workload.py --out $OUT/activations.json --work-dir /tmp/act --timeout-s 230 \
  --arm "fp32_act=$common" --arm "bf16_act=$common trainer.fp32_activations=false" 2>&1 \
  | grep -v " INFO \|WARNING\|it/s\]" | tail -30
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/activations.json"))
for arm in r.get("arms", []):
    m = arm["median_steps_2_on"]
    gaps = [s.get("train/engine_logprob_gap") for s in arm["steps"]]
    print(arm["name"], "exit", arm["exit_code"], "step", m.get("timing/step_s"), "train", m.get("timing/train_s"),
          "peak", arm.get("peak_gpu_used_gib"), "gap per step", gaps, "loss", [s.get("train/loss") for s in arm["steps"]],
          "weights moved", (arm.get("weights") or {}).get("changed_frac"))
PY
kill $smi
pack /tmp/act activations_logs.tgz
