#!/usr/bin/env bash
# The test command's steps that need rdma_rxe, in one boot of the rxe guest (tests/run-all.sh
# runs this in it through tests/vm/run.sh): the integration tests and a smoke run of the
# benchmarks that run in the guest. Each step runs whatever the one before did; exits 1 if
# either failed.
# usage: tests/rxe-tier.sh BIN_DIR TEST_BINARY...
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/steps.sh"
bin=$1
shift
status=0

step "integration tests that need real RDMA (rdma_rxe in the guest)"
"$repo/tests/guest-tests.sh" "$@" || status=1

step "the benchmarks in the rxe guest, a smoke run (few iterations; numbers are not checked)"
VRDMA_BENCH_LAT_ITERS=50 VRDMA_BENCH_BW_ITERS=100 VRDMA_BENCH_QPS=256 VRDMA_BENCH_GUESTS=8 \
  VRDMA_BENCH_MR_MIB=64 VRDMA_BENCH_CALLGRIND_WRITES=100 VRDMA_BENCH_CALLGRIND_ONE_IN_FLIGHT=0 \
  VRDMA_BENCH_CM_CONNECTIONS=10 \
  VRDMA_BENCH_TESTS="write_lat write_bw" VRDMA_BENCH_PINNED_TESTS=read_lat \
  "$repo/tests/bench-guest.sh" "$bin" || status=1

exit "$status"
