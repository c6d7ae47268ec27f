#!/bin/bash
# A private single-node Slurm (Debian 12's slurm-wlm 22.05 + munge) on this machine, for the Slurm
# tests and for trying the slurm/*.sbatch scripts by hand. Runs as root, no systemd, no cgroups;
# everything (config, munge key and socket, state, logs) lives in one directory; /etc/slurm and
# any system munged are left alone. Daemons listen on 127.0.0.1 only, on free ports.
#
#   tests/slurm/local_slurm.sh start DIR    # install slurm-wlm + munge if missing, write DIR/slurm.conf,
#                                           # start munged, slurmctld, slurmd; wait until the node is idle
#   export SLURM_CONF=DIR/slurm.conf        # every client command (sbatch, squeue, scontrol, ...) needs it
#   tests/slurm/local_slurm.sh stop DIR     # scancel our jobs, then stop exactly the daemons we started
#   tests/slurm/local_slurm.sh status DIR
#
# The harness (run_slurm_tests.sh) sources this file and calls the same functions.
# Knobs: SLURM_LOCAL_CRED_EXPIRE (10 s; also how long a requeued job waits before it may run again,
# 120 s by default in Slurm), SLURM_LOCAL_QUIET=1 (less output).

slurm_local_say() { [ "${SLURM_LOCAL_QUIET:-0}" = 1 ] || echo "$@"; }

# Installs slurm-wlm and munge with apt-get when a daemon is missing (root only).
slurm_local_install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
      && command -v mungekey >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "slurm-wlm/munge missing; install them with: sudo apt-get install -y slurm-wlm munge" >&2
    return 1
  fi
  echo "→ installing slurm-wlm munge (apt-get)"
  local log; log=$(mktemp)
  # Debian's policy-rc.d keeps the postinst scripts from starting any daemon.
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >"$log" 2>&1; then
    tail -20 "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

# A TCP port on 127.0.0.1 that nothing listens on, from a random start; $1 = a port to avoid.
slurm_local_free_port() {
  local p=$((20000 + RANDOM % 30000))
  for _ in $(seq 200); do
    if [ "$p" != "${1:-}" ] && ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
    p=$((p + 1))
  done
  return 1
}

# The slurm.conf lines every test Slurm shares (this one and tests/cluster's): no cgroups, no
# accounting, core scheduling with quick passes, PMIx, requeue. $1: the state folder.
slurm_local_common_conf() {
  local d=$1
  cat <<CONF
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the defaults (60 s, 30 s) let an eligible or requeued job wait up to a minute for a scheduler pass
SchedulerParameters=sched_interval=2,bf_interval=1
# Debian's Open MPI speaks PMIx only (no PMI-1/PMI-2): a plain srun must use pmix
MpiDefault=pmix
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$d/log/jobcomp.log
MinJobAge=600
KillWait=10
OverTimeLimit=0
InactiveLimit=0
ReturnToService=2
SlurmdTimeout=60
SlurmctldTimeout=60
MailProg=/bin/true
JobRequeue=1
CONF
}

