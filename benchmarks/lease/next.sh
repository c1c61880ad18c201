# One call (~9 min), first on the next machine after part1/part2 (issue #23; then peer.sh for #24):
# 1. the CUDA-init check: with the worker's import fix (8825d9b: has_triton; 4151339: the compute
#    capability from NVML, the query the 2026-12-06d lease's trace found) vLLM should fork its
#    engine core, so engine.log has no "We must use the `spawn` multiprocessing start method" line;
# 2. start-up of the 1B peer run on this machine, cold then warm (vLLM's compile cache), with this
#    session's defaults (Liger on, fork): time from the command to the first step (targets 60 / 35 s)
#    and the whole 6-step run (target 120 s).
source benchmarks/lease/common.sh
bash benchmarks/lease/cuda_init.sh 2>&1 | tail -8
timeout 360 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/su --out $OUT/startup.json -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -3
grep -h "multiprocessing start method\|vLLM imported in\|Dynamo bytecode\|torch.compile took" /tmp/su/*/engine.log 2>/dev/null | cut -c1-160
pack /tmp/su su_logs.tgz
