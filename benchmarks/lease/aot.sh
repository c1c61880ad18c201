# One call (~4 min, after next.sh on the same machine): issue #23's AOT lever. vLLM cannot save its
# AOT compiled model on the Transformers backend (transformers' decorated forwards; see
# colo_rl/generator/aot.py), so every start traces with Dynamo again (4-5 s). Two runs with
# COLO_RL_AOT_REBUILD=1: the first should log "saved AOT compiled function", the second load it
# ("Directly load AOT compilation") with no "Dynamo bytecode transform"; compare its time to the
# first step with next.sh's warm run.
source benchmarks/lease/common.sh
COLO_RL_AOT_REBUILD=1 timeout 330 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/aot --out $OUT/startup_aot.json \
  -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -3
grep -h "AOT\|Dynamo bytecode\|torch.compile took\|multiprocessing start method\|load failure" /tmp/aot/*/engine.log | cut -c1-220
pack /tmp/aot aot_logs.tgz
