# One call (~9.5 min): issue #24's table from one lease with colo_rl's defaults (whatever they are at
# the commit: since 2026-12-06c Liger's kernels by trainer.kernels=auto, fused AdamW, keep_cache off;
# gpu_memory_utilization=auto), bare vLLM on the same engine settings, and TRL's default.
# Run TRL bf16 in a second call: python benchmarks/peer_trl.py --out $W/t/peer_trl.json --arm trl_bf16
source benchmarks/lease/common.sh
W=/tmp/peer; mkdir -p $W
timeout 540 python benchmarks/peer_trl.py --out $W/peer_trl.json --bare --colo-rl \
  --colo-rl-arm "trainer.checkpoint_final=false generator.gpu_memory_utilization=auto" \
  --arm trl_default --timeout-s 240 2>&1 | grep -v " INFO \|WARNING\|it/s\]" | tail -60
cp $W/peer_trl.json $OUT/peer_trl.json; pack $W peer_logs.tgz
python benchmarks/peer_trl.py --table $OUT/peer_trl.json
