#!/usr/bin/env bash
# Runs one command inside a fresh QEMU/TCG guest with rdma_rxe up (device rxe0 on a veth, IPv4
# GID 192.168.77.1) and the machine's root as its root filesystem, so binaries built here run
# there unchanged. Prints the command's output and exits with its exit code.
#
# usage: tests/vm/run.sh [--no-rxe] [--mem MIB] [--cpus N] [--timeout SECONDS] [--vrdma SOCKET]
#                        [--libvirt NAME] [--host-net ADDRESS/PREFIX,PORT,PEER_PORT]
#                        [--root DIR] [--run-in DIR] -- COMMAND [ARG...]
#   --no-rxe        boot without loading rdma_rxe (also VRDMA_VM_NO_RXE=1): RDMA tests must
#                   then fail
#   --cpus N        N vCPUs (2 by default; 1 in a nested guest)
#   --vrdma SOCKET  give the guest a vrdma PCI device served by the backend listening on
#                   SOCKET (with the QEMU that tests/vm/qemu/build.sh builds); the guest is
#                   then a nested one when run.sh itself runs inside a harness guest
#   --libvirt NAME  start the guest (which needs --vrdma) as the libvirt domain NAME, made from
#                   the documented one (backend/libvirt/vrdma-vm.xml), for a caller that
#                   suspends, resumes or destroys it with virsh -c "$(tests/vm/libvirtd.sh uri)"
#   --host-net ADDRESS/PREFIX,PORT,PEER_PORT
#                   give the guest a network card (eth0, with ADDRESS) whose frames travel as
#                   UDP datagrams from 127.0.0.1:PORT to 127.0.0.1:PEER_PORT, where another
#                   guest's card listens (tests/vm/two-hosts.sh); rxe0 then sits on eth0
#   --root DIR      boot the clean system in DIR (tests/vm/clean-root.sh) with its own
#                   systemd, not the machine's root: writable, though nothing written stays;
#                   the machine's root is at /machine in it, and the command runs from
#                   /machine followed by the current folder (give it relative paths)
#   --run-in DIR    make the guest's writable folder (run.*) below DIR, where a caller
#                   running beside the guest finds it, and leave it there for the caller to
#                   read and remove (without this option it is removed when the guest ends)
# Environment passed into the guest: RUST_LOG, RUST_BACKTRACE, and every VRDMA_* variable
# (VRDMA_TEST_DEVICE is rxe0 unless given);
# the command finds a writable folder shared with the machine in $VRDMA_VM_RUN_DIR.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
rxe=$([ "${VRDMA_VM_NO_RXE:-0}" = 1 ] && echo 0 || echo 1) mem=3072 limit=${VRDMA_VM_TIMEOUT:-1800}
vrdma_socket= host_net= cpus= runs_in= keep_run=0 libvirt_domain= clean_root=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-rxe) rxe=0; shift ;;
    --mem) mem=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --vrdma) vrdma_socket=$2; shift 2 ;;
    --libvirt) libvirt_domain=$2; shift 2 ;;
    --root) clean_root=$(cd "$2" && pwd); shift 2 ;;
    --host-net) host_net=$2; shift 2 ;;
    --run-in) runs_in=$2 keep_run=1; shift 2 ;;
    --) shift; break ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--no-rxe] [--mem MIB] [--cpus N] [--timeout S] [--vrdma SOCKET] [--libvirt NAME] [--host-net ...] [--root DIR] [--run-in DIR] -- COMMAND [ARG...]" >&2; exit 2; }
if [ -n "$libvirt_domain" ]; then
  [ -n "$vrdma_socket" ] && [ -z "$host_net" ] && [ -z "$clean_root" ] ||
    { echo "run.sh: --libvirt starts a VM with --vrdma (and no --host-net or --root)" >&2; exit 2; }
  [[ "$libvirt_domain" =~ ^[A-Za-z0-9_.-]+$ ]] ||
    { echo "run.sh: --libvirt takes a domain name of letters, digits, '.', '_' and '-', not '$libvirt_domain'" >&2; exit 2; }
fi

qemu=(qemu-system-x86_64)
if [ -n "$vrdma_socket" ]; then
  # The device's queues: control, event, and one notification queue per the backend's
  # --notify-queues (VRDMA_NOTIFY_QUEUES, default 1); its config space is 128 bytes (SPEC.md).
  # modern-pio-notify: a notification port, through which the guest service's programs kick
  # the device themselves (SPEC.md §12).
  queues=$((2 + ${VRDMA_NOTIFY_QUEUES:-1}))
  patched="$repo/target/qemu/build/qemu-system-x86_64"
  [ -x "$patched" ] || { echo "run.sh: --vrdma needs $patched: run tests/vm/qemu/build.sh" >&2; exit 2; }
  qemu=("$patched" -L /usr/share/qemu -L /usr/share/seabios
    -object "memory-backend-memfd,id=mem,size=${mem}M,share=on" -numa node,memdev=mem
    -chardev "socket,id=vrdma0,path=$vrdma_socket,reconnect-ms=1000"
    -device "vhost-user-device-pci,chardev=vrdma0,virtio-id=42,num_vqs=$queues,config_size=128,modern-pio-notify=on")
