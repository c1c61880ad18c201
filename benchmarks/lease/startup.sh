# One call (~9 min): issue #23 on the H200 after the fixes of 2026-12-06 (model-info cache,
# pinned checkpoint buffers): the 1B peer run cold then warm, the engine core in the worker's
# process (generator.in_process=true) warm, and a background checkpoint's stall.
source benchmarks/lease/common.sh
timeout 330 python benchmarks/startup.py --runs 2 --peer --out $OUT/startup.json -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -3
timeout 150 python benchmarks/startup.py --runs 1 --peer --out $OUT/startup_in_process.json -- trainer.checkpoint_final=false generator.in_process=true 2>&1 | grep "^{" | tail -2
timeout 190 python benchmarks/peer_workload.py --out $OUT/checkpoint_background.json --no-weights --timeout-s 170 \
  --arm "background=trainer.checkpoint_background=true trainer.checkpoint_every=2" 2>&1 | tail -25
