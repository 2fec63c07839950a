#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests and laptops: root, no systemd.
#
#   eval "$(bash tools/slurm_cluster.sh up)"   # install if missing, start munged/slurmctld/slurmd, wait for an
#                                              # idle node; prints 'export SLURM_CONF=...' on stdout (logs on stderr)
#   bash tools/slurm_cluster.sh status         # exit 0 when the cluster answers and the node is usable
#   bash tools/slurm_cluster.sh down           # stop the daemons this script started (by their PIDs)
#   TSYNC_SLURM_DIR=/tmp/tsync-slurm-2n TSYNC_SLURMCTLD_PORT=6837 TSYNC_SLURMD_PORT=6838 \
#     bash tools/slurm_cluster.sh up --nodes 2 # a 2-node cluster on this machine: nodes tsn1, tsn2 on 127.0.0.2,
#                                              # 127.0.0.3 (slurmd port +i each), every slurmd in its own UTS
#                                              # namespace (unshare --uts; hostname = node name), names in /etc/hosts
#   TSYNC_SLURMD_NICE=-5 bash tools/slurm_cluster.sh up   # munged, slurmctld and slurmd (and so every job:
#                                              # PropagatePrioProcess=0, tasks take slurmd's nice value) at that
#                                              # nice value; the tests use -5: their jobs are timed by SLURM's clocks
#                                              # beside CPU-bound tests
#
# Idempotent: 'up' on a running cluster only prints the export line; 'down' on a stopped one does nothing.
# Debian/Ubuntu: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge (Debian 12: slurm-wlm
# 22.05.8, munge 0.5.15) when a binary is missing. Everything SLURM writes (config, state, spool, logs, PID files)
# lives under $TSYNC_SLURM_DIR (default /tmp/tsync-slurm). munged uses its default socket /run/munge/munge.socket.2
# (what auth/munge expects) and runs as the munge user; it is stopped by 'down' only if this script started it.
#
# The cluster: one node named $(hostname -s) (NodeAddr 127.0.0.1) with CPUs=$(nproc) and ~80% of MemTotal, one
# partition 'debug' (default, no time limit), no accounting (sacct does not work: use 'sbatch --wait' or
# 'scontrol show job'), proctrack/linuxproc, task/none, KillWait=30 s (SIGTERM → SIGKILL, as on most clusters), cred_expire=30 s (a
# requeued job is held for cred_expire + 1 s; default 120 s), and a scheduler pass every 2 s, a backfill pass every
# 1 s (SLURM's defaults 60 s / 30 s: a job that becomes eligible without an event, e.g. a requeued one whose hold
# ended, waits for the next pass; $TSYNC_SLURM_SCHED_PARAMS replaces the SchedulerParameters). Not configurable:
# slurmctld enforces time limits every 30 s (PERIODIC_TIMEOUT, compiled in), so a job ends 0-30 s after its limit.
# TSYNC_SLURM_NODE_CPUS=N (N above the cores): N CPU slots per node (SlurmdParameters=config_overrides), more one-CPU
# jobs side by side than there are cores (the tests use 4: their jobs mostly wait).
set -euo pipefail

BASE=${TSYNC_SLURM_DIR:-/tmp/tsync-slurm}
CONF=$BASE/etc/slurm.conf
HOST=$(hostname -s)
NNODES=$(cat "$BASE/nodes" 2>/dev/null || echo 1)  # of the cluster written last ('up --nodes N' sets it)
SLURMD_PORT=${TSYNC_SLURMD_PORT:-6818}
SLURMD_NICE=${TSYNC_SLURMD_NICE:-0}

# node i (1-based): its name and address ("$HOST 127.0.0.1" for a 1-node cluster)
node_name() { if [ "$NNODES" = 1 ]; then echo "$HOST"; else echo "tsn$1"; fi; }
node_addr() { if [ "$NNODES" = 1 ]; then echo 127.0.0.1; else echo "127.0.0.$(( $1 + 1 ))"; fi; }
[ -f "$BASE/slurmd.pid" ] && [ ! -f "$BASE/slurmd-1.pid" ] && mv "$BASE/slurmd.pid" "$BASE/slurmd-1.pid"  # older layout
usable() { [[ $1 =~ ^((idle|mixed|allocated),?)+$ ]]; }
slurmd_alive() { local i; for i in $(seq "$NNODES"); do alive "slurmd-$i" || return 1; done; }

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() { [ -f "$BASE/$1.pid" ] && kill -0 "$(cat "$BASE/$1.pid")" 2>/dev/null; }

# 'idle' etc. when every node is in that state, else the states seen
node_state() { SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | sort -u | paste -sd, || true; }

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
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # GNU nproc caps itself at OMP_NUM_THREADS (tools/test.sh sets 1)
  # TSYNC_SLURM_NODE_CPUS: CPU slots per node above the machine's (slurmd told to trust slurm.conf: config_overrides),
  # so more one-CPU jobs run side by side than there are cores (the tests' jobs mostly wait)
  local over=
  if [ -n "${TSYNC_SLURM_NODE_CPUS:-}" ] && [ "${TSYNC_SLURM_NODE_CPUS}" -gt "$cpus" ]; then
    cpus=$TSYNC_SLURM_NODE_CPUS over=1
  fi
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
SlurmdPort=${SLURMD_PORT}
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
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
# a requeued job's hold (cred_expire + 1 s) ends without an event: it starts at the next pass (defaults 60 s / 30 s)
SchedulerParameters=${TSYNC_SLURM_SCHED_PARAMS:-sched_interval=2,bf_interval=1}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=${TSYNC_SLURM_KILLWAIT:-30}
# a requeued batch job may start again once its credential expired (default 120 s)
AuthInfo=cred_expire=${TSYNC_SLURM_CRED_EXPIRE:-30}
MinJobAge=300
EOF
  if [ -n "$over" ]; then echo "SlurmdParameters=config_overrides" >>"$CONF.tmp"; fi
  local i names=()
  for i in $(seq "$NNODES"); do
    names+=("$(node_name "$i")")
    mkdir -p "$BASE/spool/$(node_name "$i")"
    if [ "$NNODES" = 1 ]; then
      echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN"
    else  # every node reports this machine's CPUs and memory: configured alike, shared
      echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") Port=$((SLURMD_PORT + i)) CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN"
    fi
  done >>"$CONF.tmp"
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$CONF.tmp"
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
  nice -n "$SLURMD_NICE" runuser -u munge -- /usr/sbin/munged  # daemonizes; writes /run/munge/munged.pid
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$BASE/munged.pid"
}

