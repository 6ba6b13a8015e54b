#!/usr/bin/env bash
# Builds vrdma's libibverbs.so.1: the vrdma-ibverbs static library linked into a shared
# library whose symbols carry the version nodes of the libibverbs installed on this machine
# (IBVERBS_1.0 ... IBVERBS_1.x, IBVERBS_PRIVATE_nn), read from it at build time, so the
# dynamic loader accepts it in place of the system's for programs and provider libraries.
# (rustc cannot attach symbol versions to a cdylib, hence the separate link.)
#
# It builds the whole workspace first (libraries, programs, examples), the one selection every
# build of the test command and the demo makes: cargo enables a dependency's features for the
# packages and targets a build selects, so a narrower build (this crate alone) would compile
# the crates it shares with the others once more, differently.
#
# usage: guest-lib/ibverbs/link.sh [--release]
# Prints the directory holding libibverbs.so.1. Needs libibverbs-dev (tests/vm/setup.sh
# installs it), cc, nm and objdump.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
profile=debug cargo_flags=(--locked)
case "${1:-}" in
  --release) profile=release cargo_flags+=(--release) ;;
  "") ;;
  *) echo "usage: $0 [--release]" >&2; exit 2 ;;
esac
log() { echo "vrdma-ibverbs: $*" >&2; }

system_lib="$(pkg-config --variable=libdir libibverbs 2>/dev/null)/libibverbs.so.1"
[ -e "$system_lib" ] || { log "no system libibverbs.so.1 to take symbol versions from: apt-get install libibverbs-dev"; exit 1; }

(cd "$repo" && cargo build --workspace --lib --bins --examples "${cargo_flags[@]}") >&2
archive="$repo/target/$profile/libvrdma_ibverbs.a"
out="$repo/target/$profile/vrdma-ibverbs"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# versioned_symbols LIB PREFIX: each default-versioned symbol of LIB with its version node
# ("IBVERBS_1.1 ibv_get_device_list"; hidden "(IBVERBS_1.0)" copies are old ABIs and are
# left out), by symbol.
versioned_symbols() {
  objdump -T "$1" | awk -v prefix="^$2" 'NF > 2 && $(NF-1) ~ prefix && $NF !~ prefix { print $(NF-1), $NF }' |
    sort -k2
}
# version_nodes LIB PREFIX: LIB's version nodes in definition order, each with its parent
# ("IBVERBS_1.1 IBVERBS_1.0").
version_nodes() {
  readelf -V "$1" | awk -v prefix="Name: $2" '
    /Version definition section/ { in_defs = 1; next }
    /Version needs section/ { in_defs = 0 }
    in_defs && $0 ~ prefix { if (node) print node, parent; node = $NF; parent = "" }
    in_defs && /Parent 1:/ { parent = $NF }
    END { if (node) print node, parent }'
}
# version_script SYMBOLS NODES KEEP: a version script giving each node of NODES its symbols
# of SYMBOLS (as versioned_symbols prints them) that the sorted list KEEP holds.
version_script() {
  local first=1 node parent symbols
  while read -r node parent; do
    echo "$node {"
    symbols=$(awk -v node="$node" '$1 == node { print $2 }' "$1" | sort | comm -12 - "$3")
    [ -n "$symbols" ] && { echo "  global:"; sed 's/^/    /; s/$/;/' <<<"$symbols"; }
    [ "$first" = 1 ] && { echo "  local: *;"; first=0; }
    echo "}${parent:+ $parent};"
  done <"$2"
}

# Symbols this library defines, and the system library's versioned ones and version nodes.
nm -g --defined-only "$archive" 2>/dev/null | awk '$2 == "T" { print $3 }' | sort -u >"$work/defined"
versioned_symbols "$system_lib" IBVERBS_ >"$work/system"
version_nodes "$system_lib" IBVERBS_ >"$work/nodes"
{
  version_script "$work/system" "$work/nodes" "$work/defined"
  # The functions behind vrdma's librdmacm.so.1 (below), under a node of their own.
  echo "VRDMA_RDMACM_PRIVATE {"
  echo "  global:"
  grep '^vrdma_rdmacm_' "$work/defined" | sed 's/^/    /; s/$/;/'
  echo "};"
} >"$work/libibverbs.map"

