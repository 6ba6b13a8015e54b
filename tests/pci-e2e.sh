#!/usr/bin/env bash
# Boots a VM with a vrdma PCI device that a backend here serves, and checks guest-lib programs
# in it (tests/pci-guest.sh, whose parts are named below) against peers here:
#   DEVICE loopback, on this machine (no RDMA, no nesting: the backend's loopback host), the
#   VM started by a real libvirtd (tests/vm/libvirtd.sh) from the documented domain
#   (backend/libvirt/vrdma-vm.xml):
#     service  the guest service (vrdmad) over the PCI device: an unprivileged user's program
#              through it makes checked round trips and RDMA WRITE+READ with a guest-lib program
#              attached directly to the same backend, ringing the device through a doorbell
#              area of its own and kicking it through its notification port; a program opening
#              the device directly is refused, naming the service; the device node for UCX;
#              idle, vrdmad and a program waiting for a completion event sleep, and the
#              completion (the device's interrupt) wakes the program; two unprivileged users'
#              unmodified ibv_rc_pingpong pair, then their ib_write_bw and ib_send_lat pairs at
#              once beside a third pair whose client is killed with SIGKILL mid-stream (vrdmad
#              destroys what it held); SIGKILL of the service under four programs asleep in
#              ibv_get_cq_event and four polling ends each with an error (none hangs or
#              reports success), and what it pinned for them stays pinned until the next
#              vrdmad has reset the device; a service restart ends a waiting program with an
#              error and serves the next at once
#     pinned   a program's 256 MiB buffer RDMA-written from here for 30 s, checked in the VM
#              where the program reads it, while the VM compacts its memory in a loop and a
#              sentinel program checks that none of the frames it is given is written
#     leaver   a program of vrdmad punches holes in, truncates and unmaps all the memory it
#              shared and exits while a peer here RDMA-WRITEs into it: a sentinel in the VM
#              finds no frame written; another program of vrdmad keeps working
#     cm       rdma_cm through the guest service over the device (the backend gives the VM an
#              address of its own): an unprivileged user's unmodified rping on vrdma's
#              librdmacm, the client of an rping server here (vrdma's librdmacm, attached to
#              the backend beside the VM), then the server of a client here
#     paused   `virsh suspend` and `virsh resume` (QEMU's stop and cont) three times under a
#              guest-lib program's checked round trips with a peer here: the program finishes
#              with no error, the device keeps every object (vrdmactl shows the VM paused,
#              then running, with its QPs)
#     reopen   a backend restart under the running VM: guest-lib reports the device reset,
#              opens the device again and creates a QP
#     held     `virsh destroy` while a guest-lib program in the VM holds a QP and more: the
#              backend closes the VM's connection and releases every object it had
#   DEVICE rxe0, inside the rxe guest (tests/vm/run.sh), which makes the VM a nested one (run
#   under KVM there: tests/vm/run.sh): real RDMA through the PCI device; once the VM has shut
#   down, every host object it had is released (`rdma resource`):
#     native   an unmodified ibv_rc_pingpong through vrdma's libibverbs, attached to the
#              device directly, pairs with a native ibv_rc_pingpong on rxe0 (guest-lib's own
#              RDMA WRITE+READ over the PCI device is checked in the loopback-served VM, and
#              with native peers on rxe0 in the rxe tier; so is rdma_cm, the latter through
#              the guest service)
# Prints one `pci-e2e: CHECK ok|FAILED (N s)` line per check; exits 1 if any failed.
# usage: tests/pci-e2e.sh BIN_DIR loopback|rxe0   (BIN_DIR holds vhost-user-rdma, vrdmad,
#            guest-endpoint, vrdma-ibverbs/libibverbs.so.1)
#   VRDMA_PCI_PARTS=PART,...   only these parts (to look into one)
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/listening.sh"
bin=$(cd "$1" && pwd)
device=${2:-}
case "$device" in
  loopback) parts=${VRDMA_PCI_PARTS:-service,cm,pinned,leaver,paused,reopen,held} round_trips=${VRDMA_PCI_ROUND_TRIPS:-100}
    # Started by libvirt from the documented domain (backend/libvirt/vrdma-vm.xml), which
    # suspends, resumes and destroys it (parts paused and held).
    domain=vrdma-loopback launch=(--libvirt "$domain")
    # The VM's address; its rdma_cm peer here shares it (--shared-gid), on other ports.
    peer_address=192.168.77.60 vm_address=192.168.77.60
    own_address=(--guest-ip "$vm_address/24") ;;
  rxe0)
    [ -n "${VRDMA_VM_RUN_DIR:-}" ] || { echo "pci-e2e.sh: rxe0 is in the rxe guest: run me there (tests/vm/run.sh)" >&2; exit 2; }
    parts=${VRDMA_PCI_PARTS:-native} round_trips=${VRDMA_PCI_ROUND_TRIPS:-20}
    domain= launch=()
    # The rxe guest's address (tests/vm/guest-init.sh) and the VM's own, for rdma_cm (part
    # cm, run on its own only: VRDMA_PCI_PARTS=cm).
    peer_address=192.168.77.1 vm_address=192.168.77.60
    own_address=(--guest-ip "$vm_address/24") ;;
  *) echo "usage: $0 BIN_DIR loopback|rxe0" >&2; exit 2 ;;
