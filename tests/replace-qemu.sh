#!/usr/bin/env bash
# QEMU replaced under a running VM (SPEC.md §11.1, docs/vm.md): a VM with a vrdma device runs a
# guest-lib program (guest-endpoint pong, over the PCI device) that echoes checked messages for
# a peer here (guest-endpoint ping, attached to the same backend); meanwhile a second QEMU
# takes the VM over with QEMU's cpr-transfer (guest RAM stays where it is, in the same memfd;
# the device state hands the device to the new QEMU's connection), and the first one quits.
# The backend serves the device with its loopback host (a declared instrument: no RDMA NIC,
# no rxe); the VM is emulated (TCG) on this machine, and mounts nothing of it (a mounted 9p
# share blocks migration): its program comes in an archive appended to the test initramfs.
# Checks: the peer's round trips go on across the replacement and end with every echo, and
# the last RDMA WRITE and READ, checked on both sides; the backend says the new connection
# took the device over and the old one closed holding nothing; once the VM has shut down,
# its connection ends. Prints QEMU's own downtime and the longest round trip
# the peer saw (how long the program saw its peer stop).
# usage: tests/replace-qemu.sh BIN_DIR [replace|pause|none]
#   BIN_DIR holds vhost-user-rdma, vrdmactl and guest-endpoint. The event is what happens to the
#   VM under the round trips: its QEMU replaced (the default, the test), a pause of 2 s (QEMU's
#   stop and cont), or nothing (the baseline): the demo measures all three (BENCHMARKS.md).
#   The last line but one is `replace-qemu: measured event=E vm_stopped_ms=S
#   longest_round_trip_ms=L round_trips=N`.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "$1" && pwd)
event=${2:-replace}
case "$event" in
  replace | pause | none) ;;
  *) echo "usage: $0 BIN_DIR [replace|pause|none]" >&2; exit 2 ;;
esac
cache=$("$repo/tests/vm/setup.sh") || exit 1
qemu=$("$repo/tests/vm/qemu/build.sh") || exit 1
work=$(mktemp -d /tmp/vrdma-replace.XXXXXX)
socket=$work/vrdma.sock admin=$work/admin.sock
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

case "$event" in
  replace) check="QEMU replaced (cpr-transfer) under a VM's program making checked round trips with a peer here" ;;
  pause) check="a VM paused for 2 s under its program's checked round trips with a peer here" ;;
  none) check="a VM's program making checked round trips with a peer here" ;;
esac
fail() {
  echo "replace-qemu: $*"
  for log in backend.log ping.out console-old.log console-new.log qemu-old.log qemu-new.log; do
    [ -s "$work/$log" ] && { echo "--- $log"; tail -n 30 "$work/$log"; }
  done
  echo "replace-qemu: $check FAILED ($SECONDS s)"
  exit 1
}

