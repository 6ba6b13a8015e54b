#!/usr/bin/env bash
# Runs every vrdma check and test: formatting, clippy, unit tests and the loopback-host
# integration tests on this machine; in one boot of a QEMU guest with rdma_rxe (tests/vm/,
# tests/rxe-tier.sh) the integration tests that need real RDMA and a smoke run of the
# benchmarks there; the fuzz targets briefly; a VM with the vrdma PCI device served by the
# loopback host and started by libvirt (tests/pci-e2e.sh), one whose QEMU is replaced while it
# runs (tests/replace-qemu.sh), then one nested in a second boot
# of the rxe guest; the Debian packages installed on a clean system booted with systemd
# (tests/install-check.sh); the cross-host tests (two rxe guests joined by an emulated
# Ethernet link, tests/cross-host.sh) and a smoke run of the benchmarks on this machine.
# Installs what it needs on first use (tests/vm/setup.sh, the patched QEMU of
# tests/vm/qemu/build.sh, the clean system of tests/vm/clean-root.sh); caches under target/.
#   VRDMA_VM_NO_RXE=1  boot the guest without rdma_rxe: the RDMA tests must then fail.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's header says when it started, so a slow step shows in the log; the summary
# at the end lists how long each took.
VRDMA_RUN_ALL_START=$(date +%s)
export VRDMA_RUN_ALL_START
source tests/steps.sh