esac
# Socket, logs, the peers' files, and copies of what the VM runs as other users: in a folder
# anyone may enter and read (the checkout may lie below one only its owner may enter). The VM
# sees this machine's (or the rxe guest's) root, /tmp included.
work=$(mktemp -d /tmp/vrdma-pci-e2e.XXXXXX)
chmod 0755 "$work"
socket=$work/vrdma.sock logs=$work/logs unprivileged=$work/unprivileged runs=$work/runs
admin=$work/admin.sock
virsh=(virsh -q -c "$("$repo/tests/vm/libvirtd.sh" uri)")
mkdir -p "$logs" "$unprivileged" "$runs"
failures=0

# Each check's line says how long it took, so a slow one shows in CI's log.
check() {
  local name=$1 start=$SECONDS
  shift
  if "$@"; then
    echo "pci-e2e: $name ok ($((SECONDS - start)) s)"
  else
    echo "pci-e2e: $name FAILED ($((SECONDS - start)) s)"
    failures=$((failures + 1))
  fi
}

# accepting FILE: how many times the backend logging to FILE said it was ready for guests.
accepting() { grep -c "accepting guests" "$1" 2>/dev/null || true; }

start_backend() {
  local before
  before=$(accepting "$logs/backend.log")
  rm -f "$socket"
  # The VM and its direct-attach peer are served at once, on the backend's one GID.
  rm -f "$admin"
  RUST_LOG=info "$bin/vhost-user-rdma" --device "$device" --socket-path "$socket" --shared-gid \
    --admin-socket "$admin" "${own_address[@]}" >>"$logs/backend.log" 2>&1 &
  backend=$!
  for _ in $(seq 300); do
    [ "$(accepting "$logs/backend.log")" -gt "${before:-0}" ] && return 0
    sleep 0.1
  done
  echo "pci-e2e: the backend did not start:" >&2
  cat "$logs/backend.log" >&2
  return 1
}

# vm_lost: whether the VM has ended, or its kernel failed (then its programs may hang until
# the VM's timeout): nothing more will come from it, and no check should wait for it.
vm_lost() {
  [ -n "${vm:-}" ] || return 1
  ! kill -0 "$vm" 2>/dev/null || grep -qE '\] (BUG: |Oops: |Kernel panic)' "$logs/vm.log"
}

# wait_line FILE REGEX SECONDS: prints the first line of FILE matching REGEX, waiting for it
# (not past the VM's loss, after which one more look).
wait_line() {
  local file=$1 pattern=$2 start=$SECONDS line lost=0
  while [ $((SECONDS - start)) -lt "$3" ]; do
    if [ -f "$file" ] && line=$(grep -m1 -E "$pattern" "$file"); then
      echo "$line"
      return 0
    fi
    [ "$lost" = 1 ] && { echo "pci-e2e: the VM is lost (see its log), no '$pattern' in $file" >&2; return 1; }
    vm_lost && lost=1
    sleep 0.5
  done
  echo "pci-e2e: no line matching '$pattern' in $file after $3 s" >&2
  return 1
}

# The host objects on rxe0 (pd, cq, qp, mr, ctx ...), as `rdma resource show` counts them.
host_objects() {
  rdma resource show | awk '$2 == "rxe0:" { $1 = $2 = ""; print }'
}