fi

nic=(-nic none) net_arg=
if [ -n "$host_net" ]; then
  IFS=, read -r address port peer_port <<<"$host_net"
  [[ "$address" =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)/[0-9]+$ && -n "$port" && -n "$peer_port" ]] ||
    { echo "run.sh: --host-net wants ADDRESS/PREFIX,PORT,PEER_PORT, not '$host_net'" >&2; exit 2; }
  # A MAC address of QEMU's prefix that differs for every address.
  mac=$(printf '52:54:00:%02x:%02x:%02x' "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}" "${BASH_REMATCH[4]}")
  nic=(-netdev "dgram,id=net0,local.type=inet,local.host=127.0.0.1,local.port=$port,remote.type=inet,remote.host=127.0.0.1,remote.port=$peer_port"
    -device "virtio-net-pci,netdev=net0,mac=$mac,romfile=")
  net_arg="vrdma.net=$address"
fi

case "$cpus" in
  '') ;;
  *[!0-9]* | 0) echo "run.sh: --cpus takes a number of vCPUs, not '$cpus'" >&2; exit 2 ;;
esac
if [ -n "${VRDMA_VM_RUN_DIR:-}" ]; then
  # Inside a harness guest: the machine's root is read-only here and already set up; runs
  # go below this guest's own run folder. The nested VM runs under KVM: the harness guest's
  # emulated CPU has AMD's SVM with nested paging (below), which QEMU's emulation implements,
  # so the nested VM's code is emulated once, not inside emulation (its boot takes seconds
  # instead of minutes). The kvm modules come from the guest kernel's package.
  cache="$repo/target/vm" cpus=${cpus:-1} runs_in=${runs_in:-$VRDMA_VM_RUN_DIR}
  [ -e /dev/kvm ] || modprobe -d "$cache/kernel/root" kvm_amd || true # says why it failed
  if [ -w /dev/kvm ]; then
    accel=(-accel kvm)
  else
    echo "run.sh: no KVM in this guest: the nested VM is emulated inside emulation (its boot alone takes minutes)" >&2
    accel=(-accel tcg)
  fi
else
  cpus=${cpus:-2}
  cache=$("$repo/tests/vm/setup.sh")
  runs_in=${runs_in:-$cache/runs}
  # QEMU's default CPU model, with SVM and nested paging for the KVM of a nested VM.
  accel=(-accel tcg -cpu qemu64,+svm,+npt)
fi
mkdir -p "$runs_in"
run=$(mktemp -d "$runs_in/run.XXXXXX")
case "$run" in *[[:space:]]*) echo "run.sh: the repository path must not contain spaces" >&2; exit 2 ;; esac
[ "$keep_run" = 1 ] || trap 'rm -rf "$run"' EXIT

{
  echo "cd $(printf '%q' "${clean_root:+/machine}$PWD") || exit 125"
  echo "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp"
  echo "export RUST_BACKTRACE=${RUST_BACKTRACE:-0}"
  [ -n "${RUST_LOG:-}" ] && echo "export RUST_LOG=$(printf '%q' "$RUST_LOG")"
  # The guest's RDMA device, for the tests and their helper programs (elsewhere they default
  # to a loopback device of their own).
  echo "export VRDMA_TEST_DEVICE=rxe0"  # overridden below when given
  while IFS='=' read -r name value; do
    echo "export $name=$(printf '%q' "$value")"
  done < <(env | grep '^VRDMA_' || true)
  echo "export VRDMA_VM_RUN_DIR=$run"
  # Says the guest booted (a QEMU that crashes before this is booted once more, below).
  echo ": >$run/started"
  printf '%q ' "$@"
  echo
} >"$run/cmd.sh"

