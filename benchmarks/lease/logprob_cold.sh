# One call (~5 min, after part1/part2 on a fresh machine): the compiled log-softmax of the output
# head's chunks (trainer.logprob_kernel, issue #24) against the eager ops, as a train step of the
# peer workload (train_profile.py); then the 1B peer run's start on this fresh machine (issue #23:
# vLLM's model inspection now in a fork of the worker, 18 s less than its fresh interpreter; ~58 s
# to the first step expected) and again warm (the AOT compiled model loaded by default: ~26 s);
# then the compiled log-softmax with the fastest arm of 2026-12-06e (bf16 activations, micro-batch 32).
source benchmarks/lease/common.sh
for arm in "compiled_logprobs:" "eager_logprobs:trainer.logprob_kernel=eager" "compiled_chunk4096:trainer.logprob_chunk=4096"; do
  name=${arm%%:*}; ov=${arm#*:}; echo "== $name ($ov)"
  timeout 80 python benchmarks/train_profile.py --steps 2 --out $OUT/train_profile_$name.json -- generator.max_model_len=512 $ov 2>&1 \
    | grep "train_profile\]\|Error\|error" | grep -v "cutedsl\|_ascend" | head -12
done
timeout 220 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/su --out $OUT/startup_cold.json \
  -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -2
grep -h "multiprocessing start method\|vLLM imported in\|Resolved architecture\|non-default args\|torch.compile took\|init engine" /tmp/su/*/engine.log 2>/dev/null | cut -c1-160
pack /tmp/su su_cold_logs.tgz
echo "== compiled_bf16_act_mb32"
timeout 80 python benchmarks/train_profile.py --steps 2 --out $OUT/train_profile_compiled_bf16_act_mb32.json -- generator.max_model_len=512 \
  trainer.fp32_activations=false trainer.micro_batch_size=32 2>&1 | grep "train_profile\]" | head -10
echo "== mm_accumulate"
timeout 60 python benchmarks/mm_accumulate.py | tee $OUT/mm_accumulate.json