show_logs() {
  local name=$1 f
  for f in "$work/$name.err" "$exchange/$name.vm-err" "$exchange/$name.from-vm"; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }
  done
  return 1
}

# beside_vm COMMAND...: runs COMMAND, a peer of the VM's programs, ending it if the VM is lost.
beside_vm() {
  "$@" &
  local peer=$!
  while kill -0 "$peer" 2>/dev/null; do
    vm_lost && { kill "$peer"; echo "pci-e2e: the VM is lost (see its log) under $1" >&2; }
    sleep 0.5
  done
  wait "$peer"
}

# pair NAME COMMAND...: runs COMMAND here against the VM's program of session NAME; they
# trade address lines, then both must print `done`.
pair() {
  local name=$1 mine theirs peer
  shift
  local to="$exchange/$name.to-vm" from="$exchange/$name.from-vm" ok=0
  mkfifo "$work/$name.in"
  "$@" <"$work/$name.in" >"$work/$name.out" 2>"$work/$name.err" &
  peer=$!
  exec 7>"$work/$name.in"
  # The first session also waits for the VM to boot.
  if mine=$(wait_line "$work/$name.out" '^qpn=' 120) && theirs=$(wait_line "$from" '^qpn=' 900); then
    echo "$mine" >>"$to"
    echo "$theirs" >&7
    wait_line "$work/$name.out" '^done' 900 >/dev/null &&
      wait_line "$from" '^done' 300 >/dev/null || ok=1
  else
    ok=1
  fi
  echo end >>"$to"
  exec 7>&-
  wait "$peer" || ok=1
  wait_line "$exchange/$name.vm-rc" '^0$' 120 >/dev/null || ok=1
  [ "$ok" = 0 ] || show_logs "$name"
}

