# One call (~2 min, warm machine): issue #23: what initialises CUDA in the engine worker before
# vLLM starts its engine core, which then has to be spawned (18 s of imports again) instead of
# forked. One 1-step run of the peer shape with COLO_RL_TRACE_CUDA_INIT=1; the stack is in engine.log.
source benchmarks/lease/common.sh
W=/tmp/cuda_init; rm -rf $W; mkdir -p $W
COLO_RL_TRACE_CUDA_INIT=1 timeout 150 python -m colo_rl.run model=olmo2_1b_shape trainer.steps=1 trainer.prompts_per_step=4 \
  sampling.n=2 sampling.max_tokens=16 eval.every=0 logger=none logger.progress=false trainer.checkpoint_final=false \
  output_dir=$W > $W/run.log 2>&1
grep -A40 "CUDA initialised here" $W/engine.log | head -60
grep "multiprocessing start method" $W/engine.log | cut -c1-200
cp $W/engine.log $OUT/cuda_init_engine.log
