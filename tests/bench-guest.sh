#!/usr/bin/env bash
# Runs inside the benchmark guest (see tests/demo.sh): the same unmodified perftest binaries
# natively on rxe0 and through vrdma (vrdma's libibverbs.so.1 via vrdma-run, over the
# vhost-user backend on rxe0), then prints a markdown table of both and their ratio (its rows
# are the lines that start with "|").
# Argument: the target directory (release for the demo), holding the backend, the examples
# and vrdma-ibverbs/libibverbs.so.1 (guest-lib/ibverbs/link.sh).
set -euo pipefail
bin=$1
lat_size=8 lat_iters=${VRDMA_BENCH_LAT_ITERS:-2000}
bw_size=65536 bw_iters=${VRDMA_BENCH_BW_ITERS:-3000}
gid_index=$("$bin/vhost-user-rdma" --device rxe0 --check | awk '/GID index/ {print $6; exit}')
# Each guest may hold everything (the scaling rows put 16,384 QPs in one guest), and up to 128
# connect at once (perftest's two ends, the control-path benchmark's guests): one trust domain.
"$bin/vhost-user-rdma" --device rxe0 --socket-path /tmp/vrdma.sock --guests 1 --shared-gid \
  --max-guests 128 &
backend=$! pinned_backend=
trap 'kill $backend $pinned_backend 2>/dev/null' EXIT
sleep 1

# Prints the value column of the result line for SIZE from a perftest-style table.
value() { awk -v size="$1" -v column="$2" '$1 == size {print $column; exit}'; }

vrdma_run="$(cd "$(dirname "$0")/.." && pwd)/guest-lib/ibverbs/vrdma-run"
export VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs"

# perftest's TEST between two ends on DEVICE (rxe0, or vrdma0 through vrdma-run); prints the
# COLUMN of the client's result line for SIZE. perftest gives up when its CPU clock
# calibration is noisy ("Can't produce a report", or a latency of "inf"), as full emulation
# sometimes makes it: up to three tries.
perftest() { # DEVICE TEST SIZE ITERS COLUMN
  local try result
  for try in 1 2 3; do
    result=$(perftest_once "$@")
    [[ "$result" =~ ^[0-9]+(\.[0-9]+)?$ ]] && break
    result=
  done
  echo "$result"
}

# vrdma0 is served by the backend on $vrdma_socket; with $ends_cpu set, both ends run on that
# CPU only.
vrdma_socket=/tmp/vrdma.sock ends_cpu=
perftest_once() { # DEVICE TEST SIZE ITERS COLUMN
  local run=() args=(-d "$1" -x "$gid_index" -n "$4")
  # A vrdma guest's table holds only its own GID, at index 0.
  [ "$1" = vrdma0 ] && run=("$vrdma_run" --device "$vrdma_socket" --) args=(-d "$1" -x 0 -n "$4")
  [ -n "$ends_cpu" ] && run=(taskset -c "$ends_cpu" "${run[@]}")
  [ "$2" = atomic_lat ] || args+=(-s "$3")
  stdbuf -oL "${run[@]}" "ib_$2" "${args[@]}" >/tmp/server.log 2>&1 &
  local server=$! i
  for i in $(seq 300); do grep -q "Waiting for client" /tmp/server.log && break; sleep 0.1; done
  timeout 120 "${run[@]}" "ib_$2" "${args[@]}" 127.0.0.1 | value "$3" "$5"
  wait $server || true
}

# Prints the table row of TEST from its native and vrdma results (empty when perftest gave
# none, which counts as a failure).
row() { # TEST SIZE UNIT NATIVE VRDMA
  local ratio label
  ratio=$(awk -v n="$4" -v v="$5" 'BEGIN { if (n > 0 && v > 0) printf "%.2f", v / n; else print "n/a" }')
  label=$([ "$1" = "${1%_lat}" ] && echo "BW average" || echo "t_typical")
  echo "| $1 | $2 B | ${4:-failed} $3 | ${5:-failed} $3 | $ratio ($label) |"
  [ -n "$4" ] && [ -n "$5" ] || failures=$((failures + 1))
}

# CPU seconds the backend has used so far (user + system).
backend_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.6f", ($14 + $15) / hz }' "/proc/$backend/stat"; }