# --- part service
direct_open_refused() {
  local rc err
  rc=$(wait_line "$exchange/direct.vm-rc" '.' 60) || return 1
  err=$(cat "$exchange/direct.vm-err")
  echo "pci-e2e: opening the PCI device under vrdmad: exit $rc, $(grep -o 'the vrdma PCI device.*' <<<"$err" | head -c 200)"
  [ "$rc" != 0 ] && grep -q 'vrdma service' <<<"$err"
}
# The first check's program kicked the device through the port (a kick that went nowhere
# would have left its round trips waiting on a sleeping poller).
notify_port_handed_over() {
  grep -q "programs kick it through its notification port" "$exchange/vrdmad.log"
}
# SPEC.md §8.6: the device offered doorbell areas through QEMU, and vrdmad gave the first
# check's program one of its own.
own_doorbell_area() { grep -q "rings through doorbell area [1-9]" "$exchange/vrdmad.log"; }
device_node_made() { wait_line "$exchange/node.vm" '^character-device$' 60 >/dev/null; }
# Idle means asleep until something happens: how often the threads of vrdmad and of a program
# blocked in a completion-event wait were woken in 10 idle seconds, a count the emulation's
# speed does not change (a poll every 100 us would be 100000; at most 100 are allowed: runs
# on a busy machine saw vrdmad's event thread woken 2 to 10 times, with no interrupt). Their
# CPU time is printed, not checked: in an emulated guest, a thread that wakes is charged for
# all the time the machine took its vCPU away meanwhile. The guest-service tests check CPU
# time where it is measured truly.
service_idle() {
  local record who wakeups ticks failed=0
  wait_line "$exchange/service-idle.vm" '^end$' 900 >/dev/null || return 1
  record=$(cat "$exchange/service-idle.vm")
  for who in vrdmad program; do
    wakeups=$(awk -v who="$who" '$1 == "wake-ups" && $2 == who { print $3 }' <<<"$record")
    ticks=$(awk -v who="$who" '$1 == "cpu-ticks" && $2 == who { print $3 * 10 }' <<<"$record")
    echo "pci-e2e: $who in 10 idle seconds: ${wakeups:-?} wake-ups, ${ticks:-?} ms of CPU time"
    [ -n "$wakeups" ] && [ "$wakeups" -le 100 ] || failed=1
  done
  grep -E '^(interrupts|thread) ' <<<"$record" | sed 's/^/pci-e2e:   /'
  [ "$failed" = 0 ]
}
sleeper_woken() {
  local rc
  rc=$(wait_line "$exchange/sleeper.vm-rc" '.' 300) || return 1
  [ "$rc" = 0 ] && grep -qx woken "$exchange/sleeper.from-vm"
}
# The pair's line in users.vm: NAME server RC client RC.
users_pair() {
  wait_line "$exchange/users.vm" '^end$' 1200 >/dev/null || return 1
  grep -qx "pingpong server 0 client 0" "$exchange/users.vm" &&
    # ibv_rc_pingpong -c checks every buffer it receives.
    grep -q ' iters in ' "$exchange/pingpong-client.out" || {
    cat "$exchange/users.vm" >&2
    tail -n 5 "$exchange/pingpong-server.out" "$exchange/pingpong-client.out" >&2
    return 1
  }
}
# perftest prints its result row (sizes, iterations, figures) only after a clean run.
result_row() { grep -qE '^ *[0-9]+ +[0-9]+ +[0-9.]+' "$1"; }
perftest_pairs() {
  local name
  wait_line "$exchange/users.vm" '^end$' 600 >/dev/null || return 1
  for name in write_bw send_lat; do
    grep -qx "$name server 0 client 0" "$exchange/users.vm" && result_row "$exchange/$name-client.out" || {
      cat "$exchange/users.vm" >&2
      tail -n 8 "$exchange/$name-server.out" "$exchange/$name-client.out" >&2
      return 1
    }
  done
}
# The killed client's programs (a process may connect more than once) each went, their
# objects destroyed, while the pairs above ran on.
killed_program_reaped() {
  local pid ids id gone destroyed=0
  pid=$(awk '$1 == "killed" { print $2 }' "$exchange/users.vm")
  [ -n "$pid" ] || { echo "pci-e2e: no killed client found" >&2; return 1; }
  ids=$(grep -oE "program [0-9]+ connected \(pid $pid," "$exchange/vrdmad.log" | awk '{ print $2 }')
  [ -n "$ids" ] || { echo "pci-e2e: vrdmad never served pid $pid" >&2; return 1; }
  for id in $ids; do
    gone=$(wait_line "$exchange/vrdmad.log" "program $id gone: " 60) || return 1
    echo "pci-e2e: the killed client's ${gone#*program }"
    destroyed=$((destroyed + $(awk '{ for (i = 1; i < NF; i++) if ($(i + 1) == "objects") print $i }' <<<"$gone")))
  done
  [ "$destroyed" -gt 0 ] && ! grep -q "program .*: destroying" "$exchange/vrdmad.log"
}
# Every program of killed.vm ended with an error (a status neither 0 nor `hung`) within
# seconds of vrdmad's SIGKILL, and none printed the pingpong's result. What the dead vrdmad
# pinned for them stayed pinned until the next one had reset the device.
killed_service_ended_its_programs() {
  local name rc seconds failed=0 dead reset
  wait_line "$exchange/killed.vm" '^end$' 900 >/dev/null || return 1
  dead=$(awk '$1 == "held-dead" { print $2 }' "$exchange/killed.vm")
  reset=$(awk '$1 == "held-reset" { print $2 }' "$exchange/killed.vm")
  echo "pci-e2e:   pages held for the device: ${dead:-?} once its programs had ended, ${reset:-?} once the next vrdmad had reset it"
  [ "${dead:-0}" -gt 0 ] && [ "$reset" = 0 ] || failed=1
  while read -r name rc seconds; do
    [[ "$name" == end || "$name" == held-* ]] && continue
    echo "pci-e2e:   $name: status $rc, $seconds s after the kill"
    if [ "$rc" = hung ] || [ "$rc" = 0 ] || grep -q ' iters in ' "$exchange/$name.out"; then
      tail -n 3 "$exchange/$name.out" >&2
      failed=1
    fi
  done <"$exchange/killed.vm"
  [ "$failed" = 0 ]
}
service_restarted() {
  wait_line "$exchange/restart.vm" '^end$' 600 >/dev/null || return 1
  grep -qx "orphan 1" "$exchange/restart.vm" && grep -q '^error: ' "$exchange/orphan.out" &&
    grep -qx "next 0" "$exchange/restart.vm" || {
    cat "$exchange/restart.vm" "$exchange/orphan.out" >&2
    tail -n 5 "$exchange/restart-next.out" >&2
    return 1
  }
}
check_service() {
  check "an unprivileged program through vrdmad over the PCI device <-> guest-lib attached directly: $round_trips checked round trips, RDMA WRITE+READ" \
    pair guest-peer "$bin/guest-endpoint" pong "$socket" "$round_trips"
  check "a program opening the PCI device vrdmad drives is refused, naming the service" \
    direct_open_refused
  check "vrdmad's programs kick the device through its notification port, not through vrdmad" \
    notify_port_handed_over
  check "vrdmad's programs ring the device through doorbell areas of their own" own_doorbell_area
  check "vrdmad made the device node programs like UCX look for (/dev/infiniband/vrdma0)" \
    device_node_made
  check "vrdmad and a program waiting for a completion event, idle over the PCI device: asleep (at most 10 wake-ups a second)" \
    service_idle
  check "the waiting program wakes when its completion arrives (the device's interrupt)" sleeper_woken
  check "two unprivileged users' unmodified ibv_rc_pingpong -c pair through vrdmad" users_pair
  check "two users' unmodified ib_write_bw and ib_send_lat pairs at once through vrdmad, beside a third pair" \
    perftest_pairs
  check "the third pair's client, killed with SIGKILL mid-stream: vrdmad destroyed all it held" \
    killed_program_reaped
  check "vrdmad killed with SIGKILL under four programs asleep in ibv_get_cq_event and four polling: each ends with an error, none reports success, their memory stays pinned until the device is reset" \
    killed_service_ended_its_programs
  check "a vrdmad restart ends a program waiting on it with an error, and the next program works" \
    service_restarted
}

