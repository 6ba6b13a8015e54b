#!/usr/bin/env bash
# Builds vrdma_pin.ko (the guest's pinning module, vrdma_pin.c) for the Debian kernel VERSION,
# from that kernel's header packages, fetched once and unpacked under CACHE (not installed:
# they would pull the kernel image onto this machine). Prints the module's path. Idempotent:
# the module is rebuilt only when its sources or the kernel change.
# usage: guest-lib/kmod/build.sh VERSION CACHE
set -euo pipefail
version=$1
mkdir -p "$2"
cache=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
out="$cache/kmod"
log() { echo "vrdma-pin: $*" >&2; }

stamp="$version $(cat "$here/vrdma_pin.c" "$here/vrdma_pin.h" "$here/Kbuild" "$0" | sha256sum | cut -c1-16)"
if [ -f "$out/vrdma_pin.ko" ] && [ "$(cat "$out/stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$out/vrdma_pin.ko"
  exit 0
fi

# linux-headers-VERSION (e.g. 6.12.95+deb12-amd64), its -common and the kbuild tools: their
# symlinks are relative, so the three unpacked into one folder build as if installed.
abi=${version%-*}
headers="$cache/headers-$version"
if [ ! -d "$headers/usr/src/linux-headers-$version" ]; then
  log "fetching the headers of $version"
  rm -rf "$headers.tmp" && mkdir -p "$headers.tmp/deb"
  (cd "$headers.tmp/deb" && apt-get download -qq -o APT::Sandbox::User=root \
    "linux-headers-$version" "linux-headers-$abi-common" "linux-kbuild-$abi" >&2) || {
    log "cannot download the headers of $version: check the machine's Debian package sources"
    exit 1
  }
  for deb in "$headers.tmp"/deb/*.deb; do dpkg -x "$deb" "$headers.tmp/root"; done
  rm -rf "$headers" && mv "$headers.tmp/root" "$headers" && rm -rf "$headers.tmp"
fi

# The kernel's own compiler (its .config names it), and no BTF for the module (that needs
# pahole, and nothing reads the module's BTF).
compiler=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\([^ ]*\) .*/\1/p' "$headers/usr/src/linux-headers-$version/.config")
command -v "$compiler" >/dev/null || compiler=gcc
work="$out/build"
rm -rf "$work" && mkdir -p "$work"
cp "$here/vrdma_pin.c" "$here/vrdma_pin.h" "$here/Kbuild" "$work/"
make -s -C "$headers/usr/src/linux-headers-$abi-common" O="$headers/usr/src/linux-headers-$version" \
  M="$work" CC="$compiler" CONFIG_DEBUG_INFO_BTF_MODULES= modules >&2
cp "$work/vrdma_pin.ko" "$out/vrdma_pin.ko"
echo "$stamp" >"$out/stamp"
echo "$out/vrdma_pin.ko"
