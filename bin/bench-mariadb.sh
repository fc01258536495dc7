#!/usr/bin/env bash
# Run a command against a private MariaDB whose commits are durable, as a
# user's server's are (innodb_flush_log_at_trx_commit=1, MariaDB's default;
# the tests' server runs 2). It is bin/services.sh's MariaDB with
# COORDINATION_MARIADB_DURABLE=1: a throwaway data directory, the first free
# port from 33069 (or COORDINATION_MARIADB_PORT) where no server of these
# scripts runs otherwise, stopped when the command ends unless another user
# shares it or COORDINATION_KEEP_SERVICES=1. The command gets DATABASE_URL.
#
#   bin/bench-mariadb.sh .venv/bin/python manage.py coordination_bench --only cycles --clients 1,8
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bin/_bootstrap.sh
source bin/_bootstrap.sh
# shellcheck source=bin/services.sh
source bin/services.sh
cd "$REPO_ROOT"

(($#)) || die "usage: bin/bench-mariadb.sh COMMAND [ARGS...]"
unset COORDINATION_TEST_MARIADB_URL
export COORDINATION_MARIADB_DURABLE=1
start_mariadb
info "MariaDB (durable commits): $COORDINATION_TEST_MARIADB_URL"
status=0
DATABASE_URL=$COORDINATION_TEST_MARIADB_URL "$@" || status=$?
exit "$status"
