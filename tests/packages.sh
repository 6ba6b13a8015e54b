#!/usr/bin/env bash
# The Debian packages (packaging/build-debs.sh): built from the workspace, they hold what they
# should, their maintainer scripts parse, their Depends name the packages of every shared
# library their programs need, and apt resolves their dependencies on this system
# (apt-get --simulate: nothing is installed). They package the debug build the other tests
# run (build-debs.sh --debug): the release build is the demo's.
# usage: tests/packages.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$repo/target/debug/debs # beside the build they hold (target/debs: the release packages)
rm -rf "$out"
mapfile -t debs < <("$repo/packaging/build-debs.sh" --debug "$out")
[ ${#debs[@]} -eq 2 ] || { echo "packages: expected 2 packages, got: ${debs[*]}" >&2; exit 1; }
fail() { echo "packages: $*" >&2; exit 1; }
version=$(awk -F'"' '/^version/ { print $2; exit }' "$repo/Cargo.toml")
# Each package's files, and its conffiles.
expect() { # DEB FILE...
  local deb=$1 listing
  shift
  listing=$(dpkg-deb --contents "$deb" | awk '{print $NF}')
  for file in "$@"; do
    grep -qx "\./${file#/}" <<<"$listing" || fail "$(basename "$deb") lacks $file"
  done
}
backend=$(printf '%s\n' "${debs[@]}" | grep /vrdma-backend_)
guest=$(printf '%s\n' "${debs[@]}" | grep /vrdma-guest_)
expect "$backend" /usr/bin/vhost-user-rdma /usr/bin/vrdmactl \
  /lib/systemd/system/vrdma-backend.service /usr/lib/sysusers.d/vrdma-backend.conf \
  /usr/lib/tmpfiles.d/vrdma-backend.conf \
  /etc/vrdma/guests.toml /etc/default/vrdma-backend /usr/share/doc/vrdma-backend/README.md \
  /usr/share/doc/vrdma-backend/docs/operating.md \
  /usr/share/doc/vrdma-backend/examples/vrdma-vm.xml
expect "$guest" /usr/lib/vrdma/libibverbs.so.1 /usr/lib/vrdma/librdmacm.so.1 /usr/lib/vrdma/vrdma-run /usr/bin/vrdma-run \
  /usr/sbin/vrdmad /lib/systemd/system/vrdmad.service /usr/lib/sysusers.d/vrdma.conf \
  /usr/share/doc/vrdma-guest/README.md /usr/share/doc/vrdma-guest/docs/vm.md \
  /usr/lib/udev/rules.d/60-vrdma.rules /usr/lib/modules-load.d/vrdma-pin.conf \
  "/usr/src/vrdma-pin-$version/vrdma_pin.c" "/usr/src/vrdma-pin-$version/dkms.conf"
[ "$(dpkg-deb -f "$guest" Recommends)" = "dkms, linux-headers-amd64" ] ||
  fail "vrdma-guest does not recommend DKMS and the headers the pinning module is built with"
conffiles=$(dpkg-deb --ctrl-tarfile "$backend" | tar -xO ./conffiles)
[ "$conffiles" = $'/etc/default/vrdma-backend\n/etc/vrdma/guests.toml' ] ||
  [ "$conffiles" = $'/etc/vrdma/guests.toml\n/etc/default/vrdma-backend' ] ||
  fail "vrdma-backend's conffiles: $conffiles"
for deb in "${debs[@]}"; do
  for script in postinst prerm postrm; do
    dpkg-deb --ctrl-tarfile "$deb" | tar -xO "./$script" | sh -n ||
      fail "$(basename "$deb"): $script does not parse"
  done
done
# The default declarations (no guest) are what the backend accepts.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dpkg-deb --extract "$backend" "$work/root"
"$work/root/usr/bin/vhost-user-rdma" --help >/dev/null
# The packaged binary starts from the packaged configuration on the loopback device and
# serves (no guest yet), its management socket answering.
"$work/root/usr/bin/vhost-user-rdma" --config "$work/root/etc/vrdma/guests.toml" \
  --device loopback --admin-socket "$work/admin.sock" --seccomp kill 2>"$work/backend.log" &
backend_pid=$!
for _ in $(seq 100); do [ -S "$work/admin.sock" ] && break; sleep 0.1; done
listed=$("$work/root/usr/bin/vrdmactl" --socket "$work/admin.sock" list) ||
  { cat "$work/backend.log" >&2; fail "vrdmactl could not read the packaged backend"; }
kill "$backend_pid"
wait "$backend_pid" 2>/dev/null || true
grep -q "no guest is connected" <<<"$listed" || fail "vrdmactl list: $listed"
# Every shared library a packaged program or library needs comes from a package its Depends
# names (found by where this machine's dynamic linker finds it), or from the package itself.
depends_cover_libraries() { # DEB
  local deb=$1 root=$work/needs depends needed path owner libraries
  libraries=$(ldconfig -p | grep -F "$(uname -m | tr _ -)") # this machine's kind's only
  rm -rf "$root" && dpkg-deb --extract "$deb" "$root"
  depends=$(dpkg-deb -f "$deb" Depends | tr ',|' '\n\n' | awk '{ print $1 }')
  while read -r needed; do
    [ -n "$(find "$root" -name "$needed" -print -quit)" ] && continue
    path=$(awk -v lib="$needed" '$1 == lib && !found { print $NF; found = 1 }' <<<"$libraries")
    [ -n "$path" ] || fail "$(basename "$deb") needs $needed, which this machine does not have"
    owner=$(dpkg -S "$path" 2>/dev/null || dpkg -S "$(realpath "$path")" 2>/dev/null) ||
      fail "$(basename "$deb") needs $needed ($path), which no package owns"
    owner=${owner%%:*}
    grep -qx "$owner" <<<"$depends" ||
      fail "$(basename "$deb") needs $needed, from $owner, which its Depends does not name"
  done < <(find "$root" -type f -exec sh -c 'objdump -p "$1" 2>/dev/null' _ {} \; | awk '/NEEDED/ { print $2 }' | sort -u)
}
for deb in "${debs[@]}"; do depends_cover_libraries "$deb"; done
# Dependencies resolve (nothing is installed: --simulate).
apt-get install --simulate "${debs[@]}" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log" >&2; fail "apt-get cannot install the packages"; }
echo "packages: ${debs[*]##*/}: contents, scripts, the libraries their Depends cover, the packaged backend and apt's resolution checked"
