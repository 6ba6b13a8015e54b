#!/usr/bin/env bash
# Re-checks "a fresh machine" without needing one: puts this machine's packages back to what it
# had when it was new, clears the setup caches, then runs the README's two commands from a fresh
# clone of the committed HEAD and prints how long each took.
#
# usage: tests/fresh-machine.sh [--since 'YYYY-MM-DD HH:MM:SS'] [--purge-only] [--yes]
#   --since       what "new" means: packages dpkg installed after this moment are removed and
#                 packages it upgraded after it are taken back to their earlier version when
#                 apt still offers it (default: when the machine booted)
#   --purge-only  stop after restoring the packages and clearing the caches
#   --yes         do not ask before purging (implied when CI=true or stdin is not a terminal)
# Needs root (it runs apt-get). Run it whenever tests/vm/setup.sh or tests/vm/qemu/ change.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
since=$(uptime -s) purge_only=0 ask=1
[ "${CI:-}" = true ] || [ ! -t 0 ] && ask=0
while [ $# -gt 0 ]; do
  case "$1" in
    --since) since=$2; shift 2 ;;
    --purge-only) purge_only=1; shift ;;
    --yes) ask=0; shift ;;
    *) echo "usage: $0 [--since 'YYYY-MM-DD HH:MM:SS'] [--purge-only] [--yes]" >&2; exit 2 ;;
  esac
done
[[ "$since" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}\ [0-9]{2}:[0-9]{2}:[0-9]{2}$ ]] ||
  { echo "fresh-machine: --since wants 'YYYY-MM-DD HH:MM:SS', got '$since'" >&2; exit 2; }

log() { echo "fresh-machine: $*" >&2; }

# dpkg's log (rotated parts too, oldest first) from $since on: "install P <none> V" is a
# package that was not on the machine before; "upgrade P OLD NEW" one that was, at OLD.
dpkg_log_since() {
  local logs=(/var/log/dpkg.log*) i
  for ((i = ${#logs[@]} - 1; i >= 0; i--)); do [ -e "${logs[i]}" ] && zcat -f "${logs[i]}"; done |
    awk -v since="$since" '($1 " " $2) >= since'
}

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }

restore_packages() {
  local added=() downgrades=() pkg
  while read -r pkg; do installed "$pkg" && added+=("$pkg"); done < <(dpkg_log_since |
    awk '$3 == "install" && $5 == "<none>" { print $4 }' | sort -u)
  while read -r pkg old; do
    installed "$pkg" && ! printf '%s\n' "${added[@]}" | grep -qx "$pkg" && downgrades+=("$pkg=$old")
  done < <(dpkg_log_since | awk '$3 == "upgrade" && !(($4) in first) { first[$4] = $5; print $4, $5 }')

  if [ ${#added[@]} -eq 0 ] && [ ${#downgrades[@]} -eq 0 ]; then
    log "no package was installed or upgraded since $since"
  else
    log "since $since, installed: ${#added[@]} packages; upgraded: ${downgrades[*]:-none}"
    if [ "$ask" = 1 ]; then
      read -r -p "purge those ${#added[@]} packages and downgrade the upgraded ones? [y/N] " answer
      [ "$answer" = y ] || { log "nothing changed"; exit 1; }
    fi
    [ ${#added[@]} -gt 0 ] && DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${added[@]}" >/dev/null
    for pkg in "${downgrades[@]}"; do
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --allow-downgrades "$pkg" >/dev/null 2>&1 ||
        log "warning: apt no longer offers $pkg; it stays at its newer version"
    done
  fi
  # The source entry setup adds; apt's lists go back to the machine's own sources.
  if [ -f /etc/apt/sources.list.d/vrdma-backports.sources ]; then
    rm -f /etc/apt/sources.list.d/vrdma-backports.sources
    apt-get update -qq
  fi
}

restore_packages
rm -rf "$repo/target/vm" "$repo/target/qemu"
log "packages restored, setup caches under target/ cleared"
[ "$purge_only" = 1 ] && exit 0

clone=$(mktemp -d "${TMPDIR:-/tmp}/vrdma-fresh.XXXXXX")
git clone -q "$repo" "$clone"
log "fresh clone of $(git -C "$clone" rev-parse --short HEAD) in $clone"
cd "$clone"

timed() { # NAME COMMAND...: runs, records "NAME: exit CODE after Ns"
  local name=$1 start status
  shift
  start=$(date +%s)
  set +e
  "$@"
  status=$?
  set -e
  results+=("$name: exit $status after $(($(date +%s) - start)) s")
  [ "$status" = 0 ] || failed=1
}
results=() failed=0
timed "tests/run-all.sh" env CI=true tests/run-all.sh
timed "tests/demo.sh" tests/demo.sh
timed "tests/vm/setup.sh (second run)" bash -c 'tests/vm/setup.sh 2>target/setup-again.log >/dev/null'
if grep -qE 'installing|fetching' target/setup-again.log; then
  results+=("setup's second run installed or fetched something:" "$(cat target/setup-again.log)")
  failed=1
fi
printf '\n'
for line in "${results[@]}"; do log "$line"; done
log "clone kept in $clone (target/ holds the logs)"
exit "$failed"
