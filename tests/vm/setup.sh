#!/usr/bin/env bash
# Prepares everything the VM harness needs, idempotently:
#   - Debian packages (QEMU 10 from bookworm-backports, rdma-core, perftest, busybox, libclang,
#     libvirt, debootstrap);
#   - the Debian kernel package, unpacked under target/vm/kernel/;
#   - an initramfs that loads virtio/9p/veth/rdma_rxe modules and runs tests/vm/guest-init.sh.
# Prints the cache directory on success. Safe to run any number of times.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache="$repo/target/vm"
mkdir -p "$cache"

log() { echo "vm-setup: $*" >&2; }

# Modules the guest loads, in dependency order after resolution through modules.dep: those
# every guest needs (the 9p root, the /tmp overlay, and uio_pci_generic, with which guest-lib's
# PCI transport drives the vrdma device of a nested guest), then those only a guest with
# rdma_rxe or a network card needs (a nested guest has neither and skips them: each module
# costs seconds under emulation inside emulation).
# crc32_generic: rxe needs the crc32 shash when a link is added (ENOENT otherwise).
# rdma_ucm: the connection manager for programs (/dev/infiniband/rdma_cm), which librdmacm
# programs and the backend's connection management (SPEC.md §13) use.
base_modules=(9p 9pnet_virtio overlay uio_pci_generic)
network_modules=(crc32_generic veth virtio_net ib_uverbs rdma_rxe rdma_ucm)

# QEMU comes from bookworm-backports (10.x: bookworm's 7.2 lacks vhost-user-device); the rest
# from the main suite.
backports_packages=(qemu-system-x86 qemu-system-data)
packages=(rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev rdmacm-utils
  perftest busybox-static cpio kmod xz-utils zstd libclang-dev clang pkg-config iproute2
  # to build the nested-VM tests' QEMU (tests/vm/qemu/build.sh)
  libglib2.0-dev libpixman-1-dev libfdt-dev libcap-ng-dev libattr1-dev ninja-build flex bison
  python3-venv patch
  # rdma-core's own test suite, run on rxe0 and on vrdma0 (tests/rdma-core-suite.py)
  python3-pyverbs
  # UCX's tools (ucx_info, ucx_perftest), run on vrdma0 (tests/tests/ibverbs_programs.rs), and
  # Open MPI over UCX (mpirun, and mpicc for the test's program)
  ucx-utils openmpi-bin libopenmpi-dev
  # libfabric's tools (fi_pingpong over its verbs provider), run on vrdma0
  # (tests/tests/rdmacm_programs.rs)
  libfabric-bin
  # to count the backend's instructions per WQE in the benchmark (callgrind)
  valgrind
  # the test command's check of the shell scripts (tests/run-all.sh)
  shellcheck
  # libvirt, which starts the VM the loopback host serves (tests/vm/libvirtd.sh, tests/pci-e2e.sh)
  libvirt-daemon-system libvirt-clients
  # the clean Debian system the packages are installed on (tests/vm/clean-root.sh)
  debootstrap)

# deb822 sources entry for bookworm-backports, derived from the machine's main Debian entry so
# that no package host is named here.
ensure_backports_source() {
  local main=/etc/apt/sources.list.d/debian.sources out=/etc/apt/sources.list.d/vrdma-backports.sources
  [ -f "$out" ] && return 0
  [ -f "$main" ] || fail "no $main: cannot derive the bookworm-backports source from it" \
    "add a deb822 entry for Debian bookworm (Types: deb, Suites: bookworm) to $main"
  local uri keyring
  uri=$(awk '/^URIs:/ {print $2; exit}' "$main")
  keyring=$(awk '/^Signed-By:/ {print $2; exit}' "$main")
  [ -n "$uri" ] || fail "no URIs line in $main" "give its Debian entry a URIs line"
  {
    echo "Types: deb deb-src"
    echo "URIs: $uri"
    echo "Suites: bookworm-backports"
    echo "Components: main"
    [ -n "$keyring" ] && echo "Signed-By: $keyring"
  } >"$out"
  rm -f "$cache/.apt-updated"
}

apt_update_once() {
  [ -f "$cache/.apt-updated" ] && return 0
  apt-get update -qq >"$cache/apt-update.log" 2>&1 ||
    fail "apt-get update failed (log: $cache/apt-update.log)" \
      "check the machine's Debian package sources, then run tests/vm/setup.sh again"
  touch "$cache/.apt-updated"
}

fail() { # WHAT FIX
  log "ERROR: $1"
  log "fix: $2"
  exit 1
}

missing_packages() { # prints the packages of "$@" that are not installed
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"
  done
}

qemu_major() {
  qemu-system-x86_64 --version 2>/dev/null | awk '/version/ { split($4, v, "."); print v[1]; exit }'
}

