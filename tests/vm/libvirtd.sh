#!/usr/bin/env bash
# A real libvirtd of the tests' own, for VMs started through libvirt (tests/vm/run.sh --libvirt
# NAME), on this machine or in a test guest. It sees the machine's configuration only
# through copies: libvirt's configuration, state and runtime folders are mounted over the
# originals in a mount namespace of its own, all below $state (where its log is), so it
# neither touches nor meets a libvirtd the machine may run; clients reach it at the URI that
# `uri` prints. QEMU runs as root with no security driver (the VMs are test machines), its
# output logged to files.
# usage: tests/vm/libvirtd.sh start   start it unless it runs; prints `started` or `running`
#                                     (fails with libvirtd's log if it cannot start)
#        tests/vm/libvirtd.sh stop    stop it (and the VMs it still runs)
#        tests/vm/libvirtd.sh uri     its connection URI, for virsh -c
set -euo pipefail
state=/tmp/vrdma-libvirt
uri="qemu:///system?socket=$state/run/libvirt-sock"
running() { [ -S "$state/run/libvirt-sock" ] && virsh -c "$uri" version >/dev/null 2>&1; }

case "${1:-}" in
  uri) echo "$uri"; exit 0 ;;
  stop)
    pid=$(cat "$state/libvirtd.pid" 2>/dev/null) || exit 0
    # QEMU processes are libvirtd's children in name only: they outlive it unless destroyed.
    if running; then
      for domain in $(virsh -q -c "$uri" list --name); do virsh -q -c "$uri" destroy "$domain" >/dev/null || true; done
    fi
    kill "$pid" 2>/dev/null || true
    # Gone, or a zombie its parent (whoever adopted it) has not reaped yet.
    alive() { [ -n "$(awk '$1 == "State:" && $2 != "Z"' "/proc/$pid/status" 2>/dev/null)" ]; }
    for _ in $(seq 100); do alive || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    [ ! -f "$state/made-run-libvirt" ] || rmdir /run/libvirt 2>/dev/null || true
    rm -rf "$state"
    exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop|uri" >&2; exit 2 ;;
esac

command -v libvirtd >/dev/null || [ -x /usr/sbin/libvirtd ] ||
  { echo "libvirtd.sh: libvirtd is not installed: run tests/vm/setup.sh on the machine" >&2; exit 1; }
if running; then echo running; exit 0; fi
rm -rf "$state" && mkdir -p "$state/run"
# The mount point below is made on the machine's /run; stop removes it again if made here.
[ -d /run/libvirt ] || { mkdir /run/libvirt && : >"$state/made-run-libvirt"; }

unshare --mount --propagation private bash -c '
  set -e
  state=$1
  for folder in /etc/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt; do
    mkdir -p "$state$folder"
    cp -a "$folder/." "$state$folder/"
    mount --bind "$state$folder" "$folder"
  done
  mount --bind "$state/run" /run/libvirt
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
  exec /usr/sbin/libvirtd --pid-file="$state/libvirtd.pid"
' libvirtd "$state" >"$state/libvirtd.log" 2>&1 &

for _ in $(seq 300); do
  running && { echo started; exit 0; }
  kill -0 $! 2>/dev/null || break
  sleep 0.2
done
echo "libvirtd.sh: libvirtd did not start:" >&2
tail -n 20 "$state/libvirtd.log" >&2
exit 1
