#!/usr/bin/env bash
# Repacks the GPU bundle's flash-attn-4 archive (.device/fa4.tar.xz) without apache-tvm-ffi's
# 3rdparty/ folder (dlpack and libbacktrace sources, read only when building an extension from
# source), its src/ folder (the C++ sources its shared libraries were built from) and its stub/
# package (a command-line stub generator, never imported by the library). That frees ~320 KB of
# the 64 MiB a GPU run may carry (docs/dsl-notes.md, tests/cpu/test_tree_size.py); tvm_ffi still
# imports without them (checked 2026-11-29 with the bundle's 0.1.15). libtvm_ffi_testing.so stays:
# tvm_ffi loads it at import.
# Safe to run twice. A GPU machine that unpacked the full archive before keeps its copy.
set -euo pipefail
archive=${1:-.device/fa4.tar.xz}
[ -f "$archive" ] || { echo "no $archive: build the bundle with --with-fa4 first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$archive" -C "$work"
if [ ! -d "$work/tvm_ffi/3rdparty" ] && [ ! -d "$work/tvm_ffi/src" ] && [ ! -d "$work/tvm_ffi/stub" ]; then
  echo "$archive: already slim ($(stat -c %s "$archive") bytes)"; exit 0
fi
rm -rf "$work/tvm_ffi/3rdparty" "$work/tvm_ffi/src" "$work/tvm_ffi/stub"
before=$(stat -c %s "$archive")
# a new file, not an overwrite: the bundle's files may be hard links into the bundle cache
tar -cf - -C "$work" . | xz -9e -T2 > "$archive.new"
rm -f "$archive" && mv "$archive.new" "$archive"
echo "$archive: $before -> $(stat -c %s "$archive") bytes"
