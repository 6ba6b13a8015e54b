#!/usr/bin/env bash
# Runs inside the test guest: of every test binary given, the tests that need rxe (those
# marked #[ignore = "needs rdma_rxe..."]); the rest ran under `cargo test` on the loopback
# host already. The binaries whose subject is the host's verbs layer or connection manager
# itself (hostverbs, control_path, cm), or host objects handed between connections
# (handover), run whole: on rxe0 their tests drive libibverbs and librdmacm, which the
# loopback host stands in for. A failing binary fails the suite, so a missing rxe device fails it. Each
# test's line says how long it took, so the slow ones show in CI's log.
set -uo pipefail
[ -d "/sys/class/infiniband/${VRDMA_TEST_DEVICE:-rxe0}" ] ||
  echo "guest-tests: RDMA device ${VRDMA_TEST_DEVICE:-rxe0} is missing: rdma_rxe is not loaded or no rxe link was added" >&2

# libtest ends a test's line when the test ends, and tests run one at a time: the time
# between two lines is the test's.
timed() {
  local line last=$SECONDS
  while IFS= read -r line; do
    case $line in
    "test "*" ... "*) printf '%s (%d s)\n' "$line" $((SECONDS - last)) ;;
    *) printf '%s\n' "$line" ;;
    esac
    last=$SECONDS
  done
}

status=0
for binary in "$@"; do
  case $(basename "$binary") in
  hostverbs-* | control_path-* | cm-* | handover-*) which=--include-ignored ;;
  *) which=--ignored ;;
  esac
  echo "guest-tests: running $(basename "$binary") $which against ${VRDMA_TEST_DEVICE:-rxe0}"
  "$binary" "$which" --test-threads=1 2>&1 | timed || status=1
done
exit $status
