#!/usr/bin/env bash
# The demo's cross-host rows, run on both hosts of tests/vm/two-hosts.sh: perftest between
# host a and host b over the emulated link, natively (rxe0 on each host, under the hosts'
# addresses) and between two vrdma guests (one per host, each under its own address through
# its own backend and vrdma-run), the same unmodified binaries. Host b serves, host a is the
# client and prints the markdown rows (lines starting with "|").
# usage: tests/bench-cross-host.sh BIN_DIR   (vhost-user-rdma and vrdma-ibverbs/ in BIN_DIR)
set -euo pipefail
bin=$(cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
: "${VRDMA_HOST:?run me through tests/vm/two-hosts.sh}"
lat_iters=${VRDMA_BENCH_LAT_ITERS:-1000} bw_iters=${VRDMA_BENCH_BW_ITERS:-1000}
export VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"
vrdma_run=$repo/guest-lib/ibverbs/vrdma-run
host_b=10.50.0.2
# Each host's vrdma guest: host a's at .11, host b's at .12.
guest_ip=$([ "$VRDMA_HOST" = a ] && echo 10.50.0.11 || echo 10.50.0.12)
guest_b=10.50.0.12

# rxe0's index of this host's own RoCEv2 GID (index 0 is the link-local one), read before the
# guest's address adds another.
native_gid=$("$bin/vhost-user-rdma" --device rxe0 --check | awk '/GID index/ {print $6; exit}')
"$bin/vhost-user-rdma" --socket-path /tmp/vrdma.sock --guest-ip "$guest_ip/24" \
  2>/tmp/backend.log &
backend=$!
trap 'kill $backend 2>/dev/null' EXIT
for _ in $(seq 300); do [ -S /tmp/vrdma.sock ] && break; sleep 0.1; done

# perftest SIDE TEST SIZE ITERS PORT: b serving, a connecting (retrying until b listens); on
# host a, prints the client's result line for SIZE. A run across the emulated link sometimes
# ends without one (seen once in CI, under load), so there are up to three, each on a port
# of its own from PORT + 1; after each, host a tells host b on that port + 1000 whether to
# serve another ("again") or not ("done").
perftest() {
  local side=$1 test=$2 size=$3 iters=$4 port=$5 run=() args peer try output result verdict
  if [ "$side" = vrdma ]; then
    run=("$vrdma_run" --device /tmp/vrdma.sock --)
    args=(-d vrdma0 -x 0) peer=$guest_b
  else
    args=(-d rxe0 -x "$native_gid") peer=$host_b
  fi
  args+=(-n "$iters")
  [ "$test" = atomic_lat ] || args+=(-s "$size")
  for try in 1 2 3; do
    local run_port=$((port + try)) verdict_port=$((port + try + 1000))
    if [ "$VRDMA_HOST" = b ]; then
      timeout 300 "${run[@]}" "ib_$test" "${args[@]}" -p "$run_port" \
        >"/tmp/server-$run_port.log" 2>&1 || true
      [ "$(timeout 400 busybox nc -l -p "$verdict_port" </dev/null)" = again ] || return 0
      continue
    fi
    verdict="done"
    for _ in $(seq 60); do
      output=$(timeout 300 "${run[@]}" "ib_$test" "${args[@]}" -p "$run_port" "$peer" 2>&1) && break
      grep -q "Couldn't connect\|Unable to open file descriptor" <<<"$output" || break
      sleep 1
    done
    result=$(awk -v size="$size" '$1 == size' <<<"$output")
    [ -n "$result" ] || [ "$try" = 3 ] || verdict=again
    for _ in $(seq 60); do
      { echo "$verdict" >"/dev/tcp/$host_b/$verdict_port"; } 2>/dev/null && break
      sleep 1
    done
    if [ -n "$result" ]; then
      echo "$result"
      return 0
    fi
    # What perftest said instead of a result goes to the log.
    sed "s/^/bench-cross-host: $side $test, run $try: /" <<<"$output" >&2
  done
}

# Prints a column of perftest's result line: t_typical (5) for latency, BW average (4).
column() { awk -v c="$1" '{ print $c; exit }'; }

port=18600
[ "$VRDMA_HOST" = a ] && {
  echo "| cross-host test | size | native rxe <-> rxe | vrdma guest <-> guest | vrdma / native |"
  echo "|---|---|---|---|---|"
}
for test in write_lat read_lat write_bw; do
  case $test in
    *_lat) size=8 iters=$lat_iters unit=us col=5 label=t_typical ;;
    *_bw) size=65536 iters=$bw_iters unit=MB/s col=4 label="BW average" ;;
  esac
  port=$((port + 10))
  n=$(perftest native $test $size "$iters" $port | column $col)
  port=$((port + 10))
  v=$(perftest vrdma $test $size "$iters" $port | column $col)
  if [ "$VRDMA_HOST" = a ]; then
    ratio=$(awk -v n="$n" -v v="$v" 'BEGIN { if (n > 0 && v > 0) printf "%.2f", v / n; else print "n/a" }')
    echo "| $test | $size B | ${n:-failed} $unit | ${v:-failed} $unit | $ratio ($label) |"
    [ -n "$n" ] && [ -n "$v" ] || { echo "bench-cross-host: $test produced no result" >&2; exit 1; }
  fi
done