run_all() {
set -euo pipefail # the caller turns errexit off around the pipeline; keep it on in here

step "setup (packages, kernel, initramfs)"
tests/vm/setup.sh >/dev/null
# What only the later steps need is made in the background at the lowest priority, in the
# time the cargo steps and the rxe guest below leave idle (the machine has two cores; the
# cargo steps keep both busy but for their gaps, the rxe guest about one and a quarter):
# the PCI device's QEMU (minutes of compiling the first time), then the fuzz targets (their
# own build, instrumented), and meanwhile the clean system the packages are installed on
# (mostly downloads). The steps that need them wait for it. Its own session (a process group
# ended with the command), which the kernel also schedules as a group of its own
# (autogroup): that group's priority is lowered too, else nice would only rank the job
# against itself.
setsid nice -n 19 bash -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null
  tests/vm/clean-root.sh >/dev/null & root=$!
  tests/vm/qemu/build.sh >/dev/null && fuzz/run.sh --brief --build-only && wait $root' \
  >target/vm-prepare.log 2>&1 &
prepare=$!
# (Until setsid has made the group, the process alone is all there is to end.)
trap 'kill -- -$prepare 2>/dev/null || kill $prepare 2>/dev/null || true' EXIT

step "cargo fmt --check"
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check

step "cargo clippy (the workspace and the fuzz targets), rustdoc's links"
cargo clippy --workspace --all-targets --locked -- -D warnings
# In the workspace's target directory: the fuzz targets' dependencies were just checked there.
CARGO_TARGET_DIR=$PWD/target cargo clippy --manifest-path fuzz/Cargo.toml --all-targets -- -D warnings
# Every rustdoc warning is an error: a link to an item a reader of the docs cannot see, too.
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --locked --quiet

step "shellcheck (the test, build and packaging scripts; .shellcheckrc)"
git ls-files -z '*.sh' .ci/run | xargs -0 shellcheck -S warning

step "build the binaries, link vrdma's libibverbs.so.1 (for the unmodified-program tests)"
# Before any test: integration tests run the backend binary and these programs as processes.
# link.sh builds the workspace as cargo test and the packages do next: they compile nothing again.
guest-lib/ibverbs/link.sh >/dev/null
cc -Wall -Werror -O1 -o target/debug/rdma_check tests/c/rdma_check.c -libverbs

step "unit tests, and the integration tests on the loopback host (this machine, no VM; about a minute)"
cargo test --workspace --locked

step "the Debian packages (of the debug build): their contents, scripts and dependencies checked"
tests/packages.sh

step "build the integration tests"
mapfile -t binaries < <(cargo test -p vrdma-tests --tests --no-run --locked --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") \
            and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
[ ${#binaries[@]} -gt 0 ] || { echo "run-all: no integration test binaries were built" >&2; exit 1; }

step "the rxe guest (QEMU, rdma_rxe) boots, for the steps that need real RDMA (tests/rxe-tier.sh)"
# One boot for both; each prints its own header. 6 GiB: the quota stress test's 64 guests
# hold ~3 GiB of the backend and the host provider.
tests/vm/run.sh --mem 6144 --timeout 3600 -- tests/rxe-tier.sh "$PWD/target/debug" "${binaries[@]}"

step "the background preparation ends: the PCI device's QEMU, the clean system, the fuzz targets' build"
wait "$prepare" || { cat target/vm-prepare.log; echo "run-all: the background preparation failed" >&2; exit 1; }
cat target/vm-prepare.log

step "fuzz targets, briefly, over their corpora (fuzz/run.sh; the long runs are in docs/testing.md)"
fuzz/run.sh --brief "${VRDMA_FUZZ_SECONDS:-4}"

step "a VM with the vrdma PCI device, served by the loopback host on this machine (2 to 4 minutes)"
tests/pci-e2e.sh "$PWD/target/debug" loopback

step "QEMU replaced under a running VM with the vrdma PCI device (cpr-transfer), served by the loopback host on this machine (under a minute)"
tests/replace-qemu.sh "$PWD/target/debug"

step "a nested VM with the vrdma PCI device, served through rxe0 in a second boot of the rxe guest (KVM there; about a minute)"
# A boot of its own: the patched QEMU it needs is built while the rxe guest's tests run.
tests/vm/run.sh --mem 4096 --timeout 1200 -- tests/pci-e2e.sh "$PWD/target/debug" rxe0

step "the packages installed on a clean Debian system booted with systemd"
tests/install-check.sh target/debug/debs/*.deb

step "two hosts: vrdma guests over RoCEv2 across an emulated link, then the cross-host benchmark's smoke run (about 3 minutes)"
# One boot of the two hosts for both; the benchmark runs even when a check failed.
VRDMA_BENCH_LAT_ITERS=50 VRDMA_BENCH_BW_ITERS=100 tests/vm/two-hosts.sh -- bash -c \
  'tests/cross-host.sh "$1" "$1/rdma_check"; checks=$?; tests/bench-cross-host.sh "$1" && exit $checks' \
  two-hosts "$PWD/target/debug"

step "the benchmarks on this machine, a smoke run (the relay's cost, rate limits; numbers are not checked)"
VRDMA_BENCH_ROUND_TRIPS=2000 VRDMA_BENCH_WQES=20000 target/debug/relay-bench
VRDMA_BENCH_RATE_MESSAGES=60 VRDMA_BENCH_LAT_ITERS=200 tests/bench-rate.sh target/debug

step "done"
}

mkdir -p target
log=target/run-all.log
set +e
run_all 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line for every runner above: the totals of their "test result:" lines and of
# the PCI-device VM, cross-host and clean-install checks.
# Each section's time, from the step headers' start times.
awk '/^=== \[[0-9]+m[0-9]+s\] / { match($0, /\[[0-9]+m[0-9]+s\]/); t = substr($0, RSTART + 1, RLENGTH - 3);
       split(t, ms, "m"); now = ms[1] * 60 + ms[2]; if (name != "") printf "section %4ds  %s\n", now - start, name;
       name = substr($0, RSTART + RLENGTH + 1); start = now }' "$log"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i + 1) ~ /^passed/) p += $i; if ($(i + 1) ~ /^failed/) f += $i } }
     /^(\[[ab]\] )?(pci-e2e|replace-qemu|cross-host|install): .* ok( \([0-9]+ s\))?$/ { p++ }
     /^(\[[ab]\] )?(pci-e2e|replace-qemu|cross-host|install): .* FAILED( \([0-9]+ s\))?$/ { f++ }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