# apt-get install "$@" with its output in apt.log; on failure, names what could not be installed.
apt_install() { # SUITE-OPTION... -- PACKAGE...
  local options=()
  while [ "$1" != -- ]; do options+=("$1"); shift; done
  shift
  log "installing: $* (apt log: $cache/apt.log)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${options[@]}" "$@" \
    >>"$cache/apt.log" 2>&1; then
    grep -E '^(E:| .*: Depends:)' "$cache/apt.log" | tail -n 8 | sed 's/^/vm-setup:   apt: /' >&2
    fail "could not install: $*" \
      "the packages must be installable from the machine's Debian sources (bookworm, and bookworm-backports for QEMU); see $cache/apt.log"
  fi
}

ensure_packages() {
  local missing_main missing_bp missing_backports=
  mapfile -t missing_main < <(missing_packages "${packages[@]}")
  [ "$(qemu_major)" -ge 10 ] 2>/dev/null || missing_backports=1
  mapfile -t missing_bp < <(missing_packages "${backports_packages[@]}")
  [ ${#missing_bp[@]} -gt 0 ] && missing_backports=1
  [ ${#missing_main[@]} -eq 0 ] && [ -z "$missing_backports" ] && return 0
  ensure_backports_source
  apt_update_once
  : >"$cache/apt.log"
  [ ${#missing_main[@]} -gt 0 ] && apt_install -- "${missing_main[@]}"
  # -t makes backports the target release for the dependencies too (qemu-system-common,
  # seabios, ...): naming only the packages as pkg/bookworm-backports leaves their
  # dependencies to bookworm, whose versions do not fit.
  [ -n "$missing_backports" ] && apt_install -t bookworm-backports -- "${backports_packages[@]}"
  return 0
}

# What the harness relies on, checked after installing: each missing piece is named with its fix.
verify_setup() {
  local major
  major=$(qemu_major)
  [ -n "$major" ] || fail "qemu-system-x86_64 is not installed" \
    "apt-get install -t bookworm-backports ${backports_packages[*]}"
  [ "$major" -ge 10 ] || fail "qemu-system-x86_64 is version $major; the harness needs QEMU 10 or newer" \
    "apt-get install -t bookworm-backports ${backports_packages[*]}"
  # Captured, not piped into `grep -q`: grep stops at its match, and under pipefail the
  # writer's SIGPIPE would fail the check.
  local objects devices
  objects=$(qemu-system-x86_64 -object help 2>/dev/null || true)
  devices=$(qemu-system-x86_64 -device help 2>/dev/null || true)
  [[ $objects == *memory-backend-memfd* ]] ||
    fail "this QEMU cannot share guest RAM with vhost-user backends (no memory-backend-memfd)" \
      "install Debian's qemu-system-x86 from bookworm-backports"
  [[ $devices == *vhost-user* ]] ||
    fail "this QEMU has no vhost-user devices" "install Debian's qemu-system-x86 from bookworm-backports"
  local tool
  for tool in rdma:iproute2 ibv_devinfo:ibverbs-utils ib_write_bw:perftest busybox:busybox-static \
    cpio:cpio depmod:kmod valgrind:valgrind ninja:ninja-build ucx_perftest:ucx-utils \
    fi_pingpong:libfabric-bin shellcheck:shellcheck \
    mpirun:openmpi-bin mpicc:libopenmpi-dev \
    libvirtd:libvirt-daemon-system virsh:libvirt-clients debootstrap:debootstrap; do
    command -v "${tool%%:*}" >/dev/null || [ -x "/sbin/${tool%%:*}" ] ||
      fail "${tool%%:*} is missing" "apt-get install ${tool#*:}"
  done
  pkg-config --exists libibverbs librdmacm ||
    fail "libibverbs/librdmacm development files are missing (rdma-sys needs them)" \
      "apt-get install libibverbs-dev librdmacm-dev"
  [ -n "$(find /usr/lib -name 'libclang*.so*' -print -quit 2>/dev/null)" ] ||
    fail "libclang is missing (rdma-sys's bindgen needs it)" "apt-get install libclang-dev"
  [ -f "$cache/kernel/vmlinuz" ] || fail "the guest kernel is missing from $cache/kernel" \
    "rm -rf $cache/kernel and run tests/vm/setup.sh again"
  local version
  version=$(cat "$cache/kernel/version")
  grep -q '/rdma_rxe\.ko' "$cache/kernel/root/lib/modules/$version/modules.dep" ||
    fail "the guest kernel $version has no rdma_rxe module" \
      "rm -rf $cache/kernel and run tests/vm/setup.sh again (it takes the kernel from linux-image-amd64)"
}

# The kernel version comes from the backports metapackage's dependency, never hard-coded.
resolve_kernel_package() {
  apt_update_once
  apt-cache show -t bookworm-backports linux-image-amd64 2>/dev/null |
    awk '/^Depends:/ { for (i = 2; i <= NF; i++) if ($i ~ /^linux-image-[0-9]/) { gsub(",", "", $i); print $i; exit } }'
}

ensure_kernel() {
  if [ -f "$cache/kernel/version" ] && [ -f "$cache/kernel/vmlinuz" ]; then return 0; fi
  ensure_backports_source
  local pkg
  pkg=$(resolve_kernel_package)
  [ -n "$pkg" ] || fail "cannot resolve the kernel package from bookworm-backports' linux-image-amd64" \
    "check that apt-cache policy linux-image-amd64 lists bookworm-backports"
  log "fetching $pkg"
  rm -rf "$cache/kernel.tmp" && mkdir -p "$cache/kernel.tmp/deb"
  (cd "$cache/kernel.tmp/deb" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >&2) ||
    fail "could not download $pkg" "check the machine's Debian package sources and the network"
  dpkg -x "$cache"/kernel.tmp/deb/*.deb "$cache/kernel.tmp/root"
  local version
  version=$(ls "$cache/kernel.tmp/root/lib/modules")
  depmod -b "$cache/kernel.tmp/root" "$version"
  cp "$cache/kernel.tmp/root/boot/vmlinuz-$version" "$cache/kernel.tmp/vmlinuz"
  echo "$version" >"$cache/kernel.tmp/version"
  rm -rf "$cache/kernel" && mv "$cache/kernel.tmp" "$cache/kernel"
}

# Appends MODULE's dependencies (depth first) and then MODULE to the ordered list.
declare -A seen_module=()
ordered_modules=()
resolve_module() {
  local name=$1 dep_file=$2 line path deps d
  line=$(grep -E "/${name}\.ko(\.[a-z]+)?:" "$dep_file" | head -n1) || true
  if [ -z "$line" ]; then log "module $name not in this kernel; skipped"; return 0; fi
  path=${line%%:*}
  [ -n "${seen_module[$path]:-}" ] && return 0
  seen_module[$path]=1
  deps=${line#*:}
  for d in $deps; do
    d=$(basename "$d"); d=${d%%.ko*}
    resolve_module "$d" "$dep_file"
  done
  ordered_modules+=("$path")
}

# vrdma's pinning module for the guest kernel (guest-lib/kmod), which every guest loads: the
# vrdma PCI device's drivers pin the memory they give the device with it (SPEC.md §12).
ensure_pin_module() {
  "$repo/guest-lib/kmod/build.sh" "$(cat "$cache/kernel/version")" "$cache" >/dev/null ||
    fail "could not build the vrdma_pin module for the guest kernel" \
      "see the messages above; rm -rf $cache/headers-* $cache/kmod and run tests/vm/setup.sh again"
}

ensure_initramfs() {
  local stamp="$cache/initramfs.stamp" inputs
  inputs="$(cat "$cache/kernel/version") $(sha256sum "$repo/tests/vm/guest-init.sh" "$0" "$cache/kmod/vrdma_pin.ko" | awk '{print $1}' | tr '\n' ' ')"
  if [ -f "$cache/initrd.gz" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then return 0; fi
  local version root work
  version=$(cat "$cache/kernel/version")
  root="$cache/kernel/root"
  work="$cache/initramfs.tmp"
  rm -rf "$work" && mkdir -p "$work"/{bin,dev,proc,sys,newroot,modules}
  cp /bin/busybox "$work/bin/busybox"
  # Its applets as links made here once, not by `busybox --install` at every boot: each link is
  # system calls, which a nested guest pays dearly for (how much was not measured apart).
  local applet
  for applet in $(/bin/busybox --list); do
    [ -e "$work/bin/$applet" ] || ln -s busybox "$work/bin/$applet"
  done
  # modules/base lists the modules every guest loads, modules/network the others (each in
  # dependency order, the second after the first).
  local m n=0 path file list
  for m in "${base_modules[@]}"; do resolve_module "$m" "$root/lib/modules/$version/modules.dep"; done
  local base_count=${#ordered_modules[@]}
  for m in "${network_modules[@]}"; do resolve_module "$m" "$root/lib/modules/$version/modules.dep"; done
  : >"$work/modules/base"
  : >"$work/modules/network"
  for path in "${ordered_modules[@]}"; do
    n=$((n + 1))
    list=network
    [ "$n" -le "$base_count" ] && list=base
    file=$(printf '%02d-%s' "$n" "$(basename "${path%%.ko*}").ko")
    case "$path" in
      *.xz) xz -dc "$root/lib/modules/$version/$path" >"$work/modules/$file" ;;
      *.zst) zstd -qdc "$root/lib/modules/$version/$path" >"$work/modules/$file" ;;
      *) cp "$root/lib/modules/$version/$path" "$work/modules/$file" ;;
    esac
    echo "$file" >>"$work/modules/$list"
  done
  cp "$cache/kmod/vrdma_pin.ko" "$work/modules/00-vrdma_pin.ko"
  echo 00-vrdma_pin.ko >>"$work/modules/base"
  cp "$repo/tests/vm/guest-init.sh" "$work/init"
  chmod +x "$work/init"
  (cd "$work" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/initrd.gz.tmp"
  mv "$cache/initrd.gz.tmp" "$cache/initrd.gz"
  rm -rf "$work"
  echo "$inputs" >"$stamp"
}

ensure_packages
ensure_kernel
ensure_pin_module
ensure_initramfs
verify_setup
echo "$cache"
