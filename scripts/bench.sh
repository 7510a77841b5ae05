#!/usr/bin/env bash
# One benchmark run on one PostgreSQL: the SQL ceiling (pgbench), the peer
# (graphile-worker), then every `intray bench` scenario on PostgreSQL and the
# main ones on SQLite; prints intray's figures as ratios to the peer's and to
# the SQL ceiling, next to the targets of issue 6, with the load average.
#
# Usage: scripts/bench.sh
#   DATABASE_URL       PostgreSQL server to use (default
#                      postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable: every part
#                      connects in the clear, as the peer does by default; libpq's and intray's
#                      default, sslmode=prefer, encrypts on a server with ssl on, as Debian's is).
#                      The databases intray_bench_sql (pgbench), peer_graphile_worker (the peer) and
#                      intray_bench (intray) are DROPPED and recreated on it; others are not touched.
#   PEERS_DIR          the shared peer benchmarks (default: ../shared/bench beside the repository)
#   INTRAY_BENCH_ARGS  extra flags for both `intray bench` calls, e.g. "--backlog-size 100000"
#   E2E_OUTSTANDING    most jobs outstanding in e2e and e2e-chained (default 1000)
#   BATCHED_OUTSTANDING  most jobs outstanding in e2e-batched (default 10000)
#                      (passed as --e2e-outstanding / --batched-outstanding, so every command line
#                      names them; set them here, not in INTRAY_BENCH_ARGS)
#   INTRAY_BIN         an intray binary to use instead of building target/release/intray
#   CARGO_LOCK         lock file held around cargo (default /tmp/intray-cargo.lock)
#   WAIT_MAX           longest wait (s) for other builds to finish before each part (default 900)
#   Passed through: DURATION, CLAIM_PREFILL, ... to pgbench/run.sh; JOBS, INFLIGHT, ... to the peer.
# Raw output goes to target/bench/bench-<UTC time>.log (the path is printed at the end).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"
PEERS_DIR="${PEERS_DIR:-$ROOT/../shared/bench}"
CARGO_LOCK="${CARGO_LOCK:-/tmp/intray-cargo.lock}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$TARGET_DIR/bench/$STAMP"
LOG="$TARGET_DIR/bench/bench-$STAMP.log"

die() { echo "bench.sh: $*" >&2; exit 1; }

# --- what it needs -----------------------------------------------------------
# tool -> Debian package that provides it
declare -A PKG=([psql]=postgresql-client [pg_isready]=postgresql-client [pgbench]=postgresql
                [node]=nodejs [npm]=npm [flock]=util-linux)
need=(psql pg_isready pgbench node npm)
[ -z "${INTRAY_BIN:-}" ] && need+=(cargo flock)
# A tool is there when it runs: /usr/bin/pgbench, psql and pg_isready can be
# postgresql-client-common's wrapper alone, which fails without the real program.
missing() { for t in "${need[@]}"; do "$t" --version >/dev/null 2>&1 || echo -n "$t "; done; }
if [ -n "$(missing)" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  pkgs=""; for t in $(missing); do [ -n "${PKG[$t]:-}" ] && pkgs="$pkgs ${PKG[$t]}"; done
  if [ -n "$pkgs" ]; then
    echo "bench.sh: installing$pkgs" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs >/dev/null; } || true
  fi
fi
if [ -n "$(missing)" ]; then
  msg="missing (\`TOOL --version\` fails): $(missing)(Debian packages:"
  for t in $(missing); do msg="$msg ${PKG[$t]:-rustup for $t}"; done
  die "$msg; a /usr/bin/pgbench from postgresql-client-common alone is only a wrapper)"
fi
[ -x "$PEERS_DIR/pgbench/run.sh" ] && [ -x "$PEERS_DIR/peers/graphile-worker/run.sh" ] ||
  die "the peer benchmarks are not at $PEERS_DIR (pgbench/run.sh, peers/graphile-worker/run.sh); set PEERS_DIR"
pg_isready -q -d "$DATABASE_URL" ||
  die "PostgreSQL does not answer at $DATABASE_URL (set DATABASE_URL; Debian: pg_ctlcluster 15 main start)"

