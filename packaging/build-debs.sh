#!/usr/bin/env bash
# Builds vrdma's Debian packages from the workspace (release unless --debug), into target/debs/ (or OUT_DIR):
# - vrdma-backend: vhost-user-rdma and vrdmactl, the systemd unit (backend/systemd), its
#   users, the default guest declarations (/etc/vrdma/guests.toml) and options
#   (/etc/default/vrdma-backend), a libvirt domain for a VM with a vrdma device (an example);
# - vrdma-guest: for programs in a VM (or on a host) that use a vrdma device: vrdma's
#   libibverbs.so.1 and librdmacm.so.1 (/usr/lib/vrdma), vrdma-run, the guest service vrdmad
#   and its unit, which the vrdma PCI device starts (udev rule), and the source of the
#   vrdma_pin module for DKMS.
# usage: packaging/build-debs.sh [--debug] [OUT_DIR]   (prints the packages' paths)
#   --debug  package the debug build (target/debug) instead: the test command checks the
#            packages of the build it tests, and spares CI a release build of its own
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
profile=release link_flags=(--release)
if [ "${1:-}" = --debug ]; then
  profile=debug link_flags=()
  shift
fi
out=$(mkdir -p "${1:-$repo/target/debs}" && cd "${1:-$repo/target/debs}" && pwd)
cd "$repo"
# The workspace's build (link.sh makes it), vrdma's libibverbs.so.1 and librdmacm.so.1 beside it.
lib_dir=$(guest-lib/ibverbs/link.sh "${link_flags[@]}")
version=$(awk -F'"' '/^version/ { print $2; exit }' Cargo.toml)
arch=$(dpkg --print-architecture)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# package NAME DEPENDS DESCRIPTION [RECOMMENDS]: turns $work/NAME into
# $out/NAME_VERSION_ARCH.deb.
package() {
  local name=$1 depends=$2 description=$3 recommends=${4:-} root=$work/$1
  mkdir -p "$root/DEBIAN" "$root/usr/share/doc/$name"
  cp README.md "$root/usr/share/doc/$name/"
  cp -r docs "$root/usr/share/doc/$name/"
  if [ -d "$root/etc" ]; then
    (cd "$root" && find etc -type f | sed 's|^|/|') >"$root/DEBIAN/conffiles"
  fi
  cat >"$root/DEBIAN/control" <<CONTROL
Package: $name
Version: $version
Architecture: $arch
Maintainer: vrdma developers <vrdma@localhost>
Section: net
Priority: optional
Depends: $depends${recommends:+
Recommends: $recommends}
Installed-Size: $(du -sk "$root" | cut -f1)
Description: $description
CONTROL
  chmod 0755 "$root"/DEBIAN/post* "$root"/DEBIAN/pre* 2>/dev/null || true
  dpkg-deb --root-owner-group --build "$root" "$out/${name}_${version}_${arch}.deb" >&2
  echo "$out/${name}_${version}_${arch}.deb"
}

# maintainer_scripts NAME USERS_FILE UNIT START: make the unit's users (and, if the package
# has one, its tmpfiles.d folders), and where systemd runs start the unit: START "boot"
# enables it and starts it now, "device" leaves that to the package's udev rule (the unit is
# wanted by a device: udev is told to look at the devices again); stop it before removal.
maintainer_scripts() {
  local root=$work/$1 users=$2 unit=$3 start
  case "$4" in
    boot)
      # A unit that cannot start yet (no RDMA device) must not fail the installation: it
      # says so, and the journal says why.
      start="systemctl enable $unit
    systemctl restart $unit || echo \"$unit did not start: see journalctl -u $unit\" >&2" ;;
    device)
      start="udevadm control --reload-rules || true
    udevadm trigger --action=add --subsystem-match=pci --attr-match=vendor=0x1af4 --attr-match=device=0x106a || true" ;;
  esac
  mkdir -p "$root/DEBIAN"
  cat >"$root/DEBIAN/postinst" <<SCRIPT
#!/bin/sh
set -e
if [ "\$1" = configure ]; then
  systemd-sysusers /usr/lib/sysusers.d/$users
  if [ -f /usr/lib/tmpfiles.d/$1.conf ] && command -v systemd-tmpfiles >/dev/null; then
    systemd-tmpfiles --create /usr/lib/tmpfiles.d/$1.conf
  fi
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    $start
  fi
