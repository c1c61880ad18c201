# One call (~4 min): issue #25 on the H200: the 1B shape with LoRA on an emulated 24 GiB card (a
# second process holds the rest), 6 steps, the device peak and step time.
source benchmarks/lease/common.sh
W=/tmp/lora24; mkdir -p $W
timeout 250 python benchmarks/peer_workload.py --out $W/peer_lora_24gib.json --no-weights --leave-gib 24 --timeout-s 240 \
  --arm "lora_24gib=task.toy.target=u trainer.lora.rank=16 trainer.lr=1e-5 trainer.gradient_checkpointing=true trainer.micro_batch_size=8 trainer.checkpoint_final=false" 2>&1 | tail -30
cp $W/peer_lora_24gib.json $OUT/ 2>/dev/null; pack $W lora24_logs.tgz
timeout 120 python -m pytest -q -p no:cacheprovider tests/generator/test_model_info.py 2>&1 | tail -3