failures=0
{
  echo "| test | size | native rxe | vrdma | vrdma / native |"
  echo "|---|---|---|---|---|"
  for test in write_lat send_lat read_lat atomic_lat write_bw send_bw read_bw; do
    case $test in
      *_lat) size=$lat_size iters=$lat_iters unit=us column=5 ;;
      *_bw) size=$bw_size iters=$bw_iters unit=MB/s column=4 ;;
    esac
    n=$(perftest rxe0 $test $size $iters $column)
    cpu_before=$(backend_cpu)
    v=$(perftest vrdma0 $test $size $iters $column)
    if [ $test = write_bw ]; then
      # Every write is one WQE the backend takes from a ring and one CQE it writes back.
      cpu_per_wqe=$(awk -v a="$cpu_before" -v b="$(backend_cpu)" -v n="$iters" 'BEGIN { printf "%.1f", (b - a) * 1e6 / n }')
    fi
    row $test $size $unit "$n" "$v"
  done
  echo
  echo "Backend CPU per WQE (write_bw, ${bw_size}-byte writes; user + system time of the backend process, busy polling included, so an upper bound): ${cpu_per_wqe:-n/a} us"
}
echo

# Latency with the poller on a vCPU of its own, where the guest's vCPUs allow it: in read_lat
# and atomic_lat the server end waits idle, so both ends go on the first vCPU and a second
# backend's poller on the last. write_lat and send_lat busy-poll at both ends.
ends_cpu=0 poller_cpu=$(($(nproc) - 1))
"$bin/vhost-user-rdma" --device rxe0 --socket-path /tmp/vrdma-pinned.sock --guests 1 \
  --shared-gid --max-guests 2 --poll-cpus "$poller_cpu" &
pinned_backend=$!
sleep 1
vrdma_socket=/tmp/vrdma-pinned.sock
echo "Latency with the poller on a vCPU of its own: both perftest ends on vCPU $ends_cpu (the server end waits idle in these two tests), the backend's one poller thread on vCPU $poller_cpu (--poll-cpus $poller_cpu); natively the same ends on vCPU $ends_cpu. The kernel's work (rxe, veth) runs where the kernel puts it in both columns."
echo
echo "| test | size | native rxe | vrdma | vrdma / native |"
echo "|---|---|---|---|---|"
for test in read_lat atomic_lat; do
  row $test $lat_size us "$(perftest rxe0 $test $lat_size $lat_iters 5)" \
    "$(perftest vrdma0 $test $lat_size $lat_iters 5)"
done
kill $pinned_backend
wait $pinned_backend 2>/dev/null || true
pinned_backend= vrdma_socket=/tmp/vrdma.sock ends_cpu=
echo
# The 2 MiB-page registrations back the guest's memory with hugetlb pages: the MR, its
# region's slack and guest-lib's first region.
huge_pages=$(( ${VRDMA_BENCH_MR_MIB:-1024} / 2 + 48 ))
echo $huge_pages >/proc/sys/vm/nr_hugepages
"$bin/ctl-bench" /tmp/vrdma.sock "$backend" || failures=$((failures + 1))
echo 0 >/proc/sys/vm/nr_hugepages

