# One call (~8 min): issue #25's 24 GiB LoRA run (lora24.sh without its checkpoint arm), issue
# #23's CUDA-init trace (cuda_init.sh), and the GPU tests of this session's trainer changes.
source benchmarks/lease/common.sh
timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_logprob_chunk_gpu.py 2>&1 | tail -4
SKIP_CHECKPOINT=1 bash benchmarks/lease/lora24.sh
bash benchmarks/lease/cuda_init.sh
