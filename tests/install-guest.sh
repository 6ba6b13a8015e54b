#!/usr/bin/env bash
# Runs in a clean Debian 12 system booted by its own systemd (tests/install-check.sh starts
# it): installs vrdma's packages as an operator would, `apt-get install ./*.deb`, with the
# local package source tests/vm/clean-root.sh filled (the guest has no network), then checks
# that the VM's vrdma device started the guest service and programs pair through it, that the
# backend's unit started the daemon as its packaged configuration says, that it serves a
# guest added at run time, and that removing the package stops it.
# Prints `install: CHECK ok|FAILED` per check; exits 1 if any failed.
# usage: tests/install-guest.sh DEPS_DIR DEB...   (the folder and the packages: paths as this
#        system sees them)
set -uo pipefail
deps=$1
shift
failures=0
check() {
  local name=$1
  shift
  if "$@"; then echo "install: $name ok"; else echo "install: $name FAILED"; failures=$((failures + 1)); fi
}
# wait_for SECONDS COMMAND...: until COMMAND succeeds.
wait_for() {
  local limit=$1 start=$SECONDS
  shift
  until "$@"; do
    [ $((SECONDS - start)) -lt "$limit" ] || return 1
    sleep 0.5
  done
}

# The system's one package source: what the packages need, in a local folder.
echo "deb [trusted=yes] file:$deps ./" >/etc/apt/sources.list
rm -f /etc/apt/sources.list.d/*
mkdir -p /tmp/debs && cp "$@" /tmp/debs/ && chmod -R a+rX /tmp/debs

installed() {
  apt-get update -qq >/tmp/apt.log 2>&1 &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y /tmp/debs/*.deb >>/tmp/apt.log 2>&1 ||
    { tail -n 20 /tmp/apt.log >&2; return 1; }
  grep -E '^Setting up vrdma|did not start' /tmp/apt.log | sed 's/^/install:   /'
}
check "apt-get install ./vrdma-backend_*.deb ./vrdma-guest_*.deb on a clean system" installed

# The guest side: this VM's vrdma device started the guest service (the package's udev
# rule), and two programs pair through it (Debian's ibv_rc_pingpong, from the machine, on
# vrdma's libibverbs as installed).
vrdmad_active() { [ "$(systemctl is-active vrdmad)" = active ]; }
started_by_the_device() {
  wait_for 120 vrdmad_active || {
    systemctl status --no-pager vrdmad >&2
    journalctl -u vrdmad --no-pager | tail -n 20 >&2
    return 1
  }
  # What it said of the device (informative).
  journalctl _SYSTEMD_UNIT=vrdmad.service --no-pager -o cat | grep -m1 -i "device" |
    sed 's/^/install:   vrdmad: /'
  return 0
}
check "the vrdma PCI device started vrdmad (udev), once the package was installed" started_by_the_device

pingpong_through_vrdmad() {
  local pingpong=(vrdma-run --device service -- /machine/usr/bin/ibv_rc_pingpong -d vrdma0 -g 0 -c -n 20 -p 18530)
  "${pingpong[@]}" >/tmp/server.out 2>&1 &
  local server=$!
  sleep 2
  wait_for 60 "${pingpong[@]}" 127.0.0.1 >/tmp/client.out 2>&1 && wait "$server" &&
    grep -q ' iters in ' /tmp/client.out || {
    tail -n 5 /tmp/server.out /tmp/client.out >&2
    return 1
  }
  grep ' iters in ' /tmp/client.out | sed 's/^/install:   /'
}
check "ibv_rc_pingpong -c pair through the installed vrdma-run and vrdmad" pingpong_through_vrdmad

backend_active() { [ "$(systemctl is-active vrdma-backend)" = active ]; }
started_by_the_unit() {
  systemctl is-enabled vrdma-backend >/dev/null &&
    wait_for 60 backend_active &&
    wait_for 30 test -S /run/vrdma/admin.sock || {
    systemctl status --no-pager vrdma-backend >&2
    journalctl -u vrdma-backend --no-pager | tail -n 20 >&2
    return 1
  }
  local pid user
  pid=$(systemctl show -p MainPID --value vrdma-backend)
  user=$(stat -c %U "/proc/$pid")
  echo "install:   vrdma-backend.service: active, pid $pid, serving as $user"
  [ "$user" = vrdma-backend ]
}
check "the unit started the daemon (enabled, active, serving as user vrdma-backend)" started_by_the_unit

serves_an_added_guest() {
  local listed
  vrdmactl add '{ name = "vm1", socket = "/run/vrdma/vm1.sock" }' &&
    [ -S /run/vrdma/vm1.sock ] &&
    listed=$(vrdmactl list) &&
    backend_active || {
    ls -la /run/vrdma >&2
    journalctl -u vrdma-backend --no-pager | tail -n 20 >&2
    return 1
  }
  echo "install:   vrdmactl list: $listed"
  journalctl -u vrdma-backend --no-pager | grep -q "guest vm1: served on /run/vrdma/vm1.sock"
}
check "the packaged daemon serves a guest added with vrdmactl (under its seccomp filter)" serves_an_added_guest

security_listed() {
  local line
  line=$(systemd-analyze security --no-pager vrdma-backend.service | tail -n 1)
  echo "install:   systemd-analyze security: $line"
  [[ "$line" == *"Overall exposure level"* ]]
}
check "systemd-analyze security rates the unit" security_listed

removed() {
  DEBIAN_FRONTEND=noninteractive apt-get remove -y vrdma-backend >>/tmp/apt.log 2>&1 &&
    ! backend_active && [ ! -e /lib/systemd/system/vrdma-backend.service ]
}
check "apt-get remove vrdma-backend stops the daemon and takes its unit away" removed
[ "$failures" = 0 ]
