#!/usr/bin/env bash
# A real single-host Slurm cluster for the test suite and for developers, built from Debian's
# packages (Slurm 22.05) and run without systemd: munged, MariaDB, slurmdbd, slurmctld and one
# slurmd per logical node, all owned by one state folder.
#
# Usage: tools/local-slurm.sh install|start|stop [--purge]|status|env
#
#   install  install the missing Debian packages only (slurm-wlm munge slurmdbd mariadb-server)
#   start    install if needed, start every daemon, wait until the nodes are idle and sacct
#            answers; a cluster that is already healthy is left alone (exit 0). A cluster
#            whose daemons were killed rather than stopped comes back empty, as after `stop`:
#            the jobs its saved state still lists are cancelled (their processes are gone)
#   stop     cancel all jobs, stop every daemon; --purge also removes the state folder
#   status   each daemon and whether it is alive, then sinfo; exit 0 only if all are healthy
#   env      the client environment:  eval "$(tools/local-slurm.sh env)"
#
# Settings (environment):
#   RFT_SLURM_DIR          state folder                          [/tmp/rft-hpc-slurm]
#   RFT_SLURM_CTLD_PORT    slurmctld port                        [16817]
#   RFT_SLURM_DBD_PORT     slurmdbd port                         [16819]
#   RFT_SLURM_SLURMD_PORT  first slurmd port (node i: +i-1)      [17001]
#   RFT_SLURM_NODES        logical nodes n1..nN                  [2]
#   RFT_SLURM_CPUS         CPUs advertised per node              [4]
#   RFT_SLURM_MEM_MB       memory advertised per node (MB)       [4096]
#   RFT_SLURM_TIMEOUT      seconds to wait for start/stop        [60]
#
# Everything (configs, keys, sockets, database, spool, logs) lives under the state folder;
# nothing is written to /etc, /run or /var. Daemons run as root (slurmd must, to run jobs).
set -euo pipefail

STATE=${RFT_SLURM_DIR:-/tmp/rft-hpc-slurm}
CTLD_PORT=${RFT_SLURM_CTLD_PORT:-16817}
DBD_PORT=${RFT_SLURM_DBD_PORT:-16819}
SLURMD_PORT=${RFT_SLURM_SLURMD_PORT:-17001}
NNODES=${RFT_SLURM_NODES:-2}
CPUS=${RFT_SLURM_CPUS:-4}
MEM_MB=${RFT_SLURM_MEM_MB:-4096}
TIMEOUT=${RFT_SLURM_TIMEOUT:-60}
CLUSTER=rfthpc
ACCOUNT=rfthpc
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)

# Paths inside the state folder.
ETC=$STATE/etc
LOG=$STATE/log
RUN=$STATE/run            # our pid files: the pid that start launched, per daemon
SPOOL=$STATE/spool
MUNGE_DIR=$STATE/munge    # munged refuses a socket folder that root does not own or others can write
MUNGE_SOCK=$MUNGE_DIR/munge.socket
DB_DIR=$STATE/mariadb
DB_SOCK=$DB_DIR/mariadb.sock
SLURM_CONF_FILE=$ETC/slurm.conf
DBD_CONF_FILE=$ETC/slurmdbd.conf

NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("n$i"); done

log() { printf '[local-slurm] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------------------------
# Packages

install_packages() {  # apt-get only when a package is missing (then `apt-get update` first)
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    case "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" in
      *" ok installed") ;;
      *) missing+=("$p") ;;
    esac
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} (apt-get)"
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  # The packages' own services are never used: on a machine with systemd they may start
  # (and on their default sockets/ports, which this cluster does not touch).
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${missing[@]}" >/dev/null
}

# ---------------------------------------------------------------------------------------------
# Processes
#
# Each daemon runs in the foreground under setsid, so that its pid is known at once ($!), it
# leaves the caller's process group (a Ctrl-C to pytest does not reach it) and it holds none
# of the caller's file descriptors (a test runner reading our output would otherwise wait for
# the daemons to exit). Liveness is read from /proc/<pid>/stat: this sandbox reaps exited
# processes late, so a dead daemon can linger as a zombie that still passes `kill -0`.

DAEMONS=(munged mariadbd slurmdbd slurmctld)   # + slurmd-<node> for each node

all_daemons() { printf '%s\n' "${DAEMONS[@]}"; for n in "${NODES[@]}"; do echo "slurmd-$n"; done; }

binary_of() { case "$1" in slurmd-*) echo slurmd ;; *) echo "$1" ;; esac; }

pid_of() { [ -s "$RUN/$1.pid" ] && cat "$RUN/$1.pid" || true; }