start_slurm() {
  export SLURM_CONF=$CONF
  if ! alive slurmctld; then
    # -D: foreground, so $! is the daemon; -i: ignore state left by an earlier cluster
    setsid nice -n "$SLURMD_NICE" /usr/sbin/slurmctld -D -i -f "$CONF" >"$BASE/log/slurmctld.out" 2>&1 </dev/null &
    echo $! >"$BASE/slurmctld.pid"
  fi
  for _ in $(seq 150); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
  scontrol ping 2>/dev/null | grep -q UP || { tail -n 30 "$BASE/log/slurmctld.log" >&2 || true; die "slurmctld is not up"; }
  local i n
  for i in $(seq "$NNODES"); do
    alive "slurmd-$i" && continue
    n=$(node_name "$i")
    if [ "$NNODES" = 1 ]; then
      setsid nice -n "$SLURMD_NICE" /usr/sbin/slurmd -D -f "$CONF" >"$BASE/log/slurmd.out" 2>&1 </dev/null &
    else  # its own UTS namespace: the node's processes see `hostname` = the node name
      setsid nice -n "$SLURMD_NICE" unshare --uts sh -c 'hostname "$1" && exec /usr/sbin/slurmd -D -N "$1" -f "$2"' sh "$n" "$CONF" \
        >"$BASE/log/slurmd-$n.out" 2>&1 </dev/null &
    fi
    echo $! >"$BASE/slurmd-$i.pid"
  done
  local st=
  for _ in $(seq 150); do
    st=$(node_state)
    usable "$st" && break
    sleep 0.2
  done
  usable "$st" || { sinfo -N -l >&2 || true; tail -n 30 "$BASE"/log/*.log >&2 || true; die "node(s) not usable (state '$st')"; }
  log "cluster up: $(sinfo -h -N -o '%N %T cpus=%c mem=%mMB')"
}

# names of a multi-node cluster resolve to their loopback addresses (the job's tcp endpoint, torchrun's master)
hosts_add() {
  [ "$NNODES" -gt 1 ] || return 0
  local i line
  for i in $(seq "$NNODES"); do
    line="$(node_addr "$i") $(node_name "$i") # tsync-slurm"
    grep -qxF "$line" /etc/hosts || echo "$line" >>/etc/hosts
  done
}
hosts_remove() {
  [ "$NNODES" -gt 1 ] || return 0
  local i tmp
  tmp=$(mktemp)
  cp /etc/hosts "$tmp"
  for i in $(seq "$NNODES"); do
    grep -vxF "$(node_addr "$i") $(node_name "$i") # tsync-slurm" "$tmp" >"$tmp.n" || true
    mv "$tmp.n" "$tmp"
  done
  cat "$tmp" >/etc/hosts  # in place: /etc/hosts may be a bind mount
  rm -f "$tmp"
}

up() {
  local t0 t1 t2 want=${1:-1}
  if [ "$want" != "$NNODES" ] && { alive slurmctld || slurmd_alive; }; then
    die "a $NNODES-node cluster runs at $BASE: 'down' it first, or use another TSYNC_SLURM_DIR for $want nodes"
  fi
  NNODES=$want
  if alive slurmctld && slurmd_alive && [ -f "$CONF" ] && SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP; then
    if usable "$(node_state)"; then log "already up ($BASE)"; echo "export SLURM_CONF=$CONF"; return; fi
  fi
  t0=$(date +%s.%N)
  install_pkgs
  t1=$(date +%s.%N)
  [ "$(id -u)" = 0 ] || die "starting munged/slurmctld/slurmd this way needs root"
  if ! alive slurmctld && ! slurmd_alive; then
    mkdir -p "$BASE"
    echo "$NNODES" >"$BASE/nodes"
    write_conf
  fi
  hosts_add
  start_munge
  start_slurm
  t2=$(date +%s.%N)
  log "$(awk -v a="$t0" -v b="$t1" -v c="$t2" 'BEGIN{printf "install %.1fs, daemons-to-idle %.1fs", b-a, c-b}')"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local d f pid
  for d in $(for i in $(seq "$NNODES"); do echo "slurmd-$i"; done) slurmd slurmctld munged; do
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
  hosts_remove
}

status() {
  [ -f "$CONF" ] || { echo "no cluster config at $CONF"; return 1; }
  SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP || { echo "slurmctld not answering"; return 1; }
  echo "SLURM_CONF=$CONF node: $(SLURM_CONF=$CONF sinfo -h -N -o '%N %T')"
  usable "$(node_state)"
}

case "${1:-}" in
  up)
    if [ "${2:-}" = --nodes ]; then
      [[ ${3:-} =~ ^[1-9]$ ]] || die "up --nodes N: N is 1..9 (got '${3:-}')"
      up "$3"
    else
      up 1
    fi ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up [--nodes N]|down|status   (state under \$TSYNC_SLURM_DIR, default /tmp/tsync-slurm)" >&2; exit 2 ;;
esac
