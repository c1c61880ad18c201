# One call (<= 10 min, after part1/part2): the GPU tests of the fused output head and the fused
# gradient accumulation, then issue #24's train step arm by arm (train_profile.py, medians of 2
# steps, the first fused arm profiled with the callers of the copy-like ops traced), while the
# call's time lasts. The whole runs come in the next call (peer24.sh, /tmp/best_train_arm.txt
# written here: the fastest bf16-activation arm at micro-batch 32).
source benchmarks/lease/common.sh
timeout 150 python -m pytest tests/gpu/test_logprob_chunk_gpu.py tests/gpu/test_kernels_gpu.py -m gpu -q -rfEs \
  --tb=short -p no:cacheprovider > $OUT/gpu_tests_head.txt 2>&1
grep -E "^(FAILED|ERROR)|^E   |passed|failed" $OUT/gpu_tests_head.txt | cut -c1-200 | tail -12
B="generator.max_model_len=512 trainer.fp32_activations=false trainer.micro_batch_size=32"
F="generator.max_model_len=512 trainer.micro_batch_size=32"
for arm in "fused_c4096:$B trainer.logprob_chunk=4096" \
           "generic_c4096:$B trainer.logprob_chunk=4096 trainer.fused_head=false" \
           "fused_keep_c4096:$B trainer.logprob_chunk=4096 trainer.logprob_recompute=false" \
           "fused_keep_c4096_fga:$B trainer.logprob_chunk=4096 trainer.logprob_recompute=false trainer.fuse_grad_accumulation=true" \
           "fp32act_keep_c4096_fga:$F trainer.logprob_chunk=4096 trainer.logprob_recompute=false trainer.fuse_grad_accumulation=true" \
           "fp32act_c1024:$F" \
           "fused_c1024:$B" \
           "fused_keep_c4096_fga_mb64:${B/micro_batch_size=32/micro_batch_size=64} trainer.logprob_chunk=4096 trainer.logprob_recompute=false trainer.fuse_grad_accumulation=true"; do
  if [ $SECONDS -gt 510 ]; then echo "== time's up at ${SECONDS}s: not run: ${arm%%:*}"; continue; fi
  name=${arm%%:*}; ov=${arm#*:}; echo "== $name ($ov) at ${SECONDS}s"
  trace=""; [ "$name" = fused_c4096 ] && trace="--trace-ops aten::cat,aten::copy_,aten::fill_,aten::add_,aten::add,aten::mul"
  timeout 80 python benchmarks/train_profile.py --steps 2 $trace --out $OUT/train_profile_$name.json -- $ov 2>&1 \
    | grep "train_profile\]\|Error\|error" | grep -v "cutedsl\|_ascend" | head -16
done
OUT=$OUT python - <<'PY' > /tmp/best_train_arm.txt
import glob, json, os
rows = []
for f in glob.glob(os.environ["OUT"] + "/train_profile_fused*.json"):
    d = json.load(open(f))
    if d.get("micro_batch_size") == 32:
        rows.append((d["median_step_s"], " ".join(d["overrides"])))
print(min(rows)[1] if rows else "generator.max_model_len=512 trainer.fp32_activations=false trainer.micro_batch_size=32")
PY
echo "best: $(cat /tmp/best_train_arm.txt)"
