#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests and laptops: root, no systemd.
#
#   eval "$(bash tools/slurm_cluster.sh up)"   # install if missing, start munged/slurmctld/slurmd, wait for an
#                                              # idle node; prints 'export SLURM_CONF=...' on stdout (logs on stderr)
#   bash tools/slurm_cluster.sh status         # exit 0 when the cluster answers and the node is usable
#   bash tools/slurm_cluster.sh down           # stop the daemons this script started (by their PIDs)
#
# Idempotent: 'up' on a running cluster only prints the export line; 'down' on a stopped one does nothing.
# Debian/Ubuntu: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge (Debian 12: slurm-wlm
# 22.05.8, munge 0.5.15) when a binary is missing. Everything SLURM writes (config, state, spool, logs, PID files)
# lives under $TSYNC_SLURM_DIR (default /tmp/tsync-slurm). munged uses its default socket /run/munge/munge.socket.2
# (what auth/munge expects) and runs as the munge user; it is stopped by 'down' only if this script started it.
#
# The cluster: one node named $(hostname -s) (NodeAddr 127.0.0.1) with CPUs=$(nproc) and ~80% of MemTotal, one
# partition 'debug' (default, no time limit), no accounting (sacct does not work: use 'sbatch --wait' or
# 'scontrol show job'), proctrack/linuxproc, task/none, KillWait=10 s.
set -euo pipefail

BASE=${TSYNC_SLURM_DIR:-/tmp/tsync-slurm}
CONF=$BASE/etc/slurm.conf
HOST=$(hostname -s)

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() { [ -f "$BASE/$1.pid" ] && kill -0 "$(cat "$BASE/$1.pid")" 2>/dev/null; }

node_state() { SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true; }

install_pkgs() {
  if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null \
     && [ -x /usr/sbin/munged ]; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "SLURM is not installed and installing it needs root"
  command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get to install it"
  log "installing slurmctld slurmd slurm-client munge (apt, --no-install-recommends)"
  export DEBIAN_FRONTEND=noninteractive
  # the packages' postinst 'start' is refused without systemd / by policy-rc.d: harmless, we start the daemons
  apt-get update -q >/dev/null || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || die "apt-get install slurmctld slurmd slurm-client munge failed"
}

write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  # RealMemory above what slurmd detects drains the node ("Low RealMemory"): ~80% of MemTotal
  mem_mb=$(awk '/MemTotal/ {printf "%d", $2/1024*0.8}' /proc/meminfo)
  mkdir -p "$BASE"/{etc,state,spool,log,run}
  cat >"$CONF.tmp" <<EOF
# written by tools/slurm_cluster.sh
ClusterName=tsync
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=${TSYNC_SLURMCTLD_PORT:-6817}
SlurmdPort=${TSYNC_SLURMD_PORT:-6818}
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
  : >"$BASE/etc/cgroup.conf"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return  # someone's munged (ours from an earlier 'up', or the system's) already answers
  fi
  install -d -o munge -g munge -m 0700 /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    runuser -u munge -- /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged  # daemonizes; writes /run/munge/munged.pid
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$BASE/munged.pid"
}

start_slurm() {
  export SLURM_CONF=$CONF
  if ! alive slurmctld; then
    # -D: foreground, so $! is the daemon; -i: ignore state left by an earlier cluster
    setsid /usr/sbin/slurmctld -D -i -f "$CONF" >"$BASE/log/slurmctld.out" 2>&1 </dev/null &
    echo $! >"$BASE/slurmctld.pid"
  fi
  for _ in $(seq 150); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
  scontrol ping 2>/dev/null | grep -q UP || { tail -n 30 "$BASE/log/slurmctld.log" >&2 || true; die "slurmctld is not up"; }
  if ! alive slurmd; then
    setsid /usr/sbin/slurmd -D -f "$CONF" >"$BASE/log/slurmd.out" 2>&1 </dev/null &
    echo $! >"$BASE/slurmd.pid"
  fi
  local st=
  for _ in $(seq 150); do
    st=$(node_state)
    case $st in idle|mixed|allocated) break ;; esac
    sleep 0.2
  done
  case $st in
    idle|mixed|allocated) ;;
    *) sinfo -N -l >&2 || true; tail -n 30 "$BASE"/log/*.log >&2 || true; die "node not usable (state '$st')" ;;
  esac
  log "cluster up: $(sinfo -h -N -o '%N %T cpus=%c mem=%mMB')"
}

up() {
  local t0 t1 t2
  if alive slurmctld && alive slurmd && [ -f "$CONF" ] && SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP; then
    case $(node_state) in
      idle|mixed|allocated) log "already up ($BASE)"; echo "export SLURM_CONF=$CONF"; return ;;
    esac
  fi
  t0=$(date +%s.%N)
  install_pkgs
  t1=$(date +%s.%N)
  [ "$(id -u)" = 0 ] || die "starting munged/slurmctld/slurmd this way needs root"
  alive slurmctld || alive slurmd || write_conf
  start_munge
  start_slurm
  t2=$(date +%s.%N)
  log "$(awk -v a="$t0" -v b="$t1" -v c="$t2" 'BEGIN{printf "install %.1fs, daemons-to-idle %.1fs", b-a, c-b}')"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local d f pid
  for d in slurmd slurmctld munged; do
    f=$BASE/$d.pid
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
      log "stopped $d ($pid)"
    fi
    rm -f "$f"
  done
}

status() {
  [ -f "$CONF" ] || { echo "no cluster config at $CONF"; return 1; }
  SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP || { echo "slurmctld not answering"; return 1; }
  echo "SLURM_CONF=$CONF node: $(SLURM_CONF=$CONF sinfo -h -N -o '%N %T')"
  case $(node_state) in idle|mixed|allocated) return 0 ;; *) return 1 ;; esac
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status   (state under \$TSYNC_SLURM_DIR, default /tmp/tsync-slurm)" >&2; exit 2 ;;
esac
