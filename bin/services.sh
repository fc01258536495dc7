# shellcheck shell=bash
# Private, throwaway PostgreSQL and Redis for the test suite. Source it.
#
#   start_postgres   exports COORDINATION_TEST_DATABASE_URL and COORDINATION_PG_PORT
#                    (postgres://coordination@127.0.0.1:54329/coordination)
#   start_redis      exports COORDINATION_TEST_REDIS_URL and COORDINATION_REDIS_PORT
#                    (redis://127.0.0.1:63799/0)
#   start_mariadb    exports COORDINATION_TEST_MARIADB_URL and COORDINATION_MARIADB_PORT
#                    (mysql://coordination:coordination@127.0.0.1:33069/coordination);
#                    with COORDINATION_MARIADB_DURABLE=1 a server whose commits wait
#                    for the disk, as MariaDB's defaults do (bin/bench-mariadb.sh)
#
# Each does nothing if its URL variable is already set (bring your own server).
#
# Ports: COORDINATION_PG_PORT and COORDINATION_REDIS_PORT, when set, are used
# as given (and the start fails at once if another process holds the port).
# Unset, each server goes on the first port from its default (54329, 63799)
# that is either free or serves one of ours; what was chosen is exported, so
# the scripts and tests started afterwards find it. PostgreSQL keeps its data
# in var/pg (var/pg-<port> on another port), Redis in var/redis likewise;
# PostgreSQL runs as the `postgres` user when we are root (it refuses root).
#
# "Ours" means started by these scripts: the one that starts a server records
# its pid (and the pid's start time) in the shared directory below, and a
# server is reused only while the process answering on the port is that one.
# Anything else on a port (another PostgreSQL, a plain socket) is never used.
#
# Servers are shared by every script of every checkout on this machine that
# uses the same port: each user registers itself, and when a script exits the
# last user out stops the server. So a second bin/test running at the same
# time, or a server left over by a killed run, is reused rather than fought
# over. COORDINATION_KEEP_SERVICES=1 leaves the servers running after exit
# (faster re-runs).

# shellcheck source=bin/_bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

# A port the caller gives is used as given; else the search starts at the default.
_SVC_PG_PORT_GIVEN=${COORDINATION_PG_PORT:+1}
_SVC_REDIS_PORT_GIVEN=${COORDINATION_REDIS_PORT:+1}
_SVC_MARIADB_PORT_GIVEN=${COORDINATION_MARIADB_PORT:+1}
COORDINATION_PG_PORT=${COORDINATION_PG_PORT:-54329}
COORDINATION_REDIS_PORT=${COORDINATION_REDIS_PORT:-63799}
COORDINATION_MARIADB_PORT=${COORDINATION_MARIADB_PORT:-33069}
# How many ports after the default a search tries before giving up.
_SVC_PORT_TRIES=50
# Lock and user registry shared by all checkouts and users of this machine.
_SVC_SHARED_DIR=${COORDINATION_SERVICES_LOCK_DIR:-/tmp/coordination-services}
_SVC_MARKER=coordination-test-cluster

# --- shared state: a mutex per service and a registry of its users ----------

_svc_prepare_shared_dir() {
    if [[ ! -d $_SVC_SHARED_DIR ]]; then
        mkdir -p "$_SVC_SHARED_DIR" 2>/dev/null || true
        chmod 1777 "$_SVC_SHARED_DIR" 2>/dev/null || true
    fi
    [[ -d $_SVC_SHARED_DIR && -w $_SVC_SHARED_DIR ]] ||
        die "cannot write $_SVC_SHARED_DIR (set COORDINATION_SERVICES_LOCK_DIR)"
}

# _svc_mutex_acquire NAME: exclusive lock for start/stop decisions about NAME;
# sets _SVC_MUTEX_FD. Every server started while holding it must get
# "{_SVC_MUTEX_FD}>&-" so it does not inherit the lock.
_svc_mutex_acquire() {
    local file="$_SVC_SHARED_DIR/$1.lock"
    _svc_prepare_shared_dir
    if [[ ! -e $file ]]; then
        (umask 000 && : >>"$file") 2>/dev/null || true
    fi
    exec {_SVC_MUTEX_FD}<"$file" || die "cannot open lock $file"
    if ! flock -n "$_SVC_MUTEX_FD"; then
        info "waiting for another script starting or stopping $1 ..."
        flock "$_SVC_MUTEX_FD"
    fi
}

