#!/usr/bin/env bash
# On a GPU machine: compile the tested variants in parallel into the disk cache, run the GPU tests
# (a skipped GPU test fails: CUTE_FLASH_REQUIRE_GPU=1), and with --sanitize first also
# compute-sanitizer over one call of each kernel family (scripts/sanitize.sh, about 3 minutes).
# Other arguments go to pytest (e.g. -k "not native" to test only the sm80 family).
# Logs land in $OUT (default /tmp/cute-flash-out): gpu-tests.log, gpu-tests.xml, sanitize-*.log.
# Exits non-zero if the tests or the sanitizer fail.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cute-flash-out}
mkdir -p "$OUT"
export CUTE_FLASH_CACHE_DIR=${CUTE_FLASH_CACHE_DIR:-/tmp/cute-flash-cache}
export CUTE_FLASH_REQUIRE_GPU=1
sanitize=0
if [ "$1" = "--sanitize" ]; then
  sanitize=1
  shift
fi
HEAD_DIMS=32,64,72,96,128,192,256
JOBS=$(nproc)
start=$(date +%s)
cute-flash warmup --jobs "$JOBS" --head-dims "$HEAD_DIMS" --passes fwd,bwd 2>&1 | tail -1
CUTE_FLASH_KERNEL_ARCH=sm80 cute-flash warmup --jobs "$JOBS" --head-dims "$HEAD_DIMS" --gqa 2>&1 | tail -1
cute-flash warmup --jobs "$JOBS" --dtypes fp32 --head-dims 32,64,128,256 --gqa 2>&1 | tail -1
python3 -m tests.gpu.warm_sweep --jobs "$JOBS" 2>&1 | tail -1
python3 -m tests.gpu.test_window_softcap_alibi --warm 2>&1 | tail -1
python3 -m tests.gpu.test_varlen --warm 2>&1 | tail -1
python3 -m tests.gpu.test_dropout --warm 2>&1 | tail -1
echo "warmup: $(( $(date +%s) - start )) s"
status=0
if [ "$sanitize" = 1 ]; then
  bash scripts/sanitize.sh || status=1
fi
python3 -m pytest -q -rs -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
[ "$?" -eq 0 ] || status=1
exit $status
