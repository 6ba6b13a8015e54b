#!/usr/bin/env bash
# Runs on both hosts of tests/vm/two-hosts.sh (VRDMA_HOST a or b): vrdma guests on two hosts
# doing RDMA over RoCEv2 across the link between them, each guest under its own address:
#   a1 = 10.50.0.11 and a2 = 10.50.0.13 on host a, b1 = 10.50.0.12 on host b, each served by
#   a backend of its own started with --guest-ip. Guests are processes attached directly to
#   their backend's socket, running unmodified libibverbs programs through vrdma-run.
# Checks, in order, each host printing `cross-host: CHECK ok|FAILED` for its side:
#   addresses        each guest address is on eth0 under vrdma's label, in rxe0's GID table,
#                    and the only GID its guest sees (no guest sees another's)
#   guest-to-native  a1 <-> a native program on host b: RC SEND/RECV, WRITE, READ, atomics
#                    and UD, payloads checked where they land (tests/c/rdma_check.c); host b
#                    names a1 by its guest address, so RC and the UD source address prove
#                    that a1's traffic left host a as 10.50.0.11, not as host a
#   guest-to-guest   a1 <-> b1, the same checks
#   two-guests       a1 and a2 at once, each with its own native server on host b, which
#                    checks each one's source address
#   rc-pingpong      Debian's ibv_rc_pingpong -c: a1 <-> native on host b
#   link-fault       host b takes its link down for 3 s under a1's stream of WRITEs: a1 sees
#                    a retry-exceeded completion (nothing hangs), then new QPs work
#   rdma_cm          Debian's rdma_cm programs through vrdma's librdmacm.so.1, each as a1 the
#                    client of a native server on host b and as a1 the server of a native
#                    client there: rping, ucmatose (4 connections), udaddy (UD),
#                    rdma_server/rdma_client, perftest -R (ib_write_lat, ib_send_bw,
#                    ib_read_bw); and rping a1 to b1
#   backends-stop    SIGTERM stops each backend (exit 0) and its guest address leaves eth0
#                    and the GID table
# After every check with RDMA traffic, rxe0's objects (`rdma resource`) return to what they
# were before it. Exits 1 if any check failed.
# usage: tests/cross-host.sh BIN_DIR RDMA_CHECK   (BIN_DIR holds vhost-user-rdma and
#                                    vrdma-ibverbs/; RDMA_CHECK is tests/c/rdma_check.c built)
set -uo pipefail
# Checks grep a command's captured output: `cmd | grep -q` fails under pipefail whenever grep
# stops reading at its match before cmd has written everything (SIGPIPE).

repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/listening.sh"
bin=$(cd "$1" && pwd)
rdma_check=$2
: "${VRDMA_HOST:?run me through tests/vm/two-hosts.sh}"
host=$VRDMA_HOST host_ip=$VRDMA_HOST_IP
a1=10.50.0.11 a2=10.50.0.13 b1=10.50.0.12
host_b=10.50.0.2
logs=/tmp/cross-host
mkdir -p "$logs"
failures=0
export VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"

check() { # NAME COMMAND...
  local name=$1
  shift
  if "$@"; then
    echo "cross-host: $name ok"
  else
    echo "cross-host: $name FAILED"
    failures=$((failures + 1))
    tail -n 5 "$logs"/backend-*.log >&2
  fi
}

# The guests of this host: name and address.
case "$host" in
  a) guests=("a1 $a1" "a2 $a2") ;;
  b) guests=("b1 $b1") ;;
  *) echo "cross-host: VRDMA_HOST must be a or b" >&2; exit 2 ;;
esac

declare -A backend
# accepting FILE: how many times the backend logging to FILE said it was ready for guests.
accepting() { grep -c "accepting guests" "$1" 2>/dev/null || true; }

