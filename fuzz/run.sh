#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer and runs each over its corpus (fuzz/corpus/TARGET,
# seeds committed, new finds kept under target/fuzz/corpus/TARGET).
# Builds with the machine's stable toolchain: the coverage instrumentation libFuzzer needs
# (LLVM's sancov pass) is reachable through stable rustc flags, as cargo-fuzz passes them
# when no sanitizer is asked for; integer overflow and debug assertions are on.
#   fuzz/run.sh [--brief] [SECONDS_PER_TARGET] [TARGET...]   (default 30 s, every target)
#   fuzz/run.sh [--brief] --build-only                         (build every target, run none)
#   --brief  build with less optimisation (profile brief), for runs of a few seconds
#   VRDMA_FUZZ_RUNS=N  stop each target after N executions instead of after SECONDS
# A crash fails the run and leaves its input under target/fuzz/artifacts/TARGET/; add it to
# fuzz/corpus/TARGET so that every later run replays it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
profile=release
if [ "${1:-}" = --brief ]; then
  profile=brief
  shift
fi
build_only=0
if [ "${1:-}" = --build-only ]; then
  build_only=1
  shift
fi
seconds=${1:-30}
shift || true
triple=$(rustc -vV | awk '/^host:/ {print $2}')
export CARGO_TARGET_DIR="$here/../target/fuzz/build"
# Only the fuzzed code is instrumented: an explicit --target keeps these flags off build
# scripts and proc macros.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
cargo build --manifest-path "$here/Cargo.toml" --locked --profile "$profile" --bins --target "$triple"
[ "$build_only" = 0 ] || exit 0
targets=("$@")
[ ${#targets[@]} -gt 0 ] ||
  mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' "$here/Cargo.toml" | grep -v '^vrdma-fuzz$')
# One target per core at a time (a libFuzzer process is one thread); their lines are printed
# once all have ended, in the order of the targets.
run_target() {
  local target=$1 corpus="$here/../target/fuzz/corpus/$1" artifacts="$here/../target/fuzz/artifacts/$1"
  mkdir -p "$corpus" "$artifacts" "$here/corpus/$target"
  local limit=(-max_total_time="$seconds")
  [ -n "${VRDMA_FUZZ_RUNS:-}" ] && limit=(-runs="$VRDMA_FUZZ_RUNS")
  local log="$here/../target/fuzz/$target.log" runs cov
  if "$CARGO_TARGET_DIR/$triple/$profile/$target" "$corpus" "$here/corpus/$target" \
    "${limit[@]}" -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1; then
    runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1)
    echo "fuzz: $target ok: $runs executions, $cov edges, corpus $(ls "$corpus" | wc -l)"
  else
    echo "fuzz: $target FAILED (log: $log):"
    grep -m1 -A4 'panicked\|ERROR: libFuzzer' "$log" || tail -n 20 "$log"
    return 1
  fi
}
lines=$(mktemp -d)
trap 'rm -rf "$lines"' EXIT
failed=0 running=0
for target in "${targets[@]}"; do
  if [ "$running" -ge "$(nproc)" ]; then
    wait -n || failed=$((failed + 1))
    running=$((running - 1))
  fi
  run_target "$target" >"$lines/$target" &
  running=$((running + 1))
done
for ((; running > 0; running--)); do wait -n || failed=$((failed + 1)); done
for target in "${targets[@]}"; do cat "$lines/$target"; done
[ "$failed" -eq 0 ]
