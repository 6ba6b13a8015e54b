#!/usr/bin/env bash
# The vrdma demo: on a fresh machine it installs what it needs (tests/vm/setup.sh), builds,
# boots the QEMU guest with rdma_rxe, starts the vhost-user backend there, and runs perftest's
# latency and bandwidth tests natively on rxe0 and, unmodified, through vrdma (vrdma-run),
# printing native, vrdma and their ratio. The table also goes into BENCHMARKS.md, with the
# date, the machine and the command.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/vm/setup.sh >/dev/null
# The workspace's release build, and vrdma's libibverbs.so.1 linked from it.
guest-lib/ibverbs/link.sh --release >/dev/null
mkdir -p target/bench
# The relay on this machine's real cores, on the loopback host (no NIC, no emulation), each
# figure beside its floor on the same two cores; before the VMs start, which would share them.
relay_table=$(target/release/relay-bench | tee target/bench/relay.log | grep '^|')
[ -n "$relay_table" ] || { echo "demo: relay-bench produced no table" >&2; exit 1; }
# Instructions per WQE on the same loopback host: vrdma's own apart from the loopback's.
. tests/callgrind-wqe.sh
relay_instructions=$(
  instructions_per_wqe target/release loopback 'hostverbs::loopback::' 2000 128 \
    "taken in batches of up to 16 per pass"
  echo
  instructions_per_wqe target/release loopback 'hostverbs::loopback::' 500 1 \
    "one in flight, so one per pass"
)
# The guest service beside direct attach, on the same loopback host and cores.
service_table=$(tests/bench-service.sh target/release | tee target/bench/service.log | grep '^|')
[ -n "$service_table" ] || { echo "demo: bench-service produced no table" >&2; exit 1; }
# Per-guest rate limits, and a quiet guest beside a noisy one, on the same loopback host.
rate_table=$(tests/bench-rate.sh target/release | tee target/bench/rate.log | grep -E '^\||^$')
grep -q '^|' <<<"$rate_table" || { echo "demo: bench-rate produced no table" >&2; exit 1; }
log=target/bench/run.log
tests/vm/run.sh --mem 4096 -- tests/bench-guest.sh "$PWD/target/release" | tee "$log"
# Two hosts joined by an emulated link: perftest across it, natively and guest to guest.
cross_log=target/bench/cross-host.log
tests/vm/two-hosts.sh -- tests/bench-cross-host.sh "$PWD/target/release" | tee "$cross_log"
cross_table=$(sed -n 's/^\[a\] \(|.*\)/\1/p' "$cross_log")
[ -n "$cross_table" ] || { echo "demo: the cross-host benchmark produced no table" >&2; exit 1; }
# A VM's program's checked round trips with a peer across nothing, a pause of 2 s and its QEMU
# replaced (tests/replace-qemu.sh: an emulated VM on this machine, the loopback host).
life_rows=$(for event in none pause replace; do
  tests/replace-qemu.sh target/release "$event" | tee -a target/bench/life.log |
    sed -n 's/^replace-qemu: measured //p'
done | awk '{ for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
  name = v["event"] == "none" ? "nothing (the baseline)" : v["event"] == "pause" ? "paused for 2 s (stop, cont)" : "QEMU replaced (cpr-transfer)"
  printf "| %s | %s ms | %s ms | %s |\n", name, v["vm_stopped_ms"], v["longest_round_trip_ms"], v["round_trips"] }')