_svc_mutex_release() {
    flock -u "$_SVC_MUTEX_FD" 2>/dev/null || true
    exec {_SVC_MUTEX_FD}<&-
}

_svc_proc_start_time() { # field 22 of /proc/PID/stat, robust to odd process names
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    printf '%s\n' "${20}"
}

_svc_users_dir() { printf '%s/%s.users\n' "$_SVC_SHARED_DIR" "$1"; }

_svc_register_user() { # _svc_register_user NAME: this script ($$) uses NAME
    local dir
    dir=$(_svc_users_dir "$1")
    if [[ ! -d $dir ]]; then
        mkdir -p "$dir" && chmod 1777 "$dir" 2>/dev/null || true
    fi
    : >"$dir/$$-$(_svc_proc_start_time $$)"
}

# _svc_unregister_user NAME: drop our entry and dead ones; prints live users left.
_svc_unregister_user() {
    local dir entry pid start
    dir=$(_svc_users_dir "$1")
    rm -f "$dir/$$-"* 2>/dev/null
    for entry in "$dir"/*; do
        [[ -e $entry ]] || continue
        entry=${entry##*/}
        pid=${entry%%-*}
        start=${entry#*-}
        if [[ "$(_svc_proc_start_time "$pid" 2>/dev/null)" == "$start" ]]; then
            printf '%s\n' "$pid"
        else
            rm -f "$dir/$entry" 2>/dev/null || true
        fi
    done
}

# --- which server is ours ----------------------------------------------------
# NAME.server in the shared directory: "PID START" of the server these scripts
# started for NAME (service-port), written when it is up, removed when stopped.

_svc_record_server() { # _svc_record_server NAME PID
    printf '%s %s\n' "$2" "$(_svc_proc_start_time "$2")" >"$_SVC_SHARED_DIR/$1.server"
}

_svc_forget_server() { rm -f "$_SVC_SHARED_DIR/$1.server"; }

# _svc_recorded_pid NAME: the recorded server's pid, if that process still runs
# (the same start time: not a later process that got its pid).
_svc_recorded_pid() {
    local pid start file="$_SVC_SHARED_DIR/$1.server"
    [[ -f $file ]] && read -r pid start <"$file" || return 1
    [[ -n $pid && "$(_svc_proc_start_time "$pid" 2>/dev/null)" == "$start" ]] || return 1
    printf '%s\n' "$pid"
}

# --- PostgreSQL -------------------------------------------------------------

_pg_find_bin() {
    local d
    for d in "${COORDINATION_PG_BIN:-}" /usr/lib/postgresql/15/bin; do
        if [[ -n $d && -x $d/initdb && -x $d/pg_ctl ]]; then
            printf '%s\n' "$d"
            return 0
        fi
    done
    if command -v pg_config >/dev/null 2>&1; then
        d=$(pg_config --bindir 2>/dev/null)
        if [[ -x $d/initdb && -x $d/pg_ctl ]]; then
            printf '%s\n' "$d"
            return 0
        fi
    fi
    if command -v initdb >/dev/null 2>&1; then
        d=$(dirname "$(readlink -f "$(command -v initdb)")")
        if [[ -x $d/pg_ctl ]]; then
            printf '%s\n' "$d"
            return 0
        fi
    fi
    return 1
}

# _pg_as_owner CMD...: run CMD as the cluster owner (postgres when we are root).
_pg_as_owner() {
    if [[ $EUID -eq 0 && ${_PG_OWNER:-postgres} != root ]]; then
        (cd / && runuser -u "${_PG_OWNER:-postgres}" -- "$@")
    else
        "$@"
    fi
}

_pg_psql() { # _pg_psql DB SQL
    PGCONNECT_TIMEOUT=5 "$_PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 \
        "postgres://coordination@127.0.0.1:$COORDINATION_PG_PORT/$1" -c "$2"
}