# wait_line FILE REGEX SECONDS [PID]: prints the first line of FILE that matches, waiting for
# it (no longer than process PID lives).
wait_line() {
  local start=$SECONDS line
  while [ $((SECONDS - start)) -lt "$3" ]; do
    line=$(grep -m1 -E "$2" "$1" 2>/dev/null) && { echo "$line"; return 0; }
    [ -z "${4:-}" ] || kill -0 "$4" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

# qmp SOCKET COMMAND_JSON...: runs QMP commands (a number between two is seconds to wait);
# prints the last one's return value as JSON, and for several commands, on stderr, the
# milliseconds from the first one's answer to the last one's.
qmp() {
  python3 - "$@" <<'PY'
import json, socket, sys, time
conn = socket.socket(socket.AF_UNIX)
conn.connect(sys.argv[1])
stream = conn.makefile("rw")
def answer():
    while True:
        message = json.loads(stream.readline())
        if "event" not in message:
            return message
answer()  # the greeting
first = None
for step in ['{"execute": "qmp_capabilities"}'] + sys.argv[2:]:
    if step.replace(".", "").isdigit():
        time.sleep(float(step))
        continue
    command = json.loads(step)
    stream.write(json.dumps(command) + "\n")
    stream.flush()
    reply = answer()
    if "error" in reply:
        sys.exit(f"qmp: {command['execute']}: {reply['error']['desc']}")
    if command["execute"] != "qmp_capabilities" and first is None:
        first = time.monotonic()
print(json.dumps(reply["return"]))
if len(sys.argv) > 3:
    print(round((time.monotonic() - first) * 1000), file=sys.stderr)
PY
}

# The test initramfs, with guest-endpoint, what it links and /standalone/run appended.
extra=$work/initrd-extra
mkdir -p "$extra/standalone"
cp "$bin/guest-endpoint" "$extra/standalone/"
ldd "$bin/guest-endpoint" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' |
  while read -r library; do cp --parents -L "$library" "$extra"; done
cat >"$extra/standalone/run" <<'RUN'
#!/bin/sh
# The peer's address line, from the kernel command line (spaces as commas).
peer=$(sed -n 's/.*vrdma\.peer=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
echo "$peer" | /standalone/guest-endpoint pong pci 0
RUN
chmod +x "$extra/standalone/run"
{
  cat "$cache/initrd.gz"
  (cd "$extra" && find . | cpio -o -H newc --quiet | gzip -1)
} >"$work/initrd.gz"

RUST_LOG=info "$bin/vhost-user-rdma" --device loopback --socket-path "$socket" --shared-gid \
  --admin-socket "$admin" >"$work/backend.log" 2>&1 &
pids+=($!)
wait_line "$work/backend.log" "accepting guests" 30 >/dev/null || fail "the backend did not start"

mkfifo "$work/ping.in"
"$bin/guest-endpoint" ping "$socket" 0 <"$work/ping.in" >"$work/ping.out" 2>&1 &
ping=$!
pids+=("$ping")
exec 7>"$work/ping.in"
peer=$(wait_line "$work/ping.out" '^qpn=' 30) || fail "the peer here did not start"

# What the two QEMUs share: the same machine, RAM in a shared memfd (which cpr-transfer hands
# to the new QEMU), every other RAM block shared too (aux-ram-share), the vrdma device on the
# backend's socket. The kernel arguments are run.sh's (which says why), less what needs 9p.
queues=$((2 + ${VRDMA_NOTIFY_QUEUES:-1}))
kernel_args="console=ttyS0 quiet loglevel=3 panic=-1 tsc=reliable cryptomgr.notests no_timer_check audit=0 mitigations=off init_on_alloc=0 vrdma.rxe=0 vrdma.standalone=1 vrdma.peer=${peer// /,}"
machine=(-L /usr/share/qemu -L /usr/share/seabios -nic none
  -machine pc,aux-ram-share=on,memory-backend=mem -accel tcg -m 512 -smp 1
  -object memory-backend-memfd,id=mem,size=512M,share=on
  -chardev "socket,id=vrdma0,path=$socket,reconnect-ms=1000"
  -device "vhost-user-device-pci,chardev=vrdma0,virtio-id=42,num_vqs=$queues,config_size=128,modern-pio-notify=on"
  -kernel "$cache/kernel/vmlinuz" -initrd "$work/initrd.gz" -append "$kernel_args"
  -display none -monitor none -no-reboot)
start_qemu() { # NAME ARG...: one QEMU, its console and monitor named NAME
  local name=$1
  shift
  "$qemu" "${machine[@]}" -serial "file:$work/console-$name.log" \
    -qmp "unix:$work/qmp-$name.sock,server=on,wait=off" "$@" >"$work/qemu-$name.log" 2>&1 &
  pids+=($!)
}

start_qemu old
old=${pids[-1]}
line=$(wait_line "$work/console-old.log" '^qpn=' 300 "$old") || fail "the program in the VM did not start"
echo "$line" >&7
wait_line "$work/console-old.log" '^state=' 60 "$old" >/dev/null || fail "the program in the VM did not connect"
sleep 3 # round trips under way
before=$("$bin/vrdmactl" --socket "$admin" list 2>&1)

stopped_ms=0
if [ "$event" = replace ]; then
  # The new QEMU reads the cpr channel (the memfd) before it makes its devices; then its
  # device connects to the backend and loads the device state from the migration stream.
  start_qemu new -incoming "unix:$work/main.sock" \
    -incoming "{\"channel-type\":\"cpr\",\"addr\":{\"transport\":\"socket\",\"type\":\"unix\",\"path\":\"$work/cpr.sock\"}}"
  new=${pids[-1]}
  for _ in $(seq 50); do [ -S "$work/cpr.sock" ] && break; sleep 0.1; done
  qmp "$work/qmp-old.sock" '{"execute":"migrate-set-parameters","arguments":{"mode":"cpr-transfer"}}' >/dev/null ||
    fail "cpr-transfer refused"
  qmp "$work/qmp-old.sock" "{\"execute\":\"migrate\",\"arguments\":{\"channels\":[
    {\"channel-type\":\"main\",\"addr\":{\"transport\":\"socket\",\"type\":\"unix\",\"path\":\"$work/main.sock\"}},
    {\"channel-type\":\"cpr\",\"addr\":{\"transport\":\"socket\",\"type\":\"unix\",\"path\":\"$work/cpr.sock\"}}]}}" >/dev/null ||
    fail "migrate refused"
  status=
  for _ in $(seq 600); do
    status=$(qmp "$work/qmp-old.sock" '{"execute":"query-migrate"}' 2>/dev/null) || break
    case "$status" in *'"status": "completed"'* | *'"status": "failed"'* | *'"status": "cancelled"'*) break ;; esac
    sleep 0.2
  done
  case "$status" in *'"status": "completed"'*) ;; *) fail "the migration did not complete: $status" ;; esac
  downtime=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1]).get("downtime", "?"))' "$status")
  qmp "$work/qmp-old.sock" '{"execute":"quit"}' >/dev/null
  wait "$old" 2>/dev/null
  stopped_ms=$downtime