[ "$(grep -c '^|' <<<"$life_rows")" = 3 ] || { echo "demo: tests/replace-qemu.sh produced no table" >&2; exit 1; }
# Table rows, the backend's CPU and instruction lines, the line that introduces the pinned
# latency table, and the blank lines between them (other output is skipped).
table=$(awk '/^\|/ { if (gap && seen) print ""; print; seen = 1; gap = 0; next }
             /^(Backend (CPU|instructions)|Latency with the poller|Connection set-up)/ { print ""; print; gap = 1; next }
             /^$/ { gap = 1 }' "$log")
[ -n "$table" ] || { echo "demo: the benchmark produced no table" >&2; exit 1; }
{
  echo "# vrdma benchmarks"
  echo
  echo "Produced by \`tests/demo.sh\` on $(date -u +%Y-%m-%d), not edited by hand."
  echo
  echo "Machine: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB;" \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')." \
    "Both columns run inside one QEMU guest under TCG (full emulation, 2 vCPUs) with Soft-RoCE" \
    "(rdma_rxe) on a veth: absolute numbers are emulation numbers; the ratio is what matters."
  echo "Latency is perftest's t_typical for 8-byte messages (half the round trip for write/send," \
    "the full operation for read/atomic); bandwidth is the average for 64 KiB messages." \
    "Both columns run the same unmodified perftest binaries: natively on rxe0, and on vrdma0" \
    "through vrdma's libibverbs.so.1 (vrdma-run), guest-lib over the vhost-user backend." \
    "The ucx_perftest row is UCX's typical active-message latency over its rc_verbs transport" \
    "(half the round trip, 8 bytes), the same unmodified binary on rxe0 and on vrdma0." \
    "Control-path timings compare the backend's host verbs layer with the same verbs through" \
    "guest-lib and the control queue; the scaling rows come from ctl-bench." \
    "The first registration over 4 KiB pages pays for the backend's page tables: the guest" \
    "touched its pages through its own mapping, so the backend maps every one of them" \
    "(MADV_POPULATE_READ, most of that row's time when traced) before the host registers" \
    "them, where native registers pages its process has mapped already; registered again," \
    "the same pages cost what native's do. Over 2 MiB pages, as vhost-user deployments back" \
    "guest RAM, there are 512 times fewer entries to map."
  echo "Backend threads: one poller (the pool's default, --poll-threads 1) serving both perftest" \
    "ends' connections, on the same 2 vCPUs as both ends. That is the floor of a relay" \
    "design here: every message needs a third thread (the poller) to run while both perftest" \
    "ends busy-poll the only two CPUs, where native rxe needs none (its work runs in the" \
    "kernel's softirq, which preempts them). guest-lib yields the CPU after a kick and every" \
    "64th empty CQ poll, so in send_lat the poller runs within the polling loop; write_lat's" \
    "ends spin on their receive buffers without any library call, so there the poller waits" \
    "for the scheduler to preempt one (up to a time slice per message, so that ratio swings the" \
    "most between runs)." \
    "read_lat and atomic_lat leave one end idle, so there the second table gives the poller a" \
    "vCPU of its own. That is not an equal footing either: natively the other vCPU is left to" \
    "the kernel's rxe and veth work, which under emulation costs about as much as a whole" \
    "native operation, while with vrdma that work shares a vCPU with the poller or the" \
    "client (when traced, the poller's host post of a READ took 15 to 75 us and its" \
    "completion came 65 to 117 us after it, against 39 to 56 us for a whole native read)." \
    "write_lat and send_lat busy-poll at both ends, so a poller of their own needs a third" \
    "vCPU and so a third host core: on this machine's $(nproc) cores a 3-vCPU guest slowed" \
    "native write_lat itself from about 40 us to 2 to 4 ms when tried, so that configuration" \
    "is not measured here."
  echo
  echo "$table"
  echo
  echo "## Across two hosts"
  echo
  echo "Two QEMU guests as hosts a and b (2 vCPUs each, both on this machine's $(nproc) cores)," \
    "each with rdma_rxe on its own emulated network card, joined by a datagram socket: RoCEv2" \
    "crosses a link. Native: perftest on rxe0 of each host under the hosts' addresses. vrdma:" \
    "the same binaries in a guest on each host (vrdma-run), each under its own address through" \
    "its own backend (\`--guest-ip\`); one poller thread per backend."
  echo
  echo "$cross_table"
  echo
  echo "## A VM's life: pause and QEMU replaced"
  echo
  echo "\`tests/replace-qemu.sh\` on this machine: an emulated VM (TCG, 1 vCPU) whose vrdma device" \
    "the loopback host serves, and in it a guest-lib program echoing checked 64-byte messages" \
    "for a peer attached to the same backend (guest-endpoint pong and ping), for about 3 s" \
    "before and after the event. The VM stopped: for a pause, from \`stop\`'s answer to" \
    "\`cont\`'s; for the replacement, QEMU's own downtime (\`query-migrate\`). The longest round" \
    "trip is how long the program's peer saw it answer nothing: the pause's, less the time" \
    "stopped, is the pause-to-first-completion time; the replacement's is the downtime the" \
    "program sees. The numbers are an emulated guest's (compare the rows, not the machines)," \
    "and the workload is the round trips, not perftest (the guest mounts nothing of this" \
    "machine, so that it may migrate, and perftest's TCP exchange has no network there)."
  echo
  echo "| event | VM stopped | longest round trip | round trips |"
  echo "|---|---|---|---|"
  echo "$life_rows"
  echo
  echo "## The relay on real cores"
  echo
  echo "\`relay-bench\` on this machine, no emulation: a backend on the loopback host" \
    "(\`--device loopback\`, the backend's own software RDMA device: a request is carried out" \
    "by copying between registered memory when the poller posts it) in one process, its one" \
    "poller thread on CPU 1, the program's thread on CPU 0; each floor is measured in the same" \
    "run on the same two cores. Round trip: the program sends 8 bytes (inline SEND) from one of" \
    "its QPs to another and back, two WQEs through the poller and two receive CQEs back, against" \
    "a cache line passed between the two cores and back, and against the ring protocol's own" \
    "transfers: the same messages' WQEs, producer indexes, doorbell bits and CQEs, each in the" \
    "cache line SPEC.md gives it, passed between the same two cores by a thread that does" \
    "nothing else (what no relay of this wire format can go below). WRITEs: 8-byte RDMA WRITEs from one QP" \
    "posted one per doorbell and 16 per doorbell, the send queue kept full (so a pass may take" \
    "several doorbells' worth), against a loop on the poller's core that only copies 8 bytes." \
    "The vrdma figures include the loopback's own work (its lock, key lookups and copies), which" \
    "a NIC would do in hardware. The goals of #35 are in the last column."
  echo
  echo "$relay_table"
  echo
  echo "Goals of #35 for vrdma's own instructions per WQE: at most 150 in batches, 350 one per pass."
  echo
  echo "$relay_instructions"
  echo
  echo "## Through the guest service"
  echo
  echo "\`tests/bench-service.sh\` on this machine's real cores: perftest between two programs" \
    "(vrdma's libibverbs) on one loopback backend, attached directly and through vrdmad, which" \
    "shares one device among programs; alternating, the median of three runs each. The service" \
    "only forwards set-up: the WQEs and CQEs go between the programs' memory and the backend" \
    "as when attached directly, so the ratio is 1 but for noise. Both ends and the poller" \
    "busy-poll the two cores, so write_lat swings with the scheduler from run to run (it took" \
    "1.5 ms through either when a VM shared the cores)."
  echo
  echo "$service_table"
  echo
  echo "## Rate limits"
  echo
  echo "\`tests/bench-rate.sh\` on this machine's real cores: perftest between programs (vrdma's" \
    "libibverbs, each program a guest of its own) on one loopback backend. First, ib_write_bw" \
    "from a guest held to a limit on payload bytes a second (\`--max-bytes-per-second\`; sends" \
    "over it wait in the guest's ring), against the limit. Then a quiet pair's ib_read_lat (its server end idle)" \
    "alone, beside a noisy pair's unlimited ib_write_bw, and beside the same noisy pair once" \
    "\`vrdmactl limit\` holds it to 100 MiB/s. The pool's one poller thread takes the guests in" \
    "turn, at most 16 WQEs of a queue per pass; the four programs and the poller share two" \
    "cores, so the latencies are the scheduler's as much as the relay's."
  echo
  echo "$rate_table"
} >BENCHMARKS.md
echo "demo: table written to BENCHMARKS.md"
