#!/bin/sh
# PID 1 of the soft-RoCE VM that scripts/softroce-vm.sh boots (busybox sh, from the initramfs).
#
# Loads the modules listed in /modules/order, mounts the host's root filesystem read-only over 9p
# at /mnt/root, sets up /proc, /sys, /dev, /dev/pts, /dev/shm, /tmp, /run, /var/tmp and the
# writable share of $REPO/target/softroce-out inside it, brings up eth0 and rxe0 with the host's
# iproute2, then runs $RUN/cmd.sh with the host's bash in a chroot there.
#
# Channels: ttyS0 is the console (kernel log and this script's diagnostics, a log file on the
# host); ttyS1 carries the command's stdout and stderr (the host's stdout); ttyS2 carries status
# lines for the host: `STAGE <name> [detail]`, `ERR <message>`, and last `RC=<exit status>`.
# Parameters come on the kernel command line: djinn.run=<dir holding cmd.sh> djinn.repo=<repo>
# djinn.addr=<IPv4/prefix> djinn.gw=<gateway>.
export PATH=/bin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/null >/dev/console 2>&1

STATUS=/dev/ttyS2
OUT=/dev/ttyS1
stty -F "$STATUS" raw -echo
stty -F "$OUT" raw -echo

say() { echo "$*" >"$STATUS"; echo "[init] $*"; }
finish() {
  sync
  say "RC=$1"
  # Let the UART drain before the machine goes away.
  sleep 0.2
  poweroff -f
  sleep 10
}
die() { say "ERR $*"; finish 125; }

RUN="" REPO="" ADDR=10.0.2.15/24 GW=10.0.2.2
for w in $(cat /proc/cmdline); do
  case "$w" in
    djinn.run=*) RUN=${w#*=} ;;
    djinn.repo=*) REPO=${w#*=} ;;
    djinn.addr=*) ADDR=${w#*=} ;;
    djinn.gw=*) GW=${w#*=} ;;
  esac
done
[ -n "$RUN" ] && [ -n "$REPO" ] || die "djinn.run= and djinn.repo= missing on the kernel command line"

say "STAGE modules"
while read -r m; do
  insmod "/modules/$m" || die "insmod $m failed"
done </modules/order

say "STAGE mount"
R=/mnt/root
P9="trans=virtio,version=9p2000.L,msize=524288"
mount -t 9p -o "$P9,cache=loose,ro" hostroot "$R" || die "mounting the host root over 9p failed"
mount -t proc proc "$R/proc" || die "mount $R/proc"
mount -t sysfs sysfs "$R/sys" || die "mount $R/sys"
mount -t devtmpfs devtmpfs "$R/dev" || die "mount $R/dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts "$R/dev/pts" || die "mount $R/dev/pts"
# The repository may itself live under one of the tmpfs mount points (a CI clone in /tmp):
# keep a handle on it first and put it back on top of the tmpfs.
mkdir -p /repo && mount -o bind "$R$REPO" /repo || die "bind mount of $REPO"
for d in /dev/shm /tmp /run /var/tmp; do
  mount -t tmpfs -o mode=1777 tmpfs "$R$d" || die "mount tmpfs on $R$d"
done
if [ ! -d "$R$REPO" ]; then
  mkdir -p "$R$REPO" && mount -o bind /repo "$R$REPO" || die "putting $REPO back over the tmpfs"
fi
mount -t 9p -o "$P9,cache=none" softroce_out "$R$REPO/target/softroce-out" ||
  die "mounting the writable share on $REPO/target/softroce-out failed"

say "STAGE network"
in_root() { chroot "$R" "$@"; }
in_root /usr/sbin/ip link set lo up || die "ip link set lo up"
in_root /usr/sbin/ip link set eth0 up || die "ip link set eth0 up"
in_root /usr/sbin/ip addr add "$ADDR" dev eth0 || die "ip addr add $ADDR dev eth0"
in_root /usr/sbin/ip route add default via "$GW" || die "ip route add default via $GW"

IP4=${ADDR%/*}
# The IPv4-mapped GID: ::ffff:a.b.c.d, as sysfs writes it (0000:...:ffff:0a00:020f).
MAPPED=$(echo "$IP4" | awk -F. '{ printf "ffff:%02x%02x:%02x%02x", $1, $2, $3, $4 }')
in_root /usr/bin/rdma link add rxe0 type rxe netdev eth0 || die "rdma link add rxe0 failed"
GIDX=""
i=0
while [ $i -lt 300 ]; do
  for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    case "$(cat "$g" 2>/dev/null)" in
      *"$MAPPED") GIDX=${g##*/}; break ;;
    esac
  done
  [ -n "$GIDX" ] && break
  sleep 0.1
  i=$((i + 1))
done
[ -n "$GIDX" ] || die "rxe0 has no IPv4-mapped GID for $IP4 after 30 s"
STATE=$(cat /sys/class/infiniband/rxe0/ports/1/state)
say "STAGE rxe0-up $IP4 gid_index=$GIDX state=$STATE"

say "STAGE run"
chroot "$R" /usr/bin/env -i \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root TERM=dumb LANG=C.UTF-8 \
  DJINN_RDMA_DEVICE=rxe0 DJINN_RDMA_ADDR="$IP4" DJINN_RDMA_GID_INDEX="$GIDX" \
  DJINN_SOFTROCE_VM=1 \
  /bin/bash "$RUN/cmd.sh" </dev/null >"$OUT" 2>&1
finish $?