start_backends() {
  local guest name address
  local -A before
  for guest in "${guests[@]}"; do
    read -r name address <<<"$guest"
    before[$name]=$(accepting "$logs/backend-$name.log")
    rm -f "$(socket "$name")"
    RUST_LOG=info "$bin/vhost-user-rdma" --socket-path "$(socket "$name")" \
      --guest-ip "$address/24" >>"$logs/backend-$name.log" 2>&1 &
    backend[$name]=$!
  done
  for guest in "${guests[@]}"; do
    read -r name address <<<"$guest"
    for _ in $(seq 300); do
      [ "$(accepting "$logs/backend-$name.log")" -gt "${before[$name]:-0}" ] && continue 2
      sleep 0.1
    done
    echo "cross-host: backend $name did not start:" >&2
    cat "$logs/backend-$name.log" >&2
    return 1
  done
}

# `$vrdma_run --device "$(socket GUEST)" -- COMMAND` runs COMMAND as a process of guest GUEST.
vrdma_run=$repo/guest-lib/ibverbs/vrdma-run
socket() { echo "/tmp/vrdma-$1.sock"; }

# rxe0's objects (pd, cq, qp, mr, ctx ...) as `rdma resource show` counts them.
host_objects() { rdma resource show | awk '$2 == "rxe0:" { $1 = $2 = ""; print }'; }

# Waits up to 15 s for rxe0's objects to be back at the baseline.
objects_settle() {
  local now
  for _ in $(seq 30); do
    now=$(host_objects)
    [ "$now" = "$baseline" ] && return 0
    sleep 0.5
  done
  echo "cross-host: rxe0 holds$now, before the check it held$baseline" >&2
  return 1
}

# run_check ROLE LOCAL PEER PORT GUEST [ARG...]: rdma_check as guest GUEST, or natively on
# rxe0 when GUEST is "-"; it must end with "rdma_check: ok".
run_check() {
  local role=$1 local_ip=$2 peer=$3 port=$4 guest=$5 log status
  shift 5
  log="$logs/rdma_check-$port-$role.log"
  if [ "$guest" = - ]; then
    timeout 300 "$rdma_check" "$role" -d rxe0 --local "$local_ip" --peer "$peer" \
      --port "$port" "$@" >"$log" 2>&1
  else
    timeout 300 "$vrdma_run" --device "$(socket "$guest")" -- "$rdma_check" "$role" \
      -d vrdma0 --local "$local_ip" --peer "$peer" --port "$port" "$@" >"$log" 2>&1
  fi
  status=$?
  if [ $status -ne 0 ] || ! grep -q '^rdma_check: ok$' "$log"; then
    echo "--- $log (exit $status)" >&2
    tail -n 20 "$log" >&2
    return 1
  fi
  # What each side saw of the other, for the record.
  sed -n 's/^rdma_check: \(.*datagram from.*\|link fault.*\)/cross-host:   \1/p' "$log"
}

# A check with RDMA traffic: COMMAND must succeed and rxe0's objects settle afterwards.
traffic() {
  "$@" || { objects_settle; return 1; }
  objects_settle
}

# GUEST ADDRESS: the address is on eth0 under vrdma's label and in rxe0's GID table, and the
# guest sees exactly one GID, its own.
guest_address_in_place() {
  local guest=$1 address=$2 devinfo
  grep -q "inet $address/24 .* eth0:vrdma" <<<"$(ip -4 -o addr show dev eth0)" ||
    { echo "cross-host: $address is not on eth0 as eth0:vrdma:" >&2; ip -4 addr show dev eth0 >&2; return 1; }
  grep -q "::ffff:$address" <<<"$(ibv_devinfo -v -d rxe0)" ||
    { echo "cross-host: $address has no GID on rxe0" >&2; return 1; }
  devinfo=$("$vrdma_run" --device "$(socket "$guest")" -- ibv_devinfo -v) || return 1
  if [ "$(grep -c 'GID\[' <<<"$devinfo")" != 1 ] || ! grep -q "GID\[  0\]:.*::ffff:$address," <<<"$devinfo"; then
    echo "cross-host: guest $guest does not see exactly its own GID:" >&2
    grep GID <<<"$devinfo" >&2
    return 1
  fi
}

addresses() {
  local guest name address
  for guest in "${guests[@]}"; do
    read -r name address <<<"$guest"
    guest_address_in_place "$name" "$address" || return 1
  done
}

