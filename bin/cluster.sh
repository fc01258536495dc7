#!/usr/bin/env bash
# A throwaway PostgreSQL HA cluster on loopback: etcd and three PostgreSQL 15
# nodes managed by Patroni, for the cluster tests (tests/cluster/) and by hand.
#
#   bin/cluster.sh start          start etcd and the three nodes; wait until one
#                                 leader and two streaming replicas; print the URL
#   bin/cluster.sh start-node N   start node N's Patroni again after a kill (nothing if it runs)
#   bin/cluster.sh status         the members as Patroni sees them
#   bin/cluster.sh url            the multi-host URL the app connects with
#   bin/cluster.sh mode sync|async   synchronous_mode (strict) on or off
#   bin/cluster.sh stop           stop the nodes and etcd, remove their data
#   bin/cluster.sh venv           print where Patroni's virtualenv must be
#   bin/cluster.sh ports          the ports of the cluster (ETCD_PORT=..., REST_PORT=..., PG_PORT=...)
#
# It installs nothing: bin/test installs Debian's etcd-server and creates the
# Patroni virtualenv (requirements/ha.txt) when the cluster tests run; by hand:
#   apt-get install etcd-server
#   python3.11 -m venv "$(bin/cluster.sh venv)" && "$(bin/cluster.sh venv)/bin/pip" install -r requirements/ha.txt
#
# PostgreSQL refuses to run as root, so as root the nodes (and Patroni, which
# starts them) run as the `postgres` user. Everything lives in one directory
# per checkout, /tmp/coordination-ha-<hash of the checkout's path> (or
# COORDINATION_HA_DIR), removed by stop.
#
# Ports: COORDINATION_HA_ETCD_PORT (etcd's clients), COORDINATION_HA_REST_PORT
# (Patroni's REST API of nodes 1-3: that port and the two after it),
# COORDINATION_HA_PG_PORT (PostgreSQL of nodes 1-3, likewise), when set, are
# used as given; start fails at once if another process holds one. Unset, start
# takes the first free ones from 23790, 8031 and 55431 (etcd's peer port: the
# first free from the client port + 10). The ports chosen are recorded in the
# cluster's directory: every later command (url, status, stop, start-node,
# `ports`, the tests and the chaos tool) uses them. Only processes this script
# started for this directory are ever reused: an etcd or a PostgreSQL on a
# default port that is someone else's is left alone.
set -euo pipefail

# shellcheck source=bin/_bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

NODES=(1 2 3)
ROOT=${COORDINATION_HA_DIR:-${TMPDIR:-/tmp}/coordination-ha-$(printf '%s' "$REPO_ROOT" | sha256sum | cut -c1-12)}
# The ports of the cluster in ROOT, once start has chosen them (choose_ports);
# until then what start would try first.
ETCD_PORT=${COORDINATION_HA_ETCD_PORT:-23790}
ETCD_PEER_PORT=$((ETCD_PORT + 10))
REST_PORT=${COORDINATION_HA_REST_PORT:-8031}
PG_PORT=${COORDINATION_HA_PG_PORT:-55431}
# shellcheck source=/dev/null  # written by choose_ports
[[ -f $ROOT/ports ]] && source "$ROOT/ports"
PG_BIN=${COORDINATION_PG_BIN:-/usr/lib/postgresql/15/bin}
SCOPE=coordination-ha
START_TIMEOUT=${COORDINATION_HA_START_TIMEOUT:-120}


