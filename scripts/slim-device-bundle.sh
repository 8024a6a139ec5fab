#!/usr/bin/env bash
# Repacks the GPU bundle's flash-attn-4 archive (.device/fa4.tar.xz) without apache-tvm-ffi's
# 3rdparty/ folder (dlpack and libbacktrace sources, read only when building an extension from
# source). That frees ~230 KB of the 64 MiB a GPU run may carry (docs/dsl-notes.md,
# tests/cpu/test_tree_size.py). libtvm_ffi_testing.so stays: tvm_ffi loads it at import.
# Safe to run twice. A GPU machine that unpacked the full archive before keeps its copy.
set -euo pipefail
archive=${1:-.device/fa4.tar.xz}
[ -f "$archive" ] || { echo "no $archive: build the bundle with --with-fa4 first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$archive" -C "$work"
if [ ! -d "$work/tvm_ffi/3rdparty" ]; then
  echo "$archive: already slim ($(stat -c %s "$archive") bytes)"; exit 0
fi
rm -rf "$work/tvm_ffi/3rdparty"
before=$(stat -c %s "$archive")
# a new file, not an overwrite: the bundle's files may be hard links into the bundle cache
tar -cf - -C "$work" . | xz -9e -T2 > "$archive.new"
rm -f "$archive" && mv "$archive.new" "$archive"
echo "$archive: $before -> $(stat -c %s "$archive") bytes"