# rdma_cm's peer here: rping natively on rxe0, or on the loopback host through vrdma's
# librdmacm, attached to the VM's socket beside it (the backend's one address, other ports).
peer_rping=(rping)
[ "$device" = loopback ] && peer_rping=(env VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"
  "$repo/guest-lib/ibverbs/vrdma-run" --device "$socket" -- rping)
# The VM's rping client, then its server (see tests/pci-guest.sh), with peers here.
rping_with_peer() {
  local server ok=0 line tries=1 try
  timeout 900 "${peer_rping[@]}" -s -a "$peer_address" -p 18530 -C 5 >"$work/rping-server.out" 2>&1 &
  server=$!
  line=$(wait_line "$exchange/cm.vm" '^client ' 900) && [ "$line" = "client 0" ] &&
    [ "$(grep -c 'ping data:' "$exchange/rping-client.out")" = 5 ] || { ok=1; kill "$server"; }
  wait "$server" || ok=1
  # The VM's server, once it listens: `rdma resource` lists the backend's id for it on rxe0;
  # the loopback host's ids are the backend's own, so there the client tries again until then.
  [ "$device" = loopback ] && tries=60
  if [ "$ok" = 0 ] && { [ "$device" = loopback ] || wait_until_cm_listening 18531 600; }; then
    for ((try = 1; try <= tries; try++)); do
      timeout 60 "${peer_rping[@]}" -c -a "$vm_address" -p 18531 -C 5 -v >"$work/rping-client.out" 2>&1 && break
      [ "$try" -lt "$tries" ] && ! vm_lost || break
      sleep 1
    done
  fi
  [ "$(grep -c 'ping data:' "$work/rping-client.out" 2>/dev/null)" = 5 ] || ok=1
  line=$(wait_line "$exchange/cm.vm" '^server ' 300) && [ "$line" = "server 0" ] || ok=1
  [ "$ok" = 0 ] || {
    tail -n 5 "$work"/rping-*.out "$exchange"/rping-*.out "$exchange/cm.vm" >&2
    return 1
  }
}
check_cm() {
  check "rdma_cm in the VM: an unprivileged user's rping (vrdma's librdmacm, vrdmad) <-> rping here ($device), both ways" \
    rping_with_peer
}

# pin_check MODE SESSION SECONDS: pin-check MODE here against the VM's target program of
# SESSION for SECONDS, then tells that program to end.
pin_check() {
  beside_vm "$bin/pin-check" "$1" "$socket" "$exchange/$2.to-vm" "$exchange/$2.from-vm" "$3" \
    >"$work/$2.out" 2>"$work/$2.err"
  local rc=$?
  echo end >>"$exchange/$2.to-vm"
  return "$rc"
}

