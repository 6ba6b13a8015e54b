#!/usr/bin/env bash
# Runs inside the rxe test guest (tests/vm/run.sh): boots a nested VM whose vrdma PCI device the
# backend here serves, and checks, against guest-lib programs in that VM (tests/nested-guest.sh):
#   1. RC SEND/RECV round trips with checksums plus RDMA WRITE/READ, with a guest-lib program
#      attached directly to the same backend;
#   2. the same with a native ibverbs program on rxe0;
#   3. a backend restart under the running VM: guest-lib reports the device reset, opens the
#      device again and creates a QP;
#   4. an unmodified ibv_rc_pingpong in the VM (vrdma's libibverbs over the PCI device) with
#      its buffer check, against a native ibv_rc_pingpong on rxe0 here;
#   5. once the VM is shut down, every host object it had is released (`rdma resource`).
# Prints one `nested-e2e: CHECK ok|FAILED (N s)` line per check; exits 1 if any failed.
# usage: tests/nested-e2e.sh BIN_DIR   (BIN_DIR holds vhost-user-rdma, guest-endpoint,
#                                       native-endpoint, vrdma-ibverbs/libibverbs.so.1)
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "$1" && pwd)
round_trips=${VRDMA_NESTED_ROUND_TRIPS:-200}
socket=/tmp/vrdma-nested.sock
: "${VRDMA_VM_RUN_DIR:?run me inside the VM harness (tests/vm/run.sh)}"
logs=/tmp/nested-e2e
mkdir -p "$logs"
failures=0

# Each check's line says how long it took, so a slow one shows in CI's log.
check() {
  local name=$1 start=$SECONDS
  shift
  if "$@"; then
    echo "nested-e2e: $name ok ($((SECONDS - start)) s)"
  else
    echo "nested-e2e: $name FAILED ($((SECONDS - start)) s)"
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
  RUST_LOG=info "$bin/vhost-user-rdma" --socket-path "$socket" --shared-gid >>"$logs/backend.log" 2>&1 &
  backend=$!
  for _ in $(seq 300); do
    [ "$(accepting "$logs/backend.log")" -gt "${before:-0}" ] && return 0
    sleep 0.1
  done
  echo "nested-e2e: the backend did not start:" >&2
  cat "$logs/backend.log" >&2
  return 1
}

# wait_line FILE REGEX SECONDS: prints the first line of FILE matching REGEX, waiting for it.
wait_line() {
  local file=$1 pattern=$2 start=$SECONDS line
  while [ $((SECONDS - start)) -lt "$3" ]; do
    if [ -f "$file" ] && line=$(grep -m1 -E "$pattern" "$file"); then
      echo "$line"
      return 0
    fi
    sleep 0.5
  done
  echo "nested-e2e: no line matching '$pattern' in $file after $3 s" >&2
  return 1
}

# The host objects on rxe0 (pd, cq, qp, mr, ctx ...), as `rdma resource show` counts them.
host_objects() {
  rdma resource show | awk '$2 == "rxe0:" { $1 = $2 = ""; print }'
}

show_logs() {
  local name=$1 f
  for f in "/tmp/$name.err" "$exchange/$name.nested-err" "$exchange/$name.from-nested"; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }
  done
  return 1
}

# pair NAME COMMAND...: runs COMMAND here against the nested program of session NAME; they
# trade address lines, then both must print `done`.
pair() {
  local name=$1 mine theirs peer
  shift
  local to="$exchange/$name.to-nested" from="$exchange/$name.from-nested" ok=0
  mkfifo "/tmp/$name.in"
  "$@" <"/tmp/$name.in" >"/tmp/$name.out" 2>"/tmp/$name.err" &
  peer=$!
  exec 7>"/tmp/$name.in"
  # The first session also waits for the nested VM to boot (minutes under emulation).
  if mine=$(wait_line "/tmp/$name.out" '^qpn=' 120) && theirs=$(wait_line "$from" '^qpn=' 900); then
    echo "$mine" >>"$to"
    echo "$theirs" >&7
    wait_line "/tmp/$name.out" '^done' 900 >/dev/null &&
      wait_line "$from" '^done' 300 >/dev/null || ok=1
  else
    ok=1
  fi
  echo end >>"$to"
  exec 7>&-
  wait "$peer" || ok=1
  wait_line "$exchange/$name.nested-rc" '^0$' 120 >/dev/null || ok=1
  [ "$ok" = 0 ] || show_logs "$name"
}

