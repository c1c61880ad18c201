# One call (~8 min, after part1/part2): issue #24's train step with the fused output head
# (colo_rl/trainer/head.py) and without Hugging Face's training KV cache (use_cache=False), arm by
# arm (train_profile.py, medians of 2 steps, one profiled with the callers of the copy-like ops
# traced), then the fastest bf16-activation arm as a whole peer run (peer_workload.py).
source benchmarks/lease/common.sh
B="generator.max_model_len=512 trainer.fp32_activations=false trainer.micro_batch_size=32"
for arm in "generic_c4096:$B trainer.logprob_chunk=4096 trainer.fused_head=false" \
           "fused_c4096:$B trainer.logprob_chunk=4096" \
           "fused_c1024:$B" \
           "fused_keep_c4096:$B trainer.logprob_chunk=4096 trainer.logprob_recompute=false" \
           "fused_keep_c8192:$B trainer.logprob_chunk=8192 trainer.logprob_recompute=false" \
           "fused_keep_c4096_mb64:${B/micro_batch_size=32/micro_batch_size=64} trainer.logprob_chunk=4096 trainer.logprob_recompute=false" \
           "fp32_act_mb32:generator.max_model_len=512 trainer.micro_batch_size=32"; do
  name=${arm%%:*}; ov=${arm#*:}; echo "== $name ($ov)"
  trace=""; [ "$name" = fused_c4096 ] && trace="--trace-ops aten::cat,aten::copy_,aten::fill_,aten::add_,aten::add,aten::mul"
  timeout 100 python benchmarks/train_profile.py --steps 2 $trace --out $OUT/train_profile_$name.json -- $ov 2>&1 \
    | grep "train_profile\]\|Error\|error" | grep -v "cutedsl\|_ascend" | head -24
done
best=$(OUT=$OUT python - <<'PY'
import json, glob, os
rows = []
for f in glob.glob(os.environ["OUT"] + "/train_profile_fused*.json"):
    d = json.load(open(f))
    if "micro_batch_size=64" not in " ".join(d["overrides"]):
        rows.append((d["median_step_s"], " ".join(o for o in d["overrides"] if "max_model_len" not in o)))
print(min(rows)[1] if rows else "trainer.fp32_activations=false trainer.micro_batch_size=32")
PY
)
echo "== whole run: $best"
timeout 280 python benchmarks/peer_workload.py --out $OUT/peer_best.json --work-dir /tmp/peerbest --timeout-s 250 \
  --arm "best=trainer.checkpoint_final=false generator.gpu_memory_utilization=auto generator.max_model_len=512 $best" 2>&1 \
  | grep -v " INFO \|WARNING\|it/s\]" | tail -15
