#!/usr/bin/env bash
# Build kinetic's C++ kernels with AddressSanitizer and UndefinedBehaviorSanitizer into a
# standalone self-test (no Python, no XLA) and run it: every format and ISA path this CPU
# has, 1 and 2 threads, attention and the row pieces. Any bad access or undefined behaviour
# aborts with the sanitizer's report; a path that disagrees with the reference fails.
#
#   scripts/sanitize_kernels.sh            # g++ (or CXX=clang++)
set -euo pipefail
cd "$(dirname "$0")/.."
CSRC=kinetic/kernels/csrc
OUT=${TMPDIR:-/tmp}/kinetic-kernels-selftest
# every kernel source except the FFI handlers and the C ABI (they need XLA / ctypes)
SOURCES=$(ls $CSRC/*.cc | grep -v -e '/ffi' -e '/capi')
FLAGS="-std=c++17 -O1 -g -fno-omit-frame-pointer -ffp-contract=off
  -fsanitize=address,undefined -fno-sanitize-recover=all -I$CSRC"
# each source on its own, as many at once as the machine has cores, then one link
OBJ="$OUT.objs"
rm -rf "$OBJ" && mkdir -p "$OBJ"
export CXX=${CXX:-g++} FLAGS OBJ
printf '%s\n' $SOURCES $CSRC/selftest/selftest.cc |
  xargs -P "$(nproc)" -I{} sh -c '$CXX $FLAGS -c "$1" -o "$OBJ/$(basename "$1" .cc).o"' _ {}
$CXX $FLAGS "$OBJ"/*.o -o "$OUT" -pthread
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$OUT"
