# One call (~7 min): issue #25 on the GPU: the 1B shape with LoRA on an emulated 24 GiB card (a
# second process holds the rest), 6 steps, the device peak and step time; then issue #23's
# background checkpoint stall (pinned host buffers reused) and the model-info cache test.
source benchmarks/lease/common.sh
W=/tmp/lora24; mkdir -p $W
timeout 250 python benchmarks/peer_workload.py --out $OUT/peer_lora_24gib.json --work-dir $W --no-weights --leave-gib 24 --timeout-s 240 \
  --arm "lora_24gib=task.toy.target=u trainer.lora.rank=16 trainer.lr=1e-5 trainer.gradient_checkpointing=true trainer.micro_batch_size=8 trainer.checkpoint_final=false generator.gpu_memory_utilization=auto" 2>&1 | tail -30
timeout 60 python -m pytest -q -p no:cacheprovider tests/generator/test_model_info.py 2>&1 | tail -3
[ -z "$SKIP_CHECKPOINT" ] && timeout 190 python benchmarks/peer_workload.py --out $OUT/checkpoint_background.json --work-dir $W --no-weights --timeout-s 170 \
  --arm "background=trainer.checkpoint_background=true trainer.checkpoint_every=2" 2>&1 | tail -25
pack $W lora24_logs.tgz