as_owner() {
    if [[ $EUID -eq 0 ]]; then
        (cd / && runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

# Patroni's virtualenv: in the checkout if the owner can run it from there,
# else in /tmp (a checkout under /root is out of the postgres user's reach).
venv_dir() {
    if [[ -n "${COORDINATION_HA_VENV:-}" ]]; then
        echo "$COORDINATION_HA_VENV"
    elif [[ $EUID -ne 0 ]] || (cd / && runuser -u postgres -- test -x "$REPO_ROOT") 2>/dev/null; then
        echo "$REPO_ROOT/.venv-ha"
    else
        echo "${TMPDIR:-/tmp}/coordination-ha-venv"
    fi
}

url() {
    local hosts="" ports="" n
    for n in "${NODES[@]}"; do
        hosts+="127.0.0.1,"
        ports+="$((PG_PORT + n - 1)),"
    done
    # libpq's multi-host form: it tries each host in turn and keeps the one
    # that accepts writes.
    printf 'postgres://coordination@%s/coordination?target_session_attrs=read-write\n' \
        "$(paste -d: <(tr ',' '\n' <<<"${hosts%,}") <(tr ',' '\n' <<<"${ports%,}") | paste -sd,)"
}

rest() { # rest N PATH [curl args...]: a call to node N's REST API
    local n=$1 path=$2
    shift 2
    curl -fsS --max-time 3 "$@" "http://127.0.0.1:$((REST_PORT + n - 1))$path"
}

# choose_ports: the ports of a new cluster (see the header), written to $ROOT/ports.
choose_ports() {
    ETCD_PORT=$(pick_port COORDINATION_HA_ETCD_PORT 23790) || exit 1
    ETCD_PEER_PORT=$(free_port $((ETCD_PORT + 10)) 1 "$ETCD_PORT") || exit 1
    REST_PORT=$(pick_port COORDINATION_HA_REST_PORT 8031 ${#NODES[@]} "$ETCD_PORT" "$ETCD_PEER_PORT") || exit 1
    PG_PORT=$(pick_port COORDINATION_HA_PG_PORT 55431 ${#NODES[@]} "$ETCD_PORT" "$ETCD_PEER_PORT" \
        $(seq "$REST_PORT" $((REST_PORT + ${#NODES[@]} - 1)))) || exit 1
    printf 'ETCD_PORT=%s\nETCD_PEER_PORT=%s\nREST_PORT=%s\nPG_PORT=%s\n' \
        "$ETCD_PORT" "$ETCD_PEER_PORT" "$REST_PORT" "$PG_PORT" >"$ROOT/ports"
    info "ports: etcd $ETCD_PORT (peer $ETCD_PEER_PORT), Patroni REST $REST_PORT-$((REST_PORT + 2)), PostgreSQL $PG_PORT-$((PG_PORT + 2))"
}

# etcd_pid: our etcd's pid, if it runs (the process the pid file names, serving
# this cluster's data directory).
etcd_pid() {
    local pid
    pid=$(cat "$ROOT/etcd.pid" 2>/dev/null) || return 1
    [[ -n $pid ]] && grep -qaF -- "$ROOT/etcd/data" "/proc/$pid/cmdline" 2>/dev/null || return 1
    echo "$pid"
}

etcd_ok() { curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }

start_etcd() {
    if etcd_pid >/dev/null; then
        info "etcd: already running on 127.0.0.1:$ETCD_PORT"
        return 0
    fi
    command -v etcd >/dev/null || die "etcd not found: apt-get install etcd-server"
    mkdir -p "$ROOT/etcd"
    info "etcd: starting on 127.0.0.1:$ETCD_PORT (log $ROOT/etcd.log)"
    # The pid is written by the process itself: setsid may fork, so $! would
    # be the pid of a parent that is gone.
    setsid sh -c 'echo $$ >"$1"; shift; exec "$@"' sh "$ROOT/etcd.pid" etcd --name ha --data-dir "$ROOT/etcd/data" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "ha=http://127.0.0.1:$ETCD_PEER_PORT" \
        --enable-v2=false </dev/null >>"$ROOT/etcd.log" 2>&1 &
    local i
    for ((i = 0; i < 100; i++)); do
        # Healthy, and ours: not another etcd that took the port first.
        etcd_ok && etcd_pid >/dev/null && return 0
        sleep 0.2
    done
    tail -n 20 "$ROOT/etcd.log" >&2
    die "etcd did not become healthy (log $ROOT/etcd.log)"
}

write_config() { # write_config N
    local n=$1 dir="$ROOT/node$1"
    mkdir -p "$dir"
    cat >"$dir/patroni.yml" <<EOF
# Written by bin/cluster.sh.
scope: $SCOPE
namespace: /coordination-ha/
name: node$n
log:
  level: INFO
restapi:
  listen: 127.0.0.1:$((REST_PORT + n - 1))
  connect_address: 127.0.0.1:$((REST_PORT + n - 1))
etcd3:
  hosts: 127.0.0.1:$ETCD_PORT
bootstrap:
  dcs:
    # A dead leader's key expires after ttl seconds: the failover time.
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    synchronous_mode: false
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        max_connections: 100
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 128MB
        fsync: "on"
  initdb:
    - encoding: UTF8
    - no-locale
  pg_hba:
    - local all all trust
    - host replication replicator 127.0.0.1/32 trust
    - host all all 127.0.0.1/32 trust
  post_bootstrap: $dir/post_bootstrap.sh
postgresql:
  listen: 127.0.0.1:$((PG_PORT + n - 1))
  connect_address: 127.0.0.1:$((PG_PORT + n - 1))
  data_dir: $dir/data
  # A replica clones the leader with pg_basebackup: without a fast checkpoint it
  # waits for a spread one (a minute and more).
  basebackup:
    - checkpoint: fast
  bin_dir: $PG_BIN
  pgpass: $dir/pgpass
  authentication:
    superuser:
      username: coordination
      password: coordination
    replication:
      username: replicator
      password: replicator
    rewind:
      username: coordination
      password: coordination
  parameters:
    unix_socket_directories: $dir
tags:
  nofailover: false
  noloadbalance: false
EOF
    # Runs once, on the node that initialises the cluster.
    cat >"$dir/post_bootstrap.sh" <<EOF
#!/bin/sh
exec "$PG_BIN/psql" -X -q -h 127.0.0.1 -p $((PG_PORT + n - 1)) -U coordination -d postgres -c 'CREATE DATABASE coordination'
EOF
    chmod 755 "$dir/post_bootstrap.sh"
}

# node_pids N: the processes running node N's Patroni (runuser's and its own),
# found by the configuration file on their command line: a pid file can name a
# runuser that a KILL took away from its child, or a start that came later.
node_pids() {
    local file pid
    for file in $(grep -laF -- "$ROOT/node$1/patroni.yml" /proc/[0-9]*/cmdline 2>/dev/null); do
        pid=${file#/proc/}
        pid=${pid%/cmdline}
        # grep matched its own command line too; it has exited by now.
        [[ $pid != "$$" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
    done
    return 0
}

start_node() { # start_node N: nothing if node N's Patroni is running already
    local n=$1 dir="$ROOT/node$1" venv i
    if [[ -n $(node_pids "$n") ]]; then
        info "node$n: Patroni is running already"
        return 0
    fi
    venv=$(venv_dir)
    [[ -x $venv/bin/patroni ]] || die "Patroni not found in $venv: bin/test creates it (requirements/ha.txt)"
    [[ -x $PG_BIN/initdb ]] || die "PostgreSQL 15 not found in $PG_BIN: apt-get install postgresql-15"
    [[ -f $dir/patroni.yml ]] || write_config "$n"
    [[ $EUID -eq 0 ]] && chown -R postgres: "$dir"
    info "node$n: starting Patroni (PostgreSQL on 127.0.0.1:$((PG_PORT + n - 1)), log $dir/patroni.log)"
    # setsid: a kill of the caller's process group leaves the node to stop.
    local run=("$venv/bin/patroni" "$dir/patroni.yml")
    [[ $EUID -eq 0 ]] && run=(runuser -u postgres -- "${run[@]}")
    # patroni.pid: the process itself (runuser as root), written by it.
    rm -f "$dir/patroni.pid"
    (cd / && setsid sh -c 'echo $$ >"$1"; shift; exec "$@"' sh "$dir/patroni.pid" "${run[@]}" \
        </dev/null >>"$dir/patroni.log" 2>&1 &)
    # Return once the pid file names the new process, so that a stop coming
    # right after this start finds it.
    for ((i = 0; i < 100; i++)); do
        [[ -s $dir/patroni.pid ]] && return 0
        sleep 0.05
    done
    die "node$n: Patroni did not start (log $dir/patroni.log)"
}

# The cluster as Patroni sees it: one "name role state lag" line per member.
members() {
    local n body
    for n in "${NODES[@]}"; do
        body=$(rest "$n" /cluster 2>/dev/null) || continue
        if "$(venv_dir)/bin/python" -c '
import json, sys
for m in json.load(sys.stdin)["members"]:
    print(m["name"], m["role"], m["state"], m.get("lag", "-"), m.get("timeline", "-"))
' <<<"$body"; then
            return 0
        fi
    done
    return 1
}

healthy() { # one leader (running) and two replicas streaming
    local list
    list=$(members 2>/dev/null) || return 1
    [[ $(grep -c -E ' leader running ' <<<"$list") -eq 1 ]] || return 1
    [[ $(grep -c -E ' (replica|sync_standby) streaming ' <<<"$list") -eq 2 ]] || return 1
}

wait_healthy() {
    local deadline=$((SECONDS + START_TIMEOUT))
    until healthy; do
        if ((SECONDS > deadline)); then
            members >&2 || true
            die "the cluster has no leader with two streaming replicas after ${START_TIMEOUT}s (logs: $ROOT/node*/patroni.log)"
        fi
        sleep 0.5
    done
}

# running: some process of this cluster (etcd, a node's Patroni) runs.
running() {
    local n
    etcd_pid >/dev/null && return 0
    for n in "${NODES[@]}"; do
        [[ -z $(node_pids "$n") ]] || return 0
    done
    return 1
}

cmd_start() {
    mkdir -p "$ROOT"
    chmod 755 "$ROOT"
    if ! running; then
        # A new cluster, on ports free now; what a killed run left is of no use.
        rm -rf -- "$ROOT"/node[0-9]* "$ROOT/etcd" "$ROOT/etcd.pid" "$ROOT/ports"
        choose_ports
    else
        # Running: its recorded ports stand; a different one asked for is an error.
        local var given recorded
        for var in ETCD REST PG; do
            given=COORDINATION_HA_${var}_PORT
            given=${!given:-}
            recorded=${var}_PORT
            [[ -z $given || $given == "${!recorded}" ]] ||
                die "the cluster in $ROOT runs with ${var}_PORT ${!recorded}, not COORDINATION_HA_${var}_PORT=$given: bin/cluster.sh stop first"
        done
    fi
    start_etcd
    local n pid
    for n in "${NODES[@]}"; do
        pid=$(cat "$ROOT/node$n/patroni.pid" 2>/dev/null || true)
        if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
            continue
        fi
        start_node "$n"
        # The first node initialises the cluster (or a running one leads); the
        # others clone the leader.
        if [[ $n == 1 ]]; then
            local deadline=$((SECONDS + START_TIMEOUT))
            until members 2>/dev/null | grep -q ' leader running '; do
                ((SECONDS < deadline)) || die "no leader (log $ROOT/node1/patroni.log)"
                sleep 0.5
            done
        fi
    done
    wait_healthy
    members >&2
    url
}

cmd_mode() { # sync | async
    local body
    case ${1:-} in
    sync) body='{"synchronous_mode": true, "synchronous_mode_strict": true}' ;;
    async) body='{"synchronous_mode": false, "synchronous_mode_strict": false}' ;;
    *) die "usage: bin/cluster.sh mode sync|async" ;;
    esac
    local n
    for n in "${NODES[@]}"; do
        if rest "$n" /config -X PATCH -H 'Content-Type: application/json' -d "$body" >/dev/null 2>&1; then
            return 0
        fi
    done
    die "no node accepted the configuration change"
}

stop_pids() { # stop_pids "PID..." [SECONDS]: TERM, wait up to SECONDS (20), then KILL
    local pids=$1 steps=$((${2:-20} * 5)) pid i alive
    [[ -n ${pids// /} ]] || return 0
    # shellcheck disable=SC2086  # a list of numbers
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < steps; i++)); do
        alive=0
        for pid in $pids; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        ((alive)) || return 0
        sleep 0.2
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

cmd_stop() {
    local n pids=""
    # Every node's Patroni at once (each stops its PostgreSQL): the process its
    # pid file names and whatever else runs the node's configuration (a
    # runuser's child that a KILL left behind, a Patroni started twice).
    for n in "${NODES[@]}"; do
        pids+=" $(cat "$ROOT/node$n/patroni.pid" 2>/dev/null || true) $(node_pids "$n")"
    done
    stop_pids "$pids"
    for n in "${NODES[@]}"; do
        # A node whose Patroni was killed leaves its PostgreSQL running.
        if [[ -f $ROOT/node$n/data/postmaster.pid ]]; then
            as_owner "$PG_BIN/pg_ctl" -D "$ROOT/node$n/data" -m immediate -w -t 30 -s stop \
                >/dev/null 2>&1 || true
        fi
    done
    stop_pids "$(etcd_pid || true)" 5
    if [[ $ROOT == "${TMPDIR:-/tmp}"/coordination-ha-* ]]; then
        rm -rf -- "$ROOT"
    else
        rm -rf -- "$ROOT"/node[0-9]* "$ROOT/etcd" "$ROOT/etcd.pid" "$ROOT/ports"
    fi
    info "cluster stopped"
}

case ${1:-} in
start) cmd_start ;;
start-node) start_node "${2:?usage: bin/cluster.sh start-node N}" ;;
status) members || die "no node answers (bin/cluster.sh start)" ;;
url) url ;;
mode) cmd_mode "${2:-}" ;;
stop) cmd_stop ;;
venv) venv_dir ;;
root) echo "$ROOT" ;;
ports) printf 'ETCD_PORT=%s\nREST_PORT=%s\nPG_PORT=%s\n' "$ETCD_PORT" "$REST_PORT" "$PG_PORT" ;;
*) die "usage: bin/cluster.sh start|start-node N|status|url|mode sync|async|stop|venv|root|ports" ;;
esac
