#!/usr/bin/env bash
# The vrdma demo: boots the QEMU guest with rdma_rxe (installing what it needs on first use),
# then shows the backend's view of the device and real RC traffic through vrdma's host verbs
# layer beside native rdma-core on the same rxe device.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/vm/setup.sh >/dev/null
cargo build --release --locked -p vrdma-backend -p vrdma-tests --bins
exec tests/vm/run.sh -- tests/demo-guest.sh "$PWD/target/release"