# The host's own index of ADDRESS's RoCEv2 GID on rxe0 (for native programs).
gid_index_of() {
  local want f
  want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${1//./ })
  for f in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    if [ "$(cat "$f")" = "$want" ] &&
      [ "$(cat "/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/${f##*/}" 2>/dev/null)" = "RoCE v2" ]; then
      echo "${f##*/}"
      return 0
    fi
  done
  return 1
}

rc_pingpong() {
  local log=$logs/rc_pingpong.log
  if [ "$host" = b ]; then
    timeout 300 ibv_rc_pingpong -d rxe0 -g "$(gid_index_of "$host_ip")" -c -s 4096 -n 100 \
      -p 18515 >"$log" 2>&1
  else
    # The client does not retry: try again while the server is not listening yet.
    for _ in $(seq 60); do
      timeout 300 "$vrdma_run" --device "$(socket a1)" -- ibv_rc_pingpong -d vrdma0 -g 0 -c \
        -s 4096 -n 100 -p 18515 "$host_b" >"$log" 2>&1 && break
      grep -q "Couldn't connect" "$log" || break
      sleep 2
    done
  fi
  grep -q '100 iters in' "$log" || { echo "--- $log" >&2; tail -n 20 "$log" >&2; return 1; }
}

# a1 and a2 at once, each against a native server of its own on host b.
two_guests() {
  local first second
  if [ "$host" = a ]; then
    run_check client "$a1" "$host_b" 7103 a1 & first=$!
    run_check client "$a2" "$host_b" 7104 a2 & second=$!
  else
    run_check server "$host_b" "$a1" 7103 - & first=$!
    run_check server "$host_b" "$a2" 7104 - & second=$!
  fi
  wait $first && first=0 || first=1
  wait $second && second=0 || second=1
  [ $first = 0 ] && [ $second = 0 ]
}

# A server's host tells the client's it listens: rdma_cm ports are not TCP ports, and a client
# refused while its server is not listening yet cannot simply start again (ucmatose's server
# ends at the first of its four connections the client gave up).

# cm_serve PORT LISTEN_PORT LOG COMMAND...: runs the server COMMAND; once it listens on
# LISTEN_PORT, the TCP port PORT + 1000 of this host accepts a connection (the client's signal
# to start).
cm_serve() {
  local port=$1 listen_port=$2 log=$3 server status
  shift 3
  timeout 150 "$@" >"$log" 2>&1 &
  server=$!
  wait_until_cm_listening "$listen_port" 60 # one that never listens fails its client
  busybox nc -l -p $((port + 1000)) </dev/null >/dev/null 2>&1 &
  wait "$server"
  status=$?
  kill $! 2>/dev/null
  return $status
}

# cm_client SERVER_ADDRESS PORT LOG COMMAND...: waits (up to 150 s) until the server says it
# listens, then runs the client COMMAND.
cm_client() {
  local address=$1 port=$2 log=$3 start=$SECONDS
  shift 3
  until (exec 3<>"/dev/tcp/$address/$((port + 1000))") 2>/dev/null; do
    [ $((SECONDS - start)) -lt 150 ] || { echo "cross-host: no server listened on $address:$port" >"$log"; return 1; }
    sleep 0.5
  done
  timeout 60 "$@" >"$log" 2>&1
}

# cm_command PROGRAM ROLE ADDRESS PORT: the server's or client's command line of PROGRAM
# (rdma_server for the rdma_server/rdma_client pair), ADDRESS being the server's; udaddy's
# port is its own (7174).
cm_command() {
  local program=$1 role=$2 address=$3 port=$4
  case "$program/$role" in
    rping/server) echo rping -s -a "$address" -p "$port" -C 100 ;;
    rping/client) echo rping -c -a "$address" -p "$port" -C 100 -v ;;
    ucmatose/server) echo ucmatose -b "$address" -p "$port" -c 4 -C 10 ;;
    ucmatose/client) echo ucmatose -s "$address" -p "$port" -c 4 -C 10 ;;
    udaddy/server) echo udaddy -b "$address" ;;
    udaddy/client) echo udaddy -s "$address" ;;
    rdma_server/server) echo rdma_server -s "$address" -p "$port" ;;
    rdma_server/client) echo rdma_client -s "$address" -p "$port" ;;
    ib_*/server) echo "$program" -R -n 100 -p "$port" ;;
    ib_*/client) echo "$program" -R -n 100 -p "$port" "$address" ;;
  esac
}

