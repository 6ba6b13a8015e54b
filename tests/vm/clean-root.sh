#!/usr/bin/env bash
# Prepares, once, what tests/install-check.sh installs vrdma's packages on: a clean Debian 12
# root file system (debootstrap, minbase with systemd and udev) under target/vm/clean-root/,
# and, for the packages built now, a local package source holding every package they need
# that the clean root lacks (under target/vm/clean-deps/): the guest that boots the root has
# no network, so apt resolves and installs from that folder. The root is never booted
# writable: the guest puts a tmpfs over it (tests/vm/run.sh --root).
# usage: tests/vm/clean-root.sh [DEB...]   (prints the root's path; without DEBs it makes only
#        the root, which needs no package built)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=$repo/target/vm
root=$cache/clean-root deps=$cache/clean-deps
log() { echo "clean-root: $*" >&2; }
fail() { log "ERROR: $1"; log "fix: $2"; exit 1; }
mkdir -p "$cache"
debs=()
for deb in "$@"; do debs+=("$(realpath "$deb")"); done # apt takes a file for a path only

# The mirror is the machine's own: read from its Debian entry, never named here.
mirror() {
  local main=/etc/apt/sources.list.d/debian.sources
  [ -f "$main" ] || fail "no $main to take the Debian mirror from" "give the machine a deb822 entry for bookworm"
  awk '/^URIs:/ { print $2; exit }' "$main"
}

# What every installed Debian system has and the packages rely on: systemd as init, udev
# (which starts vrdmad when the vrdma device appears).
include=systemd,systemd-sysv,udev
if [ "$(cat "$root/.complete" 2>/dev/null)" != "$include" ]; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing" "run tests/vm/setup.sh (or apt-get install debootstrap)"
  log "making a clean Debian 12 root with systemd (once; a few minutes; log: $cache/clean-root.log)"
  rm -rf "$root"
  debootstrap --variant=minbase --include="$include" bookworm "$root" "$(mirror)" \
    >"$cache/clean-root.log" 2>&1 ||
    fail "debootstrap failed (log: $cache/clean-root.log)" "check the network and the machine's Debian mirror"
  # No machine id yet, as on a fresh install.
  rm -f "$root/etc/machine-id" && touch "$root/etc/machine-id"
  echo "$include" >"$root/.complete"
fi

# The packages' dependencies the root lacks, downloaded as apt would on it (its dpkg status
# file stands in for the machine's), into a local source; done again when the packages'
# dependencies or the root change.
[ ${#debs[@]} -gt 0 ] || { echo "$root"; exit 0; }
want=$({ echo "$include"; for deb in "${debs[@]}"; do dpkg-deb -f "$deb" Package Depends; done; } |
  sha256sum | cut -d' ' -f1)
if [ "$(cat "$deps/.for" 2>/dev/null)" != "$want" ]; then
  log "downloading what the packages need into a local package source ($deps)"
  rm -rf "$deps" && mkdir -p "$deps/partial"
  apt-get install --download-only -y -qq --no-install-recommends \
    -o Dir::State::status="$root/var/lib/dpkg/status" -o Dir::Cache::archives="$deps" \
    -o APT::Sandbox::User=root "${debs[@]}" >"$cache/clean-deps.log" 2>&1 ||
    fail "apt could not fetch the packages' dependencies (log: $cache/clean-deps.log)" \
      "check the machine's package sources and the network"
  rm -rf "$deps/partial" "$deps/lock"
  (cd "$deps" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null >Packages)
  echo "$want" >"$deps/.for"
fi
echo "$root"
