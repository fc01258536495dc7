#!/usr/bin/env bash
# Start or stop the consensus services that coordination_bench can run beside
# the grant point as peers: etcd 3.4 (Debian etcd-server) and ZooKeeper 3.8
# (Debian zookeeper / zookeeperd). Each runs as an unprivileged user (when
# started as root: the packages' etcd / zookeeper users, else nobody) on
# private loopback ports, with its data in a directory of its own that `stop`
# deletes. Nothing here is needed by the tests or by CI: the bench skips a
# peer it cannot reach and says why.
#
#   bin/bench-peers.sh start     start both (those whose binaries exist); prints
#                                the environment the bench reads
#   bin/bench-peers.sh stop      stop both and delete their data
#   bin/bench-peers.sh env       print the environment again
#
# Environment: COORDINATION_BENCH_ETCD_PORT (etcd's client port; its peer
# port is one more), COORDINATION_BENCH_ZOOKEEPER_PORT: used as given when set
# (start fails at once if another process holds one); unset, start takes the
# first free ones from 23850 (two in a row) and 21810, and `env` prints what it
# took. A service is reused only when this script started it (its pid file in
# the directory). COORDINATION_BENCH_PEERS_DIR (default
# /tmp/coordination-bench-peers-<uid>).
set -euo pipefail

# shellcheck source=bin/_bootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

DIR=${COORDINATION_BENCH_PEERS_DIR:-/tmp/coordination-bench-peers-$(id -u)}
ZK_JAR=/usr/share/java/zookeeper.jar
# The ports start chose (recorded in the directory), else the ones it would try first.
ETCD_PORT=${COORDINATION_BENCH_ETCD_PORT:-23850}
ZK_PORT=${COORDINATION_BENCH_ZOOKEEPER_PORT:-21810}
# shellcheck source=/dev/null  # written by start
[[ -f $DIR/ports ]] && source "$DIR/ports"

say() { printf 'bench-peers: %s\n' "$*" >&2; }

# as USER CMD...: CMD as USER when root (so the service never runs as root), else as we are.
as() {
    local user=$1
    shift
    if [[ $(id -u) == 0 ]]; then
        id "$user" >/dev/null 2>&1 || user=nobody
        runuser -u "$user" -- "$@"
    else
        "$@"
    fi
}

own() { # own USER DIR: DIR writable by USER (root only)
    if [[ $(id -u) == 0 ]]; then
        id "$1" >/dev/null 2>&1 && chown -R "$1" "$2" || chown -R nobody "$2"
    fi
}

wait_port() { # wait_port PORT NAME: up to 30 s for NAME (started here) to listen on PORT
    local deadline=$((SECONDS + 30))
    while :; do
        # Ours must still run: if it exited (the port taken after all), what
        # answers there is someone else's.
        running "$2" || { say "$2 exited (log: $DIR/$2.log)"; return 1; }
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        ((SECONDS < deadline)) || { say "$2 did not start on port $1 (log: $DIR/$2.log)"; return 1; }
        sleep 0.2
    done
}

print_env() {
    [[ -f $DIR/etcd.pid ]] && echo "export COORDINATION_BENCH_ETCD_URL=http://127.0.0.1:$ETCD_PORT"
    [[ -f $DIR/zookeeper.pid ]] && echo "export COORDINATION_BENCH_ZOOKEEPER=127.0.0.1:$ZK_PORT"
    return 0
}

running() { [[ -f $DIR/$1.pid ]] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

start() {
    mkdir -p "$DIR"
    chmod 755 "$DIR"
    # A service that is not running gets a port free now; a running one keeps its own.
    running etcd || ETCD_PORT=$(pick_port COORDINATION_BENCH_ETCD_PORT 23850 2) || exit 1
    running zookeeper || ZK_PORT=$(pick_port COORDINATION_BENCH_ZOOKEEPER_PORT 21810 1 "$ETCD_PORT" $((ETCD_PORT + 1))) || exit 1
    printf 'ETCD_PORT=%s\nZK_PORT=%s\n' "$ETCD_PORT" "$ZK_PORT" >"$DIR/ports"
    if command -v etcd >/dev/null; then
        if running etcd; then
            say "etcd already running"
        else
            mkdir -p "$DIR/etcd"
            own etcd "$DIR/etcd"
            touch "$DIR/etcd.log" && own etcd "$DIR/etcd.log"
            # As a one-member cluster runs by default: every write fsyncs its WAL.
            as etcd etcd --name bench --data-dir "$DIR/etcd/data" \
                --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
                --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
                --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
                --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
                --initial-cluster "bench=http://127.0.0.1:$((ETCD_PORT + 1))" \
                --log-level warn >>"$DIR/etcd.log" 2>&1 &
            echo $! >"$DIR/etcd.pid"
            wait_port "$ETCD_PORT" etcd
            say "etcd $(etcd --version | head -1 | awk '{print $3}') on 127.0.0.1:$ETCD_PORT"
        fi
    else
        say "etcd not installed (Debian: apt-get install etcd-server); skipped"
    fi
    if [[ -f $ZK_JAR ]] && command -v java >/dev/null; then
        if running zookeeper; then
            say "ZooKeeper already running"
        else
            mkdir -p "$DIR/zookeeper/conf" "$DIR/zookeeper/data"
            cat >"$DIR/zookeeper/conf/zoo.cfg" <<EOF
tickTime=2000
dataDir=$DIR/zookeeper/data
clientPort=$ZK_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=200
admin.enableServer=false
EOF
            printf 'log4j.rootLogger=WARN, CONSOLE\nlog4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\nlog4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\nlog4j.appender.CONSOLE.layout.ConversionPattern=%%d %%p %%m%%n\n' \
                >"$DIR/zookeeper/conf/log4j.properties"
            own zookeeper "$DIR/zookeeper"
            touch "$DIR/zookeeper.log" && own zookeeper "$DIR/zookeeper.log"
            # Standalone; forceSync stays on: a write is fsynced before it is acknowledged.
            as zookeeper java -Xmx256m -cp "$DIR/zookeeper/conf:$ZK_JAR" \
                -Dzookeeper.admin.enableServer=false \
                org.apache.zookeeper.server.ZooKeeperServerMain "$DIR/zookeeper/conf/zoo.cfg" \
                >>"$DIR/zookeeper.log" 2>&1 &
            echo $! >"$DIR/zookeeper.pid"
            wait_port "$ZK_PORT" zookeeper
            say "ZooKeeper $(dpkg-query -W -f='${Version}' zookeeper 2>/dev/null || echo '?') on 127.0.0.1:$ZK_PORT"
        fi
    else
        say "ZooKeeper not installed (Debian: apt-get install zookeeperd); skipped"
    fi
    print_env
}

stop() {
    local name pid
    for name in etcd zookeeper; do
        [[ -f $DIR/$name.pid ]] || continue
        pid=$(cat "$DIR/$name.pid")
        # runuser's pid: its child is the service, stopped with it.
        pkill -TERM -P "$pid" 2>/dev/null || true
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$DIR/$name.pid"
        say "$name stopped"
    done
    rm -rf -- "$DIR"
}

case ${1:-} in
start) start ;;
stop) stop ;;
env) print_env ;;
*) say "usage: $0 start|stop|env"; exit 2 ;;
esac
