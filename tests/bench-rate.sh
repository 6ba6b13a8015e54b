#!/usr/bin/env bash
# Per-guest rate limits on this machine's real cores: perftest between programs (vrdma's
# libibverbs via vrdma-run, each program a guest of its own) on a backend on the loopback
# host. Prints markdown tables (rows start with "|"):
# - ib_write_bw of 64 KiB messages from a guest held to a limit on payload bytes a second
#   (--max-bytes-per-second), against the limit;
# - a quiet pair's ib_read_lat (8 bytes) alone, beside a noisy pair's unlimited ib_write_bw,
#   and beside the same noisy pair once `vrdmactl limit` holds it to 100 MiB/s.
# usage: tests/bench-rate.sh BIN_DIR (release: vhost-user-rdma, vrdmactl, vrdma-ibverbs/)
set -euo pipefail
bin=$(cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/listening.sh"
messages=${VRDMA_BENCH_RATE_MESSAGES:-3000}
latency_iters=${VRDMA_BENCH_LAT_ITERS:-20000}
run_dir=$(mktemp -d)
socket=$run_dir/backend.sock admin=$run_dir/admin.sock
backend=
trap 'kill $backend 2>/dev/null; wait 2>/dev/null; rm -rf "$run_dir"' EXIT
export VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"
run=("$repo/guest-lib/ibverbs/vrdma-run" --device "$socket" --)

# (Re)starts the backend with ARGS added.
start_backend() { # ARGS...
  [ -z "$backend" ] || { kill "$backend"; wait "$backend" 2>/dev/null || true; }
  rm -f "$socket" "$admin"
  "$bin/vhost-user-rdma" --device loopback --socket-path "$socket" --shared-gid --max-guests 8 \
    --admin-socket "$admin" "$@" 2>"$run_dir/backend.log" &
  backend=$!
  for _ in $(seq 100); do [ -S "$admin" ] && break; sleep 0.1; done
}

# A perftest pair of TEST on PORT with ARGS: the server in the background (its pid in
# $server_pid), then the client; the client's output goes to OUT.
pair() { # OUT TEST PORT ARGS...
  local out=$1 test=$2 port=$3
  shift 3
  "${run[@]}" "ib_$test" -d vrdma0 -x 0 -p "$port" "$@" >"$run_dir/server-$port.log" 2>&1 &
  server_pid=$!
  wait_until_listening "$port" || true # the client then says why it could not connect
  "${run[@]}" "ib_$test" -d vrdma0 -x 0 -p "$port" "$@" 127.0.0.1 >"$out" 2>&1 || true
}

echo "| limit on payload bytes a second (--max-bytes-per-second) | ib_write_bw, 64 KiB messages, average | measured / limit |"
echo "|---|---|---|"
for mib in 20 100; do
  start_backend --max-bytes-per-second $((mib << 20))
  pair "$run_dir/bw.log" write_bw 18601 -s 65536 -n "$messages"
  wait "$server_pid" || true
  # perftest's MB is 2^20 bytes.
  measured=$(awk '$1 == 65536 {print $4; exit}' "$run_dir/bw.log")
  ratio=$(awk -v m="$measured" -v l="$mib" 'BEGIN { if (m > 0) printf "%.3f", m / l; else print "n/a" }')
  echo "| $mib MiB/s | ${measured:-failed} MiB/s | $ratio |"
done
echo

# The guests connected now, by number.
guests() { "$bin/vrdmactl" --socket "$admin" --json list | awk -F'[:,]' '/^    "guest":/ {print $2+0}'; }

# The quiet pair's read_lat t_typical (us), alone (none) or beside a noisy pair's ib_write_bw,
# whose guests are then held to NOISY bytes a second (0: no limit).
quiet_latency() { # none | NOISY
  local noisy_client= noisy_server=
  if [ "$1" != none ]; then
    "${run[@]}" ib_write_bw -d vrdma0 -x 0 -p 18602 -s 65536 -D 60 >/dev/null 2>&1 &
    noisy_server=$!
    wait_until_listening 18602 || true
    "${run[@]}" ib_write_bw -d vrdma0 -x 0 -p 18602 -s 65536 -D 60 127.0.0.1 >/dev/null 2>&1 &
    noisy_client=$!
    sleep 2
    for guest in $(guests); do
      "$bin/vrdmactl" --socket "$admin" limit "$guest" --bytes-per-second "$1" >/dev/null
    done
    sleep 0.5
  fi
  pair "$run_dir/quiet.log" read_lat 18603 -s 8 -n "$latency_iters"
  wait "$server_pid" 2>/dev/null || true
  if [ -n "$noisy_client" ]; then
    kill "$noisy_client" "$noisy_server" 2>/dev/null || true
    wait "$noisy_client" "$noisy_server" 2>/dev/null || true
  fi
  awk '$1 == 8 {print $5; exit}' "$run_dir/quiet.log"
}

start_backend
alone=$(quiet_latency none)
beside=$(quiet_latency 0)
held=$(quiet_latency $((100 << 20)))
ratio() { awk -v v="$1" -v b="$alone" 'BEGIN { if (v > 0 && b > 0) printf "%.2f", v / b; else print "n/a" }'; }
echo "| a quiet pair's ib_read_lat, 8 B, t_typical | us | / alone |"
echo "|---|---|---|"
echo "| alone | ${alone:-failed} | 1.00 |"
echo "| beside a noisy pair's unlimited ib_write_bw (64 KiB messages) | ${beside:-failed} | $(ratio "$beside") |"
echo "| beside the noisy pair held to 100 MiB/s (vrdmactl limit) | ${held:-failed} | $(ratio "$held") |"
