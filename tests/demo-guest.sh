#!/usr/bin/env bash
# Runs inside the demo guest (see tests/demo.sh).
set -euo pipefail
bin=$1
echo "== vhost-user-rdma --check: the host device and what a guest would be offered"
"$bin/vhost-user-rdma" --device rxe0 --check
echo
echo "== vrdma hostverbs: RC ping-pong through MRs at guest-style IOVAs"
"$bin/rc-pingpong" 1000 64
echo
echo "== native rdma-core: ibv_rc_pingpong on the same device"
ibv_rc_pingpong -d rxe0 -g 1 -n 1000 -s 64 >/tmp/server.log 2>&1 &
server=$!
sleep 1
ibv_rc_pingpong -d rxe0 -g 1 -n 1000 -s 64 127.0.0.1 | grep -E 'bytes in|iters in'
wait "$server"
