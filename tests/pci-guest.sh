#!/usr/bin/env bash
# Runs inside the VM that tests/pci-e2e.sh boots with a vrdma PCI device: guest-lib programs on
# that device, one session after the other, each talking to a peer outside the VM through files
# in this VM's run folder, the only one it can write to: the peer's lines arrive in
# NAME.to-vm (a line `end` closes the session), the program's output goes to
# NAME.from-vm and its exit code to NAME.vm-rc. PARTS (comma-separated, run in this
# order) say which sessions run; tests/pci-e2e.sh checks the same parts:
#   service  the guest service (vrdmad) owns the device: an unprivileged user's program
#            through it (session guest-peer); a program opening the PCI device meanwhile is
#            refused (direct.vm-rc, direct.vm-err); the device node it made (node.vm); a
#            second unprivileged program asleep on a completion event (session sleeper): its
#            and the service's wake-ups and CPU time over 10 idle seconds (service-idle.vm),
#            then a completion wakes it; two users' unmodified ibv_rc_pingpong pair through
#            the service, then an ib_write_bw and an ib_send_lat pair at once beside a third
#            pair whose client is killed (users.vm); SIGKILL of the service under four
#            programs asleep in ibv_get_cq_event and four polling (killed.vm); a service
#            restart under a waiting program: how that program ended and whether the next
#            one works (restart.vm)
#   cm       the guest service, and through it rping on vrdma's librdmacm as an unprivileged
#            user: the client of a server outside the VM at the first of CM_ADDRESSES,
#            then the server of a client there on the second (cm.vm: `client RC`,
#            `server RC`)
#   reopen   a backend restart under the running VM (session reopen)
#   native   an unmodified ibv_rc_pingpong through vrdma-run --device pci (vrdma's
#            libibverbs attached to the PCI device directly), against a native peer outside;
#            this VM has no network, so its TCP address exchange is relayed through
#            pingpong.up / pingpong.down
#   held     guest-lib attached to the PCI device makes its objects (QP and all), says its QP
#            number and waits for a peer that never comes: the VM is destroyed under it
#            (session held; the last part, as the VM does not end by itself then)
#   paused   guest-lib attached to the PCI device makes checked round trips with a peer
#            outside, which pauses the VM meanwhile (session paused)
#   pinned   a program's 256 MiB registered buffer written from outside while memory is
#            compacted in a loop; a sentinel program checks the frames it is given (session
#            pinned, pinned.vm)
# usage: tests/pci-guest.sh BIN_DIR ROUND_TRIPS UNPRIVILEGED_DIR PARTS [CM_ADDRESSES]
#   UNPRIVILEGED_DIR holds copies of guest-endpoint, vrdma-run and vrdma-ibverbs/ that any
#   user may run (the checkout may lie below a folder only its owner may enter)
#   CM_ADDRESSES "PEER OWN": the peer's address and the device's own (the backend's
#   --guest-ip), for rdma_cm
set -uo pipefail
exchange=${VRDMA_VM_RUN_DIR:?run me inside the VM harness} bin=$1 round_trips=$2
unprivileged=$3 parts=$4 cm_addresses=${5:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/listening.sh"

# A descriptor that never has input: `read -t` on it waits without starting a process. Every
# process started here costs time under emulation and takes it from the program under test on
# the VM's one vCPU.
exec {never}<> <(:)
pause() { read -rt "$1" -u "$never" || true; }

# mark WHAT: the VM's uptime and WHAT, a line of timeline.vm (tests/pci-e2e.sh prints it: where
# the VM's minutes go).
mark() {
  local up
  read -r up _ </proc/uptime
  echo "$up s $*" >>"$exchange/timeline.vm"
}

# Prints the lines of FILE as they are appended (9p has no inotify: polls), until `end`.
follow() {
  local file=$1 n=0 line lines
  while :; do
    if [ -f "$file" ]; then
      mapfile -t lines <"$file"
      while [ "$n" -lt "${#lines[@]}" ]; do
        line=${lines[$n]}
        n=$((n + 1))
        [ "$line" = end ] && return 0
        echo "$line"
      done
    fi
    pause 0.2
  done
}

# session NAME [RUNNER...] -- ARG...: guest-endpoint ARG..., started through RUNNER if given.
session() {
  local name=$1 runner=()
  shift
  while [ "$1" != -- ]; do runner+=("$1"); shift; done
  shift
  follow "$exchange/$name.to-vm" |
    "${runner[@]}" "$unprivileged/guest-endpoint" "$@" >"$exchange/$name.from-vm" 2>"$exchange/$name.vm-err"
  echo "${PIPESTATUS[1]}" >"$exchange/$name.vm-rc"
}

# CPU time (user + system, in 1/100 s) process $1 has spent.
cpu_ticks() {
  local stat
  read -r stat <"/proc/$1/stat"
  stat=${stat##*) } # fields from the 3rd on (the command name may hold spaces)
  set -- $stat
  echo $((${12} + ${13}))
}

# threads LABEL PID: each thread of process PID with its CPU time and voluntary context
# switches (each one a sleep the thread was woken from).
threads() {
  local task name line switches
  for task in /proc/"$2"/task/*; do
    read -r name <"$task/comm"
    switches=0
    while read -r line; do
      [[ $line == voluntary_ctxt_switches:* ]] && switches=${line##*[[:space:]]}
    done <"$task/status"
    echo "$1 ${task##*/} $name $(cpu_ticks "$2/task/${task##*/}") $switches"
  done
}

# start_service [LOG]: vrdmad as its systemd unit starts it, with the socket's group nogroup
# for the unprivileged users; returns once it listens (says so in its log: the socket of an
# instance stopped before may still be there).
start_service() {
  RUST_LOG=info "$bin/vrdmad" --device pci --group nogroup 2>"$exchange/$1" &
  service=$!
  wait_for_line "$exchange/$1" 'listening on '
  mark "vrdmad listening"
}

# Stops vrdmad as systemd does, with SIGTERM, which ends it (exit status 143): anything else
# is said, and fails the part it ends.
stop_service() {
  local status
  kill "$service"
  wait "$service"
  status=$?
  [ "$status" = 143 ] || { echo "pci-guest.sh: vrdmad ended with status $status" >&2; return 1; }
}

# Waits until vrdmad has released what its programs left: their threads have ended.
service_settled() {
  local departing task name
  for _ in $(seq 240); do
    departing=0
    for task in /proc/"$service"/task/*; do
      read -r name <"$task/comm" 2>/dev/null && [[ $name == vrdmad-program-* ]] && departing=1
    done
    [ "$departing" = 0 ] && return 0
    pause 0.5
  done
}

# wait_for_line FILE TEXT: waits (at most 300 s) until FILE holds TEXT.
wait_for_line() {
  for _ in $(seq 600); do
    [[ -f "$1" && $(<"$1") == *"$2"* ]] && return 0
    pause 0.5
  done
}

# as_user UID PROGRAM ARG...: an unmodified program through vrdma's libibverbs and vrdmad, as
# user UID in group nogroup.
as_user() {
  local uid=$1
  shift
  # Line-buffered, so that the server's "ready" line reaches its file while it waits.
  setpriv --reuid="$uid" --regid=65534 --clear-groups -- \
    env VRDMA_IBVERBS_DIR="$unprivileged/vrdma-ibverbs" "$unprivileged/vrdma-run" \
    --device service -- stdbuf -oL "$@"
}

# users_pair NAME PORT PROGRAM ARG...: server as uid 65534, client as uid 65533; the client
# starts once the server says it is ready. The exit codes go to users.vm
# (`NAME server RC client RC`).
users_pair() {
  local name=$1 port=$2 server client_rc said
  shift 2
  said="$exchange/$name-server.out"
  as_user 65534 "$@" -p "$port" >"$said" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    # What the pingpongs and perftest say once they wait for their client.
    [[ -f $said && $(<"$said") =~ local\ address|Waiting\ for\ client ]] && break
    kill -0 "$server" 2>/dev/null || break
    pause 0.5
  done
  wait_until_listening "$port" 300
  as_user 65533 "$@" -p "$port" 127.0.0.1 >"$exchange/$name-client.out" 2>&1
  client_rc=$?
  wait "$server"
  echo "$name server $? client $client_rc" >>"$exchange/users.vm"
}

# Three pairs of two users' perftest programs at once, streaming for a time each: an
# ib_write_bw and an ib_send_lat pair for 8 seconds, and an ib_write_bw pair for a minute whose
# client is killed with SIGKILL once all three stream: the two must finish. users.vm gets their
# lines (see users_pair) and `killed PID`, the killed client's process (vrdmad's log tells its
# programs).
perftest_pairs_and_a_killed_one() {
  local pid streaming name pairs=() killed_server
  as_user 65534 ib_write_bw -d vrdma0 -x 0 -D 60 -p 18523 >"$exchange/killed-server.out" 2>&1 &
  killed_server=$!
  wait_for_line "$exchange/killed-server.out" "Waiting for client"
  wait_until_listening 18523 300
  as_user 65533 ib_write_bw -d vrdma0 -x 0 -D 60 -p 18523 127.0.0.1 \
    >"$exchange/killed-client.out" 2>&1 &
  users_pair write_bw 18521 ib_write_bw -d vrdma0 -x 0 -D 8 &
  pairs+=($!)
  users_pair send_lat 18522 ib_send_lat -d vrdma0 -x 0 -D 8 &
  pairs+=($!)
  for _ in $(seq 600); do
    streaming=0
    for name in killed write_bw send_lat; do
      [[ -f "$exchange/$name-client.out" && $(<"$exchange/$name-client.out") == *"#bytes"* ]] &&
        streaming=$((streaming + 1))
    done
    [ "$streaming" = 3 ] && break
    pause 0.5
  done
  pause 2
  pid=$(pgrep -f -- "ib_write_bw -d vrdma0 -x 0 -D 60 -p 18523 127.0.0.1")
  echo "killed $pid" >>"$exchange/users.vm"
  kill -9 $pid
  wait "${pairs[@]}"
  # The killed client's server ends once it finds its peer gone, or after its minute.
  wait "$killed_server"
}

# An unprivileged program asleep on a completion event (guest-endpoint's `sleep` mode): its
# and the service's wake-ups and CPU time over 10 idle seconds, then a line `go` makes it send
# itself a message, whose completion event must wake it.
idle_record() {
  local sleeper_session sleeper process name record label tid ticks switches
  local before_label before_tid before_ticks before_switches threads_before threads_after
  local interrupts_before interrupts_after
  session sleeper setpriv --reuid=65534 --regid=65534 --clear-groups -- sleep service 0 &
  sleeper_session=$!
  wait_for_line "$exchange/sleeper.from-vm" sleeping
  for process in /proc/[0-9]*; do
    read -r name <"$process/comm" 2>/dev/null && [ "$name" = guest-endpoint ] && sleeper=${process#/proc/}
  done
  declare -A idle_start=([vrdmad]=$(cpu_ticks "$service") [program]=$(cpu_ticks "$sleeper"))
  threads_before=$(threads vrdmad "$service"; threads program "$sleeper")
  read -r interrupts_before </sys/class/uio/uio0/event || interrupts_before=0
  pause 10
  read -r interrupts_after </sys/class/uio/uio0/event || interrupts_after=0
  threads_after=$(threads vrdmad "$service"; threads program "$sleeper")
  # /proc counts CPU time in USER_HZ, which is 100 on Linux. The record is written in one
  # piece and ends in `end`: the peer reads it as soon as it is there.
  record="cpu-ticks vrdmad $(($(cpu_ticks "$service") - idle_start[vrdmad]))"
  record+=$'\n'"cpu-ticks program $(($(cpu_ticks "$sleeper") - idle_start[program]))"
  record+=$'\n'"interrupts $((interrupts_after - interrupts_before))"
  declare -A wakeups=([vrdmad]=0 [program]=0)
  while read -r label tid name ticks switches; do
    while read -r before_label before_tid _ before_ticks before_switches; do
      [ "$before_label $before_tid" = "$label $tid" ] || continue
      record+=$'\n'"thread $label $name ($tid): $((ticks - before_ticks)) ticks, $((switches - before_switches)) wake-ups"
      wakeups[$label]=$((wakeups[$label] + switches - before_switches))
    done <<<"$threads_before"
  done <<<"$threads_after"
  printf '%s\nwake-ups vrdmad %s\nwake-ups program %s\nend\n' \
    "$record" "${wakeups[vrdmad]}" "${wakeups[program]}" >"$exchange/service-idle.vm"
  printf 'go\nend\n' >>"$exchange/sleeper.to-vm"
  wait "$sleeper_session"
}

# SIGKILL of vrdmad mid-stream under two ibv_rc_pingpong pairs with -e (asleep in
# ibv_get_cq_event) and two polling ibv_poll_cq, each pair of two users: the device still
# serves their rings, but no one serves their requests and events, and the next vrdmad
# resets it, so each must end with an error (none hang, none report success). killed.vm: a
# line `NAME RC SECONDS` per program, RC `hung` when it had not ended 120 s after the kill;
# the pages the pinning module holds for the device once they have all ended (`held-dead N`:
# the device may still write what the dead vrdmad pinned) and once vrdmad has started again
# and reset the device (`held-reset N`); `end`.
kill_record() {
  local i port name mode pids=() names=() killed rc
  for i in 0 1 2 3; do
    port=$((18540 + i)) mode=()
    if [ "$i" -lt 2 ]; then name=waiting$i mode=(-e); else name=polling$i; fi
    as_user 65534 ibv_rc_pingpong -d vrdma0 -g 0 -s 64 -n 1000000000 "${mode[@]}" -p "$port" \
      >"$exchange/$name-server.out" 2>&1 &
    pids+=($!) names+=("$name-server")
    wait_for_line "$exchange/$name-server.out" "local address"
    wait_until_listening "$port" 300
    as_user 65533 ibv_rc_pingpong -d vrdma0 -g 0 -s 64 -n 1000000000 "${mode[@]}" -p "$port" \
      127.0.0.1 >"$exchange/$name-client.out" 2>&1 &
    pids+=($!) names+=("$name-client")
    wait_for_line "$exchange/$name-client.out" "remote address"
  done
  pause 2
  kill -9 "$service"
  wait "$service"
  killed=$SECONDS
  # Its socket stays behind: the next instance replaces it, and start_service waits for that.
  rm -f /run/vrdma/vrdmad.sock
  for i in "${!pids[@]}"; do
    rc=hung
    for _ in $(seq 240); do
      kill -0 "${pids[$i]}" 2>/dev/null || { wait "${pids[$i]}"; rc=$?; break; }
      [ $((SECONDS - killed)) -ge 120 ] && break
      pause 0.5
    done
    [ "$rc" = hung ] && kill -9 "${pids[$i]}"
    echo "${names[$i]} $rc $((SECONDS - killed))" >>"$exchange/killed.vm"
  done
  echo "held-dead $(</sys/module/vrdma_pin/parameters/held_pages)" >>"$exchange/killed.vm"
  start_service vrdmad-after-kill.log
  echo "held-reset $(</sys/module/vrdma_pin/parameters/held_pages)" >>"$exchange/killed.vm"
  echo end >>"$exchange/killed.vm"
}

# A service restart under a program waiting for an event (an unprivileged `sleep` program
# whose stdin is never ready): it must end with an error (exit code 1), not hang; the next
# program must work at once. restart.vm: `orphan RC` (or `orphan hung`), `next RC`, `end`.
restart_record() {
  local orphan orphan_rc=hung orphan_in next_rc
  exec {orphan_in}<> <(:)
  setpriv --reuid=65534 --regid=65534 --clear-groups -- "$unprivileged/guest-endpoint" \
    sleep service <&"$orphan_in" >"$exchange/orphan.out" 2>&1 &
  orphan=$!
  wait_for_line "$exchange/orphan.out" sleeping
  stop_service
  start_service vrdmad-restarted.log
  for _ in $(seq 240); do
    kill -0 "$orphan" 2>/dev/null || { wait "$orphan"; orphan_rc=$?; break; }
    pause 0.5
  done
  [ "$orphan_rc" = hung ] && kill -9 "$orphan"
  as_user 65534 ibv_devinfo -d vrdma0 >"$exchange/restart-next.out" 2>&1
  next_rc=$?
  printf 'orphan %s\nnext %s\nend\n' "$orphan_rc" "$next_rc" >"$exchange/restart.vm"
}

part_service() {
  start_service vrdmad.log
  # The device's marker node, for programs that look for one (UCX): a character device.
  [ -c /dev/infiniband/vrdma0 ] && echo character-device >"$exchange/node.vm"
  # A second driver of the device: a second vrdmad, whose binary is loaded already.
  "$bin/vrdmad" --device pci --socket /run/vrdma/second.sock 2>"$exchange/direct.vm-err"
  echo $? >"$exchange/direct.vm-rc"
  session guest-peer setpriv --reuid=65534 --regid=65534 --clear-groups -- ping service "$round_trips"
  # Idle from when the service has released what the program left.
  service_settled
  idle_record
  users_pair pingpong 18520 ibv_rc_pingpong -d vrdma0 -g 0 -c -s 4096 -n 20
  perftest_pairs_and_a_killed_one
  echo end >>"$exchange/users.vm"
  kill_record
  restart_record
  stop_service
}

# rping_pairs PEER OWN: rping as uid 65534 through the service, the client of the server
# outside at PEER (started again until that server listens), then a server on OWN for a
# client outside; their exit codes go to cm.vm.
rping_pairs() {
  local rc
  for _ in $(seq 100); do
    as_user 65534 timeout 120 rping -c -a "$1" -p 18530 -C 5 -v >"$exchange/rping-client.out" 2>&1
    rc=$?
    [ "$rc" = 0 ] && break
    pause 2
  done
  echo "client $rc" >>"$exchange/cm.vm"
  mark "rping client ended"
  as_user 65534 timeout 600 rping -s -a "$2" -p 18531 -C 5 >"$exchange/rping-server.out" 2>&1
  echo "server $?" >>"$exchange/cm.vm"
  mark "rping server ended"
}

# rdma_cm's rping through the guest service.
part_cm() {
  start_service vrdmad.log
  # shellcheck disable=SC2086 # two addresses
  rping_pairs $cm_addresses
  stop_service
}

part_reopen() { session reopen -- reopen pci; }

part_native() {
  # The pingpong's peer address is 127.0.0.1 here: a one-connection listener copies the
  # socket into pingpong.up and pingpong.down into the socket.
  busybox nc -l -p 18515 -e sh -c 'busybox tail -c +1 -F -s 1 "$2" & exec cat >>"$1"' \
    relay "$exchange/pingpong.up" "$exchange/pingpong.down" &
  pause 1
  VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs" "$repo/guest-lib/ibverbs/vrdma-run" --device pci -- \
    ibv_rc_pingpong -d vrdma0 -g 0 -c -s 4096 -n 50 -p 18515 127.0.0.1 \
    >"$exchange/pingpong.from-vm" 2>"$exchange/pingpong.vm-err"
  echo $? >"$exchange/pingpong.vm-rc"
}

part_held() { session held -- pong pci 1; }

# Checked round trips with a peer outside the VM, which pauses the VM meanwhile and then
# says stop (session paused).
part_paused() { session paused -- ping pci 0; }

# Memory the device writes stays where it was told it is (SPEC.md §12): a program registers
# 256 MiB (session pinned: `guest-endpoint target`, driven by `pin-check writer` outside,
# which RDMA-WRITEs patterns into it and has the program check them); then memory is
# fragmented and compacted in a loop, and a sentinel checks that no frame it is given is
# written by anyone else (pinned.vm). The peer's last line stops the compaction.
part_pinned() {
  local target fragmenter compactor sentinel
  session pinned -- target pci $((256 << 20)) &
  target=$!
  wait_for_line "$exchange/pinned.from-vm" rkey=
  "$bin/pin-check" fragment 192 >"$exchange/fragment.vm" &
  fragmenter=$!
  wait_for_line "$exchange/fragment.vm" fragmented
  "$bin/pin-check" sentinel 45 64 >"$exchange/pinned.vm" 2>&1 &
  sentinel=$!
  (
    while [ ! -e "$exchange/pinned.stop" ]; do
      echo 1 >/proc/sys/vm/compact_memory
      pause 0.5
    done
  ) &
  compactor=$!
  wait "$target"
  touch "$exchange/pinned.stop"
  wait "$compactor"
  wait "$sentinel"
  echo "sentinel-rc $?" >>"$exchange/pinned.vm"
  grep -E '^(compact_(migrate_scanned|stall|success)|pgmigrate_success)' /proc/vmstat >>"$exchange/pinned.vm"
  echo end >>"$exchange/pinned.vm"
  kill "$fragmenter"
}

# A program of vrdmad that leaves badly (SPEC.md §12): session leaver, a `target` whose
# buffer `pin-check leaver` outside WRITEs into before and after it punches holes in,
# truncates and unmaps all the memory it shared and exits; a sentinel checks meanwhile and
# for a while after that no frame it freed is written (leaver.vm). Session bystander, a
# second program of vrdmad, is checked by `pin-check writer` outside afterwards. Their
# RLIMIT_MEMLOCK is raised for their buffers (vrdmad charges what they share to it).
part_leaver() {
  local sentinel bystander leaver
  local program=(prlimit --memlock=unlimited:unlimited setpriv --reuid=65534 --regid=65534 --clear-groups)
  start_service vrdmad-leaver.log
  session bystander "${program[@]}" -- target service $((4 << 20)) &
  bystander=$!
  # 12 MiB: 3072 pages, which one registration maps even where each lies apart in guest RAM
  # (part pinned leaves it fragmented; the backend maps up to 4095 runs, SPEC.md's REG_MR).
  session leaver "${program[@]}" -- target service $((12 << 20)) &
  leaver=$!
  wait_for_line "$exchange/leaver.from-vm" rkey=
  "$bin/pin-check" sentinel 30 64 >"$exchange/leaver.vm" 2>&1 &
  sentinel=$!
  wait "$sentinel"
  echo "sentinel-rc $?" >>"$exchange/leaver.vm"
  grep -o 'program [0-9]* gone.*' "$exchange/vrdmad-leaver.log" >>"$exchange/leaver.vm"
  echo end >>"$exchange/leaver.vm"
  wait "$leaver" "$bystander"
  stop_service
}

modprobe uio_pci_generic 2>/dev/null # the initramfs loaded it already, if it has it
IFS=, read -ra parts_to_run <<<"$parts"
for part in "${parts_to_run[@]}"; do
  mark "part $part"
  case "$part" in
    service | cm | reopen | native | held | pinned | leaver | paused) "part_$part" ;;
    *) echo "pci-guest.sh: unknown part '$part'" >&2; exit 2 ;;
  esac
done
mark "parts done"