# cm_client_ok PROGRAM LOG: the client's output shows it did its work.
cm_client_ok() {
  case "$1" in
    rping) [ "$(grep -c 'ping data:' "$2")" = 100 ] ;;
    ucmatose | udaddy) grep -q 'return status 0' "$2" ;;
    rdma_server) grep -q 'rdma_client: end 0' "$2" ;;
    ib_*) grep -Eq '^ +[0-9]+ +[0-9]+ ' "$2" ;; # a result row
  esac
}

# rdma_cm_pair PORT SERVER_HOST SERVER_GUEST SERVER_ADDRESS CLIENT_GUEST PROGRAM: PROGRAM's
# server on SERVER_HOST and its client on the other host, each as the guest named or natively
# ("-"); both must exit 0 and the client show its work.
rdma_cm_pair() {
  local port=$1 server_host=$2 server_guest=$3 address=$4 client_guest=$5 program=$6 run=()
  local role=client guest=$client_guest log command
  if [ "$host" = "$server_host" ]; then role=server guest=$server_guest; fi
  log=$logs/$program-$port-$role.log
  [ "$guest" = - ] || run=("$vrdma_run" --device "$(socket "$guest")" --)
  read -ra command <<<"$(cm_command "$program" "$role" "$address" "$port")"
  if [ "$role" = server ]; then
    cm_serve "$port" "$([ "$program" = udaddy ] && echo 7174 || echo "$port")" "$log" \
      "${run[@]}" "${command[@]}"
  else
    cm_client "$address" "$port" "$log" "${run[@]}" "${command[@]}" && cm_client_ok "$program" "$log"
  fi || { echo "--- $log" >&2; tail -n 20 "$log" >&2; return 1; }
}

# The rdma_cm checks (with traffic: rxe0's objects settle afterwards).
rdma_cm() {
  local status=0 port program
  # Each program both ways between a1 and a native peer on host b, then rping a1 to b1.
  port=7110
  for program in rping ucmatose udaddy rdma_server ib_write_lat ib_send_bw ib_read_bw; do
    rdma_cm_pair $port b - "$host_b" a1 "$program" || status=1
    rdma_cm_pair $((port + 1)) a a1 "$a1" - "$program" || status=1
    port=$((port + 2))
  done
  rdma_cm_pair $port b b1 "$b1" a1 rping || status=1
  return $status
}

backends_stop() {
  local guest name address status=0
  for guest in "${guests[@]}"; do
    read -r name address <<<"$guest"
    kill -TERM "${backend[$name]}"
    wait "${backend[$name]}" || { echo "cross-host: backend $name exited with $?" >&2; status=1; }
    if grep -q "inet $address/" <<<"$(ip -4 -o addr show dev eth0)"; then
      echo "cross-host: $address is still on eth0" >&2
      status=1
    fi
    for _ in $(seq 20); do grep -q "::ffff:$address" <<<"$(ibv_devinfo -v -d rxe0)" || continue 2; sleep 0.25; done
    echo "cross-host: $address is still in rxe0's GID table" >&2
    status=1
  done
  return $status
}

start_backends || exit 1
baseline=$(host_objects)
check addresses addresses
if [ "$host" = a ]; then
  check guest-to-native traffic run_check client "$a1" "$host_b" 7101 a1
  check guest-to-guest traffic run_check client "$a1" "$b1" 7102 a1
  check two-guests traffic two_guests
  check rc-pingpong traffic rc_pingpong
  check link-fault traffic run_check client "$a1" "$host_b" 7105 a1 --link-fault -
else
  check guest-to-native traffic run_check server "$host_b" "$a1" 7101 -
  check guest-to-guest traffic run_check server "$b1" "$a1" 7102 b1
  check two-guests traffic two_guests
  check rc-pingpong traffic rc_pingpong
  check link-fault traffic run_check server "$host_b" "$a1" 7105 - --link-fault eth0
fi
check rdma_cm traffic rdma_cm
check backends-stop backends_stop
[ "$failures" -eq 0 ]
