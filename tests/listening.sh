# shellcheck shell=bash
# Sourced by the test scripts.
# wait_until_listening PORT [SECONDS] returns once a TCP socket
# listens on PORT (at most SECONDS, 60 by default; 1 if none did). ibv_*_pingpong and perftest
# servers say they are ready before they listen: a client started on that word alone may find
# no listener. Reads /proc/net/tcp{,6} in bash alone: in an emulated guest every process
# started costs seconds.
wait_until_listening() {
  local port hex line file tries never
  port=$1
  printf -v hex ':%04X ' "$port"
  exec {never}<> <(:) # never ready: `read -t` on it waits without starting a process
  for ((tries = 0; tries < ${2:-60} * 10; tries++)); do
    for file in /proc/net/tcp /proc/net/tcp6; do
      [ -r "$file" ] || continue
      while read -r line; do
        # Fields: sl local_address rem_address st ...; 0A is LISTEN.
        [[ $line == *"$hex"*" 0A "* ]] && { exec {never}<&-; return 0; }
      done <"$file"
    done
    read -rt 0.1 -u "$never" || true
  done
  exec {never}<&-
  echo "wait_until_listening: nothing listens on port $port" >&2
  return 1
}

# wait_until_cm_listening PORT [SECONDS] returns once an rdma_cm id of this host (a native
# program's, or a vrdma backend's for its guest) listens on PORT (at most SECONDS, 60 by
# default; 1 if none did): rdma_cm ports are not TCP ports, `rdma resource` lists the ids.
wait_until_cm_listening() {
  local tries
  for ((tries = 0; tries < ${2:-60} * 2; tries++)); do
    grep -q "state LISTEN .* src-addr [0-9.]*:$1 " <<<"$(rdma resource show cm_id)" && return 0
    sleep 0.5
  done
  echo "wait_until_cm_listening: no rdma_cm id listens on port $1" >&2
  return 1
}