exported=$(awk '{ print $2 }' "$work/system" | sort -u | comm -12 - "$work/defined")
missing=$(awk '{ print $2 }' "$work/system" | sort -u | comm -23 - "$work/defined")
undefined_args=()
for symbol in $exported $(grep '^vrdma_rdmacm_' "$work/defined"); do
  undefined_args+=("-Wl,--undefined=$symbol")
done

cc -shared -o "$out/libibverbs.so.1.tmp" -Wl,-soname,libibverbs.so.1 \
  -Wl,--version-script="$work/libibverbs.map" -Wl,--gc-sections -Wl,-z,now \
  "${undefined_args[@]}" "$archive" -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
mv "$out/libibverbs.so.1.tmp" "$out/libibverbs.so.1"
cp "$work/libibverbs.map" "$out/libibverbs.map"
log "$(wc -w <<<"$exported") symbols exported, $(wc -w <<<"$missing") of the system library's not provided (see $out/not-provided)"
echo "$missing" >"$out/not-provided"

# librdmacm.so.1: every default-versioned function of the system's librdmacm, each a jump to
# this library's vrdma_rdmacm_<name> (or, for those not served, to vrdma_rdmacm_unserved
# with the function's name), so that the connection manager and the verbs share the one
# device connection and objects of libibverbs.so.1. x86-64 jumps: arguments pass untouched.
system_cm="$(pkg-config --variable=libdir librdmacm 2>/dev/null)/librdmacm.so.1"
[ -e "$system_cm" ] || { log "no system librdmacm.so.1 to take symbol versions from: apt-get install librdmacm-dev"; exit 1; }
versioned_symbols "$system_cm" RDMACM_ >"$work/cm-system"
version_nodes "$system_cm" RDMACM_ >"$work/cm-nodes"
{
  echo ".text"
  while read -r _ symbol; do
    echo ".globl $symbol"
    echo ".type $symbol, @function"
    echo "$symbol:"
    if grep -qx "vrdma_rdmacm_$symbol" "$work/defined"; then
      echo "  jmp vrdma_rdmacm_$symbol@PLT"
    else
      echo "  leaq .Lname_$symbol(%rip), %rdi"
      echo "  jmp vrdma_rdmacm_unserved@PLT"
    fi
  done <"$work/cm-system"
  echo ".section .rodata"
  while read -r _ symbol; do
    grep -qx "vrdma_rdmacm_$symbol" "$work/defined" || echo ".Lname_$symbol: .asciz \"$symbol\""
  done <"$work/cm-system"
  echo '.section .note.GNU-stack,"",@progbits'
} >"$work/rdmacm.s"
awk '{ print $2 }' "$work/cm-system" | sort -u >"$work/cm-all"
version_script "$work/cm-system" "$work/cm-nodes" "$work/cm-all" >"$work/librdmacm.map"
cc -shared -o "$out/librdmacm.so.1.tmp" -Wl,-soname,librdmacm.so.1 \
  -Wl,--version-script="$work/librdmacm.map" -Wl,-z,now "$work/rdmacm.s" \
  -L"$out" -l:libibverbs.so.1
mv "$out/librdmacm.so.1.tmp" "$out/librdmacm.so.1"
served=$(awk '{ print $2 }' "$work/cm-system" | sed 's/^/vrdma_rdmacm_/' | sort | comm -12 - "$work/defined" | wc -l)
log "librdmacm.so.1: $served of $(wc -l <"$work/cm-system") functions served, the rest fail with ENOSYS"
echo "$out"
