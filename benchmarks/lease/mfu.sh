# One call (~6 min): issue #24's training MFU. train_profile.py (a train step of the peer workload,
# no engine) for colo_rl's defaults and each faster arm (Liger's kernels, compiled decoder layers,
# a larger micro-batch; Liger with compile is refused since 2026-12-06d); the fastest arm's
# overrides go to /tmp/best_train_arm.txt for peer24.sh.
source benchmarks/lease/common.sh
for arm in "default:" "liger:trainer.kernels=liger" "compile:trainer.compile=true" \
           "liger_mb32:trainer.kernels=liger trainer.micro_batch_size=32"; do
  name=${arm%%:*}; ov=${arm#*:}
  case $name in *compile*) limit=140;; *) limit=95;; esac
  echo "== $name ($ov)"
  timeout $limit python benchmarks/train_profile.py --steps 2 --out $OUT/train_profile_$name.json -- generator.max_model_len=512 $ov 2>&1 \
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
