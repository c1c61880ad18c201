# One call (~7 min): issue #24's training MFU. train_profile.py (a train step of the peer workload,
# no engine) for colo_rl's defaults (since 2026-12-06d: Liger, the decoder layers' weights cast once
# per update) and each faster arm: autocast's per-micro-batch casts (the A/B of compute_copies),
# bf16 activations (trainer.fp32_activations=false), a larger micro-batch (compiled layers: 2.57 s
# on 2026-12-06c, slower than Liger; not rerun).
# The fastest arm's overrides go to /tmp/best_train_arm.txt for peer24.sh.
source benchmarks/lease/common.sh
for arm in "default:" "per_micro_casts:--per-micro-batch-casts" \
           "bf16_act:trainer.fp32_activations=false" "mb32:trainer.micro_batch_size=32" \
           "bf16_act_mb32:trainer.fp32_activations=false trainer.micro_batch_size=32"; do
  name=${arm%%:*}; ov=${arm#*:}
  case $name in *compile*) limit=140;; *) limit=95;; esac
  echo "== $name ($ov)"
  flags=""; case $ov in --*) flags=$ov; ov="";; esac
  timeout $limit python benchmarks/train_profile.py --steps 2 $flags --out $OUT/train_profile_$name.json -- generator.max_model_len=512 $ov 2>&1 \
    | grep "train_profile\]\|Error\|error" | head -16
done
python - <<'PY'
import glob, json, os
arms = []
for path in sorted(glob.glob(os.environ["OUT"] + "/train_profile_*.json")):
    r = json.load(open(path))
    arms.append((r["median_step_s"], " ".join(r["overrides"]), r.get("perf/mfu", 0), r.get("peak_allocated_gib", 0), path))
for s, ov, mfu, peak, path in sorted(arms):
    print(f"{s:6.2f} s  MFU {mfu * 100:5.1f} %  peak {peak:5.1f} GiB  {os.path.basename(path)}")
best = min(arms)[1] if arms else ""
open("/tmp/best_train_arm.txt", "w").write(best)
print("best:", best or "(defaults)")
PY
