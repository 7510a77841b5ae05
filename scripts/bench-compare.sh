#!/usr/bin/env bash
# Two intray builds side by side: runs `intray bench --spawn` scenarios with
# each build in turn, ROUNDS times (default 2), on one fresh PostgreSQL
# database per run, and prints one JSON line per result tagged with the
# build and the round. For before/after figures of a change on a shared,
# noisy machine: alternating the builds spreads the noise over both.
#
#   scripts/bench-compare.sh OLD_BINARY NEW_BINARY SCENARIOS [intray bench flags...]
#   scripts/bench-compare.sh /tmp/intray-old target/release/intray submit,watchers
#
# DATABASE_URL names the database each run DROPS and recreates
# (default postgres://postgres@127.0.0.1:5432/intray_bench).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
old=$1 new=$2 scenarios=$3
shift 3
url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/intray_bench}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for build in "$old" "$new"; do
    "$build" bench --spawn --database-url "$url" --scenario "$scenarios" --json "$@" |
      python3 -c '
import json, sys
tag = {"build": sys.argv[1], "round": int(sys.argv[2])}
for line in sys.stdin:
    if line.startswith("{"):
        print(json.dumps({**tag, **json.loads(line)}, sort_keys=True))
' "$build" "$round"
  done
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
