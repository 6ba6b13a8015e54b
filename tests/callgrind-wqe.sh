# shellcheck shell=bash
# Sourced by tests/bench-guest.sh (rxe0, in the benchmark guest) and tests/demo.sh (the
# loopback host, on this machine's real cores): instructions_per_wqe.
# Instructions per WQE: a backend under callgrind that counts only inside the
# functions taking WQEs from the rings and writing CQEs back (Poller::process_*), with busy
# polling off so that few idle passes are counted, and no seccomp filter (it would filter
# valgrind's own system calls too), over a fixed workload: write_bw of WRITES 64-byte writes
# (one WQE and one CQE each), DEPTH of them in flight. The profile is dumped while the backend
# runs (it does not exit cleanly under valgrind), then the backend is killed. Two guests at
# most (the perf pair): valgrind keeps the open file limit where it is, and the backend starts
# only with room for every guest it may serve.
#
# DEVICE is the host device (rxe0, or loopback); PROVIDER matches, in callgrind_annotate's
# call tree, the lines of the host provider's code (rxe's library: '\[.*libibverbs'; the
# loopback host: 'hostverbs::loopback::'), whose post and poll are reported apart (native
# pays them too; on the loopback they are the work a NIC would do).
instructions_per_wqe() { # BIN DEVICE PROVIDER WRITES DEPTH HOW (how the WQEs are taken)
  local bin=$1 device=$2 provider_lines=$3 writes=$4 depth=$5 how=$6
  local socket=/tmp/vrdma-callgrind-$$.sock out=/tmp/callgrind-$$.out
  local provider_name="rxe's library; native pays them too"
  [ "$device" = loopback ] && provider_name="the loopback host's work, a NIC's on real hardware"
  # A socket left by an earlier run would be taken for this backend's before it listens.
  rm -f "$out"* "$socket"
  valgrind --tool=callgrind --callgrind-out-file="$out" --collect-atstart=no \
    --toggle-collect='*Poller*process_*' \
    "$bin/vhost-user-rdma" --device "$device" --socket-path "$socket" --poll-idle-us 0 --seccomp none \
    --shared-gid --max-guests 2 \
    2>"$out.log" &
  local traced=$! instructions= provider= sends= posts= completions= polls= visits=
  for _ in $(seq 600); do [ -S "$socket" ] && break; sleep 0.1; done
  local args=(--socket "$socket" -s 64 -n "$writes" --tx-depth "$depth")
  "$bin/examples/vrdma-perf" write_bw "${args[@]}" -p 18599 >/dev/null 2>&1 &
  local server=$!
  sleep 1
  if timeout 600 "$bin/examples/vrdma-perf" write_bw "${args[@]}" -p 18599 --connect 127.0.0.1 >/dev/null &&
    timeout 120 callgrind_control -d "$traced" >/dev/null 2>&1; then
    instructions=$(cat "$out".[0-9]* 2>/dev/null | awk '/^totals:/ { n += $2 } END { if (n) print n }')
    # The host provider's post and poll (rxe's library, reached through libibverbs' inline
    # calls), with what they call in turn (copying SGEs, locks, the doorbell write): native
    # pays them too. Counted at each call from outside the provider into it.
    local calls
    calls=$(for f in "$out".[0-9]*; do
      callgrind_annotate --inclusive=yes --tree=calling --show-percs=no --threshold=100 "$f"
    done 2>/dev/null)
    # Those made from the seam's poll (or from rdma-sys's ibv_poll_cq where that is not
    # inlined, as in a debug build), or into a host's poll, are the provider's poll, the
    # others its posts.
    local split
    split=$(awk -v provider="$provider_lines" '
      $2 == "*" { in_provider = $0 ~ provider; polling = /ibv_poll_cq|::poll( \[|$)/ }
      $2 == ">" && $0 ~ provider && !in_provider {
        gsub(",", "", $1); if (polling || /::poll \(/) polls += $1; else posts += $1 }
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
    tail -n 5 "$out.log" >&2
    return 1
  fi
  echo "Backend instructions per WQE on $device (callgrind; write_bw of $writes 64-byte writes $how; counted in WQE and CQE processing only, busy polling off): $((instructions / writes)), of which the host provider's post and poll ($provider_name) $((provider / writes)) and vrdma's own $(((instructions - provider) / writes)). Where they go: taking WQEs from QPs' rings and posting them $((sends / writes)), of which the host provider's post $((posts / writes)) and vrdma's own $(((sends - posts) / writes)); writing CQEs $((completions / writes)), of which the host provider's poll $((polls / writes)) and vrdma's own $(((completions - polls) / writes)); the rest on SRQs. In all, $visits."
}
