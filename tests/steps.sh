# shellcheck shell=bash
# Sourced by tests/run-all.sh and by what it runs in a guest: `step NAME` prints the header of
# one step of the test command, `=== [XmYYs] NAME`, timed from VRDMA_RUN_ALL_START (seconds
# since the epoch; a guest's clock is the machine's), from which the command's summary lists
# each step's time.
step() {
  local t=$(($(date +%s) - ${VRDMA_RUN_ALL_START:?the test command sets it}))
  printf '\n=== [%dm%02ds] %s\n' $((t / 60)) $((t % 60)) "$*"
}
