#!/usr/bin/env bash
# Prepares everything the VM harness needs, idempotently:
#   - Debian packages (QEMU 10 from bookworm-backports, rdma-core, perftest, busybox, libclang);
#   - the Debian kernel package, unpacked under target/vm/kernel/;
#   - an initramfs that loads virtio/9p/veth/rdma_rxe modules and runs tests/vm/guest-init.sh.
# Prints the cache directory on success. Safe to run any number of times.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache="$repo/target/vm"
mkdir -p "$cache"

log() { echo "vm-setup: $*" >&2; }

# Modules the guest loads, in dependency order after resolution through modules.dep.
# crc32_generic: rxe needs the crc32 shash when a link is added (ENOENT otherwise).
# uio_pci_generic: guest-lib's PCI transport drives the vrdma device of a nested guest with it.
guest_modules=(crc32_generic veth 9p 9pnet_virtio overlay virtio_net ib_uverbs rdma_rxe
  uio_pci_generic)

# QEMU comes from bookworm-backports (10.x: bookworm's 7.2 lacks vhost-user-device); the rest
# from the main suite.
backports_packages=(qemu-system-x86 qemu-system-data)
packages=(rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev rdmacm-utils
  perftest busybox-static cpio kmod xz-utils zstd libclang-dev clang pkg-config iproute2
  # to build the nested-VM tests' QEMU (tests/vm/qemu/build.sh)
  libglib2.0-dev libpixman-1-dev libfdt-dev libcap-ng-dev libattr1-dev ninja-build flex bison
  python3-venv patch
  # to count the backend's instructions per WQE in the benchmark (callgrind)
  valgrind)

# deb822 sources entry for bookworm-backports, derived from the machine's main Debian entry so
# that no package host is named here.
ensure_backports_source() {
  local main=/etc/apt/sources.list.d/debian.sources out=/etc/apt/sources.list.d/vrdma-backports.sources
  [ -f "$out" ] && return 0
  [ -f "$main" ] || { log "no $main: cannot derive the backports source"; return 1; }
  local uri keyring
  uri=$(awk '/^URIs:/ {print $2; exit}' "$main")
  keyring=$(awk '/^Signed-By:/ {print $2; exit}' "$main")
  [ -n "$uri" ] || { log "no URIs line in $main"; return 1; }
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
  apt-get update -qq
  touch "$cache/.apt-updated"
}

ensure_packages() {
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  for p in "${backports_packages[@]}"; do
    dpkg-query -W -f='${Version}' "$p" 2>/dev/null | grep -q '^1:10\.' || missing+=("$p/bookworm-backports")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing: ${missing[*]} (apt log: $cache/apt.log)"
  ensure_backports_source
  apt_update_once
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" \
    >"$cache/apt.log" 2>&1 || { tail -n 30 "$cache/apt.log" >&2; return 1; }
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
  [ -n "$pkg" ] || { log "cannot resolve the kernel package from linux-image-amd64"; return 1; }
  log "fetching $pkg"
  rm -rf "$cache/kernel.tmp" && mkdir -p "$cache/kernel.tmp/deb"
  (cd "$cache/kernel.tmp/deb" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >&2)
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

ensure_initramfs() {
  local stamp="$cache/initramfs.stamp" inputs
  inputs="$(cat "$cache/kernel/version") $(sha256sum "$repo/tests/vm/guest-init.sh" "$0" | awk '{print $1}' | tr '\n' ' ')"
  if [ -f "$cache/initrd.gz" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then return 0; fi
  local version root work
  version=$(cat "$cache/kernel/version")
  root="$cache/kernel/root"
  work="$cache/initramfs.tmp"
  rm -rf "$work" && mkdir -p "$work"/{bin,dev,proc,sys,newroot,modules}
  cp /bin/busybox "$work/bin/busybox"
  local m
  for m in "${guest_modules[@]}"; do resolve_module "$m" "$root/lib/modules/$version/modules.dep"; done
  local n=0 path file
  : >"$work/modules/order"
  for path in "${ordered_modules[@]}"; do
    n=$((n + 1))
    file=$(printf '%02d-%s' "$n" "$(basename "${path%%.ko*}").ko")
    case "$path" in
      *.xz) xz -dc "$root/lib/modules/$version/$path" >"$work/modules/$file" ;;
      *.zst) zstd -qdc "$root/lib/modules/$version/$path" >"$work/modules/$file" ;;
      *) cp "$root/lib/modules/$version/$path" "$work/modules/$file" ;;
    esac
    echo "$file" >>"$work/modules/order"
  done
  cp "$repo/tests/vm/guest-init.sh" "$work/init"
  chmod +x "$work/init"
  (cd "$work" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/initrd.gz.tmp"
  mv "$cache/initrd.gz.tmp" "$cache/initrd.gz"
  rm -rf "$work"
  echo "$inputs" >"$stamp"
}

ensure_packages
ensure_kernel
ensure_initramfs
echo "$cache"
