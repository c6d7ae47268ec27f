#!/bin/bash
# A private multi-host Slurm cluster on this one machine, made of Linux network namespaces: every
# host is a network namespace plus a UTS namespace with its own hostname (h1, h2, ...) and one
# address on a bridge that lives in a "switch" namespace; a head node "ctl" on the same bridge runs
# munged and slurmctld; every host runs its own slurmd. Nothing is added to the root namespace's
# network (no interface, no route, no address), /etc is left alone, and traffic between the hosts
# is real TCP over veth links, counted by each interface.
#
#   tests/cluster/netns_cluster.sh start DIR [HOSTS]   # 2 hosts by default (2-8); returns when all are idle
#   tests/cluster/netns_cluster.sh exec DIR HOST CMD.. # CMD on HOST (ctl, h1, ...) with SLURM_CONF set:
#                                                      #   ... exec DIR ctl sbatch -N2 slurm/train-multinode.sbatch
#   tests/cluster/netns_cluster.sh stop DIR            # cancel jobs, stop daemons, delete namespaces and links
#   tests/cluster/netns_cluster.sh status DIR
#
#              switch namespace <pfx>sw: bridge br0 (no address)
#        p-ctl /          p-h1 |          p-h2 \      (veth pairs; the other end is eth0 in each host)
#   ctl 10.77.0.254     h1 10.77.0.1      h2 10.77.0.2
#   munged, slurmctld   slurmd -N h1      slurmd -N h2
#
# Host names resolve through a hosts file of this cluster (DIR/hosts), bind-mounted over /etc/hosts
# in each command's private mount namespace (cluster_exec makes one per command): the role DNS has on
# a real cluster; the machine's /etc/hosts is untouched. munged's socket is a path on the shared file
# system, so the one munged serves every host (AF_UNIX path sockets do not belong to a network
# namespace). Slurm finds the hosts by NodeAddr, Open MPI by the addresses the ranks publish
# (OMPI_MCA_{btl,oob}_tcp_if_include=10.77.0.0/24 restricts it to the cluster network).
#
# run_cluster_tests.sh sources this file. Needs root, ip (iproute2), unshare, slurm-wlm and munge.

# The slurm.conf lines shared with the one-host test Slurm (slurm_local_common_conf).
. "$(dirname "${BASH_SOURCE[0]}")/../slurm/local_slurm.sh"

CLUSTER_NET=10.77.0          # the /24 of the cluster network; the namespaces keep it private
CLUSTER_CTL_ADDR=$CLUSTER_NET.254
CLUSTER_CPUS=4               # per host, as configured (SlurmdParameters=config_overrides); the hosts
                             # share this machine's cores, so this is a slot count, not hardware

# A host that stops answering is marked DOWN after this many seconds (Slurm's default: 300), and a
# requeued job of it may run again (the lost-host test waits for that)
CLUSTER_SLURMD_TIMEOUT=${CLUSTER_SLURMD_TIMEOUT:-20}

cluster_say() { [ "${CLUSTER_QUIET:-0}" = 1 ] || echo "$@"; }

# cluster_load DIR: reads DIR/cluster.env (namespace prefix, host count) into CLUSTER_*.
cluster_load() {
  CLUSTER_DIR=$1
  [ -f "$1/cluster.env" ] || return 1
  # shellcheck disable=SC1091
  . "$1/cluster.env"
}

cluster_hosts() { local i; for i in $(seq "$CLUSTER_HOSTS"); do echo "h$i"; done; }
cluster_ns() { echo "${CLUSTER_PFX}$1"; }   # the namespace of host $1 (ctl, h1, ..., sw)

# cluster_exec HOST CMD...: runs CMD in HOST's network namespace, in a new UTS namespace named HOST,
# with the cluster's hosts file as /etc/hosts (in a private mount namespace: unshare --mount makes
# its mounts private) and SLURM_CONF set.
cluster_exec() {
  local host=$1; shift
  # nsenter, not `ip netns exec`: that one remounts /sys, which hides /sys/fs/cgroup from slurmd.
  SLURM_CONF=$CLUSTER_DIR/slurm.conf nsenter --net="/run/netns/$(cluster_ns "$host")" unshare --uts --mount -- /bin/sh -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' sh "$host" "$CLUSTER_DIR/hosts" "$@"
}

