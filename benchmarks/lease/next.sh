# One call (~9 min), for the next lease (issues #24, #22): where the train step's time goes
# (train_profile.py, no engine), then the peer workload with this session's defaults
# (trainer.keep_cache=false, gpu_memory_utilization=auto) twice on one machine: logging off as in
# peer.sh, and W&B offline as in startup.sh, whose runs generated at 18-20k tok/s against 48.5k.
source benchmarks/lease/common.sh
W=/tmp/next; mkdir -p $W
timeout 150 python benchmarks/train_profile.py --out $OUT/train_profile.json 2>&1 | grep "train_profile\]" | tail -22
timeout 380 python benchmarks/peer_workload.py --out $OUT/peer_logging_ab.json --work-dir $W --no-weights --timeout-s 185 \
  --arm "none=trainer.checkpoint_final=false generator.gpu_memory_utilization=auto" \
  --arm "wandb_offline=trainer.checkpoint_final=false generator.gpu_memory_utilization=auto logger=wandb logger.mode=offline" 2>&1 | tail -40
pack $W next_logs.tgz
