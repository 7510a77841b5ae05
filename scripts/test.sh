#!/usr/bin/env bash
# The whole test suite: unit tests, and the behavioural suite against both
# backends (a SQLite file and a real PostgreSQL) through real gRPC.
#
# PostgreSQL: INTRAY_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/postgres)
# must reach a server where that user may create databases. If nothing answers
# on 127.0.0.1:5432 this script tries to start the local Debian cluster; if
# that fails it stops and says what is missing. It never skips the PostgreSQL
# half. Each test creates its own database (intray_test_*) and drops it.
set -euo pipefail
cd "$(dirname "$0")/.."

export INTRAY_TEST_PG_URL="${INTRAY_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/postgres}"

pg_ready() {
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -d "$INTRAY_TEST_PG_URL"
  else
    # No client tools: a TCP connect is the best we can check from bash.
    (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null
  fi
}

if ! pg_ready; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    echo "test.sh: PostgreSQL not answering; starting cluster $version/main" >&2
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 30); do pg_ready && break; sleep 1; done
  fi
fi
if ! pg_ready; then
  cat >&2 <<MSG
test.sh: cannot reach PostgreSQL at $INTRAY_TEST_PG_URL.
The test suite runs every behavioural test on PostgreSQL as well as SQLite and
will not skip that half. Install and start PostgreSQL (Debian: apt-get install
postgresql; pg_ctlcluster <version> main start) or point INTRAY_TEST_PG_URL at
a server where the user may CREATE DATABASE.
MSG
  exit 1
fi
# Answering is not letting in: a refused login (user, password, pg_hba)
# must be named here, not fail every PostgreSQL test.
if command -v psql >/dev/null 2>&1 &&
  ! login=$(psql "$INTRAY_TEST_PG_URL" -Atqc 'SELECT 1' 2>&1 >/dev/null); then
  cat >&2 <<MSG
test.sh: PostgreSQL at $INTRAY_TEST_PG_URL answers but refuses the tests:
$login
Point INTRAY_TEST_PG_URL at a user that may log in and CREATE DATABASE.
MSG
  exit 1
fi

# The clock-skew fault test runs a server under libfaketime (Debian puts it
# under the machine's multiarch folder).
faketime_lib() {
  local lib
  for lib in /usr/lib/*/faketime/libfaketime.so.1; do
    [ -e "$lib" ] && { echo "$lib"; return 0; }
  done
  return 1
}
if ! faketime_lib >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Debian's faketime package for the clock-skew test" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null; }
  fi
fi
if ! INTRAY_FAKETIME_LIB=$(faketime_lib); then
  echo "test.sh: missing libfaketime (Debian package faketime: apt-get install faketime); the clock-skew test needs it" >&2
  exit 1
fi
export INTRAY_FAKETIME_LIB

# Databases left behind by an interrupted earlier run.
if command -v psql >/dev/null 2>&1; then
  psql "$INTRAY_TEST_PG_URL" -Atqc \
    "SELECT datname FROM pg_database WHERE datname LIKE 'intray\_test\_%'" 2>/dev/null |
    while read -r db; do
      [ -n "$db" ] && psql "$INTRAY_TEST_PG_URL" -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 || true
    done
fi

# Arguments narrow the run to what they select (`--test api postgres::`):
# cargo's --all-targets would override a target named in them, and the
# browser and chart suites are left out.
if [ "$#" -gt 0 ]; then
  exec cargo test "$@"
fi

cargo test --all-targets
# The examples in the documentation compile (and run, unless marked not to).
cargo test --doc

# The dashboard in headless Chromium against the binary just built
# (installs Debian's chromium when missing; screenshots under target/screenshots).
scripts/browser-test.sh

# The Helm chart: linted, rendered with Helm's own engine and validated
# against the Kubernetes schemas (its own virtualenv; see the script).
scripts/chart-test.sh

# The Dockerfile, checked without a container engine (none here): its COPY
# sources, its user and entrypoint, and that cargo accepts the manifest in
# the tree it copies.
scripts/check-image.sh
