#!/usr/bin/env bash
# Runs inside the test guest: every test binary given, with the tests that need rxe included.
# Fails on the first failing binary, so a missing rxe device fails the suite.
set -uo pipefail
[ -d "/sys/class/infiniband/${VRDMA_TEST_DEVICE:-rxe0}" ] ||
  echo "guest-tests: RDMA device ${VRDMA_TEST_DEVICE:-rxe0} is missing: rdma_rxe is not loaded or no rxe link was added" >&2
status=0
for binary in "$@"; do
  echo "guest-tests: running $(basename "$binary") against ${VRDMA_TEST_DEVICE:-rxe0}"
  "$binary" --include-ignored --test-threads=1 || status=1
done
exit $status
