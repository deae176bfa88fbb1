# Sourced into the VM's cmd.sh by scripts/softroce-vm.sh --perftest (bash, in the repository root).
# perftest on rxe0, server and client in this VM, the client connecting to the VM's own address.
# Under TCG perftest's clock calibration sometimes fails and one side prints `inf`: both sides'
# reports are printed, take the other one.
set -u
GIDX=${DJINN_RDMA_GID_INDEX:-0}
rc=0
perf() {
  local name=$1; shift
  local log=/tmp/$name-server.log
  echo "=== $name $* (server and client on $DJINN_RDMA_DEVICE, client -> $DJINN_RDMA_ADDR, gid index $GIDX)"
  "$name" -d "$DJINN_RDMA_DEVICE" -x "$GIDX" "$@" >"$log" 2>&1 &
  local server=$! tries=0
  # The server listens on TCP port 18515 for the connection exchange; wait for it.
  until grep -q ':4853 ' /proc/net/tcp /proc/net/tcp6 2>/dev/null || ((tries++ >= 100)); do sleep 0.1; done
  echo "--- client"
  "$name" -d "$DJINN_RDMA_DEVICE" -x "$GIDX" "$@" "$DJINN_RDMA_ADDR" || rc=1
  wait "$server" || rc=1
  echo "--- server"
  cat "$log"
}
perf ib_write_lat -s 2 -n 5000
perf ib_write_bw -s 65536 -n 2000
exit $rc
