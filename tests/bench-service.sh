#!/usr/bin/env bash
# The guest service's cost on the data path, on this machine's real cores: perftest's
# ib_write_lat and ib_read_lat between two programs (vrdma's libibverbs via vrdma-run) on a
# backend on the loopback host, attached directly and through vrdmad, alternating, three runs
# of each; prints a markdown table (rows start with "|") of the medians and their ratio.
# usage: tests/bench-service.sh BIN_DIR (release: vhost-user-rdma, vrdmad, vrdma-ibverbs/)
set -euo pipefail
bin=$(cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
source "$repo/tests/listening.sh"
iters=${VRDMA_BENCH_LAT_ITERS:-2000}
run_dir=$(mktemp -d)
backend_socket=$run_dir/backend.sock service_socket=$run_dir/vrdmad.sock
"$bin/vhost-user-rdma" --device loopback --socket-path "$backend_socket" --shared-gid \
  --max-guests 8 2>"$run_dir/backend.log" &
backend=$!
service=
trap 'kill $service $backend 2>/dev/null; rm -rf "$run_dir"' EXIT
for _ in $(seq 100); do [ -S "$backend_socket" ] && break; sleep 0.1; done
"$bin/vrdmad" --device "$backend_socket" --socket "$service_socket" 2>"$run_dir/vrdmad.log" &
service=$!
for _ in $(seq 100); do [ -S "$service_socket" ] && break; sleep 0.1; done
export VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"

# t_typical of ib_TEST for 8 bytes between two programs on DEVICE (a vrdma-run --device).
latency() { # DEVICE TEST
  local run=("$repo/guest-lib/ibverbs/vrdma-run" --device "$1" --) args=(-d vrdma0 -x 0 -s 8 -n "$iters")
  stdbuf -oL "${run[@]}" "ib_$2" "${args[@]}" >"$run_dir/server.log" 2>&1 &
  local server=$!
  wait_until_listening 18515 || true # the client then says why it could not connect
  timeout 120 "${run[@]}" "ib_$2" "${args[@]}" 127.0.0.1 2>>"$run_dir/client.log" |
    awk '$1 == 8 {print $5; exit}'
  wait $server || true
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'; }

echo "| test | attached directly | through vrdmad | ratio |"
echo "|---|---|---|---|"
for test in write_lat read_lat; do
  direct=() served=()
  for _ in 1 2 3; do
    direct+=("$(latency "$backend_socket" "$test")")
    served+=("$(latency "service:$service_socket" "$test")")
  done
  d=$(printf '%s\n' "${direct[@]}" | grep -E '^[0-9.]+$' | median)
  s=$(printf '%s\n' "${served[@]}" | grep -E '^[0-9.]+$' | median)
  ratio=$(awk -v d="$d" -v s="$s" 'BEGIN { if (d > 0 && s > 0) printf "%.2f", s / d; else print "n/a" }')
  echo "| ib_$test, 8 B, t_typical | ${d:-failed} us | ${s:-failed} us | $ratio |"
done
