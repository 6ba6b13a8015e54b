#!/usr/bin/env bash
# Runs one command inside a fresh QEMU/TCG guest with rdma_rxe up (device rxe0 on a veth, IPv4
# GID 192.168.77.1) and the machine's root as its root filesystem, so binaries built here run
# there unchanged. Prints the command's output and exits with its exit code.
#
# usage: tests/vm/run.sh [--no-rxe] [--mem MIB] [--timeout SECONDS] -- COMMAND [ARG...]
#   --no-rxe   boot without loading rdma_rxe (also VRDMA_VM_NO_RXE=1): RDMA tests must then fail
# Environment passed into the guest: RUST_LOG, RUST_BACKTRACE, and every VRDMA_* variable.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
rxe=$([ "${VRDMA_VM_NO_RXE:-0}" = 1 ] && echo 0 || echo 1) mem=3072 limit=${VRDMA_VM_TIMEOUT:-1800}
while [ $# -gt 0 ]; do
  case "$1" in
    --no-rxe) rxe=0; shift ;;
    --mem) mem=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--no-rxe] [--mem MIB] [--timeout S] -- COMMAND [ARG...]" >&2; exit 2; }

cache=$("$repo/tests/vm/setup.sh")
mkdir -p "$cache/runs"
run=$(mktemp -d "$cache/runs/run.XXXXXX")
case "$run" in *[[:space:]]*) echo "run.sh: the repository path must not contain spaces" >&2; exit 2 ;; esac
trap 'rm -rf "$run"' EXIT

{
  echo "cd $(printf '%q' "$PWD") || exit 125"
  echo "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp"
  echo "export RUST_BACKTRACE=${RUST_BACKTRACE:-0}"
  [ -n "${RUST_LOG:-}" ] && echo "export RUST_LOG=$(printf '%q' "$RUST_LOG")"
  while IFS='=' read -r name value; do
    echo "export $name=$(printf '%q' "$value")"
  done < <(env | grep '^VRDMA_' || true)
  printf '%q ' "$@"
  echo
} >"$run/cmd.sh"

timeout --foreground "$limit" qemu-system-x86_64 \
  -accel tcg -m "$mem" -smp 2 -nographic -no-reboot -nic none \
  -kernel "$cache/kernel/vmlinuz" -initrd "$cache/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 vrdma.results=$run vrdma.rxe=$rxe" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on \
  -virtfs "local,path=$run,mount_tag=results,security_model=none" \
  </dev/null | sed -u -e 's/\r$//; s/\x1b[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' \
  -e '/^SeaBIOS (version/d; s/^Booting from ROM\.*//; /reboot: Power down/d' || true

if [ ! -f "$run/rc" ]; then
  echo "run.sh: the guest ended without the command's exit code (boot failure or timeout after ${limit}s)" >&2
  exit 1
fi
exit "$(cat "$run/rc")"
