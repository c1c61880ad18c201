# One call (~5 min), first on the next machine after part1/part2 (issue #23; then mfu.sh for #24):
# start-up of the 1B peer run on this machine, cold then warm (vLLM's compile cache), with this
# session's defaults: time from the command to the first step (targets 60 / 35 s) and the whole
# 6-step run (target 120 s). With the worker's import fix (8825d9b: has_triton; 4151339: the
# compute capability from NVML, the query the 2026-12-06d lease's trace found) vLLM should fork its
# engine core: startup.json's engine_core_spawned false. COLO_RL_TRACE_CUDA_INIT=1 prints, in
# engine.log, the stack of whatever still initialises CUDA in the worker (nothing if none does).
source benchmarks/lease/common.sh
COLO_RL_TRACE_CUDA_INIT=1 timeout 360 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/su --out $OUT/startup.json \
  -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -3
grep -h "multiprocessing start method\|vLLM imported in\|Dynamo bytecode\|torch.compile took" /tmp/su/*/engine.log 2>/dev/null | cut -c1-160
grep -h -A40 "CUDA initialised here" /tmp/su/run0/engine.log 2>/dev/null | grep -v "frozen importlib" | head -40
pack /tmp/su su_logs.tgz
