#!/usr/bin/env bash
# On a GPU machine: Nsight Compute reports for a list of cases, one `python -m perf.profile_call` each.
# Each argument is one case: "<name>:<perf.profile_call arguments>", e.g.
#   scripts/ncu-profile.sh "bwd128:--method ours --pass bwd --headdim 128"
# Writes <name>.ncu-rep, <name>.log and a text summary <name>.txt (every kernel's speed-of-light,
# occupancy, launch, warp-state and memory sections) into $OUT/ncu.tgz (one file: the device
# returns a limited number of files), and one line per case to stdout and $OUT/ncu-summary.txt.
# Clocks are left alone (--clock-control none) unless NCU_CLOCK says otherwise (base: locked at the
# base clock, so a kernel's cycles do not depend on its power draw).
set -o pipefail
OUT=${OUT:-/tmp/cute-flash-out}
mkdir -p "$OUT/ncu"
# A second call in the same run adds to the first one's reports instead of replacing them.
[ -f "$OUT/ncu.tgz" ] && tar xzf "$OUT/ncu.tgz" -C "$OUT"
SET=${NCU_SET:-full}
CLOCK=${NCU_CLOCK:-none}
for case in "$@"; do
  name=${case%%:*}
  args=${case#*:}
  # shellcheck disable=SC2086
  ncu --clock-control "$CLOCK" --profile-from-start off --set "$SET" --import-source no \
      -f -o "$OUT/ncu/$name" python3 -m perf.profile_call $args > "$OUT/ncu/$name.log" 2>&1 \
    || { echo "$name: ncu failed"; tail -5 "$OUT/ncu/$name.log"; continue; }
  ncu --import "$OUT/ncu/$name.ncu-rep" --page details \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section InstructionStats > "$OUT/ncu/$name.txt" 2>&1
  # Stall reasons and instruction mix, one "kernel | metric | value" line each.
  ncu --import "$OUT/ncu/$name.ncu-rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, re, sys
rows = list(csv.reader(sys.stdin))
head, want = rows[0], re.compile(r"smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$|smsp__inst_executed\.sum$|sm__pipe_tensor_op_(hmma|gmma)_cycles_active\.avg\.pct_of_peak_sustained_active$|smsp__sass_inst_executed_op_\w+\.sum$|sm__inst_executed_pipe_\w+\.avg\.pct_of_peak_sustained_active$")
name = head.index("Kernel Name")
for r in rows[2:]:
    for h, v in zip(head, r):
        if want.search(h) and v not in ("", "0", "0.00"):
            print(r[name][:60], "|", h, "|", v)
' > "$OUT/ncu/$name.raw.txt"
  echo "$name: $(grep -cE '^  [A-Za-z_]' "$OUT/ncu/$name.txt") kernels, $(grep -E 'Duration' "$OUT/ncu/$name.txt" | tr -s ' ' | tr '\n' ';')" \
    | tee -a "$OUT/ncu-summary.txt"
done
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