# cluster_counters HOST: "tx_bytes rx_bytes tx_packets rx_packets" of HOST's eth0 (its link to the switch).
cluster_counters() {
  local s=/sys/class/net/eth0/statistics
  ip netns exec "$(cluster_ns "$1")" sh -c "echo \$(cat $s/tx_bytes $s/rx_bytes $s/tx_packets $s/rx_packets)"
}

# cluster_has_netem: 0 when this kernel has sch_netem (a delay can be added to the links).
cluster_has_netem() {
  local ns=stnetem$$ ok=1
  ip netns add "$ns" 2>/dev/null || return 1
  ip -n "$ns" link add va type veth peer name vb 2>/dev/null \
    && ip netns exec "$ns" tc qdisc add dev va root netem delay 1ms 2>/dev/null && ok=0
  ip netns del "$ns"
  return "$ok"
}

# cluster_shape RATE [DELAY]: limits what every host hN sends on its link (eth0 egress) to RATE
# (tc units: 100mbit, 1gbit) with a token bucket (tbf; root qdisc 1:), and delays it by DELAY
# (e.g. 1ms) with netem under it where the kernel has sch_netem (else DELAY is ignored and
# cluster_shape says so on stderr). RATE "none" removes the shaping. ctl's link is left alone.
# Both directions between two hosts are shaped, as on a real link: each end shapes its own egress.
cluster_shape() {
  local rate=$1 delay=${2:-} h ns bits burst
  for h in $(cluster_hosts); do
    ns=$(cluster_ns "$h")
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    [ "$rate" = none ] && continue
    # burst: 1 ms at RATE, at least 16 kB (more than one 1514-byte frame); queue: 50 ms at RATE
    bits=$(tc_rate_bits "$rate") || { echo "cluster_shape: cannot read rate '$rate' (use e.g. 100mbit, 1gbit)" >&2; return 1; }
    burst=$(( bits / 8000 > 16000 ? bits / 8000 : 16000 ))
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: tbf rate "$rate" burst "$burst" latency 50ms || return 1
    if [ -n "$delay" ]; then
      ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: netem delay "$delay" 2>/dev/null \
        || echo "cluster_shape: no netem here (sch_netem missing): rate $rate without the delay $delay" >&2
    fi
  done
}
# tc_rate_bits RATE: bits per second of a tc rate (kbit, mbit, gbit; plain numbers are bits)
tc_rate_bits() {
  awk -v r="$1" 'BEGIN { n = r + 0; u = tolower(substr(r, length(n "") + 1));
    m = (u == "" || u == "bit") ? 1 : (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : -1;
    if (n <= 0 || m < 0) exit 1; printf "%d\n", n * m }'
}
# cluster_qdisc_stats HOST: "sent_bytes overlimits drops" of HOST's tbf (0 0 0 without shaping).
cluster_qdisc_stats() {
  ip netns exec "$(cluster_ns "$1")" tc -s qdisc show dev eth0 2>/dev/null | awk '
    $1 == "qdisc" { tbf = ($2 == "tbf") }
    tbf && $1 == "Sent" { b = $2; gsub(/[^0-9]/, "", $7); d = $7; gsub(/[^0-9]/, "", $9); o = $9; tbf = 0 }
    END { printf "%d %d %d\n", b, o, d }'
}

