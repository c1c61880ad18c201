# Sourced first by every call of a lease on the lent H200 (benchmarks/README.md, "Running on the
# lent H200"): the vLLM bundle (.gpu/part3 carried), the extra wheels of .gpu_extra (carried; trl
# and torchao, installed once per machine), colo_rl on the path, and pack() for what comes back.
source .gpu/part3/device_setup.sh || exit 3
if [ ! -f /tmp/site/.extra_ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_extra/*.whl 2>&1 | grep -v "already exists" | tail -2
  s=$SECONDS; python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1
  echo "compileall /tmp/site: $((SECONDS - s)) s (pip install compiles by default; the bundle's --no-compile does not)"
  touch /tmp/site/.extra_ok
fi
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
# the small files of a work dir (no weights, no checkpoints) as one archive under $OUT (8 files come back at most)
pack() { (cd "$1" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.csv' -o -name '*.txt' \) -size -20M -not -path '*_model/*' -not -path '*checkpoint*' -print0 | tar czf "$OUT/$2" --null -T -); }
