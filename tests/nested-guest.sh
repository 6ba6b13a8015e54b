#!/usr/bin/env bash
# Runs inside the nested VM that tests/nested-e2e.sh boots: guest-lib programs on the vrdma PCI
# device, one session after the other, each talking to a peer in the outer guest through files
# in this VM's run folder, the only one it can write to: the peer's lines arrive in
# NAME.to-nested (a line `end` closes the session), the program's output goes to
# NAME.from-nested and its exit code to NAME.nested-rc.
# The last session runs an unmodified ibv_rc_pingpong on the PCI device through vrdma's
# libibverbs; this VM has no network, so its TCP address exchange is relayed through
# pingpong.up / pingpong.down.
# usage: tests/nested-guest.sh BIN_DIR ROUND_TRIPS
set -uo pipefail
exchange=${VRDMA_VM_RUN_DIR:?run me inside the VM harness} bin=$1 round_trips=$2
repo=$(cd "$(dirname "$0")/.." && pwd)

# A descriptor that never has input: `read -t` on it waits without starting a process. Every
# process started here costs seconds (this VM is emulated inside an emulated guest) and takes
# them from the program under test on the VM's one vCPU.
exec {never}<> <(:)
pause() { read -rt "$1" -u "$never" || true; }

# Prints the lines of FILE as they are appended (9p has no inotify: polls), until `end`.
follow() {
  local file=$1 n=0 line lines
  while :; do
    if [ -f "$file" ]; then
      mapfile -t lines <"$file"
      while [ "$n" -lt "${#lines[@]}" ]; do
        line=${lines[$n]}
        n=$((n + 1))
        [ "$line" = end ] && return 0
        echo "$line"
      done
    fi
    pause 0.2
  done
}

session() {
  local name=$1
  shift
  follow "$exchange/$name.to-nested" |
    "$bin/guest-endpoint" "$@" >"$exchange/$name.from-nested" 2>"$exchange/$name.nested-err"
  echo "${PIPESTATUS[1]}" >"$exchange/$name.nested-rc"
}

modprobe uio_pci_generic 2>/dev/null # the initramfs loaded it already, if it has it
session guest-peer ping pci "$round_trips"
session native-peer pong pci "$round_trips"
session reopen reopen pci

# The pingpong's peer address is 127.0.0.1 here: a one-connection listener copies the socket
# into pingpong.up and pingpong.down into the socket.
busybox nc -l -p 18515 -e sh -c 'busybox tail -c +1 -F -s 1 "$2" & exec cat >>"$1"' \
  relay "$exchange/pingpong.up" "$exchange/pingpong.down" &
pause 1
VRDMA_IBVERBS_DIR="$bin/vrdma-ibverbs" "$repo/guest-lib/ibverbs/vrdma-run" --device pci -- \
  ibv_rc_pingpong -d vrdma0 -g 0 -c -s 4096 -n 50 -p 18515 127.0.0.1 \
  >"$exchange/pingpong.from-nested" 2>"$exchange/pingpong.nested-err"
echo $? >"$exchange/pingpong.nested-rc"
