# One call (~8 min, after next.sh on the same machine): issue #24's table with colo_rl's defaults
# (Liger's kernels by trainer.kernels=auto, fused AdamW, micro-batch 16, keep_cache off,
# gpu_memory_utilization auto) beside bare vLLM and TRL 1.16's default, one lease.
source benchmarks/lease/common.sh
W=/tmp/peerd; mkdir -p $W
timeout 560 python benchmarks/peer_trl.py --out $W/peer_trl.json --bare --colo-rl \
  --colo-rl-arm "trainer.checkpoint_final=false generator.gpu_memory_utilization=auto" \
  --arm trl_default --timeout-s 240 2>&1 | grep -v " INFO \|WARNING\|it/s\]" | tail -40
cp $W/peer_trl.json $OUT/peer_trl.json; pack $W peerd_logs.tgz
python benchmarks/peer_trl.py --table $OUT/peer_trl.json
