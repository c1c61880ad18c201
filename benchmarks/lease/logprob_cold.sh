# One call (~6 min, after part1/part2 on a fresh machine). First, before anything compiles here:
# the 1B peer run's start on this fresh machine (issue #23: vLLM's model inspection now in a fork of
# the worker, 18 s less than its fresh interpreter; ~58 s to the first step expected) and again warm
# (the AOT compiled model loaded by default: ~26 s); where importing vLLM goes (15 s of a warm start
# on 2026-12-06e). Then the compiled log-softmax of the output head's chunks
# (trainer.logprob_kernel, issue #24) against the eager ops and with 4096-token chunks, as a train
# step of the peer workload (train_profile.py, with the device time by op); the compiled one with
# the fastest arm of 2026-12-06e (bf16 activations, micro-batch 32); fp32 weight-gradient
# accumulation by addmm's out_dtype.
source benchmarks/lease/common.sh
timeout 220 python benchmarks/startup.py --runs 2 --peer --work-dir /tmp/su --out $OUT/startup_cold.json \
  -- trainer.checkpoint_final=false 2>&1 | grep "^{" | tail -2
grep -h "multiprocessing start method\|vLLM imported in\|Resolved architecture\|non-default args\|torch.compile took\|init engine\|Graph capturing" /tmp/su/*/engine.log 2>/dev/null | cut -c1-160
pack /tmp/su su_cold_logs.tgz
timeout 60 python benchmarks/import_profile.py --out $OUT/import_profile.json 2>&1 | tail -22
for arm in "compiled_logprobs:" "eager_logprobs:trainer.logprob_kernel=eager" "compiled_chunk4096:trainer.logprob_chunk=4096" \
           "compiled_bf16_act_mb32:trainer.fp32_activations=false trainer.micro_batch_size=32"; do
  name=${arm%%:*}; ov=${arm#*:}; echo "== $name ($ov)"
  timeout 80 python benchmarks/train_profile.py --steps 2 --out $OUT/train_profile_$name.json -- generator.max_model_len=512 $ov 2>&1 \
    | grep "train_profile\]\|Error\|error" | grep -v "cutedsl\|_ascend" | head -12
done
echo "== mm_accumulate"
timeout 60 python benchmarks/mm_accumulate.py | tee $OUT/mm_accumulate.json
