#!/usr/bin/env bash
# Starts a real libvirtd inside the test guest (tests/vm/run.sh), for VMs started through
# libvirt (run.sh --libvirt NAME). Does nothing if one already runs. The guest's root is the
# machine's, read-only: libvirtd gets writable copies of libvirt's configuration and state
# folders, mounted over the originals in a mount namespace of its own (they live below
# $state, where the logs are read from outside that namespace). QEMU runs as root with no
# security driver (the guest is a throwaway test machine), its output logged to files.
# usage: tests/vm/libvirtd.sh   (prints nothing; fails with libvirtd's log if it cannot start)
set -euo pipefail
[ -n "${VRDMA_VM_RUN_DIR:-}" ] || { echo "libvirtd.sh: run me inside the test guest (tests/vm/run.sh)" >&2; exit 2; }
command -v libvirtd >/dev/null || [ -x /usr/sbin/libvirtd ] ||
  { echo "libvirtd.sh: libvirtd is not installed: run tests/vm/setup.sh on the machine" >&2; exit 1; }

state=/tmp/vrdma-libvirt
if [ -S /run/libvirt/libvirt-sock ] && virsh -c qemu:///system version >/dev/null 2>&1; then exit 0; fi
rm -rf "$state" && mkdir -p "$state"

unshare --mount --propagation private bash -c '
  set -e
  state=$1
  for folder in /etc/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt; do
    mkdir -p "$state$folder"
    cp -a "$folder/." "$state$folder/"
    mount --bind "$state$folder" "$folder"
  done
  # The package autostarts a NAT network (dnsmasq, iptables): the VMs here need none.
  rm -f /etc/libvirt/qemu/networks/autostart/*
  cat >/etc/libvirt/qemu.conf <<CONF
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
namespaces = [ ]
stdio_handler = "file"
CONF
  exec /usr/sbin/libvirtd --pid-file=/run/vrdma-libvirtd.pid
' libvirtd "$state" >"$state/libvirtd.log" 2>&1 &

for _ in $(seq 300); do
  [ -S /run/libvirt/libvirt-sock ] && virsh -c qemu:///system version >/dev/null 2>&1 && exit 0
  kill -0 $! 2>/dev/null || break
  sleep 0.2
done
echo "libvirtd.sh: libvirtd did not start:" >&2
tail -n 20 "$state/libvirtd.log" >&2
exit 1
