#!/bin/busybox sh
# shellcheck shell=dash
# PID 1 of the test guest. Loads the modules the initramfs carries, mounts the machine's root
# (read-only 9p) and the run's results folder (writable 9p, mounted at the same path it has on
# the machine), brings up rdma_rxe on a veth, runs the command and records its exit code.
# Kernel command line: vrdma.results=PATH (required), vrdma.rxe=0 to leave rdma_rxe out,
# vrdma.net=ADDRESS/PREFIX to put ADDRESS on the network card eth0 and rdma_rxe on eth0,
# vrdma.root=PATH to boot the machine's folder PATH (a clean system, tests/vm/clean-root.sh)
# with systemd instead of running the command in the machine's root (see boot_clean_root),
# vrdma.standalone=1 to run /standalone/run from the initramfs and mount nothing (see below).
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

results=
want_rxe=1
net=
clean_root=
standalone=0
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    vrdma.results=*) results=${arg#vrdma.results=} ;;
    vrdma.rxe=*) want_rxe=${arg#vrdma.rxe=} ;;
    vrdma.net=*) net=${arg#vrdma.net=} ;;
    vrdma.root=*) clean_root=${arg#vrdma.root=} ;;
    vrdma.standalone=*) standalone=${arg#vrdma.standalone=} ;;
  esac
done

fail() { echo "guest-init: $*"; poweroff -f; }

# The network and RDMA modules only when rxe or the network card is wanted: a nested guest
# has neither, and every module costs it seconds.
lists=/modules/base
[ "$want_rxe" = 1 ] || [ -n "$net" ] && lists="$lists /modules/network"
for m in $(cat $lists); do
  case "$m" in *-rdma_rxe.ko) [ "$want_rxe" = 1 ] || continue ;; esac
  insmod "/modules/$m" || echo "guest-init: insmod $m failed"
done

# A guest QEMU may migrate mounts nothing of the machine (QEMU blocks migration while a 9p
# share is mounted): its command is /standalone/run, from an archive appended to the
# initramfs (tests/replace-qemu.sh), and its output and exit code go to the console.
if [ "$standalone" = 1 ]; then
  ip link set lo up
  /standalone/run
  echo "standalone: exit $?"
  poweroff -f
fi

opts=trans=virtio,version=9p2000.L,msize=512000
# The root is cached in the guest's page cache: without it every exec reads its binary and
# libraries over 9p again (a process took ten times as long to start).
# Nothing on the machine changes it while a guest runs; what the guest and the machine trade
# goes through the results share, which is not cached.
mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot || fail "cannot mount the machine's root over 9p"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/shm /newroot/dev/pts 2>/dev/null
ln -sf /proc/self/fd /newroot/dev/fd # bash process substitution
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/run
# /tmp must be writable, yet what the machine keeps under /tmp (a checkout, its build) must stay
# visible: an overlay with the machine's /tmp below and a tmpfs above.
mkdir -p /newroot/run/.tmp/upper /newroot/run/.tmp/work
mount -t overlay overlay \
  -o lowerdir=/newroot/tmp,upperdir=/newroot/run/.tmp/upper,workdir=/newroot/run/.tmp/work \
  /newroot/tmp || fail "cannot mount the /tmp overlay"
# Last, so that no later mount hides it.
[ -n "$results" ] || fail "no vrdma.results= on the kernel command line"
mount -t 9p -o "$opts" results "/newroot$results" || fail "cannot mount the results share"

# A host name: the kernel's default, "(none)", is no valid node name, and Open MPI's mpirun
# refuses to start with it.
hostname vrdma-guest || echo "guest-init: cannot set the host name"

# rxe cannot sit on lo on this kernel; one end of a veth pair works, and two processes on the
# same rxe device reach each other through its IPv4 GID. Without rxe only lo is needed.
if [ "$want_rxe" = 1 ]; then
  chroot /newroot /bin/sh -c '
    ip link set lo up
    ip link add va type veth peer name vb
    ip addr add 192.168.77.1/24 dev va
    ip link set va up
    ip link set vb up'
else
  ip link set lo up # busybox's: the machine's ip loads a dozen libraries over 9p
fi
rxe_netdev=va
if [ -n "$net" ]; then
  # A host of several (tests/vm/two-hosts.sh): rxe on the network card, towards the others.
  chroot /newroot /bin/sh -c "ip addr add $net dev eth0 && ip link set eth0 up" ||
    echo "guest-init: cannot configure eth0 with $net"
  rxe_netdev=eth0
fi
if [ "$want_rxe" = 1 ]; then
  chroot /newroot rdma link add rxe0 type rxe netdev $rxe_netdev || echo "guest-init: rdma link add rxe0 failed"
fi

# The clean system PATH, booted by its own systemd: read-only below a tmpfs (nothing it does
# outlives the guest), the machine's root read-only at /machine, the results folder where it
# is on the machine. The command runs as a unit once the system is up, its output on the
# console; it then powers the guest off.
boot_clean_root() {
  local lower=/newroot$clean_root unit
  [ -x "$lower/lib/systemd/systemd" ] || fail "vrdma.root=$clean_root holds no systemd"
  mkdir -p /clean /upper
  mount -t tmpfs tmpfs /upper && mkdir -p /upper/data /upper/work
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=/upper/data,workdir=/upper/work" /clean ||
    fail "cannot mount the clean root's overlay"
  mkdir -p /clean/machine "/clean$results"
  mount --bind /newroot /clean/machine
  mount --bind "/newroot$results" "/clean$results"
  unit=/clean/etc/systemd/system/vrdma-harness.service
  cat >"$unit" <<UNIT
[Unit]
Description=the command tests/vm/run.sh gave this guest
After=multi-user.target
[Service]
Type=oneshot
ExecStart=/bin/sh -c '/bin/bash $results/cmd.sh; echo \$? >$results/rc; sync; systemctl --no-block start poweroff.target --job-mode=replace-irreversibly'
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
[Install]
WantedBy=multi-user.target
UNIT
  mkdir -p /clean/etc/systemd/system/multi-user.target.wants
  ln -s ../vrdma-harness.service /clean/etc/systemd/system/multi-user.target.wants/
  # The console is the command's; no login prompt on it.
  ln -s /dev/null /clean/etc/systemd/system/serial-getty@ttyS0.service
  umount /proc /sys 2>/dev/null
  exec switch_root /clean /lib/systemd/systemd
}
[ -n "$clean_root" ] && boot_clean_root

chroot /newroot /bin/bash "$results/cmd.sh"
echo $? >"/newroot$results/rc"
sync
umount "/newroot$results"
poweroff -f
