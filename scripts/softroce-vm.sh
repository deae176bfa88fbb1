#!/usr/bin/env bash
# Runs a command inside a qemu VM that has a working soft-RoCE device, rxe0, and returns its exit
# status. The host kernel has no RDMA; Debian's linux-image-amd64 ships rdma_rxe, so this boots
# that kernel under TCG (KVM does not work here) with a minimal initramfs (busybox-static and the
# modules, scripts/vm/init.sh as /init) that mounts the host's root filesystem read-only over 9p
# and chroots into it: every binary and library is used from where it is on the host.
#
#   scripts/softroce-vm.sh [--cpus N] [--mem MiB] [--timeout SECONDS] [--env NAME=VALUE]... -- COMMAND [ARGS...]
#   scripts/softroce-vm.sh [--cpus N] [--mem MiB] [--timeout SECONDS] --perftest
#
# In the VM COMMAND runs as root in the repository root (the same absolute path as on the host),
# with bash: one argument is a shell command line (`bash -c`), several are an argv run as given.
# Its environment: PATH, HOME=/root, DJINN_RDMA_DEVICE=rxe0, DJINN_RDMA_ADDR=<the VM's IPv4
# address>, DJINN_RDMA_GID_INDEX=<index of rxe0's IPv4-mapped GID>, DJINN_SOFTROCE_VM=1, every
# DJINN_* and RUST_* variable of the caller, and each --env. Its stdout and stderr come to this
# script's stdout; its exit status is this script's (124: the timeout struck; 125: the VM failed
# before the command ran, the console log is then printed on stderr).
#
# The host's files are read-only in the VM except $REPO/target/softroce-out/ (a writable share,
# created if missing and not emptied) and tmpfs on /tmp, /run, /var/tmp and /dev/shm.
# The initramfs is built into target/softroce/ and reused while its inputs stay the same.
# Progress goes to stderr, prefixed with [softroce-vm]. SOFTROCE_VM_KEEP=1 keeps the run folder
# (target/softroce/runs/*: cmd.sh, console.log, status); the last console log is always left at
# target/softroce/last-console.log.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
CACHE="$REPO/target/softroce"
OUTDIR="$REPO/target/softroce-out"
ADDR=10.0.2.15/24 # qemu user networking's default guest address
GW=10.0.2.2

log() { printf '[softroce-vm] %s\n' "$*" >&2; }
fail() { log "error: $*"; exit 125; }
usage() {
  sed -n '8,9p' "${BASH_SOURCE[0]}" | sed 's/^#  *//' >&2
  exit 2
}

CPUS=4 MEM=4096 TIMEOUT=900 PERFTEST=0
EXTRA_ENV=()
while (($#)); do
  case "$1" in
    --cpus) CPUS=${2:?}; shift 2 ;;
    --mem) MEM=${2:?}; shift 2 ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    --env) [[ "${2:-}" == [A-Za-z_]*=* ]] || usage; EXTRA_ENV+=("$2"); shift 2 ;;
    --perftest) PERFTEST=1; shift ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) log "unknown argument: $1"; usage ;;
  esac