# _pg_isready: 0 accepting, 1 starting/stopping, 2 nothing there.
_pg_isready() {
    "$_PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$COORDINATION_PG_PORT" -t 3
}

# _pg_choose_root: sets _PG_ROOT (holds data/, the socket and the log), _PG_OWNER.
_pg_choose_root() {
    # One data directory per port: a server on another port (a second run of
    # this checkout alongside the first) must not find the first's lock file.
    _PG_ROOT="$REPO_ROOT/var/pg"
    [[ $COORDINATION_PG_PORT == 54329 ]] || _PG_ROOT+="-$COORDINATION_PG_PORT"
    _PG_OWNER=$(id -un)
    if [[ $EUID -ne 0 ]]; then
        mkdir -p "$_PG_ROOT"
        return 0
    fi
    id -u postgres >/dev/null 2>&1 ||
        die "running as root, but there is no 'postgres' user to run PostgreSQL as (apt-get install postgresql-15 creates it)"
    _PG_OWNER=postgres
    mkdir -p "$_PG_ROOT"
    chown postgres:postgres "$_PG_ROOT" 2>/dev/null || true
    # Unix sockets are limited to ~107 bytes; the checkout may be deep.
    local sock="$_PG_ROOT/.s.PGSQL.$COORDINATION_PG_PORT"
    if (cd / && runuser -u postgres -- test -w "$_PG_ROOT" -a -x "$_PG_ROOT") 2>/dev/null &&
        ((${#sock} < 100)); then
        return 0
    fi
    # The postgres user cannot reach the checkout (e.g. under /root): use a
    # throwaway directory instead, removed when the cluster is stopped. The
    # directory made above is left only if it holds something (rmdir).
    rmdir -- "$_PG_ROOT" 2>/dev/null || true
    _PG_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/coordination-pg.XXXXXX")
    chmod 755 "$_PG_ROOT"
    chown postgres:postgres "$_PG_ROOT"
    info "PostgreSQL: postgres cannot use $REPO_ROOT/var; using $_PG_ROOT"
}

# _pg_ours: the server on the port is the one these scripts recorded (it may be
# starting up or shutting down: wait for it); sets _PG_DATA.
_pg_ours() {
    local pid status i
    pid=$(_svc_recorded_pid "pg-$COORDINATION_PG_PORT") || return 1
    for ((i = 0; i < 30; i++)); do
        status=0
        _pg_isready || status=$?
        ((status == 1)) || break # 1: starting up or shutting down
        sleep 1
    done
    ((status == 0)) || return 1
    _PG_DATA=$(_pg_psql postgres "show data_directory" 2>/dev/null) || return 1
    # The recorded postmaster is the one that serves this data directory.
    [[ "$(head -n 1 "$_PG_DATA/postmaster.pid" 2>/dev/null)" == "$pid" ]]
}

_pg_start_new() {
    _pg_choose_root
    local data="$_PG_ROOT/data" log="$_PG_ROOT/postgres.log" fresh=0
    if [[ ! -f $data/PG_VERSION ]]; then
        fresh=1
        info "PostgreSQL: initdb $data"
        _pg_as_owner "$_PG_BIN/initdb" -D "$data" -U coordination -A trust -E UTF8 --no-locale \
            >"$_PG_ROOT/initdb.log" 2>&1 ||
            { cat "$_PG_ROOT/initdb.log" >&2; die "initdb failed (log: $_PG_ROOT/initdb.log)"; }
        printf "\ninclude_if_exists = 'coordination.conf'\n" >>"$data/postgresql.conf"
        if [[ $_PG_ROOT == "$REPO_ROOT"/var/pg* ]]; then
            echo persistent >"$data/$_SVC_MARKER"
        else
            echo ephemeral >"$data/$_SVC_MARKER"
        fi
    fi
    local sockdir="$_PG_ROOT"
    ((${#sockdir} + 20 < 100)) || sockdir=""
    cat >"$data/coordination.conf" <<EOF
# Written by bin/services.sh on every start.
port = $COORDINATION_PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$sockdir'
max_connections = 200
EOF
    if [[ ${COORDINATION_PG_FAST:-0} == 1 ]]; then
        # bin/test's server: its databases are made again by every run, so a
        # commit need not wait for the disk (no test crashes this server; the
        # chaos run restarts a server of its own). Benchmarks want it durable.
        printf 'fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n' >>"$data/coordination.conf"
    else
        printf 'fsync = on\n' >>"$data/coordination.conf"
    fi
    [[ $EUID -eq 0 ]] && chown -R "$_PG_OWNER": "$_PG_ROOT"

    info "PostgreSQL: starting on 127.0.0.1:$COORDINATION_PG_PORT (data $data, log $log)"
    local log_before
    log_before=$(wc -l 2>/dev/null <"$log" || echo 0)
    if ! _pg_as_owner "$_PG_BIN/pg_ctl" -D "$data" -l "$log" -w -t 60 -s start \
        {_SVC_MUTEX_FD}<&- </dev/null >/dev/null; then
        # Another process bound the port between our check and the server's
        # bind (a run with its own lock directory): the caller tries the next.
        if tail -n "+$((log_before + 1))" "$log" 2>/dev/null | grep -q "could not bind"; then
            info "PostgreSQL: port $COORDINATION_PG_PORT was taken while starting"
            # A data directory made for this attempt is not left behind.
            # The refused postmaster may still be exiting: try the removal again.
            ((fresh == 0)) || rm -rf -- "$_PG_ROOT" 2>/dev/null || { sleep 1; rm -rf -- "$_PG_ROOT"; }
            return 2
        fi
        tail -n 30 "$log" >&2 2>/dev/null
        die "PostgreSQL failed to start (log: $log)"
    fi
    _PG_DATA=$data

    local i
    for ((i = 0; i < 60; i++)); do
        _pg_isready && break
        sleep 0.5
    done
    _pg_isready || die "PostgreSQL started but does not answer on port $COORDINATION_PG_PORT (log: $log)"
    if [[ -z "$(_pg_psql postgres "select 1 from pg_database where datname = 'coordination'")" ]]; then
        _pg_psql postgres "create database coordination" || die "could not create database coordination"
    fi
}

# _svc_start_on_free_port LABEL KIND PORT_VAR GIVEN OURS START STARTED REUSED: the one
# search every server's start makes. From the port in PORT_VAR on: reuse the server of
# ours that answers there (then run REUSED), else start one with START where the port
# is free (then STARTED NAME records it), else try the next port; a GIVEN port is used
# as given (port_taken if it is not). Sets _SVC_NAME (KIND-port) and leaves its mutex
# held for the caller's _svc_register_user; PORT_VAR holds the port chosen.
_svc_start_on_free_port() {
    local label=$1 kind=$2 port_var=$3 given=$4 ours=$5 start=$6 started=$7 reused=$8
    local tries outcome
    for ((tries = 0; ; tries++)); do
        _SVC_NAME="$kind-${!port_var}"
        _svc_mutex_acquire "$_SVC_NAME"
        if "$ours"; then
            info "$label: reusing ours on port ${!port_var}"
            "$reused"
            return 0
        fi
        if port_free "${!port_var}"; then
            outcome=0
            "$start" || outcome=$?
            if ((outcome == 0)); then
                "$started" "$_SVC_NAME"
                return 0
            fi
        fi
        _svc_mutex_release
        [[ -z $given ]] || port_taken "$port_var"
        ((tries < _SVC_PORT_TRIES)) || die "$label: no free port from $((${!port_var} - tries))"
        info "$label: port ${!port_var} is taken by another process; trying the next one"
        printf -v "$port_var" '%d' $((${!port_var} + 1))
    done
}

_pg_started() { _svc_record_server "$1" "$(head -n 1 "$_PG_DATA/postmaster.pid")"; }
_pg_reused() {
    info "PostgreSQL: data in $_PG_DATA"
    if [[ -z "$(_pg_psql postgres "select 1 from pg_database where datname = 'coordination'")" ]]; then
        _pg_psql postgres "create database coordination" || die "could not create database coordination"
    fi
}
_redis_started() { _svc_record_server "$1" "$(_redis_pid)"; }
_mariadb_started() {
    _svc_record_server "$1" "$(cat "$_MARIADB_ROOT/mysqld.pid")"
    printf '%s\n' "$_MARIADB_ROOT" >"$_SVC_SHARED_DIR/$1.root"
}

start_postgres() {
    if [[ -n "${COORDINATION_TEST_DATABASE_URL:-}" ]]; then
        info "PostgreSQL: using COORDINATION_TEST_DATABASE_URL from the environment"
        return 0
    fi
    _PG_BIN=$(_pg_find_bin) ||
        die "PostgreSQL server binaries (initdb, pg_ctl) not found in /usr/lib/postgresql/15/bin or PATH.
       Install them:  apt-get install postgresql-15
       or point COORDINATION_TEST_DATABASE_URL at a PostgreSQL you already run."
    local b
    for b in psql pg_isready; do
        [[ -x $_PG_BIN/$b ]] || die "$_PG_BIN/$b missing: apt-get install postgresql-client-15"
    done
    command -v flock >/dev/null || die "flock missing: apt-get install util-linux"

    _PG_DATA=""
    _svc_start_on_free_port PostgreSQL pg COORDINATION_PG_PORT "$_SVC_PG_PORT_GIVEN" \
        _pg_ours _pg_start_new _pg_started _pg_reused
    local name=$_SVC_NAME
    _svc_register_user "$name"
    _svc_mutex_release
    on_exit _stop_postgres

    export COORDINATION_PG_PORT
    export COORDINATION_TEST_DATABASE_URL="postgres://coordination@127.0.0.1:$COORDINATION_PG_PORT/coordination"
}

_stop_postgres() {
    local name="pg-$COORDINATION_PG_PORT" others kind="" owner root
    _svc_mutex_acquire "$name"
    others=$(_svc_unregister_user "$name")
    if [[ -n $others ]]; then
        info "PostgreSQL: left running for other users (pid ${others//$'\n'/ })"
    elif [[ "${COORDINATION_KEEP_SERVICES:-0}" == 1 ]]; then
        info "PostgreSQL: left running on port $COORDINATION_PG_PORT (COORDINATION_KEEP_SERVICES=1)"
    else
        # Ours (started here, or proven by _pg_ours): the last user out stops it.
        kind=$(cat "$_PG_DATA/$_SVC_MARKER" 2>/dev/null || true)
        owner=$(stat -c %U "$_PG_DATA" 2>/dev/null || echo "")
        if [[ -n $owner && ($EUID -eq 0 || $owner == "$(id -un)") ]]; then
            _PG_OWNER=$owner
            info "PostgreSQL: stopping"
            _pg_as_owner "$_PG_BIN/pg_ctl" -D "$_PG_DATA" -m fast -w -t 60 -s stop \
                {_SVC_MUTEX_FD}<&- >/dev/null ||
                info "PostgreSQL: pg_ctl stop failed (data $_PG_DATA)"
            _svc_forget_server "$name"
            root=$(dirname "$_PG_DATA")
            if [[ $kind == ephemeral && $root == "${TMPDIR:-/tmp}"/coordination-pg.* ]]; then
                rm -rf -- "$root"
            fi
        fi
    fi
    _svc_mutex_release
}

# --- Redis ------------------------------------------------------------------

_redis_ping() {
    [[ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$COORDINATION_REDIS_PORT" ping 2>/dev/null)" == PONG ]]
}

_redis_pid() { # the pid of the Redis answering on the port
    timeout 5 redis-cli -h 127.0.0.1 -p "$COORDINATION_REDIS_PORT" info server 2>/dev/null |
        sed -n 's/^process_id:\([0-9]*\).*/\1/p'
}

# _redis_ours: the Redis on the port is the one these scripts recorded.
_redis_ours() {
    local pid
    pid=$(_svc_recorded_pid "redis-$COORDINATION_REDIS_PORT") || return 1
    [[ "$(_redis_pid)" == "$pid" ]]
}

_redis_start_new() {
    local dir="$REPO_ROOT/var/redis" logfile i
    [[ $COORDINATION_REDIS_PORT == 63799 ]] || dir+="-$COORDINATION_REDIS_PORT"
    mkdir -p "$dir"
    logfile="$dir/coordination-test-redis.log"
    info "Redis: starting on 127.0.0.1:$COORDINATION_REDIS_PORT (log $logfile)"
    local log_before
    log_before=$(wc -l 2>/dev/null <"$logfile" || echo 0)
    # shellcheck disable=SC2094 # stdout catches errors from before the log file is open
    setsid redis-server --port "$COORDINATION_REDIS_PORT" --bind 127.0.0.1 \
        --save '' --appendonly no --daemonize no \
        --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$logfile" \
        {_SVC_MUTEX_FD}<&- </dev/null >>"$logfile" 2>&1 &
    _REDIS_PID=$!
    _REDIS_STARTED=1
    for ((i = 0; i < 100; i++)); do
        if kill -0 "$_REDIS_PID" 2>/dev/null; then
            # Answering, and it is the one we started (not a server that took
            # the port between our check and this bind).
            _redis_ping && [[ "$(_redis_pid)" == "$_REDIS_PID" ]] && return 0
        else
            wait "$_REDIS_PID" 2>/dev/null || true
            _REDIS_STARTED=0
            if tail -n "+$((log_before + 1))" "$logfile" 2>/dev/null | grep -q "Address already in use"; then
                info "Redis: port $COORDINATION_REDIS_PORT was taken while starting"
                return 2
            fi
            break
        fi
        sleep 0.1
    done
    tail -n 20 "$logfile" >&2 2>/dev/null
    die "Redis failed to start on port $COORDINATION_REDIS_PORT (log: $logfile)"
}

start_redis() {
    if [[ -n "${COORDINATION_TEST_REDIS_URL:-}" ]]; then
        info "Redis: using COORDINATION_TEST_REDIS_URL from the environment"
        return 0
    fi
    local missing=""
    command -v redis-server >/dev/null 2>&1 || missing+=" redis-server"
    command -v redis-cli >/dev/null 2>&1 || missing+=" redis-cli"
    [[ -z $missing ]] ||
        die "${missing# } not found. Install:  apt-get install redis-server  (redis-cli comes with redis-tools)
       or point COORDINATION_TEST_REDIS_URL at a Redis you already run."
    command -v flock >/dev/null || die "flock missing: apt-get install util-linux"

    _REDIS_STARTED=0
    _svc_start_on_free_port Redis redis COORDINATION_REDIS_PORT "$_SVC_REDIS_PORT_GIVEN" \
        _redis_ours _redis_start_new _redis_started :
    local name=$_SVC_NAME
    _svc_register_user "$name"
    _svc_mutex_release
    on_exit _stop_redis

    export COORDINATION_REDIS_PORT
    export COORDINATION_TEST_REDIS_URL="redis://127.0.0.1:$COORDINATION_REDIS_PORT/0"
}

_stop_redis() {
    local name="redis-$COORDINATION_REDIS_PORT" others i
    _svc_mutex_acquire "$name"
    others=$(_svc_unregister_user "$name")
    if [[ -n $others ]]; then
        info "Redis: left running for other users (pid ${others//$'\n'/ })"
    elif [[ "${COORDINATION_KEEP_SERVICES:-0}" == 1 ]]; then
        info "Redis: left running on port $COORDINATION_REDIS_PORT (COORDINATION_KEEP_SERVICES=1)"
    else
        # Ours (started here, or proven by _redis_ours): the last user out stops it.
        info "Redis: stopping"
        redis-cli -h 127.0.0.1 -p "$COORDINATION_REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
        for ((i = 0; i < 50; i++)); do
            _redis_ping || break
            sleep 0.1
        done
        if [[ $_REDIS_STARTED == 1 ]]; then
            kill "$_REDIS_PID" 2>/dev/null || true
            wait "$_REDIS_PID" 2>/dev/null || true
        fi
        _svc_forget_server "$name"
    fi
    _svc_mutex_release
}

# --- MariaDB ----------------------------------------------------------------
# start_mariadb exports COORDINATION_TEST_MARIADB_URL and COORDINATION_MARIADB_PORT
# (mysql://coordination:coordination@127.0.0.1:33069/coordination). Its data
# lives in a throwaway directory, removed when the server stops: mariadb-install-db
# makes a new one in seconds. It runs as the `mysql` user when we are root.

_mariadb_admin() { # _mariadb_admin SQL: as the server's root, over its socket
    timeout 30 mariadb --no-defaults -u root --socket="$_MARIADB_ROOT/mysqld.sock" -N -e "$1"
}

_mariadb_ping() {
    timeout 5 mariadb-admin --no-defaults -h 127.0.0.1 -P "$COORDINATION_MARIADB_PORT" \
        -u coordination -pcoordination --connect-timeout=3 ping >/dev/null 2>&1
}

# innodb_flush_log_at_trx_commit: 2 for the tests' server (a commit waits for the
# log write, not for the disk: its databases are made again by every run); 1,
# MariaDB's default, with COORDINATION_MARIADB_DURABLE=1 (benchmarks: a commit
# is durable when it returns, as on a user's server).
_mariadb_flush_mode() { [[ ${COORDINATION_MARIADB_DURABLE:-0} == 1 ]] && echo 1 || echo 2; }

_mariadb_ours() {
    local pid mode
    pid=$(_svc_recorded_pid "mariadb-$COORDINATION_MARIADB_PORT") || return 1
    _MARIADB_ROOT=$(cat "$_SVC_SHARED_DIR/mariadb-$COORDINATION_MARIADB_PORT.root" 2>/dev/null) || return 1
    [[ "$(cat "$_MARIADB_ROOT/mysqld.pid" 2>/dev/null)" == "$pid" ]] && _mariadb_ping || return 1
    # Ours, but committing otherwise than asked: not the one wanted (the search goes on).
    mode=$(timeout 10 mariadb --no-defaults -h 127.0.0.1 -P "$COORDINATION_MARIADB_PORT" \
        -u coordination -pcoordination -N -e "SELECT @@innodb_flush_log_at_trx_commit" 2>/dev/null) ||
        return 1
    if [[ $mode != "$(_mariadb_flush_mode)" ]]; then
        info "MariaDB: ours on port $COORDINATION_MARIADB_PORT runs innodb_flush_log_at_trx_commit=$mode, not $(_mariadb_flush_mode)"
        return 1
    fi
}

_mariadb_start_new() {
    local owner i log
    _MARIADB_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/coordination-mariadb.XXXXXX")
    chmod 755 "$_MARIADB_ROOT"
    owner=$(id -un)
    if [[ $EUID -eq 0 ]]; then
        id -u mysql >/dev/null 2>&1 ||
            die "running as root, but there is no 'mysql' user to run MariaDB as (apt-get install mariadb-server creates it)"
        owner=mysql
        chown mysql:mysql "$_MARIADB_ROOT"
    fi
    log="$_MARIADB_ROOT/error.log"
    info "MariaDB: mariadb-install-db $_MARIADB_ROOT/data"
    (cd / && runuser -u "$owner" -- mariadb-install-db --no-defaults --datadir="$_MARIADB_ROOT/data" \
        --auth-root-authentication-method=socket --skip-test-db --skip-name-resolve) \
        >"$_MARIADB_ROOT/install.log" 2>&1 ||
        { tail -n 20 "$_MARIADB_ROOT/install.log" >&2; die "mariadb-install-db failed (log: $_MARIADB_ROOT/install.log)"; }
    info "MariaDB: starting on 127.0.0.1:$COORDINATION_MARIADB_PORT (data $_MARIADB_ROOT/data, log $log," \
        "innodb_flush_log_at_trx_commit=$(_mariadb_flush_mode))"
    # Every descriptor of the caller's is closed: a pipe the caller reads must end.
    (cd / && exec setsid runuser -u "$owner" -- "$_MARIADB_BIN" --no-defaults \
        --datadir="$_MARIADB_ROOT/data" --port="$COORDINATION_MARIADB_PORT" --bind-address=127.0.0.1 \
        --socket="$_MARIADB_ROOT/mysqld.sock" --pid-file="$_MARIADB_ROOT/mysqld.pid" \
        --log-error="$log" --skip-name-resolve --max-connections=300 \
        --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci \
        --innodb-flush-log-at-trx-commit="$(_mariadb_flush_mode)" --innodb-buffer-pool-size=128M) \
        {_SVC_MUTEX_FD}<&- </dev/null >/dev/null 2>&1 &
    for ((i = 0; i < 120; i++)); do
        [[ -S $_MARIADB_ROOT/mysqld.sock && -s $_MARIADB_ROOT/mysqld.pid ]] && break
        if grep -q "Do you already have another server running on port" "$log" 2>/dev/null; then
            info "MariaDB: port $COORDINATION_MARIADB_PORT was taken while starting"
            rm -rf -- "$_MARIADB_ROOT"
            return 2
        fi
        sleep 0.25
    done
    [[ -S $_MARIADB_ROOT/mysqld.sock ]] ||
        { tail -n 20 "$log" >&2 2>/dev/null; die "MariaDB failed to start (log: $log)"; }
    _mariadb_admin "CREATE USER IF NOT EXISTS 'coordination'@'127.0.0.1' IDENTIFIED BY 'coordination';
        GRANT ALL PRIVILEGES ON *.* TO 'coordination'@'127.0.0.1';
        CREATE DATABASE IF NOT EXISTS coordination CHARACTER SET utf8mb4;" ||
        die "MariaDB: could not create the coordination user (log: $log)"
    _mariadb_ping || die "MariaDB started but does not answer on port $COORDINATION_MARIADB_PORT (log: $log)"
}

start_mariadb() {
    if [[ -n "${COORDINATION_TEST_MARIADB_URL:-}" ]]; then
        info "MariaDB: using COORDINATION_TEST_MARIADB_URL from the environment"
        return 0
    fi
    _MARIADB_BIN=$(command -v mariadbd || echo /usr/sbin/mariadbd)
    [[ -x $_MARIADB_BIN ]] && command -v mariadb-install-db >/dev/null && command -v mariadb >/dev/null ||
        die "MariaDB server not found. Install:  apt-get install mariadb-server
       or point COORDINATION_TEST_MARIADB_URL at a MariaDB you already run."
    command -v flock >/dev/null || die "flock missing: apt-get install util-linux"

    _svc_start_on_free_port MariaDB mariadb COORDINATION_MARIADB_PORT "$_SVC_MARIADB_PORT_GIVEN" \
        _mariadb_ours _mariadb_start_new _mariadb_started :
    local name=$_SVC_NAME
    _svc_register_user "$name"
    _svc_mutex_release
    on_exit _stop_mariadb

    export COORDINATION_MARIADB_PORT
    export COORDINATION_TEST_MARIADB_URL="mysql://coordination:coordination@127.0.0.1:$COORDINATION_MARIADB_PORT/coordination"
}

_stop_mariadb() {
    local name="mariadb-$COORDINATION_MARIADB_PORT" others pid i
    _svc_mutex_acquire "$name"
    others=$(_svc_unregister_user "$name")
    if [[ -n $others ]]; then
        info "MariaDB: left running for other users (pid ${others//$'\n'/ })"
    elif [[ "${COORDINATION_KEEP_SERVICES:-0}" == 1 ]]; then
        info "MariaDB: left running on port $COORDINATION_MARIADB_PORT (COORDINATION_KEEP_SERVICES=1)"
    elif pid=$(_svc_recorded_pid "$name"); then
        info "MariaDB: stopping"
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 120; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -9 "$pid" 2>/dev/null || true
        _svc_forget_server "$name"
        rm -f "$_SVC_SHARED_DIR/$name.root"
        [[ $_MARIADB_ROOT == "${TMPDIR:-/tmp}"/coordination-mariadb.* ]] && rm -rf -- "$_MARIADB_ROOT"
    fi
    _svc_mutex_release
}
