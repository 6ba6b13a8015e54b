#!/usr/bin/env bash
# Builds the QEMU the nested-VM tests run: Debian's QEMU 10.0 source with
# vhost-user-rdma.patch (the generic vhost-user PCI device made user-creatable, migratable with
# its back end's state, and reconnecting; virtio id 42 given a name), x86_64 system emulator only, TCG, the devices of tests/vm/qemu/devices.mak,
# no firmware, no debug information (each a fifth or more less build time: this build is on the
# path of every fresh clone's test command).
# Idempotent: the result is cached under target/qemu/ and rebuilt only when this script, the
# patch or the device list change.
# Prints the path of the built qemu-system-x86_64.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../../.." && pwd)
cache="$repo/target/qemu"
patch="$repo/tests/vm/qemu/vhost-user-rdma.patch"
devices="$repo/tests/vm/qemu/devices.mak"
binary="$cache/build/qemu-system-x86_64"
mkdir -p "$cache"

log() { echo "qemu-build: $*" >&2; }

"$repo/tests/vm/setup.sh" >/dev/null # packages, including the build dependencies

inputs=$(sha256sum "$0" "$patch" "$devices" | awk '{print $1}' | tr '\n' ' ')
if [ -x "$binary" ] && [ "$(cat "$cache/stamp" 2>/dev/null)" = "$inputs" ]; then
  echo "$binary"
  exit 0
fi

# The newest 10.0.x source in the configured suites, and its upstream tarball's checksum.
read -r version tarball sha256 < <(apt-cache showsrc qemu | awk '
  /^Version:/ { version = $2 }
  /^Checksums-Sha256:/ { in_sums = 1; next }
  /^[^ ]/ { in_sums = 0 }
  in_sums && $3 ~ /\.orig\.tar\.xz$/ && version ~ /^1:10\.0\./ { print version, $3, $1 }' |
  sort -V | tail -n1)
[ -n "${tarball:-}" ] || { log "no QEMU 10.0 source package: is the backports deb-src entry configured?"; exit 1; }

mkdir -p "$cache/download"
if ! echo "$sha256  $cache/download/$tarball" | sha256sum -c --status 2>/dev/null; then
  log "fetching the QEMU $version source"
  # Only the upstream tarball is needed; apt may fail on the Debian packaging files.
  (cd "$cache/download" && apt-get source --download-only -qq "qemu=$version" >/dev/null 2>&1) || true
  echo "$sha256  $cache/download/$tarball" | sha256sum -c --status ||
    { log "could not fetch $tarball (or its checksum differs)"; exit 1; }
fi

if [ ! -x "$cache/venv/bin/meson" ]; then
  log "preparing a Python venv with meson"
  python3 -m venv "$cache/venv"
  "$cache/venv/bin/pip" install -q meson==1.5.0 pycotap==1.3.1
fi

log "building QEMU $version with the vrdma patch (a few minutes; log: $cache/build.log)"
rm -rf "$cache/src" "$cache/build"
mkdir -p "$cache/src"
tar -xf "$cache/download/$tarball" -C "$cache/src" --strip-components=1
patch -d "$cache/src" -p1 --quiet <"$patch"
cp "$devices" "$cache/src/configs/devices/x86_64-softmmu/vrdma-test.mak"
mkdir -p "$cache/build"
(
  cd "$cache/build"
  "$cache/src/configure" --python="$cache/venv/bin/python3" --target-list=x86_64-softmmu \
    --without-default-features --without-default-devices --with-devices-x86_64=vrdma-test \
    --enable-tcg --enable-kvm --enable-vhost-user --enable-virtfs --enable-attr \
    --enable-cap-ng --enable-fdt=system --disable-docs --disable-install-blobs \
    --disable-debug-info --disable-qom-cast-debug
  ninja qemu-system-x86_64
) >"$cache/build.log" 2>&1 || { tail -n 40 "$cache/build.log" >&2; exit 1; }
echo "$inputs" >"$cache/stamp"
echo "$binary"
