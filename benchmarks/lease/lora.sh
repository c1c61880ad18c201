# One call (~8 min): issue #25 on the H200: vLLM's own LoRA adapters against merged pushes (1B),
# then the 7B shape with LoRA for 3 steps beside the engine. lora24.sh is the 24 GiB card's call.
source benchmarks/lease/common.sh
W=/tmp/lora; mkdir -p $W
timeout 220 python benchmarks/lora_adapters.py --out $OUT/lora_adapters.json 2>&1 | grep "lora_adapters\]" | tail -8
timeout 310 python benchmarks/peer_workload.py --model olmo2_7b_shape --out $W/peer_lora_7b.json --no-weights --timeout-s 290 \
  --arm "lora_7b=trainer.steps=3 task.toy.target=u trainer.lora.rank=16 trainer.lr=1e-5 trainer.gradient_checkpointing=true trainer.checkpoint_final=false" 2>&1 | tail -30
cp $W/peer_lora_7b.json $OUT/ 2>/dev/null
pack $W lora_logs.tgz
