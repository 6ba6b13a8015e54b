#!/usr/bin/env bash
# Runs every vrdma check and test: formatting, clippy, unit tests on this machine, then the
# integration tests that need real RDMA inside a QEMU guest with rdma_rxe (tests/vm/).
# Installs what it needs on first use (tests/vm/setup.sh); caches under target/.
#   VRDMA_VM_NO_RXE=1  boot the guest without rdma_rxe: the RDMA tests must then fail.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "setup (packages, kernel, initramfs)"
tests/vm/setup.sh >/dev/null

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit tests (this machine)"
cargo test --workspace --locked

step "build the integration tests"
mapfile -t binaries < <(cargo test -p vrdma-tests --tests --no-run --locked --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") \
            and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
[ ${#binaries[@]} -gt 0 ] || { echo "run-all: no integration test binaries were built" >&2; exit 1; }

step "integration tests with real RDMA (QEMU guest, rdma_rxe)"
tests/vm/run.sh -- tests/guest-tests.sh "${binaries[@]}"
