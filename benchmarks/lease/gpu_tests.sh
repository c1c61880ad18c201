# One call (~6-7 min): the GPU tests (tests/gpu and the GPU cases of tests/trainer) with the whole
# output under $OUT (the 2026-12-06d lease ran the suite three times to get its failure list from a
# tail), then the summary lines.
source benchmarks/lease/common.sh
timeout 540 python -m pytest tests/gpu tests/trainer -m gpu -q -rfEs --tb=short -p no:cacheprovider \
  > $OUT/gpu_tests.txt 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)|^E   |passed|failed" $OUT/gpu_tests.txt | cut -c1-240 | tail -40