# --- part pinned: see tests/pci-guest.sh. 30 s of writes and checks while the VM compacts.
compacted_under_writes() {
  local ok=0
  pin_check writer pinned 30 || ok=1
  wait_line "$exchange/pinned.vm" '^end$' 300 >/dev/null || ok=1
  echo "pci-e2e: $(tail -n 1 "$work/pinned.out"); $(grep -E '^sentinel ' "$exchange/pinned.vm");" \
    "$(awk '$1 == "pgmigrate_success" || $1 == "compact_success" { printf "%s %s ", $1, $2 }' "$exchange/pinned.vm")"
  grep -qx 'sentinel-rc 0' "$exchange/pinned.vm" && grep -q 'mismatches=0$' "$work/pinned.out" || ok=1
  [ "$ok" = 0 ] || { cat "$work/pinned.out" "$exchange/pinned.vm" >&2; show_logs pinned; }
}
check_pinned() {
  check "a program's 256 MiB buffer written from outside for 30 s while the VM compacts memory: every byte where the program reads it, no frame of another program written" \
    compacted_under_writes
}

# --- part leaver: see tests/pci-guest.sh.
left_badly() {
  local ok=0
  pin_check leaver leaver 20 || ok=1
  wait_line "$exchange/leaver.vm" '^end$' 300 >/dev/null || ok=1
  pin_check writer bystander 5 || ok=1
  echo "pci-e2e: leaver: $(tail -n 1 "$work/leaver.out"); $(grep -E '^sentinel ' "$exchange/leaver.vm");" \
    "bystander: $(tail -n 1 "$work/bystander.out"); vrdmad: $(grep -o '^program [0-9]* gone.*' "$exchange/leaver.vm" | tr '\n' ' ')"
  grep -qx 'sentinel-rc 0' "$exchange/leaver.vm" && grep -q 'mismatches=0$' "$work/bystander.out" || ok=1
  [ "$ok" = 0 ] || { cat "$work/leaver.out" "$exchange/leaver.vm" >&2; show_logs leaver; show_logs bystander; }
}
check_leaver() {
  check "a program of vrdmad punches holes in, truncates and unmaps all it shared and exits under a peer's RDMA WRITEs: no frame it freed is written (a sentinel checks for 30 s), another program keeps working" \
    left_badly
}

# --- part paused: libvirt's suspend and resume (QEMU's stop and cont) under a program's
# traffic (SPEC.md §9).
# Every connection's state and QPs as `vrdmactl list` shows them (the VM's, and its peer's
# attached here), sorted.
guest_states() { "$bin/vrdmactl" --socket "$admin" list | awk 'NR > 1 && $1 ~ /^[0-9]+$/ { print $3, $4 }' | sort | tr '\n' ' '; }
# Three pauses of 2 s, 2 s apart, once the pair's VM side is under way; each line of
# $work/pauses.log: the guests' states and QPs before the stop, during it, after the cont;
# and whether the pair had finished by the last cont (it must not: it runs until told).
# 2 s after the last cont the VM's side is told to stop.
pause_three_times() {
  wait_line "$exchange/paused.from-vm" '^state=' 600 >/dev/null || return 1
  sleep 3
  local i
  for i in 1 2 3; do
    local before during after
    before=$(guest_states)
    "${virsh[@]}" suspend "$domain" >/dev/null
    sleep 2
    during=$(guest_states)
    "${virsh[@]}" resume "$domain" >/dev/null
    after=$(guest_states)
    echo "pause $i: before [$before] during [$during] after [$after]" >>"$work/pauses.log"
    [ "$i" = 3 ] || sleep 2
  done
  grep -q '^done' "$exchange/paused.from-vm" && echo "finished-before-the-last-pause" >>"$work/pauses.log"
  sleep 2
  echo stop >>"$exchange/paused.to-vm"
}
paused_under_traffic() {
  local pauser ok=0
  pause_three_times &
  pauser=$!
  pair paused "$bin/guest-endpoint" pong "$socket" 0 || ok=1
  wait "$pauser" || ok=1
  sed 's/^/pci-e2e: /' "$work/pauses.log"
  echo "pci-e2e: round trips: $(grep -o '^done [0-9]*' "$exchange/paused.from-vm")"
  # Each pause: a guest paused during it, running before and after, with the same QPs.
  [ "$(grep -c 'during \[[^]]*paused' "$work/pauses.log")" = 3 ] || ok=1
  ! grep -q 'finished-before\|\(before\|after\) \[[^]]*paused' "$work/pauses.log" || ok=1
  awk '{ b = $0; sub(/.*before \[/, "", b); sub(/\].*/, "", b); a = $0; sub(/.*after \[/, "", a); sub(/\].*/, "", a);
         gsub(/running|paused/, "", b); gsub(/running|paused/, "", a); if (a != b) bad = 1 } END { exit bad }' \
    "$work/pauses.log" || ok=1
  return "$ok"
}
check_paused() {
  check "virsh suspend/resume three times (2 s each) under a program's checked round trips (until 2 s after the last): no error, every object kept" \
    paused_under_traffic
}