# DATABASE_URL with another database name (query string kept).
url_with_db() {
  local base="${DATABASE_URL%%\?*}" query=""
  [[ "$DATABASE_URL" == *\?* ]] && query="?${DATABASE_URL#*\?}"
  local hostpart="${base#*://}"
  if [[ "$hostpart" == */* ]]; then base="${base%/*}"; fi
  echo "$base/$1$query"
}
recreate_db() {
  psql "$DATABASE_URL" -Xq -v ON_ERROR_STOP=1 -c "SET client_min_messages=warning" \
    -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" -c "CREATE DATABASE $1"
}
busy() { for p in rustc cargo; do pgrep -x "$p" >/dev/null && echo -n "$p,"; done; true; }
# Bounded wait until no rustc/cargo has run for 20 s (the peers' scripts do the same).
wait_idle() {
  local t0=$SECONDS quiet=0
  while [ $((SECONDS - t0)) -lt "${WAIT_MAX:-900}" ]; do
    if [ -z "$(busy)" ]; then quiet=$((quiet + 2)); [ $quiet -ge 20 ] && return 0; else quiet=0; fi
    sleep 2
  done
  echo "# WARNING: still busy after ${WAIT_MAX:-900}s: $(busy)"
}
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
# Percent of CPU time busy over the next 2 s, all cores.
cpu_busy() {
  local a b
  read -r -a a < <(grep '^cpu ' /proc/stat)
  sleep 2
  read -r -a b < <(grep '^cpu ' /proc/stat)
  local total=0 idle i
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  idle=$((b[4] - a[4] + b[5] - a[5]))
  echo $(( total > 0 ? 100 * (total - idle) / total : 0 ))
}
# Before each part: a CHECKPOINT, so that the WAL the part before wrote
# (pgbench writes a lot of it right before graphile-worker's part) is not
# written out during this one, then a bounded wait for the CPU to calm down
# (under 25 % busy).
settle() {
  psql "$DATABASE_URL" -Xqc "CHECKPOINT" 2>/dev/null ||
    echo "# note: CHECKPOINT refused (needs superuser or pg_checkpoint); parts may overlap checkpoints"
  local t0=$SECONDS b
  while [ $((SECONDS - t0)) -lt 60 ]; do
    b=$(cpu_busy)
    [ "$b" -lt 25 ] && { echo "# settled: CPU ${b} % busy, load average $(loadavg)"; return 0; }
  done
  echo "# WARNING: CPU still ${b} % busy after 60 s; load average $(loadavg)"
}

mkdir -p "$OUT"
exec > >(tee -a "$LOG") 2>&1
# Also when a part fails: the log is where to look.
trap 'echo "raw log: $LOG"' EXIT
LOAD_START="$(loadavg)"
echo "# bench.sh $STAMP on $(nproc) cores; load average at start: $LOAD_START; busy: $(busy)"
echo "# intray $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown); PostgreSQL: ${DATABASE_URL%%@*}@... "

# --- intray, built first so that no build runs during the measurements --------
if [ -n "${INTRAY_BIN:-}" ]; then
  BIN="$INTRAY_BIN"
else
  echo "## building intray (release)"
  flock "$CARGO_LOCK" cargo build --release --bin intray
  BIN="$TARGET_DIR/release/intray"
fi
[ -x "$BIN" ] || die "no intray binary at $BIN"

# --- the SQL ceiling and the peer --------------------------------------------
echo "## pgbench: the SQL ceiling"
recreate_db intray_bench_sql
settle
TESTS="lifecycle claim_b10" CLIENTS="8 32" DATABASE_URL="$(url_with_db intray_bench_sql)" \
  "$PEERS_DIR/pgbench/run.sh" | tee "$OUT/pgbench.out"
echo "## graphile-worker"
settle
DATABASE_URL="$DATABASE_URL" "$PEERS_DIR/peers/graphile-worker/run.sh" | tee "$OUT/graphile-worker.out"

# --- intray --------------------------------------------------------------------
BOUNDS=(--e2e-outstanding "${E2E_OUTSTANDING:-1000}" --batched-outstanding "${BATCHED_OUTSTANDING:-10000}")
# Rows whose server-side count of SUCCEEDED jobs differs from the jobs the
# run completed (intray bench fails on them itself; this also catches a
# binary that does not report what it expected).
unaccounted() {
  awk '/^\{/ && /"stats_succeeded"/ {
    s = e = n = "?"
    if (match($0, /"stats_succeeded":[0-9]+/)) s = substr($0, RSTART + 18, RLENGTH - 18)
    if (match($0, /"expected_succeeded":[0-9]+/)) e = substr($0, RSTART + 21, RLENGTH - 21)
    if (match($0, /"scenario":"[^"]*"/)) n = substr($0, RSTART + 12, RLENGTH - 13)
    if (s != e) printf "%s: %s SUCCEEDED, expected %s; ", n, s, e }' "$1"
}
# Word splitting of INTRAY_BENCH_ARGS is wanted: it holds several flags.
# shellcheck disable=SC2086
{
  echo "## intray bench on PostgreSQL"
  wait_idle
  settle
  "$BIN" bench --spawn --database-url "$(url_with_db intray_bench)" "${BOUNDS[@]}" \
    --server-log "$OUT/server-postgres.log" ${INTRAY_BENCH_ARGS:-} | tee "$OUT/intray-postgres.out"
  bad="$(unaccounted "$OUT/intray-postgres.out")"
  [ -z "$bad" ] || die "not every job of the PostgreSQL run ended SUCCEEDED: $bad"
  echo "## intray bench on SQLite"
  wait_idle
  settle
  "$BIN" bench --spawn --database-url "sqlite://$OUT/intray-bench.db" "${BOUNDS[@]}" \
    --scenario submit,e2e,e2e-chained,e2e-batched,burn-down,burn-down-chained,dispatch \
    --server-log "$OUT/server-sqlite.log" ${INTRAY_BENCH_ARGS:-} | tee "$OUT/intray-sqlite.out"
  bad="$(unaccounted "$OUT/intray-sqlite.out")"
  [ -z "$bad" ] || die "not every job of the SQLite run ended SUCCEEDED: $bad"
}
LOAD_END="$(loadavg)"

# --- the summary ---------------------------------------------------------------
# pgbench TEST CLIENTS KEY: "pgbench lifecycle c=32 tps=... jobs/s=..." lines
pgb() {
  awk -v t="$1" -v c="c=$2" -v k="$3" '$1 == "pgbench" && $2 == t && $3 == c {
    for (i = 4; i <= NF; i++) if (index($i, k "=") == 1) { v = substr($i, length(k) + 2); sub(/ms$/, "", v); print v; exit } }' \
    "$OUT/pgbench.out"
}
# gw FIGURE KEY: "graphile-worker process_default jobs=... jobs_per_s=..." lines
gw() {
  awk -v f="$1" -v k="$2" '$1 == "graphile-worker" && $2 == f {
    for (i = 3; i <= NF; i++) if (index($i, k "=") == 1) { print substr($i, length(k) + 2); exit } }' \
    "$OUT/graphile-worker.out"
}
# ij BACKEND SCENARIO KEY [MATCH]: KEY of the first JSON line of SCENARIO (that contains MATCH)
ij() {
  grep '^{' "$OUT/intray-$1.out" | grep -F "\"scenario\":\"$2\"" | grep -F -- "${4:-}" | head -n 1 |
    sed -n "s/.*\"$3\":\([-0-9.eE+]*\).*/\1/p"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "-"; else printf "%.2fx", a / b }'; }
# meets VALUE OP LIMIT -> yes / NO / ?
meets() {
  awk -v v="$1" -v op="$2" -v l="$3" 'BEGIN { if (v == "" || v == "-") { print "?"; exit }
    sub(/x$/, "", v); ok = (op == ">=") ? (v + 0 >= l + 0) : (v + 0 <= l + 0); print ok ? "yes" : "NO" }'
}
row() { printf "| %-54s | %10s | %10s | %12s | %8s | %-34s | %-4s |\n" "$@"; }

GW_DEFAULT="$(gw process_default jobs_per_s)"; GW_BATCHED="$(gw process_batched jobs_per_s)"
GW_C16="$(gw enqueue_single_c16 jobs_per_s)"
GW_SEQ50="$(gw enqueue_single_seq p50_ms)"; GW_SEQ99="$(gw enqueue_single_seq p99_ms)"
GW_LAT50="$(gw latency_add_job_to_task_start p50_ms)"; GW_LAT99="$(gw latency_add_job_to_task_start p99_ms)"
SQL32="$(pgb lifecycle 32 jobs/s)"
E2E="$(ij postgres e2e jobs_per_s)"; E2E_SQ="$(ij sqlite e2e jobs_per_s)"
E2E_OUT="$(ij postgres e2e outstanding)"; BAT_OUT="$(ij postgres e2e-batched outstanding)"
E2E_CH="$(ij postgres e2e-chained jobs_per_s)"; E2E_CH_SQ="$(ij sqlite e2e-chained jobs_per_s)"
BURN="$(ij postgres burn-down jobs_per_s)"; BURN_SQ="$(ij sqlite burn-down jobs_per_s)"
BURN_CH="$(ij postgres burn-down-chained jobs_per_s)"; BURN_CH_SQ="$(ij sqlite burn-down-chained jobs_per_s)"
BAT="$(ij postgres e2e-batched jobs_per_s)"; BAT_SQ="$(ij sqlite e2e-batched jobs_per_s)"
S16="$(ij postgres submit jobs_per_s '"producers":16,')"; S16_SQ="$(ij sqlite submit jobs_per_s '"producers":16,')"
S1_50="$(ij postgres submit latency_p50_ms '"producers":1,')"; S1_50_SQ="$(ij sqlite submit latency_p50_ms '"producers":1,')"
S1_99="$(ij postgres submit latency_p99_ms '"producers":1,')"; S1_99_SQ="$(ij sqlite submit latency_p99_ms '"producers":1,')"
D50="$(ij postgres dispatch dispatch_p50_ms)"; D50_SQ="$(ij sqlite dispatch dispatch_p50_ms)"
D99="$(ij postgres dispatch dispatch_p99_ms)"; D99_SQ="$(ij sqlite dispatch dispatch_p99_ms)"
BL_E2E="$(ij postgres backlog e2e_ratio '"e2e_ratio"')"
BL_D50="$(ij postgres backlog dispatch_p50_ratio '"e2e_ratio"')"
BL_D99="$(ij postgres backlog dispatch_p99_ratio '"e2e_ratio"')"
BL_SIZE="$(ij postgres backlog backlog '"e2e_ratio"')"
TR_CALLS="$(ij postgres transport calls_per_s)"; TR_CEIL="$(ij postgres transport e2e_ceiling_jobs_per_s)"
W_RSS="$(ij postgres watchers rss_above_idle_mib)"; W_RSS_ABS="$(ij postgres watchers rss_watching_mib)"
W_P99="$(ij postgres watchers event_p99_ms)"
W_DEL99="$(ij postgres watchers delivery_after_answer_p99_ms)"
W_DB="$(ij postgres watchers db_connections)/$(ij postgres watchers db_connections_busy)"; W_N="$(ij postgres watchers watchers)"

echo
echo "## Summary ($STAMP; intray on PostgreSQL unless marked SQLite; ratios are intray PostgreSQL / reference)"
echo "load average: start $LOAD_START, end $LOAD_END"
row "figure" "intray" "SQLite" "reference" "ratio" "target" "met"
row "------------------------------------------------------" "----------" "----------" "------------" "--------" "----------------------------------" "----"
r="$(ratio "$E2E" "$GW_DEFAULT")"
row "e2e jobs/s, 1 job per RPC, vs graphile default" "$E2E" "$E2E_SQ" "$GW_DEFAULT" "$r" ">= 1.5x graphile-worker default" "$(meets "$r" ">=" 1.5)"
# Another shape than the issue's e2e (Lease max_jobs 1 + one Complete per
# job): shown for comparison, with no target and no verdict.
row "extra shape, not e2e: e2e-chained vs graphile default" "$E2E_CH" "$E2E_CH_SQ" "$GW_DEFAULT" "$(ratio "$E2E_CH" "$GW_DEFAULT")" "- (no target: not the e2e shape)" ""
r="$(ratio "$E2E" "$SQL32")"
row "e2e jobs/s vs SQL lifecycle, 32 clients" "$E2E" "$E2E_SQ" "$SQL32" "$r" "> 1x (only coalescing gets there)" "$(meets "$r" ">=" 1.0)"
row "extra shape, not e2e: e2e-chained vs SQL lifecycle c32" "$E2E_CH" "$E2E_CH_SQ" "$SQL32" "$(ratio "$E2E_CH" "$SQL32")" "- (no target: not the e2e shape)" ""
row "e2e jobs/s vs transport ceiling (calls/s / 3)" "$E2E" "" "$TR_CEIL" "$(ratio "$E2E" "$TR_CEIL")" "-" ""
r="$(ratio "$BURN" "$GW_BATCHED")"
row "burn-down jobs/s vs graphile batched" "$BURN" "$BURN_SQ" "$GW_BATCHED" "$r" ">= 1x (below 0.75x is not done)" "$(meets "$r" ">=" 1.0)"
r="$(ratio "$BURN_CH" "$GW_BATCHED")"
row "burn-down-chained (CompleteAndLease) vs graphile" "$BURN_CH" "$BURN_CH_SQ" "$GW_BATCHED" "$r" ">= 1x (below 0.75x is not done)" "$(meets "$r" ">=" 1.0)"
row "burn-down jobs/s vs SQL lifecycle, 32 clients" "$BURN" "$BURN_SQ" "$SQL32" "$(ratio "$BURN" "$SQL32")" "-" ""
row "e2e-batched jobs/s vs graphile batched" "$BAT" "$BAT_SQ" "$GW_BATCHED" "$(ratio "$BAT" "$GW_BATCHED")" "-" ""
r="$(ratio "$S16" "$GW_C16")"
row "unary submit jobs/s, 16 in flight" "$S16" "$S16_SQ" "$GW_C16" "$r" ">= 5x graphile-worker add_job c16" "$(meets "$r" ">=" 5)"
row "submit latency p50 ms, 1 producer" "$S1_50" "$S1_50_SQ" "$GW_SEQ50" "$(ratio "$S1_50" "$GW_SEQ50")" "<= 1.0 ms" "$(meets "$S1_50" "<=" 1.0)"
row "submit latency p99 ms, 1 producer" "$S1_99" "$S1_99_SQ" "$GW_SEQ99" "$(ratio "$S1_99" "$GW_SEQ99")" "<= 3.5 ms" "$(meets "$S1_99" "<=" 3.5)"
row "dispatch p50 ms, idle worker" "$D50" "$D50_SQ" "$GW_LAT50" "$(ratio "$D50" "$GW_LAT50")" "<= 1.5 ms" "$(meets "$D50" "<=" 1.5)"
row "dispatch p99 ms, idle worker" "$D99" "$D99_SQ" "$GW_LAT99" "$(ratio "$D99" "$GW_LAT99")" "<= 5 ms" "$(meets "$D99" "<=" 5)"
row "runnable backlog ${BL_SIZE:-?} vs 1000: e2e jobs/s ratio" "$BL_E2E" "" "" "" ">= 0.90 (within 10 %)" "$(meets "$BL_E2E" ">=" 0.9)"
row "scheduled backlog ${BL_SIZE:-?} vs 1000: dispatch p50 ratio" "$BL_D50" "" "" "" "<= 1.10 (within 10 %)" "$(meets "$BL_D50" "<=" 1.1)"
row "scheduled backlog ${BL_SIZE:-?} vs 1000: dispatch p99 ratio" "$BL_D99" "" "" "" "<= 1.10 (within 10 %)" "$(meets "$BL_D99" "<=" 1.1)"
row "${W_N:-?} watchers: server RSS above idle, MiB" "$W_RSS" "" "" "" "<= 100 MiB" "$(meets "$W_RSS" "<=" 100)"
row "${W_N:-?} watchers: server RSS with streams open, MiB" "$W_RSS_ABS" "" "" "" "-" ""
row "${W_N:-?} watchers: event p99 ms from Complete call" "$W_P99" "" "" "" "<= 50 ms" "$(meets "$W_P99" "<=" 50)"
row "${W_N:-?} watchers: delivery p99 ms after answer" "$W_DEL99" "" "" "" "<= 50 ms" "$(meets "$W_DEL99" "<=" 50)"
row "${W_N:-?} watchers: DB connections open/busy" "$W_DB" "" "" "" "no connection per stream" ""
echo "e2e and e2e-chained: at most ${E2E_OUT:-?} jobs outstanding, e2e-batched ${BAT_OUT:-?} (producers wait for completions)"
echo "e2e-chained: workers on CompleteAndLease (max_jobs 1), another shape than issue 6's e2e (Lease max_jobs 1 + one Complete per job); its target is on the e2e rows only"
echo "backlog: e2e behind a RUNNABLE backlog of that size (due now, same priority, claimed oldest first), kept at that depth;" \
     "dispatch beside a SCHEDULED backlog (priority -1, run_at +24h, never claimed) in a queue of its own"
echo "every row that ran jobs: the server counted each of them SUCCEEDED (stats_succeeded = expected_succeeded)"
echo "transport (health checks, no database; e2e makes 3 calls per job): $TR_CALLS calls/s"
echo "SQL ceiling (pgbench jobs/s): lifecycle c=8 $(pgb lifecycle 8 jobs/s), c=32 $SQL32;" \
     "claim_b10 c=8 $(pgb claim_b10 8 jobs/s), c=32 $(pgb claim_b10 32 jobs/s)"
echo "commands: see the '# command:' lines above; intray reports: $OUT/intray-postgres.out, $OUT/intray-sqlite.out"
