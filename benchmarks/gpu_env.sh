# Sourced before benchmarks/run.py on the lent GPU (benchmarks/README.md, "On the lent GPU"): the
# vLLM bundle (.gpu/part3 carried), the extra wheels of .gpu_extra (carried; trl, torchao and
# liger-kernel, installed into the bundle's site directory once per machine), colo_rl on the path.
source .gpu/part3/device_setup.sh || return 3
if [ ! -f /tmp/site/.extra_ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_extra/*.whl 2>&1 | grep -v "already exists" | tail -2
  # pip install compiles by default; the bundle's --no-compile does not: compile once, here
  python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1
  touch /tmp/site/.extra_ok
fi
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