# --- part reopen: the backend is killed and started again under the running VM.
restart_backend_under_the_vm() {
  local to="$exchange/reopen.to-vm" from="$exchange/reopen.from-vm" attached error
  wait_line "$from" '^ready' 600 >/dev/null || { show_logs reopen; return 1; }
  kill -9 "$backend"
  wait "$backend" 2>/dev/null
  attached=$(grep -c "front end attached" "$logs/backend.log")
  start_backend || return 1
  # QEMU reconnects (reconnect-ms) and restarts the device on the new backend.
  local start=$SECONDS
  until [ "$(grep -c "front end attached" "$logs/backend.log")" -gt "$attached" ]; do
    [ $((SECONDS - start)) -lt 120 ] || { echo "pci-e2e: QEMU did not reconnect" >&2; return 1; }
    sleep 0.5
  done
  echo go >>"$to"
  error=$(wait_line "$from" '^error' 300) || { show_logs reopen; return 1; }
  echo "pci-e2e: the guest program saw: $error"
  wait_line "$from" '^reopened' 300 >/dev/null || { show_logs reopen; return 1; }
  echo end >>"$to"
  wait_line "$exchange/reopen.vm-rc" '^0$' 120 >/dev/null || { show_logs reopen; return 1; }
  [[ "$error" == *"device was reset"* ]]
}
check_reopen() {
  check "backend restart under the VM: guest-lib reports the reset, reopens, creates a QP" \
    restart_backend_under_the_vm
}

# --- part native: the native server here; its address exchange with the VM's client goes
# through the relay files (see tests/pci-guest.sh).
pingpong_with_native() {
  local up="$exchange/pingpong.up" down="$exchange/pingpong.down" server relay ok=0
  : >"$down"
  beside_vm stdbuf -oL timeout 900 ibv_rc_pingpong -d rxe0 -g 1 -c -s 4096 -n 50 -p 18515 \
    >"$work/pingpong.out" 2>&1 &
  server=$!
  wait_until_listening 18515 60 || ok=1
  busybox tail -c +1 -F -s 1 "$up" 2>/dev/null | busybox nc 127.0.0.1 18515 >"$down" &
  relay=$!
  wait "$server" || ok=1
  wait_line "$exchange/pingpong.vm-rc" '^0$' 300 >/dev/null || ok=1
  kill "$relay" 2>/dev/null
  pkill -f "tail -c \+1 -F -s 1 $up"
  grep -q ' iters in ' "$work/pingpong.out" && grep -q ' iters in ' "$exchange/pingpong.from-vm" || ok=1
  # How long the VM's program took for its round trips, apart from starting.
  grep -hs ' iters in ' "$exchange/pingpong.from-vm" | sed 's/^/pci-e2e: in the VM, ibv_rc_pingpong: /'
  [ "$ok" = 0 ] || {
    tail -n 5 "$work/pingpong.out" >&2
    show_logs pingpong
  }
}
check_native() {
  check "ibv_rc_pingpong -c in a nested VM (vrdma's libibverbs, PCI) <-> native ibv_rc_pingpong" \
    pingpong_with_native
}

objects_released() {
  local start=$SECONDS now
  while now=$(host_objects) && [ "$now" != "$baseline" ]; do
    if [ $((SECONDS - start)) -gt 30 ]; then
      echo "pci-e2e: host objects (pd cq qp mr) $now, before the VM $baseline" >&2
      return 1
    fi
    sleep 0.5
  done
}