fi
SCRIPT
  cat >"$root/DEBIAN/prerm" <<SCRIPT
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl disable --now $unit || true
fi
SCRIPT
  cat >"$root/DEBIAN/postrm" <<SCRIPT
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
SCRIPT
}

backend=$work/vrdma-backend
install -D -s -m 0755 target/$profile/vhost-user-rdma "$backend/usr/bin/vhost-user-rdma"
install -D -s -m 0755 target/$profile/vrdmactl "$backend/usr/bin/vrdmactl"
install -D -m 0644 backend/systemd/vrdma-backend.service "$backend/lib/systemd/system/vrdma-backend.service"
install -D -m 0644 backend/systemd/vrdma-backend.sysusers "$backend/usr/lib/sysusers.d/vrdma-backend.conf"
install -D -m 0644 backend/systemd/vrdma-backend.tmpfiles "$backend/usr/lib/tmpfiles.d/vrdma-backend.conf"
install -D -m 0644 backend/systemd/guests.toml "$backend/etc/vrdma/guests.toml"
install -D -m 0644 backend/systemd/vrdma-backend.default "$backend/etc/default/vrdma-backend"
install -D -m 0644 backend/libvirt/vrdma-vm.xml "$backend/usr/share/doc/vrdma-backend/examples/vrdma-vm.xml"
maintainer_scripts vrdma-backend vrdma-backend.conf vrdma-backend.service boot
package vrdma-backend "libc6, libgcc-s1, libibverbs1, librdmacm1, ibverbs-providers, systemd | systemd-standalone-sysusers" \
  "vhost-user backend of vrdma, a paravirtual RDMA device for virtual machines
 Serves the vrdma virtio device (id 42) to QEMU and cloud-hypervisor guests over
 vhost-user, relaying their RDMA to the host's verbs device. vrdmactl reads and
 changes the guests it serves."

guest=$work/vrdma-guest
install -D -s -m 0644 "$lib_dir/libibverbs.so.1" "$guest/usr/lib/vrdma/libibverbs.so.1"
install -D -s -m 0644 "$lib_dir/librdmacm.so.1" "$guest/usr/lib/vrdma/librdmacm.so.1"
install -D -m 0755 guest-lib/ibverbs/vrdma-run "$guest/usr/lib/vrdma/vrdma-run"
install -D -s -m 0755 target/$profile/vrdmad "$guest/usr/sbin/vrdmad"
install -D -m 0644 guest-lib/service/systemd/vrdmad.service "$guest/lib/systemd/system/vrdmad.service"
install -D -m 0644 guest-lib/service/systemd/vrdma.sysusers "$guest/usr/lib/sysusers.d/vrdma.conf"
install -D -m 0644 guest-lib/service/systemd/60-vrdma.rules "$guest/usr/lib/udev/rules.d/60-vrdma.rules"
mkdir -p "$guest/usr/bin"
cat >"$guest/usr/bin/vrdma-run" <<'RUN'
#!/bin/sh
# Runs an unmodified libibverbs program on a vrdma device (see /usr/lib/vrdma/vrdma-run).
VRDMA_IBVERBS_DIR=${VRDMA_IBVERBS_DIR:-/usr/lib/vrdma} exec /usr/lib/vrdma/vrdma-run "$@"
RUN
chmod 0755 "$guest/usr/bin/vrdma-run"
# The pinning module's source, for DKMS to build for the VM's kernels, loaded at boot.
for file in vrdma_pin.c vrdma_pin.h Kbuild; do
  install -D -m 0644 "guest-lib/kmod/$file" "$guest/usr/src/vrdma-pin-$version/$file"
done
sed "s/@VERSION@/$version/" guest-lib/kmod/dkms.conf >"$guest/usr/src/vrdma-pin-$version/dkms.conf"
install -D -m 0644 /dev/stdin "$guest/usr/lib/modules-load.d/vrdma-pin.conf" <<<"vrdma_pin"
maintainer_scripts vrdma-guest vrdma.conf vrdmad.service device
package vrdma-guest "libc6, libgcc-s1, kmod, systemd | systemd-standalone-sysusers" \
  "vrdma's libibverbs, librdmacm and guest service for programs on a vrdma device
 Unmodified libibverbs and librdmacm programs run on a vrdma device through
 vrdma-run; inside a VM, vrdmad shares the vrdma PCI device among the
 programs of group vrdma, and the vrdma_pin module (built by DKMS) pins the
 memory they give the device." "dkms, linux-headers-amd64"