# Instructions per WQE: a second backend under callgrind that counts only inside the
# functions taking WQEs from the rings and writing CQEs back (Poller::process_*), with busy
# polling off so that few idle passes are counted, and no seccomp filter (it would filter
# valgrind's own system calls too), over a fixed workload: write_bw of WRITES 64-byte writes
# (one WQE and one CQE each), DEPTH of them in flight. The profile is dumped while the backend
# runs (it does not exit cleanly under valgrind), then the backend is killed. Two guests at
# most (the perf pair): valgrind keeps the open file limit where it is, and the backend starts
# only with room for every guest it may serve.
instructions_per_wqe() { # WRITES DEPTH HOW (how the WQEs are taken, for the report)
  local writes=$1 depth=$2 how=$3 socket=/tmp/vrdma-callgrind.sock
  local out=/tmp/callgrind.out
  # A socket left by an earlier run would be taken for this backend's before it listens.
  rm -f "$out"* "$socket"
  valgrind --tool=callgrind --callgrind-out-file="$out" --collect-atstart=no \
    --toggle-collect='*Poller*process_*' \
    "$bin/vhost-user-rdma" --device rxe0 --socket-path "$socket" --poll-idle-us 0 --seccomp none \
    --shared-gid --max-guests 2 \
    2>/tmp/callgrind.log &
  local traced=$! instructions= provider= sends= posts= completions= polls= visits=
  for _ in $(seq 600); do [ -S "$socket" ] && break; sleep 0.1; done
  local args=(--socket "$socket" -s 64 -n "$writes" --tx-depth "$depth")
  "$bin/examples/vrdma-perf" write_bw "${args[@]}" >/tmp/server.log 2>&1 &
  local server=$!
  if timeout 600 "$bin/examples/vrdma-perf" write_bw "${args[@]}" --connect 127.0.0.1 >/dev/null &&
    timeout 120 callgrind_control -d "$traced" >/dev/null 2>&1; then
    instructions=$(cat "$out".* 2>/dev/null | awk '/^totals:/ { n += $2 } END { if (n) print n }')
    # The host provider's post and poll (rxe's library, reached through libibverbs' inline
    # calls), with what they call in turn (copying SGEs, locks, the doorbell write): native
    # pays them too. Counted at each call from outside the provider into it.
    local calls
    calls=$(for f in "$out".*; do
      callgrind_annotate --inclusive=yes --tree=calling --show-percs=no --threshold=100 "$f"
    done 2>/dev/null)
    # Those made from the seam's poll (or from rdma-sys's ibv_poll_cq where that is not
    # inlined, as in a debug build) are the provider's poll, the others its posts.
    local split
    split=$(awk '
      $2 == "*" { in_provider = /\[.*libibverbs/; polling = /ibv_poll_cq|::poll( \[|$)/ }
      $2 == ">" && /\[.*libibverbs/ && !in_provider {
        gsub(",", "", $1); if (polling) polls += $1; else posts += $1 }
      END { print posts + 0, polls + 0 }' <<<"$calls")
    read -r posts polls <<<"$split"
    provider=$((posts + polls))
    # Visits of QPs and of CQs, with or without work: "> ...Poller::process_qp_sends (N x)".
    visits() {
      awk -v name="Poller::$1 (" '$2 == ">" && index($0, name) {
          count = substr($0, index($0, name) + length(name)); sub(/x\).*/, "", count)
          gsub(",", "", count); n += count }
        END { print n + 0 }' <<<"$calls"
    }
    visits="$(visits process_qp_sends) QP visits and $(visits process_cq) CQ visits"
    # Where they go: the visits that take WQEs from QPs' rings and post them, and those
    # that write CQEs, each with the host call under it.
    # (A function's own line in the call tree: "N  *  file:function [object]".)
    inclusive() {
      awk -v name="$1 [" 'index($0, name) { gsub(",", "", $1); n += $1 } END { print n + 0 }' \
        <<<"$calls"
    }
    sends=$(inclusive Poller::process_qp_sends) completions=$(inclusive Poller::process_cq)
  fi
  kill -9 "$traced" "$server" 2>/dev/null
  wait "$traced" "$server" 2>/dev/null
  if [ -z "$instructions" ]; then
    echo "bench: callgrind measured nothing; the end of its log:" >&2
    tail -n 5 /tmp/callgrind.log >&2
    return 1
  fi
  echo "Backend instructions per WQE (callgrind; write_bw of $writes 64-byte writes $how; counted in WQE and CQE processing only, busy polling off): $((instructions / writes)), of which the host provider's post and poll (rxe's library; native pays them too) $((provider / writes)) and vrdma's own $(((instructions - provider) / writes)). Where they go: taking WQEs from QPs' rings and posting them $((sends / writes)), of which the host provider's post $((posts / writes)) and vrdma's own $(((sends - posts) / writes)); writing CQEs $((completions / writes)), of which the host provider's poll $((polls / writes)) and vrdma's own $(((completions - polls) / writes)); the rest on SRQs. In all, $visits."
}
writes=${VRDMA_BENCH_CALLGRIND_WRITES:-2000}
instructions_per_wqe "$writes" 128 "taken in batches of up to 16 per pass" ||
  failures=$((failures + 1))
# One in flight: every pass pays its fixed costs for one WQE, and the CQs are visited again
# while its completion is on its way (the count swings with timing between runs).
instructions_per_wqe "$((writes / 4))" 1 "one in flight, so one per pass" ||
  failures=$((failures + 1))
if [ "$failures" -gt 0 ]; then
  echo "bench: $failures tests produced no result" >&2
  exit 1
fi
