#!/usr/bin/env bash
# On a GPU machine: Nsight Compute reports for a list of cases, one `python -m perf.profile` each.
# Each argument is one case: "<name>:<perf.profile arguments>", e.g.
#   scripts/ncu-profile.sh "bwd128:--method ours --pass bwd --headdim 128"
# Writes <name>.ncu-rep, <name>.log and a text summary <name>.txt (every kernel's speed-of-light,
# occupancy, launch, warp-state and memory sections) into $OUT/ncu.tgz (one file: the device
# returns a limited number of files), and one line per case to stdout and $OUT/ncu-summary.txt.
# Clocks are left alone (--clock-control none).
set -o pipefail
OUT=${OUT:-/tmp/cute-flash-out}
mkdir -p "$OUT/ncu"
SET=${NCU_SET:-full}
for case in "$@"; do
  name=${case%%:*}
  args=${case#*:}
  # shellcheck disable=SC2086
  ncu --clock-control none --profile-from-start off --set "$SET" --import-source no \
      -f -o "$OUT/ncu/$name" python3 -m perf.profile $args > "$OUT/ncu/$name.log" 2>&1 \
    || { echo "$name: ncu failed"; tail -5 "$OUT/ncu/$name.log"; continue; }
  ncu --import "$OUT/ncu/$name.ncu-rep" --page details \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section InstructionStats > "$OUT/ncu/$name.txt" 2>&1
  echo "$name: $(grep -cE '^  [A-Za-z_]' "$OUT/ncu/$name.txt") kernels, $(grep -E 'Duration' "$OUT/ncu/$name.txt" | tr -s ' ' | tr '\n' ';')" \
    | tee -a "$OUT/ncu-summary.txt"
done
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
