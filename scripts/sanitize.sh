#!/usr/bin/env bash
# On a GPU machine: compute-sanitizer's memcheck, racecheck and synccheck over one small call of
# each kernel family (scripts/sanitize-calls.py). The calls run once outside the sanitizer first,
# which compiles their kernels into the disk cache, so that under the sanitizer nothing is compiled
# (the calls fail if something is). Exits non-zero if any tool reports an error, a call fails, or a
# tool runs past SANITIZE_TIMEOUT seconds (default 150). Logs: $OUT/sanitize-<tool>.log.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cute-flash-out}
mkdir -p "$OUT"
export CUTE_FLASH_CACHE_DIR=${CUTE_FLASH_CACHE_DIR:-/tmp/cute-flash-cache}
SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$SANITIZER" ]; then
  echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
python3 scripts/sanitize-calls.py > "$OUT/sanitize-warm.log" 2>&1 || { echo "sanitize: the calls fail without the sanitizer"; tail -20 "$OUT/sanitize-warm.log"; exit 1; }

# One cudaMalloc per tensor: memcheck then sees each tensor's own bounds, not a pool's.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for tool in memcheck racecheck synccheck; do
  start=$(date +%s)
  timeout "${SANITIZE_TIMEOUT:-150}" "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      python3 scripts/sanitize-calls.py --expect-warm > "$OUT/sanitize-$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize-$tool.log" | tail -1)
  echo "sanitize $tool: exit $rc, $(( $(date +%s) - start )) s, ${summary:-no summary}"
  if [ "$rc" -ne 0 ]; then
    status=1
    grep -E "^=========" "$OUT/sanitize-$tool.log" | head -30
    tail -5 "$OUT/sanitize-$tool.log"
  fi
done
exit $status
