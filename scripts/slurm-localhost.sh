#!/usr/bin/env bash
# A real single-node SLURM on localhost, for tests/test_slurm.py and bench/play/bench_workers.py.
#
#   scripts/slurm-localhost.sh start    install (Debian packages) if missing, configure, start
#   scripts/slurm-localhost.sh status   daemons, node state and queue; exit 0 only when up
#   scripts/slurm-localhost.sh stop     cancel every job, then stop the daemons this script started
#
# Needs root (apt-get, mknod, munged as the munge user). Every command is idempotent. The
# configuration lives in $SLURM_LOCAL_DIR (default /tmp/unstable-dask-slurm), not /etc/slurm, so a
# machine's own SLURM setup is never overwritten: clients need `export SLURM_CONF=$DIR/slurm.conf`
# (printed by start and status). The node offers two fake GRES GPUs, so `--gres=gpu:1` jobs get
# CUDA_VISIBLE_DEVICES 0 and 1. Facts behind each setting: shared/notes/slurm-on-localhost.md.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/unstable-dask-slurm}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
HOST=$(hostname -s)

log() { echo "slurm-localhost: $*" >&2; }

# A daemon counts as running when its recorded PID is alive and not a zombie (PID 1 here reaps
# slowly, so a stopped daemon may linger in state Z).
alive() {
  local pid
  pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [[ -r /proc/$pid/status ]] || return 1
  ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
     command -v munged >/dev/null; then
    return
  fi
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [[ -s /etc/munge/munge.key ]] || { /usr/sbin/mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
  # munged refuses to run as root ("Logfile is insecure"); it daemonizes and writes its pid file.
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
  cp /run/munge/munged.pid "$DIR/munged.pid"
  munge -n | unmunge >/dev/null || { log "munged did not start"; exit 1; }
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/jobs"
  # Fake GPUs: slurmd drops a GRES without File= and then drains the node; any character device
  # will do (1,3 is /dev/null's).
  for i in 0 1; do
    [[ -c "$DIR/fakegpu$i" ]] || { rm -f "$DIR/fakegpu$i"; mknod "$DIR/fakegpu$i" c 1 3; }
  done
  # The node's real hardware line: a bare CPUs=N that disagrees with it gets the node drained.
  local hw
  hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
  cat > "$CONF" <<EOF
ClusterName=unstable-dask-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.daemon.pid
SlurmdPidFile=$DIR/slurmd.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 $hw Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  echo "NodeName=$HOST Name=gpu File=$DIR/fakegpu[0-1]" > "$DIR/gres.conf"
}

start_daemon() {  # name, command...
  local name=$1; shift
  alive "$name" && return
  # setsid: the daemons must not die with the shell (or pytest) that started them.
  setsid "$@" > "$DIR/log/$name.out" 2>&1 < /dev/null &
  echo $! > "$DIR/$name.pid"
}

wait_idle() {
  local state=""
  for _ in $(seq 150); do
    state=$(sinfo -h -o %T 2>/dev/null | head -1 || true)
    case "$state" in
      idle|mixed|allocated) return 0 ;;
      *drain*|down*|inval*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  log "node did not become idle (state '${state:-none}'); see $DIR/log/"
  tail -5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  exit 1
}

cmd_start() {
  [[ $EUID -eq 0 ]] || { log "must run as root"; exit 1; }
  local t0=$SECONDS
  install_packages
  mkdir -p "$DIR"
  start_munge
  if alive slurmctld && alive slurmd && sinfo -h >/dev/null 2>&1; then
    log "already running"
  else
    write_config
    # -c clears state saved by an earlier run (a stale drain reason, old jobs).
    start_daemon slurmctld slurmctld -D -c -f "$CONF"
    start_daemon slurmd slurmd -D -f "$CONF"
    wait_idle
    timeout 60 srun -N1 -t 1 true || { log "smoke test 'srun -N1 true' failed"; exit 1; }
    log "up in $(( SECONDS - t0 )) s"
  fi
  echo "export SLURM_CONF=$CONF"
}

cmd_status() {
  local up=0
  for d in munged slurmctld slurmd; do
    if alive "$d"; then echo "$d: running (pid $(cat "$DIR/$d.pid"))"; else echo "$d: stopped"; up=1; fi
  done
  if [[ $up -eq 0 ]]; then
    echo "node: $(sinfo -h -o '%n %T %G' 2>/dev/null || echo unreachable)"
    echo "jobs: $(squeue -h 2>/dev/null | wc -l)"
    echo "export SLURM_CONF=$CONF"
  fi
  return $up
}

stop_pid() {  # name
  alive "$1" || { rm -f "$DIR/$1.pid"; return 0; }
  local pid
  pid=$(cat "$DIR/$1.pid")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do alive "$1" || break; sleep 0.1; done
  alive "$1" && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$DIR/$1.pid"
}

cmd_stop() {
  # Jobs first: their slurmstepd processes outlive slurmd and would keep workers running.
  if alive slurmctld; then
    squeue -h -o %i | xargs -r scancel 2>/dev/null || true
    for _ in $(seq 100); do
      [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
      sleep 0.2
    done
  fi
  stop_pid slurmd
  stop_pid slurmctld
  stop_pid munged  # only when this script started it (the pid file is ours)
  log "stopped"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
