# One call (~7 min, after mfu.sh on the same machine): issue #24's side by side: colo_rl with the
# fastest training arm mfu.sh found (defaults: keep_cache=false, gpu_memory_utilization=auto)
# against TRL 1.16's default, one lease.
source benchmarks/lease/common.sh
W=/tmp/peer24; mkdir -p $W
best=$(cat /tmp/best_train_arm.txt 2>/dev/null); echo "colo_rl arm: trainer.checkpoint_final=false generator.gpu_memory_utilization=auto $best"
timeout 560 python benchmarks/peer_trl.py --out $W/peer_trl.json --colo-rl \
  --colo-rl-arm "trainer.checkpoint_final=false generator.gpu_memory_utilization=auto $best" \
  --arm trl_default --timeout-s 260 2>&1 | grep -v " INFO \|WARNING\|it/s\]" | tail -40
cp $W/peer_trl.json $OUT/peer_trl.json; pack $W peer24_logs.tgz
python benchmarks/peer_trl.py --table $OUT/peer_trl.json
