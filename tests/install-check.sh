#!/usr/bin/env bash
# Installs vrdma's Debian packages on a clean Debian 12 system and checks the backend's unit
# (tests/install-guest.sh): the system is a debootstrap'ed root with systemd
# (tests/vm/clean-root.sh, made once and cached), booted in a test guest with rdma_rxe up
# (tests/vm/run.sh --root), where its own systemd runs the units as on a real host.
# usage: tests/install-check.sh DEB...   (packaging/build-debs.sh builds them)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || { echo "usage: $0 DEB..." >&2; exit 2; }
debs=()
for deb in "$@"; do debs+=("$(realpath --relative-to="$repo" "$deb")"); done
root=$("$repo/tests/vm/clean-root.sh" "${debs[@]/#/$repo/}")
cd "$repo"
# The clean system sees the machine's root at /machine.
tests/vm/run.sh --root "$root" -- bash tests/install-guest.sh "/machine$repo/target/vm/clean-deps" "${debs[@]}"