pid_alive() {  # pid_alive PID [COMM]: running (not a zombie) and, if given, named COMM
  local pid=$1 comm=${2:-} stat state
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  state=${stat##*) }; state=${state%% *}
  case "$state" in Z | X | x) return 1 ;; esac
  # comm is at most 15 characters; it guards against a recycled pid.
  [ -z "$comm" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${comm:0:15}" ]
}

daemon_alive() { pid_alive "$(pid_of "$1")" "$(binary_of "$1")"; }

launch() {  # launch NAME COMMAND...: start a foreground daemon in its own session
  local name=$1; shift
  # 9>&-: the daemon must not inherit (and so keep holding) the start/stop lock.
  setsid "$@" </dev/null >"$LOG/$name.out" 2>&1 9>&- &
  local pid=$! i
  echo "$pid" >"$RUN/$name.pid"
  # Until the forked shell has exec'd the daemon, /proc shows the shell's name: wait for the
  # exec, so that the name check of daemon_alive holds from here on.
  for ((i = 0; i < 100; i++)); do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$(binary_of "$name")" ] && return 0
    pid_alive "$pid" || return 0
    sleep 0.01
  done
}

log_tail() {  # log_tail NAME: the end of the daemon's log, or of its stdout/stderr
  # A daemon that dies before it opens its log (bad option, unreadable config) says why on
  # stderr only; one that ran logs the same lines to both: show one of them.
  local f=$LOG/$1.log
  if [ ! -s "$f" ] || [ "$RUN/$1.pid" -nt "$f" ]; then f=$LOG/$1.out; fi
  [ -s "$f" ] || return 0
  echo "---- tail of $f"
  tail -n 25 "$f"
}

STARTING=0

fail() {  # fail NAME MESSAGE: give up, with the logs that tell why
  log "error: $2"
  log_tail "$1" >&2
  if [ "$STARTING" -eq 1 ]; then
    # Leave nothing half-running behind a failed start; the logs stay.
    STARTING=0
    stop_all >/dev/null 2>&1 || true
    log "stopped the daemons that had started; logs are in $LOG"
  fi
  exit 1
}

wait_for() {  # wait_for NAME WHAT COMMAND...: poll COMMAND until it succeeds, or fail
  local name=$1 what=$2; shift 2
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    daemon_alive "$name" || fail "$name" "$name exited while waiting for $what"
    [ "$SECONDS" -lt "$deadline" ] || fail "$name" "timed out after ${TIMEOUT}s waiting for $what"
    sleep 0.1
  done
}

stop_daemon() {  # stop_daemon NAME: TERM, wait, then KILL
  local name=$1 pid
  pid=$(pid_of "$name")
  if daemon_alive "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + TIMEOUT))
    while pid_alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if pid_alive "$pid"; then
      log "$name ($pid) ignored TERM for ${TIMEOUT}s: KILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$RUN/$name.pid"
}

# ---------------------------------------------------------------------------------------------
# Configuration

write_configs() {
  local host
  host=$(hostname -s)
  local last_port=$((SLURMD_PORT + NNODES - 1))
  local node_range="n[1-$NNODES]" port_range="[$SLURMD_PORT-$last_port]"
  [ "$NNODES" -eq 1 ] && node_range=n1 && port_range=$SLURMD_PORT

  # Clients find everything through this file (SLURM_CONF): the controller's address, the
  # munge socket, slurmdbd for sacct. The per-node %n patterns keep the logical nodes apart.
  cat >"$SLURM_CONF_FILE.tmp" <<EOF
# Generated by tools/local-slurm.sh; rewritten on every start.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
StateSaveLocation=$SPOOL/slurmctld
SlurmdSpoolDir=$SPOOL/slurmd-%n
# The daemons' own pid files (start and stop use those in $RUN, written at launch)
SlurmctldPidFile=$SPOOL/slurmctld.pid
SlurmdPidFile=$SPOOL/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers: track processes through /proc, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
# Advertise more CPUs and memory than the host has (the nodes share it)
SlurmdParameters=config_overrides
# Start jobs within ~1 s of submission, and requeued ones within ~1 s of being eligible
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
KillWait=5
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
JobRequeue=1
# Preemption by QOS, as sites with a scavenger QOS do: a job with --qos=urgent requeues the
# --qos=preemptible jobs it needs room from; jobs of the default QOS are never preempted (so
# concurrent test sessions leave each other alone)
PreemptType=preempt/qos
PreemptMode=REQUEUE
# pmix creates per-job folders under TmpFS; both nodes on one host would clash on /tmp
TmpFS=$STATE/tmp-%n
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# The controller's link to slurmdbd takes its munge socket from here
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageEnforce=associations
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$node_range NodeHostname=$host NodeAddr=127.0.0.1 Port=$port_range CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$node_range Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$SLURM_CONF_FILE.tmp" "$SLURM_CONF_FILE"

  # slurmdbd reaches MariaDB over its private socket as root (socket authentication: no
  # password anywhere). slurmdbd refuses a slurmdbd.conf that others can read.
  (
    umask 077
    cat >"$DBD_CONF_FILE.tmp" <<EOF
# Generated by tools/local-slurm.sh; rewritten on every start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$SPOOL/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DBD_CONF_FILE.tmp"
  mv "$DBD_CONF_FILE.tmp" "$DBD_CONF_FILE"
}

# ---------------------------------------------------------------------------------------------
# Daemons, in start order

start_munged() {
  install -d -o root -m 755 "$MUNGE_DIR"
  if [ ! -s "$MUNGE_DIR/munge.key" ]; then
    mungekey --create --keyfile="$MUNGE_DIR/munge.key.tmp" >/dev/null
    chmod 400 "$MUNGE_DIR/munge.key.tmp"
    mv "$MUNGE_DIR/munge.key.tmp" "$MUNGE_DIR/munge.key"
  fi
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  launch munged munged --foreground --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed"
  wait_for munged "the munge socket" munge --socket="$MUNGE_SOCK" --no-input
}

db_query() { mariadb --no-defaults --socket="$DB_SOCK" --user=root --batch "$@"; }

start_mariadbd() {
  mkdir -p "$DB_DIR"
  if [ ! -d "$DB_DIR/data/mysql" ]; then
    rm -rf "$DB_DIR/data"
    # Root logs in through the socket as the Unix root user: no password to keep anywhere.
    mariadb-install-db --no-defaults --datadir="$DB_DIR/data" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.out" 2>&1 ||
      fail mariadb-install "mariadb-install-db failed"
  fi
  rm -f "$DB_SOCK"
  # mariadbd does not daemonize. --skip-networking: no TCP port to clash with anything.
  # The innodb sizes are the least slurmdbd accepts without an error in its log; relaxed
  # flushing suits a throw-away accounting database.
  launch mariadbd mariadbd --no-defaults --datadir="$DB_DIR/data" --user=root \
    --socket="$DB_SOCK" --pid-file="$DB_DIR/mariadbd.pid" --skip-networking \
    --skip-name-resolve --log-error="$LOG/mariadbd.log" \
    --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
    --innodb-flush-log-at-trx-commit=2
  wait_for mariadbd "MariaDB to answer on $DB_SOCK" db_query -e 'SELECT 1'
}

start_slurmdbd() {
  # slurmdbd's MySQL client has no socket setting: StorageHost=localhost means "the default
  # Unix socket", which libmariadb takes from MYSQL_UNIX_PORT.
  MYSQL_UNIX_PORT=$DB_SOCK launch slurmdbd slurmdbd -D
  wait_for slurmdbd "slurmdbd to listen on port $DBD_PORT" listening "$DBD_PORT"
  wait_for slurmdbd "slurmdbd to answer (sacctmgr)" sacctmgr --noheader list cluster
}

register_accounts() {  # QOS, cluster, account and users, before slurmctld starts (it enforces them)
  local user users=(root) qos assocs
  [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ] && users+=("$SUDO_USER")
  qos=$(sacctmgr --noheader --parsable2 list qos format=name)
  if ! grep -qx preemptible <<<"$qos"; then
    sacctmgr --immediate add qos preemptible >/dev/null
  fi
  if ! grep -qx urgent <<<"$qos"; then
    sacctmgr --immediate add qos urgent set preempt=preemptible preemptmode=requeue >/dev/null
  fi
  assocs=$(sacctmgr --noheader --parsable2 list assoc format=cluster,account,user)
  if ! grep -qx "$CLUSTER|root|" <<<"$assocs"; then  # a new cluster gets the root account
    sacctmgr --immediate add cluster "$CLUSTER" >/dev/null
  fi
  if ! grep -qx "$CLUSTER|$ACCOUNT|" <<<"$assocs"; then
    # Its users inherit the QOS list
    sacctmgr --immediate add account "$ACCOUNT" cluster="$CLUSTER" \
      qos=normal,preemptible,urgent description="rft-hpc tests" organization=rft-hpc >/dev/null
  fi
  for user in "${users[@]}"; do
    if ! grep -qx "$CLUSTER|$ACCOUNT|$user" <<<"$assocs"; then
      sacctmgr --immediate add user "$user" account="$ACCOUNT" defaultaccount="$ACCOUNT" \
        cluster="$CLUSTER" >/dev/null
    fi
  done
}

listening() {  # listening PORT: some process listens on this TCP port (IPv4 or IPv6)
  # Polling /proc costs nothing, while a Slurm client that finds no daemon retries for ~10 s
  # before it gives up: wait for the port first, so that a daemon that dies is seen at once.
  local hex
  hex=$(printf ':%04X' "$1")
  awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { found = 1 } END { exit !found }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
  mkdir -p "$SPOOL/slurmctld"
  launch slurmctld slurmctld -D -i
  wait_for slurmctld "slurmctld to listen on port $CTLD_PORT" listening "$CTLD_PORT"
  wait_for slurmctld "slurmctld to answer (scontrol ping)" ctld_up
}

start_slurmd() {  # start_slurmd NODE
  local node=$1
  mkdir -p "$SPOOL/slurmd-$node" "$STATE/tmp-$node"
  launch "slurmd-$node" slurmd -D -N "$node"
}

node_states() { sinfo --noheader --Node --partition=debug --format='%N %t' 2>/dev/null; }

nodes_idle() {  # every node is up and taking jobs (idle, or busy with some)
  local states
  states=$(node_states) || return 1
  [ "$(grep -cE ' (idle|mix|alloc|comp|resv|plnd)$' <<<"$states")" -eq "$NNODES" ]
}

sacct_works() { sacct --noheader --allusers --starttime=now-1minutes >/dev/null 2>&1; }

wait_nodes_idle() {
  local deadline=$((SECONDS + TIMEOUT)) node states
  until nodes_idle; do
    for node in "${NODES[@]}"; do
      daemon_alive "slurmd-$node" || fail "slurmd-$node" "slurmd for $node exited"
    done
    daemon_alive slurmctld || fail slurmctld "slurmctld exited"
    # The controller keeps node states across restarts: a node drained (by hand, or for a
    # job that would not die) stays drained until resumed.
    states=$(node_states) || true
    while read -r node; do
      scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
    done < <(awk '$2 ~ /^(drain|drng|drained|down)$/ {print $1}' <<<"$states")
    if [ "$SECONDS" -ge "$deadline" ]; then
      sinfo --Node --long >&2 || true
      fail "slurmd-${NODES[0]}" "timed out after ${TIMEOUT}s waiting for the nodes to be idle"
    fi
    sleep 0.1
  done
}

# ---------------------------------------------------------------------------------------------
# Commands

export SLURM_CONF=$SLURM_CONF_FILE

healthy() {  # all daemons alive, nodes up, sacct answering
  local d
  [ -f "$SLURM_CONF_FILE" ] || return 1
  for d in $(all_daemons); do daemon_alive "$d" || return 1; done
  nodes_idle && sacct_works
}

lock() {  # serialize start/stop: concurrent test processes may all call start
  mkdir -p "$(dirname "$STATE")"
  exec 9>"$STATE.lock"
  flock -w "$TIMEOUT" 9 || die "another local-slurm.sh holds $STATE.lock"
}

require_root() {
  [ "$(id -u)" -eq 0 ] || die "run as root: slurmd must be root to start jobs (try sudo)"
}

check_ports_free() {  # say which setting to change, rather than let a daemon die on bind()
  local port var i
  for var in RFT_SLURM_CTLD_PORT:$CTLD_PORT RFT_SLURM_DBD_PORT:$DBD_PORT; do
    port=${var#*:}
    listening "$port" && die "port $port is in use by another program: set ${var%%:*}"
  done
  for ((i = 0; i < NNODES; i++)); do
    port=$((SLURMD_PORT + i))
    listening "$port" && die "port $port is in use by another program: set RFT_SLURM_SLURMD_PORT"
  done
  return 0
}

cmd_start() {
  install_packages
  require_root
  lock
  if healthy; then
    log "already running"
    cmd_status
    return 0
  fi
  # A half-running cluster (a daemon died, a stale pid file) is restarted as a whole.
  local d
  for d in $(all_daemons); do
    if daemon_alive "$d"; then
      log "restarting a partly running cluster"
      stop_all
      break
    fi
  done

  check_ports_free
  kill_stray_steps

  local t0=$SECONDS
  STARTING=1
  mkdir -p "$ETC" "$LOG" "$RUN" "$SPOOL"
  write_configs
  start_munged
  start_mariadbd
  start_slurmdbd
  register_accounts
  start_slurmctld
  for d in "${NODES[@]}"; do start_slurmd "$d"; done
  wait_nodes_idle
  local deadline=$((SECONDS + TIMEOUT))
  until sacct_works; do
    [ "$SECONDS" -lt "$deadline" ] || fail slurmdbd "sacct does not answer after ${TIMEOUT}s"
    sleep 0.1
  done
  # The controller recovers from its saved state every job it had when its daemons were
  # killed (a machine or sandbox that stopped without `stop`), and keeps them running or
  # queued, holding their nodes' CPUs, though no process of theirs is left.
  cancel_jobs "left from before the cluster was last killed"
  STARTING=0
  log "started in $((SECONDS - t0))s: SLURM_CONF=$SLURM_CONF_FILE"
  sinfo >&2
}

cancel_jobs() {  # cancel_jobs [WHY]: cancel every job, wait until the queue is empty
  daemon_alive slurmctld && ctld_up || return 0
  local jobs
  jobs=$(squeue --noheader --all --format=%A 2>/dev/null | sort -u) || return 0
  [ -z "$jobs" ] && return 0
  log "cancelling $(wc -w <<<"$jobs") job(s)${1:+ $1}: $(tr '\n' ' ' <<<"$jobs")"
  # shellcheck disable=SC2086  # one argument per job id
  scancel $jobs 2>/dev/null || true
  # Cancelled jobs leave the queue within KillWait (5 s) unless a step ignores KILL, or the
  # slurmd of its node is dead (then it stays "completing" until that slurmd is back, and
  # kill_stray_steps ends its processes).
  local deadline=$((SECONDS + 15)) node
  while [ -n "$(squeue --noheader --all --format=%A 2>/dev/null)" ]; do
    for node in "${NODES[@]}"; do daemon_alive "slurmd-$node" || return 0; done
    [ "$SECONDS" -lt "$deadline" ] || { log "jobs still queued after 15s"; break; }
    sleep 0.2
  done
}

kill_stray_steps() {  # slurmstepd processes of this cluster (they carry our SLURM_CONF)
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    pid_alive "$pid" slurmstepd || continue
    if grep -qzxF "SLURM_CONF=$SLURM_CONF_FILE" "/proc/$pid/environ" 2>/dev/null; then
      log "killing stray slurmstepd $pid"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

stop_all() {
  local node
  cancel_jobs
  for node in "${NODES[@]}"; do stop_daemon "slurmd-$node"; done
  kill_stray_steps
  stop_daemon slurmctld
  stop_daemon slurmdbd
  stop_daemon mariadbd
  stop_daemon munged
}

cmd_stop() {
  local purge=0
  case "${1:-}" in
    "") ;;
    --purge) purge=1 ;;
    *) die "usage: tools/local-slurm.sh stop [--purge]" ;;
  esac
  require_root
  lock
  if [ -d "$STATE" ]; then
    stop_all
    log "stopped"
  fi
  if [ "$purge" -eq 1 ]; then
    # (.tests.lock: tests/helpers/slurm_cluster.py's lock for the test sessions sharing the cluster)
    rm -rf "$STATE" "$STATE.lock" "$STATE.tests.lock"
    log "removed $STATE"
  fi
}

cmd_status() {
  local d pid ok=0
  if [ ! -d "$STATE" ]; then
    echo "no cluster at $STATE"
    return 1
  fi
  for d in $(all_daemons); do
    pid=$(pid_of "$d")
    if daemon_alive "$d"; then
      printf '%-12s running  (pid %s)\n' "$d" "$pid"
    else
      printf '%-12s DOWN%s\n' "$d" "${pid:+  (pid $pid gone)}"
      ok=1
    fi
  done
  # Only ask the controller when it runs: a client without one retries for a long time.
  if daemon_alive slurmctld; then
    sinfo || ok=1
    nodes_idle || { echo "nodes are not all up"; ok=1; }
  fi
  if daemon_alive slurmdbd; then
    sacct_works || { echo "sacct does not answer"; ok=1; }
  fi
  return "$ok"
}

cmd_env() {
  # %q: the output is eval'd, and the state folder may hold spaces
  printf 'export SLURM_CONF=%q\n' "$SLURM_CONF_FILE"
  printf 'export RFT_SLURM_DIR=%q\n' "$STATE"
}

main() {
  local cmd=${1:-}
  [ $# -gt 0 ] && shift
  case "$cmd" in
    install) install_packages ;;
    start) cmd_start ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *)
      echo "usage: tools/local-slurm.sh install|start|stop [--purge]|status|env" >&2
      exit 2
      ;;
  esac
}

main "$@"
