#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the given benches.
# Usage on the device: bash bench/device_run.sh [tests|notests] [bench commands as 'cmd' args]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mode=$1; shift
if [ "$mode" = tests ]; then
  timeout 450 python3 -m pytest -q -p no:cacheprovider -o addopts="-rs -n 6" tests/test_gpu.py tests/test_cuda_backend.py tests/test_cuda_sliding.py tests/test_speculators_heads.py \
    tests/test_cuda_attention.py tests/test_cuda_kernels.py tests/test_cuda_matvec.py tests/test_eagle3.py \
    tests/test_gemma4_mtp.py tests/test_benchmark.py tests/test_simulated.py 2>&1 | tee $OUT/tests.log | tail -25
fi
i=0
for cmd in "$@"; do
  i=$((i + 1))
  echo "=== $cmd"
  bash -c "$cmd" > $OUT/bench$i.log 2>&1
  echo "rc=$?"
  grep -v "warning\|^\s*$" $OUT/bench$i.log | tail -40
done
