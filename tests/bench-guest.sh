#!/usr/bin/env bash
# Runs inside the benchmark guest (see tests/demo.sh): the same unmodified perftest binaries
# natively on rxe0 and through vrdma (vrdma's libibverbs.so.1 via vrdma-run, over the
# vhost-user backend on rxe0), then prints a markdown table of both and their ratio (its rows
# are the lines that start with "|").
# Argument: the target directory (release for the demo), holding the backend, the examples
# and vrdma-ibverbs/libibverbs.so.1 (guest-lib/ibverbs/link.sh).
set -euo pipefail
bin=$1
source "$(dirname "$0")/listening.sh"
lat_size=8 lat_iters=${VRDMA_BENCH_LAT_ITERS:-2000}
# The perftest tests of the two latency tables (the smoke run in the test command takes one or
# two: every table's machinery, not every row).
tests=${VRDMA_BENCH_TESTS:-write_lat send_lat read_lat atomic_lat write_bw send_bw read_bw}
pinned_tests=${VRDMA_BENCH_PINNED_TESTS:-read_lat atomic_lat}
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
  local result
  for _ in 1 2 3; do
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
  local server=$!
  wait_until_listening 18515 || true # the client then says why it could not connect
  timeout 120 "${run[@]}" "ib_$2" "${args[@]}" 127.0.0.1 | value "$3" "$5"
  wait $server || true
}

