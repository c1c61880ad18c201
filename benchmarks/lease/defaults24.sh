# One call (~8 min, after gpu_tests.sh on the same machine): issue #24's side by side with colo_rl's
# defaults as a user gets them (fp32 activations; the plan's micro-batch, 32 on an H100, and its
# choice to keep the head's logits; the fused head and gradient accumulation) against TRL 1.16's
# default, and a bare vLLM engine on the same shape in the same call (generation against the
# engine's own speed: 87 % on 2026-12-06d, not remeasured since).
source benchmarks/lease/common.sh
W=/tmp/defaults24; mkdir -p $W
timeout 585 python benchmarks/peer_trl.py --out $W/peer_trl.json --colo-rl --bare \
  --colo-rl-arm "trainer.checkpoint_final=false generator.gpu_memory_utilization=auto generator.max_model_len=512 trainer.micro_batch_size=auto" \
  --arm trl_default --timeout-s 240 2>&1 | grep -v " INFO \|WARNING\|it/s\]" | grep "trainer\.\|exit\|step\|MFU\|mfu\|tok\|peak\||" | tail -40
cp $W/peer_trl.json $OUT/peer_trl_defaults.json; pack $W defaults24_logs.tgz