# cluster_lose_host HOST: the host drops off the network and dies, as in a power cut: its link goes
# down first (so no FIN or RST reaches the others: their peers just stop answering), then every
# process in its network namespace -- slurmd, slurmstepd, ranks -- gets SIGKILL.
cluster_lose_host() {
  local ns pids; ns=$(cluster_ns "$1")
  ip -n "$ns" link set eth0 down || return 1
  pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
  # shellcheck disable=SC2086
  [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
  rm -f "$CLUSTER_DIR/run/slurmd-$1.pid"
}

# cluster_revive_host HOST: the link up again and a fresh slurmd (ReturnToService=2 makes the
# node usable as soon as it registers).
cluster_revive_host() {
  ip -n "$(cluster_ns "$1")" link set eth0 up || return 1
  cluster_exec "$1" slurmd -f "$CLUSTER_DIR/slurm.conf" -N "$1"
}

cluster_install() {
  local missing=""
  command -v ip >/dev/null || missing="$missing iproute2"
  command -v unshare >/dev/null || missing="$missing util-linux"
  { command -v slurmctld && command -v slurmd; } >/dev/null || missing="$missing slurm-wlm"
  { command -v munged && command -v mungekey; } >/dev/null || missing="$missing munge"
  [ -n "$missing" ] || return 0
  echo "→ installing$missing (apt-get)"
  local log; log=$(mktemp)
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing; } >"$log" 2>&1; then
    tail -20 "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

# cluster_probe: "" when network namespaces, veth pairs and bridges can be made here, else why not.
cluster_probe() {
  local ns=stprobe$$ out
  if ! out=$(ip netns add "$ns" 2>&1); then echo "ip netns add: $out"; return 0; fi
  if ! out=$(ip -n "$ns" link add br0 type bridge 2>&1 && ip -n "$ns" link add va type veth peer name vb 2>&1 \
             && ip -n "$ns" link set va master br0 2>&1 && unshare --uts true 2>&1); then
    ip netns del "$ns" 2>/dev/null; echo "bridge/veth/unshare: $out"; return 0
  fi
  ip netns del "$ns"
}

cluster_write_conf() {
  local d=$1 h i
  {
    echo "# Written by tests/cluster/netns_cluster.sh: the cluster's own name resolution (bind-mounted over /etc/hosts"
    echo "# inside its namespaces only)"
    echo "127.0.0.1 localhost"
    echo "$CLUSTER_CTL_ADDR ctl"
    for i in $(seq "$CLUSTER_HOSTS"); do echo "$CLUSTER_NET.$i h$i"; done
  } >"$d/hosts"
  cat >"$d/slurm.conf" <<CONF
# Written by tests/cluster/netns_cluster.sh: $CLUSTER_HOSTS hosts, each a network + UTS namespace on the
# bridge of namespace ${CLUSTER_PFX}sw; head node ctl ($CLUSTER_CTL_ADDR) runs slurmctld (and munged).
ClusterName=shardtrain-netns
SlurmctldHost=ctl($CLUSTER_CTL_ADDR)
SlurmctldPort=6817
SlurmdPort=6818
# every daemon binds its own host's address, not INADDR_ANY
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# one munged (on ctl) for all hosts: its socket is a file-system path, reachable from every namespace
AuthInfo=socket=$d/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$d/state
# %n: the node's name, so that the hosts' slurmd keep apart what real nodes keep on their own disks
SlurmdSpoolDir=$d/spool/%n
SlurmdPidFile=$d/run/slurmd-%n.pid
SlurmdLogFile=$d/log/slurmd-%n.log
# TmpFS is also PMIx's per-step directory base (spmix_appdir_*): one per host
TmpFS=$d/tmp/%n
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
# the hosts share this machine's cores: take CPUs as configured below, not as slurmd -C counts them
SlurmdParameters=config_overrides
$(slurm_local_common_conf "$d" | sed "s/^SlurmdTimeout=.*/SlurmdTimeout=$CLUSTER_SLURMD_TIMEOUT/")
CONF
  for i in $(seq "$CLUSTER_HOSTS"); do
    echo "NodeName=h$i NodeAddr=$CLUSTER_NET.$i CPUs=$CLUSTER_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CLUSTER_CPUS ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN" >>"$d/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$d/slurm.conf"
}

# cluster_link NAME ADDR: host namespace NAME with eth0 = ADDR/24, its peer p-NAME on the switch's bridge.
cluster_link() {
  local ns sw; ns=$(cluster_ns "$1"); sw=$(cluster_ns sw)
  ip netns add "$ns" || return 1
  ip -n "$sw" link add "p-$1" type veth peer name eth0 netns "$ns" || return 1
  ip -n "$sw" link set "p-$1" master br0 up || return 1
  ip -n "$ns" addr add "$2/24" dev eth0 || return 1
  # One TCP segment per packet, as on a 1500-byte-MTU wire: without this the veth passes 64 KiB
  # GSO packets and its counters hold a fraction of the headers a real link carries.
  ip -n "$ns" link set eth0 gso_max_segs 1 || return 1
  ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up
}

# cluster_start DIR [HOSTS]: the namespaces, links and daemons; returns 0 once every host is idle.
cluster_start() {
  local d=$1 n=${2:-2} h i st sock
  [ "$(id -u)" = 0 ] || { echo "netns_cluster.sh: needs root (network namespaces, SlurmUser=root)" >&2; return 1; }
  [ "$n" -ge 1 ] && [ "$n" -le 8 ] || { echo "netns_cluster.sh: 1 to 8 hosts, not $n" >&2; return 1; }
  [ ! -f "$d/cluster.env" ] || { echo "netns_cluster.sh: $d already has a cluster; stop it first" >&2; return 1; }
  cluster_install || return 1
  mkdir -p "$d"/{state,spool,log,munge,run,tmp} || return 1
  for i in $(seq "$n"); do mkdir -p "$d/spool/h$i" "$d/tmp/h$i" || return 1; done
  chmod 0755 "$d"
  chown munge:munge "$d/munge"; chmod 0711 "$d/munge"
  runuser -u munge -- test -w "$d/munge" || { echo "the munge user cannot reach $d/munge (a parent directory closed to others?)" >&2; return 1; }
  # A prefix of our own for the namespace names, recorded first so that stop finds whatever exists.
  printf 'CLUSTER_PFX=stc%s-\nCLUSTER_HOSTS=%s\n' "$(tr -dc 'a-z0-9' </dev/urandom | head -c 6)" "$n" >"$d/cluster.env"
  cluster_load "$d"
  cluster_write_conf "$d"
  # The switch: a namespace holding only the bridge; every host, ctl included, hangs on it by a veth.
  ip netns add "$(cluster_ns sw)" || return 1
  ip -n "$(cluster_ns sw)" link add br0 type bridge || return 1
  ip -n "$(cluster_ns sw)" link set br0 up || return 1
  cluster_link ctl "$CLUSTER_CTL_ADDR" || return 1
  for i in $(seq "$n"); do cluster_link "h$i" "$CLUSTER_NET.$i" || return 1; done
  # munged on ctl (it refuses to run as root), one key for the cluster
  sock=$d/munge/munge.socket.2
  runuser -u munge -- mungekey --create --force --keyfile="$d/munge/munge.key" || return 1
  cluster_exec ctl runuser -u munge -- munged --socket="$sock" --key-file="$d/munge/munge.key" \
      --pid-file="$d/munge/munged.pid" --log-file="$d/munge/munged.log" --seed-file="$d/munge/munged.seed" || return 1
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
  for h in ctl $(cluster_hosts); do   # the one socket works from every namespace
    cluster_exec "$h" sh -c "munge -S '$sock' -n | unmunge -S '$sock' >/dev/null" \
      || { echo "munge does not work from $h; see $d/munge/munged.log" >&2; return 1; }
  done
  cluster_exec ctl slurmctld -f "$d/slurm.conf" -c || { echo "slurmctld failed; see $d/log/slurmctld.log" >&2; return 1; }
  for h in $(cluster_hosts); do
    cluster_exec "$h" slurmd -f "$d/slurm.conf" -N "$h" || { echo "slurmd on $h failed; see $d/log/slurmd-$h.log" >&2; return 1; }
  done
  for _ in $(seq 300); do
    st=$(cluster_exec ctl sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$(grep -o ' idle' <<<" $st" | wc -l)" = "$n" ] && return 0
    sleep 0.1
  done
  echo "not every host idle after 30 s ($st); see $d/log" >&2
  return 1
}

# cluster_kill_pidfiles FILE...: SIGTERM to the PID in each pid file at once, SIGKILL to those still
# alive 10 s later (each daemon takes 1.5-2 s to stop); removes the files.
cluster_kill_pidfiles() {
  local f p pids=""
  for f in "$@"; do
    [ -f "$f" ] || continue
    p=$(cat "$f")
    if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then kill -TERM "$p" 2>/dev/null && pids="$pids $p"; fi
    rm -f "$f"
  done
  for _ in $(seq 100); do
    local alive=""
    for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
    pids=$alive
    [ -n "$pids" ] || return 0
    sleep 0.1
  done
  echo "still alive 10 s after SIGTERM: $pids (SIGKILL)" >&2
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
}

# cluster_stop DIR: cancels the jobs, stops the daemons, SIGKILLs whatever still runs inside the
# cluster's namespaces (they are ours: we made them), then deletes the namespaces, which takes their
# veth pairs and the bridge with them. Safe to call on a half-made cluster, and twice.
cluster_stop() {
  local d=$1 ids h ns pids
  cluster_load "$d" || return 0
  if [ -f "$d/run/slurmctld.pid" ] && kill -0 "$(cat "$d/run/slurmctld.pid")" 2>/dev/null; then
    ids=$(cluster_exec ctl squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      cluster_exec ctl scancel $ids 2>/dev/null || true
      for _ in $(seq 150); do
        ids=$(cluster_exec ctl squeue -h -o %i 2>/dev/null || true)
        [ -n "$ids" ] || break
        sleep 0.2
      done
      [ -z "$ids" ] || echo "jobs still in the queue 30 s after scancel: $ids (killed below)" >&2
    fi
  fi
  # shellcheck disable=SC2046
  cluster_kill_pidfiles "$d/run/slurmctld.pid" $(for h in $(cluster_hosts); do echo "$d/run/slurmd-$h.pid"; done) \
    "$d/munge/munged.pid"
  for h in $(cluster_hosts) ctl sw; do
    ns=$(cluster_ns "$h")
    [ -e "/run/netns/$ns" ] || continue
    # job steps, stray ranks, orted: anything left in our namespaces
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      echo "killing processes left in $ns: $pids" >&2
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || echo "could not delete namespace $ns" >&2
  done
  rm -f "$d/cluster.env"
}

cluster_status() {
  local d=$1 h
  cluster_load "$d" || { echo "no cluster in $d"; return 1; }
  echo "namespaces: $(ip netns list | grep -o "^${CLUSTER_PFX}[a-z0-9]*" | tr '\n' ' ')"
  for h in $(cluster_hosts); do
    echo "$h: eth0 $(ip -n "$(cluster_ns "$h")" -br addr show eth0 2>/dev/null | awk '{print $3}'), counters (tx rx bytes, packets) $(cluster_counters "$h" 2>/dev/null)"
  done
  cluster_exec ctl sinfo -N 2>&1 || true
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  [ $# -ge 2 ] || { echo "usage: $0 start DIR [HOSTS] | exec DIR HOST CMD... | stop DIR | status DIR" >&2; exit 2; }
  cmd=$1
  dir=$(mkdir -p "$2" && cd "$2" && pwd) || exit 1
  shift 2
  case "$cmd" in
    start)
      if cluster_start "$dir" "${1:-2}"; then
        echo "cluster up: $(cluster_hosts | tr '\n' ' ')(slurmctld on ctl); run commands with: $0 exec $dir ctl sinfo"
      else
        cluster_stop "$dir"; exit 1
      fi ;;
    exec) cluster_load "$dir" || { echo "no cluster in $dir" >&2; exit 1; }; cluster_exec "$@" ;;
    stop) cluster_stop "$dir" && echo "cluster stopped ($dir kept)" ;;
    status) cluster_status "$dir" ;;
    *) echo "usage: $0 start DIR [HOSTS] | exec DIR HOST CMD... | stop DIR | status DIR" >&2; exit 2 ;;
  esac
fi