# UCX's active-message latency over rc_verbs (ucx_perftest at UCX's transport layer, as Open
# MPI's UCX runs it) on DEVICE (rxe0, or vrdma0 through vrdma-run); prints the client's typical
# latency in us. UCX polls its receive and send CQs in turn, never arming them, and its
# receives come from an SRQ: a pattern perftest does not have. Both ends name the device
# (ucx_perftest's server takes the client's parameters, its device too).
ucx_am_lat() { # DEVICE ITERS
  local run=() port=13377
  [ "$1" = vrdma0 ] && run=("$vrdma_run" --device "$vrdma_socket" --)
  "${run[@]}" ucx_perftest -d "$1:1" -x rc_verbs -t am_lat -s $lat_size -n "$2" -p $port >/tmp/ucx-server.log 2>&1 &
  local server=$!
  wait_until_listening $port || true # the client then says why it could not connect
  # "Final: ITERATIONS TYPICAL AVERAGE OVERALL ...", latencies in us.
  timeout 120 "${run[@]}" ucx_perftest -d "$1:1" -x rc_verbs -t am_lat -s $lat_size -n "$2" -p $port 127.0.0.1 |
    awk '$1 == "Final:" {print $3; exit}'
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
  for test in $tests; do
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
  ucx_iters=${VRDMA_BENCH_UCX_ITERS:-$lat_iters}
  row "ucx_perftest rc_verbs am_lat" $lat_size us "$(ucx_am_lat rxe0 $ucx_iters)" \
    "$(ucx_am_lat vrdma0 $ucx_iters)"
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
for test in $pinned_tests; do
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

# Instructions per WQE (tests/callgrind-wqe.sh).
. "$(dirname "$0")/callgrind-wqe.sh"
writes=${VRDMA_BENCH_CALLGRIND_WRITES:-2000}
rxe_lib='\[.*libibverbs'
instructions_per_wqe "$bin" rxe0 "$rxe_lib" "$writes" 128 "taken in batches of up to 16 per pass" ||
  failures=$((failures + 1))
# One in flight: every pass pays its fixed costs for one WQE, and the CQs are visited again
# while its completion is on its way (the count swings with timing between runs). The smoke
# run leaves it out (VRDMA_BENCH_CALLGRIND_ONE_IN_FLIGHT=0): the machinery is the row above's,
# and a backend under valgrind takes half a minute to start in the emulated guest.
if [ "${VRDMA_BENCH_CALLGRIND_ONE_IN_FLIGHT:-1}" = 1 ]; then
  instructions_per_wqe "$bin" rxe0 "$rxe_lib" "$((writes / 4))" 1 "one in flight, so one per pass" ||
    failures=$((failures + 1))
fi
# Connection set-up through rdma_cm (SPEC.md §13): rdma-core's unmodified cmtime, natively and
# through vrdma's librdmacm.so.1, each vrdma end a guest with an address of its own.
cm_connections=${VRDMA_BENCH_CM_CONNECTIONS:-50}
"$bin/vhost-user-rdma" --device rxe0 --socket-path /tmp/vrdma-cm-a.sock --guest-ip 192.168.77.91/24 &
cm_a=$!
"$bin/vhost-user-rdma" --device rxe0 --socket-path /tmp/vrdma-cm-b.sock --guest-ip 192.168.77.92/24 &
cm_b=$!
trap 'kill $backend $pinned_backend $cm_a $cm_b 2>/dev/null' EXIT
sleep 2
# cmtime between a server at ADDRESS and a client, each natively (-) or on a vrdma socket;
# prints the client's report.
cm_pair() { # ADDRESS SERVER_SOCKET CLIENT_SOCKET PORT
  local server_run=() client_run=()
  [ "$2" = - ] || server_run=("$vrdma_run" --device "$2" --)
  [ "$3" = - ] || client_run=("$vrdma_run" --device "$3" --)
  timeout 120 "${server_run[@]}" cmtime -b "$1" -p "$4" -c "$cm_connections" >/tmp/cmtime-server.log 2>&1 &
  local server=$!
  # cmtime's server says nothing once it listens, and rdma_cm ports are not TCP ports.
  sleep 3
  timeout 120 "${client_run[@]}" cmtime -s "$1" -p "$4" -c "$cm_connections" || true
  # The report is the client's: its server gets a few seconds to end, then is stopped (one
  # left waiting for a disconnect it missed would hold the run for its whole time limit).
  for _ in $(seq 20); do kill -0 $server 2>/dev/null || break; sleep 0.5; done
  kill $server 2>/dev/null
  wait $server || true
}
# Microseconds per connection of STEP in a cmtime report.
cm_step() { awk -v step="$1" -F: '{ sub(/ +$/, "", $1) } $1 == step { split($2, f, " "); print f[4]; exit }'; }
native_cm=$(cm_pair 192.168.77.1 - - 7601)
vrdma_cm=$(cm_pair 192.168.77.1 - /tmp/vrdma-cm-a.sock 7602)
both_cm=$(cm_pair 192.168.77.92 /tmp/vrdma-cm-b.sock /tmp/vrdma-cm-a.sock 7603)
echo
echo "Connection set-up through rdma_cm: rdma-core's unmodified cmtime, $cm_connections connections, microseconds per connection of each step as its client reports them; natively on rxe0, and through vrdma's librdmacm.so.1 (vrdma-run) from a guest with its own address, to a native server and to a server in a second guest."
echo
echo "| step | native rxe | vrdma client, native server | ratio | vrdma client, vrdma server | ratio |"
echo "|---|---|---|---|---|---|"
for step in "resolve addr" "resolve route" "create qp" connect disconnect; do
  n=$(cm_step "$step" <<<"$native_cm") v=$(cm_step "$step" <<<"$vrdma_cm") b=$(cm_step "$step" <<<"$both_cm")
  ratio() { awk -v n="$1" -v v="$2" 'BEGIN { if (n > 0 && v > 0) printf "%.1f", v / n; else print "n/a" }'; }
  echo "| $step | ${n:-failed} us | ${v:-failed} us | $(ratio "$n" "$v") | ${b:-failed} us | $(ratio "$n" "$b") |"
  [ -n "$n" ] && [ -n "$v" ] && [ -n "$b" ] || failures=$((failures + 1))
done
if [ "$failures" -gt 0 ]; then
  echo "bench: $failures tests produced no result" >&2
  exit 1
fi