done
[[ "$CPUS" =~ ^[0-9]+$ && "$MEM" =~ ^[0-9]+$ && "$TIMEOUT" =~ ^[0-9]+$ ]] || usage
if [ "$PERFTEST" = 1 ]; then
  (($# == 0)) || usage
else
  (($# > 0)) || usage
fi

# --- what the VM needs from the host ------------------------------------------------------------
for tool in qemu-system-x86_64 cpio modprobe; do
  command -v "$tool" >/dev/null || fail "$tool is missing: run scripts/setup.sh"
done
BUSYBOX=/bin/busybox
[ -x "$BUSYBOX" ] && ! ldd "$BUSYBOX" >/dev/null 2>&1 ||
  fail "$BUSYBOX is missing or not static: install busybox-static (scripts/setup.sh)"
# Debian's generic kernel (linux-image-amd64), not the cloud one (it lacks rdma_rxe) and not the
# running kernel (which has no RDMA): the newest /boot/vmlinuz-*-amd64 that has rdma_rxe.
KVER=""
for k in $(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V -r); do
  v=${k#/boot/vmlinuz-}
  if [[ "$v" != *cloud* ]] && modprobe -S "$v" -n -q rdma_rxe 2>/dev/null; then KVER=$v; break; fi
done
[ -n "$KVER" ] || fail "no /boot/vmlinuz-*-amd64 with rdma_rxe: install linux-image-amd64 (scripts/setup.sh)"
KERNEL=/boot/vmlinuz-$KVER
[ -r "$KERNEL" ] || fail "$KERNEL is not readable"
for f in /usr/sbin/ip /usr/bin/rdma /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so; do
  [ -e "$f" ] || fail "$f is missing: run scripts/setup.sh"
done

# --- the initramfs (cached) ---------------------------------------------------------------------
# rdma_rxe asks the crypto API for "crc32" when a link is added and there is no modprobe in the VM:
# crc32_generic goes first. rdma_ucm gives /dev/infiniband/rdma_cm.
MODULES=(crc32_generic rdma_rxe rdma_ucm virtio_pci virtio_net 9p 9pnet_virtio)
mapfile -t MODFILES < <(modprobe -S "$KVER" --show-depends -a "${MODULES[@]}" |
  awk '$1 == "insmod" && !seen[$2]++ { print $2 }')
((${#MODFILES[@]} >= ${#MODULES[@]})) || fail "modprobe -S $KVER --show-depends found too few modules"
INIT="$REPO/scripts/vm/init.sh"
INITRD="$CACHE/initramfs-$KVER.cpio"
KEY=$( {
  echo "softroce-vm initramfs v1 $KVER"
  printf '%s\n' "${MODULES[@]}"
  sha256sum "$BUSYBOX" "$INIT" "${MODFILES[@]}"
} | sha256sum | cut -d' ' -f1)
mkdir -p "$CACHE" "$OUTDIR"
if [ -s "$INITRD" ] && [ "$(cat "$INITRD.key" 2>/dev/null)" = "$KEY" ]; then
  log "initramfs up to date ($KVER)"
else
  log "building initramfs ($KVER, ${#MODFILES[@]} modules)"
  stage=$(mktemp -d "$CACHE/initramfs.XXXXXX")
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage"/{bin,dev,proc,sys,tmp,mnt/root,modules}
  cp "$BUSYBOX" "$stage/bin/busybox"
  ln -s busybox "$stage/bin/sh"
  install -m 0755 "$INIT" "$stage/init"
  for f in "${MODFILES[@]}"; do
    name=$(basename "$f")
    case "$name" in
      *.ko) cp "$f" "$stage/modules/$name" ;;
      *.ko.xz) name=${name%.xz}; xz -dc "$f" >"$stage/modules/$name" ;;
      *.ko.zst) name=${name%.zst}; zstd -qdc "$f" >"$stage/modules/$name" ;;
      *.ko.gz) name=${name%.gz}; gzip -dc "$f" >"$stage/modules/$name" ;;
      *) fail "unexpected module file $f" ;;
    esac
    echo "$name" >>"$stage/modules/order"
  done
  [ "$(id -u)" -ne 0 ] || mknod -m 600 "$stage/dev/console" c 5 1
  (cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$INITRD.tmp.$$"
  mv -f "$INITRD.tmp.$$" "$INITRD"
  echo "$KEY" >"$INITRD.key"
  rm -rf "$stage"
  trap - EXIT
fi

# --- the run ------------------------------------------------------------------------------------
mkdir -p "$CACHE/runs"
RUNDIR=$(mktemp -d "$CACHE/runs/run.XXXXXX")
QPID=""
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
  [ -f "$RUNDIR/console.log" ] && cp -f "$RUNDIR/console.log" "$CACHE/last-console.log" 2>/dev/null
  [ "${SOFTROCE_VM_KEEP:-0}" = 1 ] || rm -rf "$RUNDIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

{
  echo "# generated by scripts/softroce-vm.sh"
  while IFS='=' read -r name _; do
    case "$name" in
      DJINN_RDMA_DEVICE|DJINN_RDMA_ADDR|DJINN_RDMA_GID_INDEX|DJINN_SOFTROCE_VM) ;;
      DJINN_*|RUST_*) printf 'export %s=%q\n' "$name" "${!name}" ;;
    esac
  done < <(env | grep -E '^(DJINN|RUST)_[A-Za-z0-9_]*=' || true)
  for kv in "${EXTRA_ENV[@]}"; do printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"; done
  printf 'cd %q || exit 125\n' "$REPO"
  if [ "$PERFTEST" = 1 ]; then
    cat "$REPO/scripts/vm/perftest.sh"
  elif (($# == 1)); then
    printf 'exec /bin/bash -c %q\n' "$1"
  else
    printf 'exec'; printf ' %q' "$@"; printf '\n'
  fi
} >"$RUNDIR/cmd.sh"
: >"$RUNDIR/status"

if [ "$PERFTEST" = 1 ]; then WHAT="perftest (ib_write_lat, ib_write_bw)"; elif (($# == 1)); then WHAT=$1; else WHAT=$(printf '%q ' "$@"); WHAT=${WHAT% }; fi
log "booting ($KVER, $CPUS vCPUs, $MEM MiB, timeout ${TIMEOUT}s)"
START=$(date +%s.%N)
elapsed() { awk -v s="$START" -v n="$(date +%s.%N)" 'BEGIN { printf "%.1fs", n - s }'; }
boot() {
  : >"$RUNDIR/console.log"
  # ttyS0: the console, to a log; ttyS1: the command's output, to our stdout; ttyS2: status lines.
  timeout -k 5 "$TIMEOUT" qemu-system-x86_64 \
    -accel tcg,thread=multi -cpu max -smp "$CPUS" -m "$MEM" \
    -nodefaults -no-user-config -display none -no-reboot \
    -kernel "$KERNEL" -initrd "$INITRD" \
    -append "console=ttyS0 tsc=reliable quiet loglevel=4 panic=-1 djinn.run=$RUNDIR djinn.repo=$REPO djinn.addr=$ADDR djinn.gw=$GW" \
    -serial "file:$RUNDIR/console.log" \
    -chardev stdio,id=cmdout,signal=on -serial chardev:cmdout \
    -serial "file:$RUNDIR/status" \
    -netdev user,id=net0 -device virtio-net-pci,netdev=net0,romfile= \
    -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
    -fsdev local,id=out,path="$OUTDIR",security_model=none,multidevs=remap \
    -device virtio-9p-pci,fsdev=out,mount_tag=softroce_out \
    </dev/null &
  QPID=$!
}
# A boot reaches /init in about 5 s; once in a while a TCG boot hangs before that with nothing
# on the console. Such a boot is killed and started again (the command has not run yet).
BOOT_WAIT=90
for attempt in 1 2 3; do
  boot
  for ((i = 0; i < BOOT_WAIT * 5; i++)); do
    [ -s "$RUNDIR/status" ] || ! kill -0 "$QPID" 2>/dev/null && break
    sleep 0.2
  done
  [ -s "$RUNDIR/status" ] || ! kill -0 "$QPID" 2>/dev/null && break
  [ "$attempt" = 3 ] && break
  log "no sign of the kernel after ${BOOT_WAIT}s (a hung boot): booting again ($(elapsed))"
  kill "$QPID" 2>/dev/null || true
  wait "$QPID" 2>/dev/null || true
done

# Turn the status lines into progress on stderr while the VM runs.
( tail -n +1 -F -s 0.2 --pid="$QPID" "$RUNDIR/status" 2>/dev/null | while read -r kind rest; do
    rest=${rest%$'\r'}
    case "$kind" in
      STAGE)
        case "$rest" in
          modules) log "kernel up, loading modules ($(elapsed))" ;;
          mount) log "mounting the host root over 9p ($(elapsed))" ;;
          network) log "bringing up eth0 ($(elapsed))" ;;
          rxe0-up*) log "rxe0 up: ${rest#rxe0-up } ($(elapsed))" ;;
          run) log "running $WHAT ($(elapsed))" ;;
        esac ;;
      ERR) log "VM error: $rest" ;;
    esac
  done ) &
WATCH=$!

set +e
wait "$QPID"
QRC=$?
set -e
QPID=""
wait "$WATCH" 2>/dev/null || true
RC=$(tr -d '\r' <"$RUNDIR/status" | sed -n 's/^RC=\([0-9]*\)$/\1/p' | tail -n 1)
if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
  log "timed out after ${TIMEOUT}s; console log tail:"
  tail -n 30 "$RUNDIR/console.log" | tr -d '\r' >&2 || true
  exit 124
fi
if [ -z "$RC" ]; then
  log "the VM stopped (qemu exit $QRC) without returning a status; console log tail:"
  tail -n 40 "$RUNDIR/console.log" | tr -d '\r' >&2 || true
  exit 125
fi
if [ "$RC" = 125 ] && grep -q '^ERR' "$RUNDIR/status"; then
  log "console log tail:"
  tail -n 40 "$RUNDIR/console.log" | tr -d '\r' >&2 || true
fi
log "done: exit $RC after $(elapsed)"
exit "$RC"
