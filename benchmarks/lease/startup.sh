# One call (~8 min) on a fresh machine (vLLM's compile cache cold): issue #23 after the fixes of
# 2026-12-06 (model-info cache, the worker spawned before the trainer's imports): the 1B peer run
# cold then warm, then warm with the engine core in the worker's process (generator.in_process=true).
source benchmarks/lease/common.sh
timeout 330 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/su --out $OUT/startup.json -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -3
timeout 150 python benchmarks/startup.py --runs 1 --peer --work-dir /tmp/su_ip --out $OUT/startup_in_process.json -- trainer.checkpoint_final=false generator.in_process=true 2>&1 | grep "^{" | tail -2
for d in /tmp/su /tmp/su_ip; do [ -d $d ] && pack $d $(basename $d)_logs.tgz; done