elif [ "$event" = pause ]; then
  stopped_ms=$(qmp "$work/qmp-old.sock" '{"execute":"stop"}' 2 '{"execute":"cont"}' 2>&1 >/dev/null) ||
    fail "stop or cont refused: $stopped_ms"
fi
[ "$event" = replace ] || new=$old
sleep 3 # round trips after the event
after=$("$bin/vrdmactl" --socket "$admin" list 2>&1)

echo stop >&7
done_line=$(wait_line "$work/ping.out" '^done ' 120) || fail "the peer's round trips did not finish"
exec 7>&-
wait "$ping" || fail "the peer here failed"
console=$work/console-old.log
[ "$event" = replace ] && console=$work/console-new.log
wait_line "$console" '^standalone: exit' 120 "$new" >/dev/null || fail "the program in the VM did not end"
grep -q '^standalone: exit 0' "$console" || fail "the program in the VM failed"
wait "$new" 2>/dev/null
if [ "$event" = replace ]; then
  taker=$(wait_line "$work/backend.log" "took over the guest's device" 5) || fail "no connection took the device over"
  taker=$(echo "$taker" | sed -n 's/.*\] \(connection [0-9]*\) .*/\1/p')
  grep -q "closed, its device handed to a successor" "$work/backend.log" || fail "the old connection did not close empty"
else
  taker="connection 2"
fi
# The program destroys its objects as it exits; whatever it left, the connection's end frees.
wait_line "$work/backend.log" "$taker: closed, [0-9]* objects released" 30 >/dev/null ||
  fail "the VM's connection did not end"

# The VM's device is the same one after (its WQE count went on from where it was), and not
# the peer's (connection 1, attached first).
vm_wqes() { awk 'NR > 1 && $1 != 1 { print $(NF - 2) }' <<<"$1"; }
[ "$(vm_wqes "$after")" -gt "$(vm_wqes "$before")" ] 2>/dev/null ||
  fail "the VM's device after the replacement is not the one before: $before / $after"
round_trips=$(echo "$done_line" | awk '{print $2}')
longest_us=$(echo "$done_line" | sed -n 's/.*longest_round_trip_us=\([0-9]*\).*/\1/p')
echo "$before" | sed 's/^/replace-qemu: vrdmactl list before: /'
echo "$after" | sed 's/^/replace-qemu: vrdmactl list after:  /'
echo "replace-qemu: measured event=$event vm_stopped_ms=$stopped_ms longest_round_trip_ms=$((longest_us / 1000)) round_trips=$round_trips"
echo "replace-qemu: $check ok ($SECONDS s)"
