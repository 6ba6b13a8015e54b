#!/usr/bin/env bash
# Boots two test guests at once, "host a" and "host b", each with rdma_rxe on a network card of
# its own (eth0); the two cards are joined by QEMU datagram sockets on 127.0.0.1, so RoCEv2
# between the hosts crosses a real (emulated) Ethernet link. Runs COMMAND on both, with
#   VRDMA_HOST       a or b
#   VRDMA_HOST_IP    this host's address (a: 10.50.0.1, b: 10.50.0.2; prefix /24)
#   VRDMA_PEER_IP    the other host's address
# and prints both outputs, each line prefixed with [a] or [b]. Exits 0 when both exit 0.
#
# usage: tests/vm/two-hosts.sh [--mem MIB] [--timeout SECONDS] -- COMMAND [ARG...]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
options=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mem | --timeout) options+=("$1" "$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "two-hosts.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--mem MIB] [--timeout S] -- COMMAND [ARG...]" >&2; exit 2; }

"$here/setup.sh" >/dev/null # once, before two guests would race to do it

# Two UDP ports on 127.0.0.1 that nothing else holds.
read -r port_a port_b < <(python3 -c '
import socket
held = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
for s in held:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in held))')

boot() { # NAME ADDRESS PEER_ADDRESS PORT PEER_PORT COMMAND...
  local name=$1 address=$2 peer=$3 port=$4 peer_port=$5
  shift 5
  VRDMA_HOST=$name VRDMA_HOST_IP=$address VRDMA_PEER_IP=$peer \
    "$here/run.sh" "${options[@]}" --host-net "$address/24,$port,$peer_port" -- "$@" \
    > >(sed -u "s/^/[$name] /") 2>&1
}

boot a 10.50.0.1 10.50.0.2 "$port_a" "$port_b" "$@" &
host_a=$!
boot b 10.50.0.2 10.50.0.1 "$port_b" "$port_a" "$@" &
host_b=$!
status=0
wait "$host_a" || { status=$?; echo "two-hosts: host a exited with $status" >&2; }
wait "$host_b" || { rc=$?; status=$rc; echo "two-hosts: host b exited with $rc" >&2; }
exit "$status"