# tsc=reliable: under full emulation the kernel's clocksource watchdog soon finds the TSC
# "unstable" (its reference, the HPET, is read through QEMU's device emulation and lags under
# load) and moves the clock to the HPET. Every clock read is then a system call and an
# emulated device access: clock_gettime costs microseconds, and perftest's CPU-clock
# calibration, which brackets gettimeofday with rdtsc, is too noisy to produce a report.
# The emulated TSC comes from the host's clock and is the same on every vCPU.
#
# The kernel arguments after tsc=reliable skip boot work that costs an emulated guest seconds
# (measured with initcall_debug): the crypto self-tests, the timer check, audit, and the CPU
# vulnerability mitigations (a test guest runs only the tests).
# init_on_alloc=0: Debian's kernel zeroes every page and heap object it allocates (hardening),
# which under emulation taxes each page read over 9p and each packet rxe sends or receives
# (native ib_send_lat in the guest: about 400 us with it, 220 us without).
kernel_args="console=ttyS0 quiet loglevel=3 panic=-1 tsc=reliable cryptomgr.notests no_timer_check audit=0 mitigations=off init_on_alloc=0 vrdma.results=$run vrdma.rxe=$rxe $net_arg${clean_root:+ vrdma.root=$clean_root}"
# What the guest prints on its console, without terminal escapes and firmware chatter.
console_filter() {
  sed -u -e 's/\r//g; s/\x1b[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' \
    -e '/^SeaBIOS (version/d; s/^Booting from ROM\.*//; /reboot: Power down/d'
}

# The guest as a libvirt domain, defined from the documented one (backend/libvirt/vrdma-vm.xml)
# in the tests' own libvirtd (tests/vm/libvirtd.sh; stopped again if started here): its
# console is a file, followed until the domain is shut off.
start_with_libvirt() {
  # Globals: the EXIT trap reads them.
  libvirtd_was=$("$repo/tests/vm/libvirtd.sh" start)
  virsh=(virsh -q -c "$("$repo/tests/vm/libvirtd.sh" uri)")
  "$repo/tests/vm/libvirt-domain.py" "$repo/backend/libvirt/vrdma-vm.xml" "$libvirt_domain" \
    "$mem" "$cpus" "$patched" "$vrdma_socket" "$queues" "$cache/kernel/vmlinuz" "$cache/initrd.gz" \
    "$kernel_args" "$run" "$run/console.log" >"$run/domain.xml"
  : >"$run/console.log"
  # errexit holds in the trap too: each step goes on whatever the one before it did.
  trap '"${virsh[@]}" destroy "$libvirt_domain" >/dev/null 2>&1 || true
    "${virsh[@]}" undefine "$libvirt_domain" >/dev/null 2>&1 || true
    [ "$libvirtd_was" != started ] || "$repo/tests/vm/libvirtd.sh" stop || true
    [ "$keep_run" = 1 ] || rm -rf "$run"' EXIT
  "${virsh[@]}" define "$run/domain.xml" >/dev/null
  "${virsh[@]}" start "$libvirt_domain" >/dev/null
  tail -n +1 -F "$run/console.log" 2>/dev/null > >(console_filter) &
  local console=$! start=$SECONDS state
  # (Also ended when libvirtd no longer answers: the domain went with it.)
  while state=$("${virsh[@]}" domstate "$libvirt_domain" 2>/dev/null) && [ "$state" != "shut off" ]; do
    if [ $((SECONDS - start)) -ge "$limit" ]; then
      "${virsh[@]}" destroy "$libvirt_domain" >/dev/null 2>&1 || true
      break
    fi
    sleep 1
  done
  echo "run.sh: domain $libvirt_domain is $("${virsh[@]}" domstate --reason "$libvirt_domain" 2>&1)"
  sleep 1 # the console's last lines
  kill "$console" 2>/dev/null || true
}

if [ -n "$libvirt_domain" ]; then
  start_with_libvirt
else
  boot() {
    timeout --foreground "$limit" "${qemu[@]}" \
      "${accel[@]}" -m "$mem" -smp "$cpus" -nographic -no-reboot "${nic[@]}" \
      -kernel "$cache/kernel/vmlinuz" -initrd "$cache/initrd.gz" -append "$kernel_args" \
      -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on \
      -virtfs "local,path=$run,mount_tag=results,security_model=none" \
      </dev/null | console_filter
    qemu_status=${PIPESTATUS[0]}
  }
  boot || true
  # QEMU 10.0 under TCG was once seen to crash at boot (a call through a null pointer in a
  # vCPU thread, before the guest ran anything; one boot in hundreds): that boot says nothing
  # of the test, which gets one more, said so.
  if [ "$qemu_status" -gt 128 ] && [ ! -f "$run/started" ]; then
    echo "run.sh: QEMU ended by signal $((qemu_status - 128)) before the guest started; booting once more" >&2
    boot || true
  fi
fi

if [ ! -f "$run/rc" ]; then
  echo "run.sh: the guest ended without the command's exit code (boot failure or timeout after ${limit}s)" >&2
  exit 1
fi
exit "$(cat "$run/rc")"
