#!/usr/bin/env bash
# On a GPU machine: compile the tested variants in parallel into the disk cache, then run the GPU
# tests. Extra arguments go to pytest (e.g. -k "not native" to test only the sm80 family).
# Logs land in $OUT (default /tmp/cute-flash-out): gpu-tests.log, gpu-tests.xml.
set -o pipefail
OUT=${OUT:-/tmp/cute-flash-out}
mkdir -p "$OUT"
export CUTE_FLASH_CACHE_DIR=${CUTE_FLASH_CACHE_DIR:-/tmp/cute-flash-cache}
HEAD_DIMS=32,64,72,96,128,192,256
JOBS=$(nproc)
start=$(date +%s)
cute-flash warmup --jobs "$JOBS" --head-dims "$HEAD_DIMS" --passes fwd 2>&1 | tail -1
CUTE_FLASH_KERNEL_ARCH=sm80 cute-flash warmup --jobs "$JOBS" --head-dims "$HEAD_DIMS" --gqa 2>&1 | tail -1
echo "warmup: $(( $(date +%s) - start )) s"
python3 -m pytest -q -rs -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
