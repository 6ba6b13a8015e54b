#!/usr/bin/env bash
# Installs vrdma's Debian packages on a clean Debian 12 system and checks them there
# (tests/install-guest.sh): the system is a debootstrap'ed root with systemd and udev
# (tests/vm/clean-root.sh, made once and cached), booted in a test guest with rdma_rxe up
# (tests/vm/run.sh --root), where its own systemd runs the units as on a real machine. The
# guest is a VM with a vrdma PCI device too, served from here by the packaged backend on the
# loopback host, so that the guest side's package meets a device.
# usage: tests/install-check.sh DEB...   (packaging/build-debs.sh builds them)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || { echo "usage: $0 DEB..." >&2; exit 2; }
debs=()
for deb in "$@"; do debs+=("$(realpath --relative-to="$repo" "$deb")"); done
root=$("$repo/tests/vm/clean-root.sh" "${debs[@]/#/$repo/}")
"$repo/tests/vm/qemu/build.sh" >/dev/null # the QEMU that gives the guest a vrdma device
cd "$repo"

work=$(mktemp -d /tmp/vrdma-install.XXXXXX)
backend=
trap '[ -z "$backend" ] || kill "$backend" 2>/dev/null; rm -rf "$work"' EXIT
dpkg-deb --extract "$(printf '%s\n' "${debs[@]}" | grep /vrdma-backend_)" "$work/root"
RUST_LOG=info "$work/root/usr/bin/vhost-user-rdma" --device loopback --socket-path "$work/vrdma.sock" \
  >"$work/backend.log" 2>&1 &
backend=$!
for _ in $(seq 100); do grep -q "accepting guests" "$work/backend.log" 2>/dev/null && break; sleep 0.1; done
grep -q "accepting guests" "$work/backend.log" || { cat "$work/backend.log" >&2; exit 1; }

# The clean system sees the machine's root at /machine.
tests/vm/run.sh --root "$root" --vrdma "$work/vrdma.sock" -- \
  bash tests/install-guest.sh "/machine$repo/target/vm/clean-deps" "${debs[@]}"