# --- part held: libvirt destroys the VM (kills its QEMU) while a program in it holds a QP
# and more: the backend closes the VM's connection and releases every object it had.
released_lines() { grep -c " objects released; " "$logs/backend.log" || true; }
destroy_under_a_program() {
  wait_line "$exchange/held.from-vm" '^qpn=' 600 >/dev/null || { show_logs held; return 1; }
  local held released start=$SECONDS line
  held=$(guest_states) released=$(released_lines)
  [[ "$held" == running* ]] || { echo "pci-e2e: the VM's state before: [$held]" >&2; return 1; }
  "${virsh[@]}" destroy "$domain" >/dev/null || return 1
  until [ "$(released_lines)" -gt "$released" ]; do
    [ $((SECONDS - start)) -lt 30 ] || { echo "pci-e2e: the backend did not close the VM's connection" >&2; return 1; }
    sleep 0.5
  done
  line=$(grep " objects released; " "$logs/backend.log" | tail -n 1)
  echo "pci-e2e: vrdmactl showed the VM [$held]; destroyed, the backend said: ${line#*connection }"
  [ -z "$(guest_states)" ] && [[ "$line" =~ closed,\ [1-9][0-9]*\ objects\ released ]]
}
check_held() {
  check "virsh destroy while a program in the VM holds a QP: the backend releases all it held" \
    destroy_under_a_program
}

start_backend || exit 1
[ "$device" = rxe0 ] && baseline=$(host_objects)
# libvirtd, started here (unless one of the tests' runs already) so that it outlives the VM:
# the domain's end is read from it.
if [ -n "$domain" ]; then
  libvirtd_was=$("$repo/tests/vm/libvirtd.sh" start) || exit 1
  [ "$libvirtd_was" = started ] && trap '"$repo/tests/vm/libvirtd.sh" stop' EXIT
fi
cp -r "$bin/guest-endpoint" "$bin/vrdma-ibverbs" "$repo/guest-lib/ibverbs/vrdma-run" \
  "$unprivileged/" && chmod -R a+rX "$unprivileged" || exit 1
# The VM can write only to its own run folder (below $runs): that is the exchange.
# 1.5 GiB: part pinned registers 256 MiB beside memory it fragments.
VRDMA_NOTIFY_QUEUES=1 "$repo/tests/vm/run.sh" --no-rxe --mem 1536 --timeout 2400 --run-in "$runs" \
  --vrdma "$socket" "${launch[@]}" -- "$repo/tests/pci-guest.sh" "$bin" "$round_trips" "$unprivileged" "$parts" \
  "$peer_address $vm_address" \
  >"$logs/vm.log" 2>&1 &
vm=$!
until exchange=$(ls -d "$runs"/run.* 2>/dev/null); do
  kill -0 "$vm" 2>/dev/null || { cat "$logs/vm.log" >&2; exit 1; }
  sleep 0.2
done

IFS=, read -ra parts_to_check <<<"$parts"
for part in "${parts_to_check[@]}"; do "check_$part"; done

vm_ok() {
  wait "$vm" || { echo "--- the VM's log" >&2; tail -n 30 "$logs/vm.log" >&2; return 1; }
}
# Destroyed, the VM leaves no exit code: libvirt's word on how it ended counts, and the
# domain is gone once run.sh has undefined it.
vm_destroyed() {
  wait "$vm"
  grep -q "domain $domain is shut off (destroyed)" "$logs/vm.log" &&
    ! "${virsh[@]}" dominfo "$domain" >/dev/null 2>&1 ||
    { echo "--- the VM's log" >&2; tail -n 30 "$logs/vm.log" >&2; return 1; }
}
if [[ ",$parts," == *,held,* ]]; then
  check "libvirt: the domain was destroyed, then undefined" vm_destroyed
else
  check "the VM ran its programs and shut down" vm_ok
fi
[ "$device" = rxe0 ] && check "every host object of the VM released after it shut down" objects_released
# Where the VM's time went (its uptime at each mark): a boot, each part, the service's start.
awk '{ printf "pci-e2e: in the VM at %s", $1; $1 = ""; print }' "$exchange/timeline.vm" 2>/dev/null
kill "$backend" 2>/dev/null
wait "$backend" 2>/dev/null
if [ "$failures" = 0 ]; then
  rm -rf "$work"
else
  echo "pci-e2e: logs kept in $work" >&2
  exit 1
fi