# Writes $1/slurm.conf for this machine.
slurm_local_write_conf() {
  local d=$1 host line cpus sockets cores threads mem ctld_port slurmd_port
  host=$(hostname -s)
  line=$(slurmd -C | head -1)
  field() { sed -n "s/.*$1=\([0-9]*\).*/\1/p" <<<"$line"; }
  cpus=$(field CPUs); sockets=$(field SocketsPerBoard); cores=$(field CoresPerSocket)
  threads=$(field ThreadsPerCore); mem=$(field RealMemory)
  [ "$cpus" = "$(nproc --all)" ] || slurm_local_say "note: slurmd -C reports CPUs=$cpus, nproc --all $(nproc --all)"
  # RealMemory above the real memory would drain the node ("Low RealMemory"): stay at 95 %.
  mem=$((mem * 95 / 100))
  ctld_port=$(slurm_local_free_port) && slurmd_port=$(slurm_local_free_port "$ctld_port") || return 1
  cat >"$d/slurm.conf" <<CONF
# Written by tests/slurm/local_slurm.sh: one node ($host), loopback only, no cgroups, no accounting.
ClusterName=shardtrain-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
# bind to the node's address (127.0.0.1) instead of INADDR_ANY
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$d/munge/munge.socket.2,cred_expire=${SLURM_LOCAL_CRED_EXPIRE:-10}
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
# also the base of PMIx's per-step directories (spmix_appdir_<uid>_<job>.<step>): job ids restart
# at 1 in every fresh state directory, so a leftover of an earlier instance in /tmp would fail the
# step launch ("pmixp_mkdir: Cannot create directory ... File exists")
TmpFS=$d/tmp
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
$(slurm_local_common_conf "$d")
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

# Starts munged, slurmctld and slurmd with state in $1; returns when the node is idle.
slurm_local_start() {
  local d=$1 sock st host
  [ "$(id -u)" = 0 ] || { echo "local_slurm.sh: needs root (SlurmUser=root, munged as the munge user)" >&2; return 1; }
  slurm_local_install || return 1
  host=$(hostname -s)
  mkdir -p "$d"/{state,spool,log,munge,tmp} || return 1
  chmod 0755 "$d"                       # the munge user must reach its socket directory
  chown munge:munge "$d/munge"; chmod 0711 "$d/munge"
  runuser -u munge -- test -w "$d/munge" || { echo "the munge user cannot reach $d/munge (a parent directory closed to others?)" >&2; return 1; }
  slurm_local_write_conf "$d" || return 1
  export SLURM_CONF=$d/slurm.conf
  sock=$d/munge/munge.socket.2
  # A private key and socket keep us off any system munged. munged refuses to run as root.
  runuser -u munge -- mungekey --create --keyfile="$d/munge/munge.key" || return 1
  runuser -u munge -- munged --socket="$sock" --key-file="$d/munge/munge.key" --pid-file="$d/munge/munged.pid" \
      --log-file="$d/munge/munged.log" --seed-file="$d/munge/munged.seed" || return 1
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
  munge -S "$sock" -n | unmunge -S "$sock" >/dev/null || { echo "munge does not work; see $d/munge/munged.log" >&2; return 1; }
  slurmctld -f "$SLURM_CONF" -c || return 1      # -c: clean state, no jobs from an earlier run
  slurmd -f "$SLURM_CONF" -N "$host" || return 1
  for _ in $(seq 300); do
    st=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    [ "$st" = idle ] && return 0
    sleep 0.1
  done
  echo "node $host not idle after 30 s (state '$st'); see $d/log" >&2
  return 1
}

# Kills exactly the PID in pidfile $1 (TERM, then KILL after 10 s).
slurm_local_kill_pidfile() {
  [ -f "$1" ] || return 0
  local p; p=$(cat "$1")
  if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then echo "$2 ($p) still alive after 10 s: SIGKILL" >&2; kill -KILL "$p" 2>/dev/null; fi
  fi
  rm -f "$1"
}

# The process tree under PID $1, deepest first.
slurm_local_tree() {
  local c
  for c in $(pgrep -P "$1"); do slurm_local_tree "$c"; done
  echo "$1"
}

# SIGKILLs the slurmstepd processes of this instance (their environment carries our SLURM_CONF,
# inherited from slurmd) and everything under them: the last resort when a job would not end.
slurm_local_kill_steps() {
  local d=$1 p pids=""
  for p in $(pgrep -x slurmstepd); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_CONF=$d/slurm.conf"; then
      pids="$pids $(slurm_local_tree "$p" | tr '\n' ' ')"
    fi
  done
  [ -n "${pids// /}" ] || return 0
  echo "killing leftover job processes of $d:$pids" >&2
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}

# Cancels every job of this private cluster (stopping slurmd does not kill jobs), then stops the
# daemons; job processes that outlive all that are killed.
slurm_local_stop() {
  local d=$1 ids i conf=$1/slurm.conf
  if [ -f "$d/slurmctld.pid" ] && kill -0 "$(cat "$d/slurmctld.pid")" 2>/dev/null; then
    ids=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      SLURM_CONF=$conf scancel $ids 2>/dev/null || true
      for i in $(seq 300); do
        ids=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
        [ -n "$ids" ] || break
        # again every 5 s: a job may have been requeued meanwhile
        # shellcheck disable=SC2086
        [ $((i % 50)) != 0 ] || SLURM_CONF=$conf scancel $ids 2>/dev/null || true
        sleep 0.1
      done
      ids=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
      if [ -n "$ids" ]; then
        echo "jobs still in the queue 30 s after scancel: $(SLURM_CONF=$conf squeue -h -o '%i %T %r' | tr '\n' ';')" >&2
        slurm_local_kill_steps "$d"
      fi
    fi
  fi
  slurm_local_kill_pidfile "$d/slurmd.pid" slurmd
  slurm_local_kill_pidfile "$d/slurmctld.pid" slurmctld
  slurm_local_kill_pidfile "$d/munge/munged.pid" munged
  slurm_local_kill_steps "$d"
}

slurm_local_status() {
  local d=$1 f p
  for f in "$d/munge/munged.pid" "$d/slurmctld.pid" "$d/slurmd.pid"; do
    if [ -f "$f" ]; then
      p=$(cat "$f"); if kill -0 "$p" 2>/dev/null; then echo "$(basename "$f" .pid) pid $p running"; else echo "$(basename "$f" .pid) pid $p DEAD"; fi
    else
      echo "$(basename "$f" .pid) not started"
    fi
  done
  SLURM_CONF=$d/slurm.conf sinfo 2>&1 || true
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  [ $# = 2 ] || { echo "usage: $0 start|stop|status DIR" >&2; exit 2; }
  dir=$(mkdir -p "$2" && cd "$2" && pwd) || exit 1
  case "$1" in
    start) slurm_local_start "$dir" && echo "Slurm up; export SLURM_CONF=$dir/slurm.conf" ;;
    stop) slurm_local_stop "$dir" && echo "Slurm stopped ($dir kept)" ;;
    status) slurm_local_status "$dir" ;;
    *) echo "usage: $0 start|stop|status DIR" >&2; exit 2 ;;
  esac
fi