# The reopen session: the backend is killed and started again under the running VM.
restart_backend_under_the_vm() {
  local to="$exchange/reopen.to-nested" from="$exchange/reopen.from-nested" attached error
  wait_line "$from" '^ready' 600 >/dev/null || { show_logs reopen; return 1; }
  kill -9 "$backend"
  wait "$backend" 2>/dev/null
  attached=$(grep -c "front end attached" "$logs/backend.log")
  start_backend || return 1
  # QEMU reconnects (reconnect-ms) and restarts the device on the new backend.
  local start=$SECONDS
  until [ "$(grep -c "front end attached" "$logs/backend.log")" -gt "$attached" ]; do
    [ $((SECONDS - start)) -lt 120 ] || { echo "nested-e2e: QEMU did not reconnect" >&2; return 1; }
    sleep 0.5
  done
  echo go >>"$to"
  error=$(wait_line "$from" '^error' 300) || { show_logs reopen; return 1; }
  echo "nested-e2e: the guest program saw: $error"
  wait_line "$from" '^reopened' 300 >/dev/null || { show_logs reopen; return 1; }
  echo end >>"$to"
  wait_line "$exchange/reopen.nested-rc" '^0$' 120 >/dev/null || show_logs reopen
  [[ "$error" == *"device was reset"* ]]
}

start_backend || exit 1
baseline=$(host_objects)
# The nested VM can write only to its own run folder (below ours): that is the exchange.
VRDMA_NOTIFY_QUEUES=1 "$repo/tests/vm/run.sh" --no-rxe --mem 768 --timeout 2400 \
  --vrdma "$socket" -- "$repo/tests/nested-guest.sh" "$bin" "$round_trips" \
  >"$logs/vm.log" 2>&1 &
vm=$!
until exchange=$(ls -d "$VRDMA_VM_RUN_DIR"/nested.* 2>/dev/null); do
  kill -0 "$vm" 2>/dev/null || { cat "$logs/vm.log" >&2; exit 1; }
  sleep 0.2
done

check "guest-lib in a nested VM <-> guest-lib attached directly: $round_trips checked round trips, RDMA WRITE+READ" \
  pair guest-peer "$bin/guest-endpoint" pong "$socket" "$round_trips"
check "guest-lib in a nested VM <-> native ibverbs: $round_trips checked round trips, RDMA WRITE+READ" \
  pair native-peer "$bin/native-endpoint" ping "$round_trips"
check "backend restart under the VM: guest-lib reports the reset, reopens, creates a QP" \
  restart_backend_under_the_vm

# The native server here; its address exchange with the VM's client goes through the relay
# files (see tests/nested-guest.sh).
pingpong_with_native() {
  local up="$exchange/pingpong.up" down="$exchange/pingpong.down" server relay ok=0
  : >"$down"
  stdbuf -oL timeout 900 ibv_rc_pingpong -d rxe0 -g 1 -c -s 4096 -n 50 -p 18515 \
    >/tmp/pingpong.out 2>&1 &
  server=$!
  wait_line /tmp/pingpong.out 'local address' 60 >/dev/null || ok=1
  busybox tail -c +1 -F -s 1 "$up" 2>/dev/null | busybox nc 127.0.0.1 18515 >"$down" &
  relay=$!
  wait "$server" || ok=1
  wait_line "$exchange/pingpong.nested-rc" '^0$' 300 >/dev/null || ok=1
  kill "$relay" 2>/dev/null
  pkill -f "tail -c \+1 -F -s 1 $up"
  grep -q ' iters in ' /tmp/pingpong.out && grep -q ' iters in ' "$exchange/pingpong.from-nested" || ok=1
  [ "$ok" = 0 ] || {
    tail -n 5 /tmp/pingpong.out >&2
    show_logs pingpong
  }
}
check "ibv_rc_pingpong -c in a nested VM (vrdma's libibverbs, PCI) <-> native ibv_rc_pingpong" \
  pingpong_with_native

vm_ok() {
  wait "$vm" || { echo "--- nested VM log" >&2; tail -n 30 "$logs/vm.log" >&2; return 1; }
}
check "the nested VM ran its programs and shut down" vm_ok
objects_released() {
  local start=$SECONDS now
  while now=$(host_objects) && [ "$now" != "$baseline" ]; do
    if [ $((SECONDS - start)) -gt 30 ]; then
      echo "nested-e2e: host objects (pd cq qp mr) $now, before the VM $baseline" >&2
      return 1
    fi
    sleep 0.5
  done
}
check "every host object of the VM released after it shut down" objects_released
kill "$backend" 2>/dev/null
[ "$failures" = 0 ]
