//! The PostgreSQL store: several stateless replicas share one database.
//!
//! Claims use `FOR UPDATE SKIP LOCKED`; decisions that need the time use the
//! database's `now()`, so replicas with skewed clocks agree. Other replicas
//! learn about changes through `NOTIFY` on [`CHANNEL`], sent after the commits
//! and coalesced across them. Hot-path calls come in batches (the coalescers
//! of `engine::batchers`), and each batch is a handful of set-based statements.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use serde_json::Value;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Connection, PgConnection, Row};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::changes::{CHANNEL, Changes, wake_everything, wake_from_payload};
use super::db_clock::DbClock;
use super::pg_caps;
use super::pg_counts::Counts;
use super::pg_hot::HotPool;
use super::pg_leased::{Beat, Leased};
use super::unreadable::{self, RECHECK_CHUNK, RowKey, Unreadable};
use super::{
    Ended, Grouped, JobGroup, QueueDepth, QueueStatsBuilder, QueueWorkers, Reaped, Retried,
    RunningCaps, Stats, Store, StoreError, StoreResult, Submitted,
};
use crate::config::Settings;
use crate::domain::breaker::{self, Breaker, BreakerChange, BreakerPolicy};
use crate::domain::transition::{self, TransitionError};
use crate::domain::{
    Backoff, CompleteSpec, EventType, Handoff, HeartbeatAck, HeartbeatSpec, Job, JobError,
    JobEvent, JobState, LeaseSpec, ListFilter, NewJob, RetryFilter, WorkerSeen,
};
use crate::engine::notifier::Notifier;

/// The PostgreSQL migrations. `intray migrate` is strict: a database with a
/// migration this build does not know is refused. A server opening the
/// store is not (see [`super::migrations_ahead`]): migrations are additive,
/// so that a pod of the previous build, restarted during a rollout or
/// after a rollback, starts on a schema a newer build migrated.
fn migrator(strict: bool) -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("./migrations/postgres");
    migrator.set_ignore_missing(!strict);
    migrator
}

/// Applies the PostgreSQL migrations.
pub async fn migrate(url: &str, strict: bool) -> StoreResult<()> {
    let pool = PgPoolOptions::new().max_connections(1).connect(url).await?;
    // The open that follows (`serve`) warns of migrations a newer build
    // applied.
    migrator(strict).run(&pool).await?;
    pool.close().await;
    Ok(())
}

/// The planner settings of the hot path's statements (the claim, the
/// hand-off, Complete, the oldest-due probe; why: at the claim), set once
/// per connection of [`PgStore::planned`]. Session settings rather than a
/// `SET LOCAL` per transaction let the claim and the hand-off run
/// autocommitted: one round trip instead of three (BEGIN with the
/// settings, the statement, COMMIT). One constant, so the statements
/// cannot drift apart: the hand-off once lacked `enable_sort = off` and
/// sorted a million queued jobs per submit.
const PLANNER_SETTINGS: &str = "SET plan_cache_mode = force_generic_plan; \
                                SET enable_seqscan = off; SET enable_sort = off; SET jit = off";

/// Bounds on what a replica's sessions may hold and wait for, set on every
/// connection of both pools (not on the one that migrates: a migration may
/// wait for another replica's, and take long). A replica that stops without
/// closing its connections (SIGSTOP, a paused VM, a partition the database
/// has not noticed) would otherwise keep the row and advisory locks of its
/// open transactions for ever, and the other replicas' statements would
/// queue behind them until their pools were full: with these, the stopped
/// replica's transactions end after 10 s idle, and a statement gives up a
/// lock wait after 5 s (`UNAVAILABLE`: retried by the caller) instead of
/// holding its connection. Ours are never idle in a transaction for more
/// than a round trip, nor wait for a lock longer than another statement
/// of ours runs.
const SESSION_LIMITS: &str =
    "SET lock_timeout = '5s'; SET idle_in_transaction_session_timeout = '10s'";

/// The PostgreSQL implementation of [`Store`].
pub struct PgStore {
    pool: PgPool,
    /// Connections with [`PLANNER_SETTINGS`], for the hot path's statements
    /// only: other statements keep PostgreSQL's own planning. Outside sqlx's
    /// pool, so that they go back without a ping (see `pg_hot`).
    planned: Arc<HotPool>,
    notifier: Arc<Notifier>,
    caps: RunningCaps,
    breaker: BreakerPolicy,
    /// What committed, for the task that tells other replicas.
    committed: mpsc::UnboundedSender<Changes>,
    /// Stops the LISTEN and NOTIFY tasks when the store is closed or
    /// dropped.
    listener_stop: CancellationToken,
    /// The NOTIFY task, for [`Store::close`] to wait for its last one.
    announcer: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Jobs per queue and state, kept by the database.
    counts: Counts,
    unreadable: Unreadable,
    /// Jobs this replica leased, for their `Complete` (see `pg_leased`).
    leased: Leased,
    /// The database's clock, read at open and then by the reaper.
    clock: DbClock,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.listener_stop.cancel();
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A row of [`Store::active_workers`]' statement.
fn queue_workers(row: &PgRow) -> StoreResult<QueueWorkers> {
    Ok(QueueWorkers {
        tenant: row.try_get("tenant")?,
        queue: row.try_get("queue")?,
        workers: u64::try_from(row.try_get::<i64, _>("workers")?).unwrap_or(0),
    })
}

fn corrupt(column: &str) -> StoreError {
    StoreError::Internal(format!("corrupt value in column {column}"))
}

fn to_u32(v: i32, column: &str) -> StoreResult<u32> {
    u32::try_from(v).map_err(|_| corrupt(column))
}

fn to_u64(v: i64, column: &str) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| corrupt(column))
}

fn job_from_row(row: &PgRow) -> StoreResult<Job> {
    let state: String = row.try_get("state")?;
    let error_class: Option<String> = row.try_get("error_class")?;
    let error_message: Option<String> = row.try_get("error_message")?;
    let backoff = Backoff::try_new(
        Duration::from_millis(to_u64(
            row.try_get("backoff_initial_ms")?,
            "backoff_initial_ms",
        )?),
        Duration::from_millis(to_u64(row.try_get("backoff_max_ms")?, "backoff_max_ms")?),
    )
    .map_err(|_| corrupt("backoff"))?;
    Ok(Job {
        id: row.try_get("id")?,
        tenant: row.try_get("tenant")?,
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        state: JobState::parse(&state).ok_or_else(|| corrupt("state"))?,
        payload: row.try_get::<Json<Value>, _>("payload")?.0,
        result: row
            .try_get::<Option<Json<Value>>, _>("result")?
            .map(|j| j.0),
        error: error_class.map(|class| JobError {
            class,
            message: error_message.unwrap_or_default(),
        }),
        attempt: to_u32(row.try_get("attempt")?, "attempt")?,
        max_attempts: to_u32(row.try_get("max_attempts")?, "max_attempts")?,
        priority: row.try_get("priority")?,
        idempotency_key: row.try_get("idempotency_key")?,
        input_hash: row.try_get("input_hash")?,
        labels: row
            .try_get::<Json<BTreeMap<String, String>>, _>("labels")?
            .0,
        progress: row.try_get("progress")?,
        cancel_requested: row.try_get("cancel_requested")?,
        cancel_requested_at: row.try_get("cancel_requested_at")?,
        cost_cents: row.try_get("cost_cents")?,
        lease_owner: row.try_get("lease_owner")?,
        lease_token: row.try_get("lease_token")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        run_at: row.try_get("run_at")?,
        deadline: row.try_get("deadline")?,
        backoff,
        callback_url: row.try_get("callback_url")?,
        max_cost_cents: row.try_get("max_cost_cents")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        event_seq: to_u64(row.try_get("event_seq")?, "event_seq")?,
        trace_parent: row.try_get("trace_parent")?,
        leased_at: row.try_get("leased_at")?,
    })
}

/// A job row's id alone, for naming a row that cannot be read whole.
fn row_key(row: &PgRow) -> Option<RowKey> {
    Some(RowKey {
        tenant: row.try_get("tenant").ok()?,
        id: row.try_get::<Uuid, _>("id").ok()?.to_string(),
    })
}

fn breaker_from_row(row: &PgRow) -> StoreResult<Breaker> {
    Ok(Breaker {
        failures: to_u32(row.try_get("failures")?, "failures")?,
        max_retry_after: Duration::from_millis(to_u64(
            row.try_get("max_retry_after_ms")?,
            "max_retry_after_ms",
        )?),
        open_until: row.try_get("open_until")?,
        probe_job: row.try_get("probe_job")?,
    })
}

fn event_from_row(row: &PgRow) -> StoreResult<JobEvent> {
    let kind: String = row.try_get("type")?;
    let state: String = row.try_get("state")?;
    Ok(JobEvent {
        job_id: row.try_get("job_id")?,
        sequence: to_u64(row.try_get("sequence")?, "sequence")?,
        kind: EventType::parse(&kind).ok_or_else(|| corrupt("type"))?,
        state: JobState::parse(&state).ok_or_else(|| corrupt("state"))?,
        attempt: to_u32(row.try_get("attempt")?, "attempt")?,
        worker_id: row.try_get("worker_id")?,
        at: row.try_get("at")?,
        detail: row
            .try_get::<Option<Json<Value>>, _>("detail")?
            .map(|j| j.0),
    })
}

/// The multi-row submit with the hand-off condition spliced in. A submit
/// that hands nothing off says `false`, which the planner folds away, so
/// the common statement has no guard to plan (planning it costs more than
/// running it); one that does materialises the condition, or every use of
/// `handed` would run the guard again, and returns with each row what
/// keeping a handed-off job for its `Complete` needs (`$kept`).
///
/// Rows go in in key order (request order among equal keys and keyless
/// items): an insert waits for a concurrent one holding its key, so two
/// submits taking shared keys in different orders would deadlock, and
/// PostgreSQL would fail one of them whole.
macro_rules! submit_statement {
    ($materialized:literal, $handed:literal, $kept:literal) => {
        concat!(
            "WITH input AS (
                SELECT * FROM unnest($2::uuid[], $3::text[], $4::text[], $5::jsonb[], $6::int4[],
                    $7::int4[], $8::text[], $9::text[], $10::jsonb[], $11::timestamptz[],
                    $12::timestamptz[], $13::int8[], $14::int8[], $15::text[], $16::int8[],
                    $17::text[], $18::text[], $19::int8[]) WITH ORDINALITY
                  AS i(id, queue, kind, payload, max_attempts, priority, idempotency_key,
                       input_hash, labels, run_at, deadline, backoff_initial_ms, backoff_max_ms,
                       callback_url, max_cost_cents, trace_parent, worker, lease_ms, ord)
             ), placed AS ", $materialized, " (
                SELECT i.*, ", $handed, " AS handed FROM input i
             ), ins AS (
                INSERT INTO jobs (id, tenant, queue, kind, state, payload, max_attempts, priority,
                    idempotency_key, input_hash, labels, run_at, deadline, backoff_initial_ms,
                    backoff_max_ms, callback_url, max_cost_cents, created_at, updated_at, event_seq,
                    trace_parent, attempt, lease_owner, lease_token, lease_expires_at, started_at,
                    leased_at, lease_ms)
                SELECT id, $1, queue, kind, CASE WHEN handed THEN 'running' ELSE 'queued' END,
                    payload, max_attempts, priority, idempotency_key, input_hash, labels,
                    COALESCE(run_at, now()), deadline, backoff_initial_ms, backoff_max_ms,
                    callback_url, max_cost_cents, now(), now(), CASE WHEN handed THEN 2 ELSE 1 END,
                    trace_parent, CASE WHEN handed THEN 1 ELSE 0 END,
                    CASE WHEN handed THEN worker END,
                    CASE WHEN handed THEN gen_random_uuid()::text END,
                    CASE WHEN handed THEN LEAST(now() + lease_ms * interval '1 millisecond',
                                                COALESCE(deadline, 'infinity'::timestamptz)) END,
                    CASE WHEN handed THEN now() END, CASE WHEN handed THEN now() END,
                    CASE WHEN handed THEN lease_ms END
                FROM placed ORDER BY idempotency_key NULLS LAST, ord
                ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING *", $kept, "
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at)
                SELECT id, 1, 'submitted', 'queued', 0, NULL, created_at FROM ins
                UNION ALL
                SELECT id, 2, 'leased', 'running', 1, lease_owner, created_at FROM ins
                WHERE state = 'running'
             )
             SELECT * FROM ins"
        )
    };
}

/// The dead set (the jobs `Retry` may replay) as SQL. Statements that read
/// it splice this in, so that their plans can use `jobs_replayable`, whose
/// predicate (migration 0009) it must match.
macro_rules! in_dead_set {
    () => {
        "state IN ('failed', 'cancelled', 'expired')"
    };
}

/// The jobs a replay filter matches: tenant `$1`, states `$2` (only
/// dead-set ones: validation admits no others, and saying so lets any plan
/// read jobs_replayable), queue `$3`, kind `$4`, error class `$5`.
macro_rules! replay_filter {
    () => {
        concat!(
            "tenant = $1 AND state = ANY($2) AND ",
            in_dead_set!(),
            "
               AND ($3::text IS NULL OR queue = $3)
               AND ($4::text IS NULL OR kind = $4)
               AND ($5::text IS NULL OR error_class = $5)"
        )
    };
}

/// `ListJobs`, newest first, with `$extra` spliced into the filter.
macro_rules! list_statement {
    ($columns:expr, $extra:expr) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM jobs
             WHERE tenant = $1
               AND ($2::uuid IS NULL OR id < $2)
               AND ($3::text IS NULL OR queue = $3)
               AND ($4::text IS NULL OR kind = $4)
               AND (cardinality($5::text[]) = 0 OR state = ANY($5))
               AND ($6::text IS NULL OR error_class = $6)
               AND labels @> $7 ",
            $extra,
            " ORDER BY id DESC
             LIMIT $8"
        )
    };
}

/// [`list_statement`] for any filter.
const LIST: &str = list_statement!("*", "");

/// [`list_statement`] for a filter of dead-set states only: the condition
/// is implied by `$5`, but only spelled out can it let a plan (a generic
/// one too) read the few rows of `jobs_replayable` instead of stepping
/// through every job of the tenant.
const LIST_REPLAYABLE: &str = list_statement!("*", concat!("AND ", in_dead_set!()));

/// What a list without payloads reads: not `payload` and `result`, which
/// can be a MiB each and are stored out of line, so they are not fetched.
macro_rules! columns_but_payloads {
    () => {
        concat!(
            job_columns_but_payloads!(),
            ", 'null'::jsonb AS payload, NULL::jsonb AS result"
        )
    };
}

/// [`LIST`] without payloads.
const LIST_BASIC: &str = list_statement!(columns_but_payloads!(), "");

/// [`LIST_REPLAYABLE`] without payloads.
const LIST_REPLAYABLE_BASIC: &str =
    list_statement!(columns_but_payloads!(), concat!("AND ", in_dead_set!()));

/// [`submit_statement`] for a submit without hand-offs.
const SUBMIT: &str = submit_statement!("NOT MATERIALIZED", "false", "");

/// [`submit_statement`] handing a job off only where a claim made now
/// would pick it: due, queue not paused, no breaker for its kind, and no
/// due queued job at its priority or above. That is probed level by level,
/// as the claim does, each level by its first job in `run_at` order (a
/// scalar subquery, so that no plan can turn it into a scan of every due
/// job of the queue: an `EXISTS` became a hash join over a million rows).
/// Its own jobs are invisible to the probe: the caller offers them in
/// priority order.
const SUBMIT_HANDING: &str = submit_statement!(
    "MATERIALIZED",
    "i.worker IS NOT NULL
                AND COALESCE(i.run_at, now()) <= now()
                AND (i.deadline IS NULL OR i.deadline > now())
                AND NOT EXISTS (SELECT 1 FROM paused_queues p
                                WHERE p.tenant = $1 AND p.queue = i.queue)
                AND NOT EXISTS (SELECT 1 FROM breakers b
                                WHERE b.tenant = $1 AND b.queue = i.queue AND b.kind = i.kind)
                AND NOT EXISTS (
                    WITH RECURSIVE levels(priority) AS (
                        SELECT (SELECT priority FROM jobs
                                WHERE tenant = $1 AND queue = i.queue AND state = 'queued'
                                  AND priority >= i.priority
                                ORDER BY priority LIMIT 1)
                        UNION ALL
                        SELECT (SELECT j.priority FROM jobs j
                                WHERE j.tenant = $1 AND j.queue = i.queue
                                  AND j.state = 'queued' AND j.priority > l.priority
                                ORDER BY j.priority LIMIT 1)
                        FROM levels l WHERE l.priority IS NOT NULL
                    )
                    SELECT 1 FROM levels l
                    WHERE l.priority IS NOT NULL
                      AND (SELECT q.run_at FROM jobs q
                           WHERE q.tenant = $1 AND q.queue = i.queue
                             AND q.state = 'queued' AND q.priority = l.priority
                           ORDER BY q.run_at LIMIT 1) <= now()
                )",
    ", xmin::text AS row_version, pg_column_size(payload) AS payload_bytes"
);

/// The claim, with what each candidate carries besides its job (`$loads`)
/// and the choice of candidates in slot order (`$picked`) spliced in: the
/// general choice ([`CLAIM`]) and one for a single tenant without caps
/// ([`CLAIM_ONE_TENANT`]) share every other line.
///
/// Tenants: the caller's, or every tenant with queued jobs, found by a
/// skip scan over the claim index (one probe per tenant). Per tenant and
/// queue the claim index gives the best candidates in order. A lease never
/// outlives the deadline.
macro_rules! claim_statement {
    ($loads:literal, $picked:literal, $eligible:literal) => {
        concat!(
            "WITH RECURSIVE seen(tenant) AS (
                SELECT (SELECT tenant FROM jobs WHERE state = 'queued' AND $1::text IS NULL
                        ORDER BY tenant LIMIT 1)
                UNION ALL
                SELECT (SELECT j.tenant FROM jobs j WHERE j.state = 'queued' AND j.tenant > s.tenant
                        ORDER BY j.tenant LIMIT 1)
                FROM seen s WHERE s.tenant IS NOT NULL
             ), tenants AS (
                SELECT tenant FROM seen WHERE tenant IS NOT NULL
                UNION ALL
                SELECT $1::text WHERE $1::text IS NOT NULL
             ), running AS (
                -- Counted only when caps or fairness need it ($10): the scan
                -- walks every running row, and dead ones until vacuum.
                SELECT tenant, queue, count(*) AS n FROM jobs
                WHERE $10 AND state = 'running' AND ($1::text IS NULL OR tenant = $1)
                GROUP BY tenant, queue
             ), candidates AS (
                SELECT c.id, c.tid, c.priority, c.run_at, c.kind, c.half_open, t.tenant, q.name AS queue",
                $loads, "
                FROM tenants t
                CROSS JOIN unnest($2::text[]) AS q(name)
                -- Whether the queue has any breaker, once: most have none,
                -- and then no job needs the two checks of its kind's.
                CROSS JOIN LATERAL (
                    SELECT EXISTS (SELECT 1 FROM breakers b
                                   WHERE b.tenant = t.tenant AND b.queue = q.name) AS any
                ) qb
                CROSS JOIN LATERAL (
                    -- A skip scan over the queue's priority levels (one index
                    -- probe each), then per level a range scan that stops at
                    -- the first job not yet due. One scan in (priority,
                    -- run_at) order would step over every job scheduled for
                    -- later at a higher level, so an empty claim would cost
                    -- as much as that backlog (100 ms at a million).
                    -- The levels are found from the lowest up, each probe a
                    -- backward scan that lands on its level's newest entry:
                    -- a level's oldest entries are where claims take jobs,
                    -- and until vacuum they are pages of dead entries that a
                    -- forward probe steps through (in psql during e2e:
                    -- 0.9-5 ms forward, 0.05 ms backward).
                    WITH RECURSIVE levels(priority) AS (
                        SELECT (SELECT priority FROM jobs
                                WHERE tenant = t.tenant AND queue = q.name AND state = 'queued'
                                ORDER BY priority LIMIT 1)
                        UNION ALL
                        SELECT (SELECT j.priority FROM jobs j
                                WHERE j.tenant = t.tenant AND j.queue = q.name AND j.state = 'queued'
                                  AND j.priority > l.priority
                                ORDER BY j.priority LIMIT 1)
                        FROM levels l WHERE l.priority IS NOT NULL
                    )
                    -- Highest level first, and no order above the join:
                    -- the limit stops the join once it has enough, so a
                    -- lower level's scan runs (and locks jobs) only when the
                    -- higher ones fall short. Ordered above it, every
                    -- level's scan ran and locked as many jobs as asked for,
                    -- and a claim beside this one skipped those it did not
                    -- take. The picks below sort the candidates again.
                    SELECT due.* FROM (SELECT priority FROM levels
                                       WHERE priority IS NOT NULL
                                       ORDER BY priority DESC) l
                    CROSS JOIN LATERAL (
                        SELECT id, ctid AS tid, priority, run_at, kind,
                            qb.any AND EXISTS (
                                SELECT 1 FROM breakers b
                                WHERE b.tenant = t.tenant AND b.queue = q.name AND b.kind = jobs.kind
                                  AND b.open_until IS NOT NULL) AS half_open
                        FROM jobs
                        WHERE tenant = t.tenant AND queue = q.name AND state = 'queued'
                          -- The statement's time, not the transaction's: a
                          -- capped claim's began before it waited for its
                          -- queue's lock.
                          AND priority = l.priority AND run_at <= statement_timestamp()
                          AND (cardinality($3::text[]) = 0 OR kind = ANY($3))
                          AND (deadline IS NULL OR deadline > statement_timestamp())
                          AND (NOT qb.any OR NOT EXISTS (
                              SELECT 1 FROM breakers b
                              WHERE b.tenant = t.tenant AND b.queue = q.name AND b.kind = jobs.kind
                                -- The probe's state by key: with the state in
                                -- the filter, plans took jobs_running_owner
                                -- and read the tenant's running jobs (and
                                -- their cost made the claim JIT-compiled).
                                AND (b.open_until > statement_timestamp()
                                     OR (SELECT p.state FROM jobs p
                                         WHERE p.tenant = b.tenant AND p.id = b.probe_job)
                                        = 'running')
                          ))
                        ORDER BY run_at, id
                        LIMIT $4
                        FOR UPDATE SKIP LOCKED
                    ) due
                    LIMIT $4
                ) c
                WHERE NOT EXISTS (
                    SELECT 1 FROM paused_queues p WHERE p.tenant = t.tenant AND p.queue = q.name
                )
             ), picked AS (", $picked, "
             ), probe_picks AS (
                -- A picked candidate of a half-open breaker is to be its
                -- probe: the breaker's row version as this statement's
                -- snapshot has it.
                SELECT c.id, c.tid, b.tenant, b.queue, b.kind, b.xmin::text AS version
                FROM candidates c
                JOIN breakers b ON b.tenant = c.tenant AND b.queue = c.queue AND b.kind = c.kind
                WHERE c.half_open AND c.id IN (SELECT id FROM picked)
             ), probes AS (
                -- Compare and set: the probe is named only if nobody changed
                -- the breaker since the snapshot. A claim of another replica
                -- that named its own probe meanwhile holds the row until it
                -- commits; then the row is re-read at its new version, this
                -- comparison fails, and this claim leases no probe (it would
                -- otherwise overwrite the other's, and two probes would run).
                UPDATE breakers b SET probe_job = s.id, updated_at = now()
                FROM probe_picks s
                WHERE b.tenant = s.tenant AND b.queue = s.queue AND b.kind = s.kind
                  AND b.xmin::text = s.version
                RETURNING s.id
             ), slots AS (
                SELECT jsonb_object_agg(id::text, slot) AS of FROM picked
             ), passed AS (
                -- The queues where a candidate that could have been taken
                -- was locked and left (the batch was full): a claim beside
                -- this one skipped it, and its caller may have parked. At
                -- most 16 (a claim across many tenants could name
                -- thousands); those past them wait for their next poll.
                -- Only a claim over several queues or tenants can leave
                -- one over (a queue's scan stops at the batch), so any
                -- other skips this at once.
                SELECT array_agg(tenant) AS tenants, array_agg(queue) AS queues
                FROM (SELECT DISTINCT c.tenant, c.queue FROM candidates c
                      WHERE (cardinality($2::text[]) > 1 OR $1::text IS NULL)
                        AND ", $eligible, " AND c.id NOT IN (SELECT id FROM picked)
                      ORDER BY c.tenant, c.queue LIMIT 16) left_over
             ), upd AS (
                -- The picked rows are locked (FOR UPDATE above), so their
                -- tuple ids hold until this update: it reads them by tuple
                -- id, with no index and so no plan to go wrong, and each
                -- finds its slot in a map (evaluated once), not by a join
                -- to picked. Generic plans of key lookups went wrong here:
                -- a join to picked scanned all of jobs when planned on a
                -- young table, or probed the primary key once per job with
                -- the whole array as a second key, sorted again for every
                -- probe (12 % of all CPU in burn-down); with the key
                -- (tenant, id), the key arrays were planned on a young
                -- table as a scan of the tenant's jobs filtered by id.
                -- The lease's times are the statement's: a capped claim's
                -- transaction began before it waited for its queue lock.
                UPDATE jobs j SET state = 'running', attempt = j.attempt + 1,
                    lease_owner = ($5::text[])[((SELECT of FROM slots) ->> j.id::text)::int],
                    lease_token = gen_random_uuid()::text,
                    lease_ms = ($6::int8[])[((SELECT of FROM slots) ->> j.id::text)::int],
                    lease_expires_at = LEAST(
                        statement_timestamp()
                            + ($6::int8[])[((SELECT of FROM slots) ->> j.id::text)::int]
                            * interval '1 millisecond',
                        COALESCE(j.deadline, 'infinity'::timestamptz)),
                    started_at = COALESCE(j.started_at, statement_timestamp()),
                    leased_at = statement_timestamp(),
                    updated_at = GREATEST(j.updated_at, statement_timestamp()),
                    progress = 0,
                    event_seq = j.event_seq + 1
                WHERE j.ctid = ANY(ARRAY(SELECT tid FROM picked))
                  -- Not a probe that lost its breaker to another claim (the
                  -- array, computed once, is nearly always empty).
                  AND NOT j.ctid = ANY(ARRAY(
                      SELECT tid FROM probe_picks
                      WHERE id NOT IN (SELECT id FROM probes)))
                RETURNING j.*, ((SELECT of FROM slots) ->> j.id::text)::int8 AS slot,
                    j.xmin::text AS row_version,
                    pg_column_size(j.payload) AS payload_bytes,
                    -- On the first slot's row only, not repeated on each (a
                    -- first pick left out as a probe that lost its breaker
                    -- takes the hint with it: the queues wait for their
                    -- next poll, as before).
                    CASE WHEN (SELECT tenants FROM passed) IS NULL THEN NULL
                         WHEN ((SELECT of FROM slots) ->> j.id::text)::int8 = 1
                         THEN (SELECT tenants FROM passed) END AS passed_tenants,
                    CASE WHEN (SELECT queues FROM passed) IS NULL THEN NULL
                         WHEN ((SELECT of FROM slots) ->> j.id::text)::int8 = 1
                         THEN (SELECT queues FROM passed) END AS passed_queues
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at)
                SELECT id, event_seq, 'leased', 'running', attempt, lease_owner, updated_at FROM upd
             )
             SELECT * FROM upd"
        )
    };
}

/// [`claim_statement`] for any claim. Each candidate's load is its
/// tenant's running jobs plus its rank, so tenants far below their share
/// go first and interleave; within a tenant that is priority order. A
/// candidate that would lift its tenant above the queue's cap is skipped,
/// and of a half-open breaker's kind only the best candidate is taken (its
/// probe).
const CLAIM: &str = claim_statement!(
    ",
                    t.tenant || '/' || q.name AS tenant_load_key,
                    COALESCE((SELECT sum(r.n) FROM running r WHERE r.tenant = t.tenant), 0)
                      + row_number() OVER (PARTITION BY t.tenant
                                           ORDER BY c.priority DESC, c.run_at, c.id) AS tenant_load,
                    COALESCE((SELECT r.n FROM running r WHERE r.tenant = t.tenant AND r.queue = q.name), 0)
                      + row_number() OVER (PARTITION BY t.tenant, q.name
                                           ORDER BY c.priority DESC, c.run_at, c.id) AS queue_load,
                    COALESCE((SELECT o.cap FROM unnest($7::text[], $8::bigint[]) AS o(queue, cap)
                              WHERE o.queue = q.name), $9) AS cap",
    "
                SELECT id, tid,
                    row_number() OVER (ORDER BY tenant_load, priority DESC, run_at, id) AS slot
                FROM (
                    SELECT *, row_number() OVER (PARTITION BY tenant_load_key, kind
                                                 ORDER BY priority DESC, run_at, id) AS kind_rank
                    FROM candidates
                ) ranked
                WHERE queue_load <= cap AND (NOT half_open OR kind_rank = 1)
                ORDER BY tenant_load, priority DESC, run_at, id
                LIMIT $4",
    "NOT c.half_open AND c.queue_load <= c.cap"
);

/// [`claim_statement`] for one tenant's claim when no cap is set: what
/// [`CLAIM`] picks then, without its loads and windows. With one tenant the
/// load order is priority order, and with no cap nothing is skipped but a
/// half-open breaker's candidates after the best of each kind. At a
/// burn-down's 700 jobs the general claim took 40 % longer than a minimal
/// one in psql; this one made burn-down 7 % faster (docs/performance-log.md,
/// "Changes of 2026-12-05, morning").
const CLAIM_ONE_TENANT: &str = claim_statement!(
    "",
    "
                SELECT id, tid, row_number() OVER (ORDER BY priority DESC, run_at, id) AS slot
                FROM (
                    SELECT * FROM candidates WHERE NOT half_open
                    UNION ALL
                    (SELECT DISTINCT ON (queue, kind) * FROM candidates WHERE half_open
                     ORDER BY queue, kind, priority DESC, run_at, id)
                ) eligible
                ORDER BY priority DESC, run_at, id
                LIMIT $4",
    "NOT c.half_open"
);

/// A claim's parameters: one slot per job asked for, in caller order. The
/// claim fills slot k with its k-th best candidate, leased to that slot's
/// worker. Every spec shares the queues, kinds and scope of the first.
struct Claim<'a> {
    specs: &'a [LeaseSpec],
    queues: &'a [String],
    kinds: &'a [String],
    /// The caller's tenant, or none for a claim across tenants.
    only_tenant: Option<&'a str>,
    /// Whether running caps apply, so that the claim must not run beside
    /// another that counts the same running jobs (see `pg_caps`).
    capped: bool,
    slot_caller: Vec<usize>,
}

impl<'a> Claim<'a> {
    /// The claim for `specs`, capped when a cap of `caps` applies to one of
    /// its queues; `None` when there are no specs.
    fn new(tenant: &'a str, specs: &'a [LeaseSpec], caps: &RunningCaps) -> Option<Claim<'a>> {
        let spec = specs.first()?;
        let slot_caller = specs
            .iter()
            .enumerate()
            .flat_map(|(caller, s)| std::iter::repeat_n(caller, s.max_jobs as usize))
            .collect();
        Some(Claim {
            specs,
            queues: &spec.queues,
            kinds: &spec.kinds,
            only_tenant: (!spec.all_tenants).then_some(tenant),
            capped: caps.cover_any(&spec.queues),
            slot_caller,
        })
    }

    /// Whether loads are counted (`$10`): across tenants, or under caps.
    fn counted(&self) -> bool {
        self.only_tenant.is_none() || self.capped
    }

    /// The statement on its own.
    ///
    /// Planning the claim costs 2-5 ms and PostgreSQL keeps choosing a
    /// custom plan for it; the generic plan runs it in ~0.4 ms (the
    /// parameters only pick tenants and queues). A generic plan is made
    /// once and kept, often while the table is still young, so its row
    /// estimates are not to be trusted: without sequential scans or
    /// avoidable sorts it takes the index paths that stay cheap at any
    /// table size (the level probes of `claim_statement` read the claim
    /// index in order instead of sorting every queued row). Those settings
    /// price the plans they avoid so high that the estimate passes JIT's
    /// threshold, and compiling the statement took a second: no JIT. Those
    /// are the settings of the `planned` pool's sessions.
    fn statement(&self) -> &'static str {
        if self.counted() {
            CLAIM
        } else {
            CLAIM_ONE_TENANT
        }
    }

    /// Whether [`WRITE_THEN_CLAIM`] can run it. A claim that counts running
    /// jobs cannot: in one statement it would still count the jobs the
    /// write ends.
    fn follows_a_write(&self) -> bool {
        !self.counted()
    }

    /// Binds the claim's parameters after whatever `query` has bound.
    fn bind(&self, query: PgQuery, caps: &RunningCaps) -> PgQuery {
        let mut workers = Vec::with_capacity(self.slot_caller.len());
        let mut lease_ms = Vec::with_capacity(self.slot_caller.len());
        for &caller in &self.slot_caller {
            let spec = &self.specs[caller];
            workers.push(spec.worker_id.as_str());
            lease_ms.push(millis(spec.lease_duration));
        }
        query
            .bind(self.only_tenant)
            .bind(self.queues)
            .bind(self.kinds)
            .bind(i64::try_from(self.slot_caller.len()).unwrap_or(i64::MAX))
            .bind(&workers)
            .bind(&lease_ms)
            .bind(&caps.queues)
            .bind(&caps.caps)
            .bind(caps.default)
            .bind(self.counted())
    }
}

/// The jobs of one tenant (`$2`) that a batch of outcomes ends (`$1`, ids in
/// order: a `$lock` takes the row locks in that order), another tenant's
/// job not found, as if missing; with the database's time, each row's
/// version and whether a circuit breaker exists for its queue and kind.
///
/// One primary-key probe per id, in a lateral subquery that cannot be
/// flattened into a join: given the two key conditions `tenant = $2 AND id
/// = ANY($1)`, a generic plan made on a young table scanned the tenant's
/// jobs and filtered them by id.
macro_rules! complete_read {
    ($lock:literal) => {
        concat!(
            "SELECT j.*, now() AS db_now,
                EXISTS (SELECT 1 FROM breakers b WHERE b.tenant = j.tenant
                        AND b.queue = j.queue AND b.kind = j.kind) AS has_breaker
             FROM unnest($1::uuid[]) AS k(id)
             CROSS JOIN LATERAL (
                 SELECT *, xmin::text AS row_version FROM jobs
                 WHERE tenant = $2 AND id = k.id OFFSET 0 ",
            $lock,
            "
             ) j"
        )
    };
}

/// What [`complete_read!`] found of one tenant's jobs.
struct CompleteRead {
    jobs: HashMap<Uuid, Job>,
    /// Jobs whose rows were read but cannot be: only their own outcomes
    /// are refused.
    unreadable: HashSet<Uuid>,
    /// Each job's row version as read (`xmin`).
    versions: HashMap<Uuid, String>,
    /// The database's time.
    now: DateTime<Utc>,
    /// Whether a breaker exists for one of the jobs' queues and kinds.
    has_breaker: bool,
}

impl CompleteRead {
    /// Nothing read yet, with this process's clock as the time.
    fn empty(capacity: usize) -> CompleteRead {
        CompleteRead {
            jobs: HashMap::with_capacity(capacity),
            unreadable: HashSet::new(),
            versions: HashMap::with_capacity(capacity),
            now: Utc::now(),
            has_breaker: false,
        }
    }

    /// Runs `statement` ([`complete_read!`], with or without its lock) for
    /// `tenant`'s jobs `ids`, each once and in order, so that concurrent
    /// locking reads take their locks in one order. A row that cannot be
    /// read is left out (logged and counted in `unreadable`) and refuses
    /// only its own outcome.
    async fn load(
        conn: &mut PgConnection,
        statement: &'static str,
        ids: &[Uuid],
        tenant: &str,
        unreadable: &Unreadable,
    ) -> StoreResult<CompleteRead> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let rows = sqlx::query(statement)
            .bind(&ids)
            .bind(tenant)
            .fetch_all(conn)
            .await?;
        let mut read = CompleteRead::empty(rows.len());
        let (readable, left_out) = unreadable.readable_by_id(
            &rows,
            |row| {
                let versioned: (Job, String, bool) = (
                    job_from_row(row)?,
                    row.try_get("row_version")?,
                    row.try_get("has_breaker")?,
                );
                Ok(versioned)
            },
            row_key,
            "complete",
        );
        for (row, (job, version, has_breaker)) in readable {
            read.now = row.try_get("db_now")?;
            read.has_breaker |= has_breaker;
            read.versions.insert(job.id, version);
            read.jobs.insert(job.id, job);
        }
        read.unreadable = left_out;
        Ok(read)
    }
}

/// What a heartbeat's statement returned, for the kept lease;
/// `with_event`: whether it added an event.
fn beat_from_row(row: &PgRow, with_event: bool) -> StoreResult<Beat> {
    let event_seq =
        u64::try_from(row.try_get::<i64, _>("event_seq")?).map_err(|_| corrupt("event_seq"))?;
    Ok(Beat {
        version: row.try_get("row_version")?,
        event_seq_before: event_seq.saturating_sub(u64::from(with_event)),
        event_seq,
        lease_expires_at: row.try_get("lease_expires_at")?,
        progress: row.try_get("progress")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// The jobs and events of the outcomes that ended an attempt, for [`save`].
fn ended_pairs(results: &[StoreResult<Ended>]) -> Vec<(&Job, &JobEvent)> {
    results
        .iter()
        .flatten()
        .map(|ended| (&ended.job, &ended.event))
        .collect()
}

/// Loads a job with its row lock and the database's time.
async fn load_for_update(
    conn: &mut PgConnection,
    tenant: &str,
    id: Uuid,
) -> StoreResult<(Job, DateTime<Utc>)> {
    let row =
        sqlx::query("SELECT *, now() AS db_now FROM jobs WHERE id = $1 AND tenant = $2 FOR UPDATE")
            .bind(id)
            .bind(tenant)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or(StoreError::NotFound)?;
    Ok((job_from_row(&row)?, row.try_get("db_now")?))
}

/// Writes jobs after domain transitions together with their events, all in
/// one statement. The `event_seq` guard turns a lost update into an error
/// rather than a silent overwrite (the row locks make it unreachable in
/// practice); each job may appear once.
async fn save(conn: &mut PgConnection, saved: &[(&Job, &JobEvent)]) -> StoreResult<()> {
    let written = write_jobs(conn, saved, &vec![None; saved.len()], false).await?;
    if written.len() != saved.len() {
        return Err(StoreError::Internal("job changed concurrently".into()));
    }
    Ok(())
}

/// Like [`save`], for jobs read without a lock: a job is written only if its
/// row is still the version that was read (`xmin`, as text) and, when
/// `breakers_count`, no circuit breaker exists for its queue and kind (its
/// outcome would have to count against it, under the breaker's lock).
/// Returns the ids written; the others are left as they are.
async fn save_unchanged(
    conn: &mut PgConnection,
    saved: &[(&Job, &JobEvent)],
    versions: &[&str],
    breakers_count: bool,
) -> StoreResult<Vec<Uuid>> {
    let versions: Vec<Option<&str>> = versions.iter().copied().map(Some).collect();
    write_jobs(conn, saved, &versions, breakers_count).await
}

/// The CTEs of [`write_jobs`]' statement, `written` returning the ids
/// written: one row per job in the arrays, the version to check in `$22`
/// (NULL for a locked row), `$23` whether a breaker's existence stops a
/// versioned write, the tenants in `$24`. [`WRITE_THEN_CLAIM`] puts a claim
/// after them.
///
/// The rows are found by one primary-key probe each, then updated by tuple
/// id, so that no plan can choose another path: a join to the input on the
/// key, or the key arrays beside it, were planned on a young table (generic
/// plans last) as a scan of all jobs, or of the tenant's, filtered by id.
///
/// The probe locks each row, skipping one another transaction holds: the
/// write then never waits for a job row. A version-checked row the probe
/// finds updated since the statement began (the lock follows it to its
/// latest version, which the write's snapshot does not see) is left as it
/// is, like one whose version differs. An unlocked write that waited
/// would hold rows in tuple order while a locked batch holds them in id
/// order, and the two could deadlock; a row skipped here is unwritten, so
/// its caller redoes it under lock. A locked caller's own locks never make
/// a row skip.
macro_rules! write_ctes {
    () => {
        "input AS (
        SELECT * FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::text[], $5::text[],
            $6::int4[], $7::float8[], $8::bool[], $9::timestamptz[], $10::int8[], $11::text[],
            $12::text[], $13::timestamptz[], $14::timestamptz[], $15::timestamptz[],
            $16::timestamptz[], $17::timestamptz[], $18::int8[], $19::text[], $20::text[],
            $21::jsonb[], $22::text[], $24::text[])
          AS i(id, state, result, error_class, error_message, attempt, progress,
               cancel_requested, cancel_requested_at, cost_cents, lease_owner, lease_token,
               lease_expires_at, run_at, deadline, updated_at, finished_at, event_seq,
               event_type, worker_id, detail, row_version, tenant)
     ), written_rows AS (
        UPDATE jobs j SET state = i.state, result = i.result, error_class = i.error_class,
            error_message = i.error_message, attempt = i.attempt, progress = i.progress,
            cancel_requested = i.cancel_requested, cancel_requested_at = i.cancel_requested_at,
            cost_cents = i.cost_cents, lease_owner = i.lease_owner, lease_token = i.lease_token,
            lease_expires_at = i.lease_expires_at, run_at = i.run_at, deadline = i.deadline,
            updated_at = i.updated_at, finished_at = i.finished_at, event_seq = i.event_seq,
            -- A job with no attempt spent has not started (a first lease
            -- given back, a replay): the rule of domain::transition.
            started_at = CASE WHEN i.attempt = 0 THEN NULL ELSE j.started_at END
        FROM input i
        WHERE j.ctid = ANY(ARRAY(
                  SELECT (SELECT f.ctid FROM jobs f WHERE f.tenant = w.tenant AND f.id = w.id
                          FOR NO KEY UPDATE SKIP LOCKED)
                  FROM input w))
          AND j.id = i.id AND j.event_seq = i.event_seq - 1
          AND (i.row_version IS NULL OR j.xmin::text = i.row_version)
          AND (i.row_version IS NULL OR NOT $23 OR NOT EXISTS (
              SELECT 1 FROM breakers b
              WHERE b.tenant = j.tenant AND b.queue = j.queue AND b.kind = j.kind))
        RETURNING j.id
     ), written AS (
        INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at, detail)
        SELECT i.id, i.event_seq, i.event_type, i.state, i.attempt, i.worker_id, i.updated_at,
               i.detail
        FROM input i JOIN written_rows r ON r.id = i.id
        RETURNING job_id
     )"
    };
}

/// [`write_ctes`] as a statement of their own.
const WRITE_JOBS: &str = concat!("WITH ", write_ctes!(), " SELECT job_id FROM written");

/// [`write_ctes`] and then [`CLAIM_ONE_TENANT`] (its parameters from
/// `$25` on) in one statement: a batch of `Complete` writes and a batch of
/// claims share an execution and a commit instead of taking one each (in
/// psql, a write of 8 jobs and a claim of 8 took 0.26 ms less CPU as one
/// statement than as two). They touch different rows: the write only rows
/// that are running at the version it read, the claim only queued ones. One
/// row per claimed job, and one row of NULL job columns when none was
/// claimed; every row carries the ids written (`written`).
static WRITE_THEN_CLAIM: LazyLock<String> = LazyLock::new(|| write_then_claim(CLAIM_ONE_TENANT));

/// Builds [`WRITE_THEN_CLAIM`] from a claim statement.
fn write_then_claim(claim: &str) -> String {
    let body = claim
        .strip_prefix("WITH RECURSIVE ")
        .and_then(|body| body.strip_suffix("SELECT * FROM upd"))
        .unwrap_or_else(|| unreachable!("claim_statement! begins and ends as written"));
    format!(
        "WITH RECURSIVE {}, {} SELECT w.written, u.* FROM \
         (SELECT array_agg(job_id) AS written FROM written) w LEFT JOIN upd u ON true",
        write_ctes!(),
        shift_parameters(body, WRITE_PARAMETERS)
    )
}

/// How many parameters [`write_ctes`] takes.
const WRITE_PARAMETERS: usize = 24;

/// `sql` with every parameter `$n` renumbered `$(n + by)`. The claim and
/// write statements have no dollar quoting and no `$` in literals.
fn shift_parameters(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c != '$' {
            continue;
        }
        let mut digits = String::new();
        while let Some(d) = chars.next_if(char::is_ascii_digit) {
            digits.push(d);
        }
        match digits.parse::<usize>() {
            Ok(n) => out.push_str(&(n + by).to_string()),
            Err(_) => out.push_str(&digits),
        }
    }
    out
}

/// A query of the hot path, its arguments bound as it is built.
type PgQuery = sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// The statement behind [`save`] and [`save_unchanged`]; `versions` holds
/// `None` where the row is locked, and only rows with a version are checked
/// for a breaker (`breakers_count`).
async fn write_jobs(
    conn: &mut PgConnection,
    saved: &[(&Job, &JobEvent)],
    versions: &[Option<&str>],
    breakers_count: bool,
) -> StoreResult<Vec<Uuid>> {
    if saved.is_empty() {
        return Ok(Vec::new());
    }
    let done = bind_write(sqlx::query(WRITE_JOBS), saved, versions, breakers_count)?
        .fetch_all(&mut *conn)
        .await?;
    done.iter()
        .map(|row| row.try_get("job_id").map_err(StoreError::from))
        .collect()
}

/// Binds [`write_ctes`]' parameters (`$1` to `$24`) for `saved`.
fn bind_write(
    query: PgQuery,
    saved: &[(&Job, &JobEvent)],
    versions: &[Option<&str>],
    breakers_count: bool,
) -> StoreResult<PgQuery> {
    let n = saved.len();
    let mut ids = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut results = Vec::with_capacity(n);
    let mut error_classes = Vec::with_capacity(n);
    let mut error_messages = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut progress = Vec::with_capacity(n);
    let mut cancel_requested = Vec::with_capacity(n);
    let mut cancel_requested_at = Vec::with_capacity(n);
    let mut costs = Vec::with_capacity(n);
    let mut owners = Vec::with_capacity(n);
    let mut tokens = Vec::with_capacity(n);
    let mut lease_expires = Vec::with_capacity(n);
    let mut run_ats = Vec::with_capacity(n);
    let mut deadlines = Vec::with_capacity(n);
    let mut updated = Vec::with_capacity(n);
    let mut finished = Vec::with_capacity(n);
    let mut seqs = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut workers = Vec::with_capacity(n);
    let mut details = Vec::with_capacity(n);
    let mut tenants = Vec::with_capacity(n);
    for (job, event) in saved {
        tenants.push(job.tenant.as_str());
        ids.push(job.id);
        states.push(job.state.as_str());
        results.push(job.result.as_ref().map(Json));
        error_classes.push(job.error.as_ref().map(|e| e.class.as_str()));
        error_messages.push(job.error.as_ref().map(|e| e.message.as_str()));
        attempts.push(i32::try_from(job.attempt).map_err(|_| corrupt("attempt"))?);
        progress.push(job.progress);
        cancel_requested.push(job.cancel_requested);
        cancel_requested_at.push(job.cancel_requested_at);
        costs.push(job.cost_cents);
        owners.push(job.lease_owner.as_deref());
        tokens.push(job.lease_token.as_deref());
        lease_expires.push(job.lease_expires_at);
        run_ats.push(job.run_at);
        deadlines.push(job.deadline);
        updated.push(job.updated_at);
        finished.push(job.finished_at);
        seqs.push(i64::try_from(event.sequence).map_err(|_| corrupt("event_seq"))?);
        types.push(event.kind.as_str());
        workers.push(event.worker_id.as_deref());
        details.push(event.detail.as_ref().map(Json));
    }
    Ok(query
        .bind(&ids)
        .bind(&states)
        .bind(&results)
        .bind(&error_classes)
        .bind(&error_messages)
        .bind(&attempts)
        .bind(&progress)
        .bind(&cancel_requested)
        .bind(&cancel_requested_at)
        .bind(&costs)
        .bind(&owners)
        .bind(&tokens)
        .bind(&lease_expires)
        .bind(&run_ats)
        .bind(&deadlines)
        .bind(&updated)
        .bind(&finished)
        .bind(&seqs)
        .bind(&types)
        .bind(&workers)
        .bind(&details)
        .bind(versions)
        .bind(breakers_count)
        .bind(&tenants))
}

/// The circuit breakers a batch of outcomes counts against, locked for the
/// batch's transaction, and what the outcomes did to them.
#[derive(Default)]
struct Breakers {
    /// By queue and kind: the breaker now (`None`: closed, no row), and
    /// whether the batch changed it.
    rows: HashMap<(String, String), (Option<Breaker>, bool)>,
}

impl Breakers {
    /// Locks the breakers of the jobs' queues and kinds (a superset is
    /// harmless): an advisory lock for each, which covers a breaker that
    /// has no row yet (see `pg_caps`), then the rows, each in key order so
    /// that concurrent batches cannot deadlock.
    async fn load<'a>(
        conn: &mut PgConnection,
        tenant: &str,
        jobs: impl Iterator<Item = &'a Job>,
    ) -> StoreResult<Breakers> {
        let (queues, kinds): (Vec<&str>, Vec<&str>) =
            jobs.map(|j| (j.queue.as_str(), j.kind.as_str())).unzip();
        let keys = pg_caps::breaker_keys(tenant, queues.iter().copied().zip(kinds.iter().copied()));
        sqlx::query("SELECT pg_advisory_xact_lock($1, k) FROM unnest($2::int4[]) AS k")
            .bind(pg_caps::BREAKER)
            .bind(&keys)
            .execute(&mut *conn)
            .await?;
        let rows = sqlx::query(
            "SELECT queue, kind, failures, max_retry_after_ms, open_until, probe_job FROM breakers
             WHERE tenant = $1 AND queue = ANY($2) AND kind = ANY($3)
             ORDER BY queue, kind FOR UPDATE",
        )
        .bind(tenant)
        .bind(&queues)
        .bind(&kinds)
        .fetch_all(&mut *conn)
        .await?;
        let mut breakers = Breakers::default();
        for row in &rows {
            let breaker = breaker_from_row(row)?;
            breakers.rows.insert(
                (row.try_get("queue")?, row.try_get("kind")?),
                (Some(breaker), false),
            );
        }
        Ok(breakers)
    }

    /// Counts one attempt's outcome, in the order the batch applies them.
    fn outcome(
        &mut self,
        job: &Job,
        failure: Option<&(String, Option<Duration>)>,
        now: DateTime<Utc>,
        policy: &BreakerPolicy,
    ) {
        let entry = self
            .rows
            .entry((job.queue.clone(), job.kind.clone()))
            .or_insert((None, false));
        let failure = failure.map(|(class, retry_after)| (class.as_str(), *retry_after));
        match breaker::on_outcome(entry.0.as_ref(), failure, job.id, now, policy) {
            BreakerChange::Unchanged => {}
            BreakerChange::Reset => {
                if entry.0.take().is_some_and(|b| b.open_until.is_some()) {
                    tracing::info!(tenant = %job.tenant, queue = %job.queue, kind = %job.kind, "circuit breaker closed");
                }
                entry.1 = true;
            }
            BreakerChange::Update { breaker, opened } => {
                if opened {
                    tracing::warn!(
                        tenant = %job.tenant, queue = %job.queue, kind = %job.kind,
                        failures = breaker.failures, open_until = ?breaker.open_until,
                        "circuit breaker opened"
                    );
                }
                entry.0 = Some(breaker);
                entry.1 = true;
            }
        }
    }

    /// Whether the outcomes changed a breaker.
    fn changed(&self) -> bool {
        self.rows.values().any(|(_, changed)| *changed)
    }

    /// Writes the breakers the batch changed (rare: failures, and the first
    /// success after them), in key order.
    async fn write(&self, conn: &mut PgConnection, tenant: &str) -> StoreResult<()> {
        let mut changed: Vec<_> = self.rows.iter().filter(|(_, (_, c))| *c).collect();
        changed.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for ((queue, kind), (breaker, _)) in changed {
            match breaker {
                None => {
                    sqlx::query(
                        "DELETE FROM breakers WHERE tenant = $1 AND queue = $2 AND kind = $3",
                    )
                    .bind(tenant)
                    .bind(queue)
                    .bind(kind)
                    .execute(&mut *conn)
                    .await?;
                }
                Some(breaker) => {
                    sqlx::query(
                        "INSERT INTO breakers (tenant, queue, kind, failures, max_retry_after_ms,
                            open_until, probe_job, updated_at)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, now())
                         ON CONFLICT (tenant, queue, kind) DO UPDATE SET failures = EXCLUDED.failures,
                            max_retry_after_ms = EXCLUDED.max_retry_after_ms,
                            open_until = EXCLUDED.open_until, probe_job = EXCLUDED.probe_job,
                            updated_at = now()",
                    )
                    .bind(tenant)
                    .bind(queue)
                    .bind(kind)
                    .bind(i32::try_from(breaker.failures).unwrap_or(i32::MAX))
                    .bind(millis(breaker.max_retry_after))
                    .bind(breaker.open_until)
                    .bind(breaker.probe_job)
                    .execute(&mut *conn)
                    .await?;
                }
            }
        }
        Ok(())
    }
}

/// Borrows transitioned jobs with their events, for [`save`].
fn pairs(owned: &[(Job, JobEvent)]) -> Vec<(&Job, &JobEvent)> {
    owned.iter().map(|(job, event)| (job, event)).collect()
}

/// How many more times a submit inserts an item whose key holder retention
/// deleted between the insert and its read. A new holder is a fresh job,
/// which retention does not delete, so one round is all it takes in
/// practice; the bound only keeps a misbehaving database from looping.
const RESUBMITS: u32 = 3;

/// The shortest time between two notifications from one replica. What
/// commits meanwhile waits and goes into the next one: under load that is
/// one NOTIFY per gap rather than one per shared transaction (about 530 a
/// second in e2e, more than any statement of the hot path, each waking every
/// replica's listener), for at most this much more latency in another
/// replica's waiters. A change after a quiet spell goes out at once.
const ANNOUNCE_GAP: Duration = Duration::from_millis(5);

/// How long [`Store::close`] waits for the last notification (the chart's
/// termination grace counts it).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Sends other replicas what committed transactions changed, after their
/// commits: whatever committed while the previous NOTIFY was in flight, or
/// within [`ANNOUNCE_GAP`] of it, goes into the next one. A notification is
/// only a hint (replicas also re-read on a timer), so one lost in a crash
/// costs latency, never a job. On `stop` (the store closed, at shutdown)
/// what committed and is not yet sent goes out in a last one: the calls
/// finished during the shutdown grace would otherwise reach other
/// replicas' watchers only at their fallback poll.
async fn announce(
    planned: Arc<HotPool>,
    origin: Uuid,
    mut committed: mpsc::UnboundedReceiver<Changes>,
    stop: CancellationToken,
) {
    let mut next_at = tokio::time::Instant::now();
    loop {
        let (mut changes, mut stopping) = tokio::select! {
            biased;
            next = committed.recv() => match next {
                Some(changes) => (changes, false),
                None => return,
            },
            () = stop.cancelled() => (Changes::default(), true),
        };
        if !stopping {
            stopping = tokio::select! {
                () = stop.cancelled() => true,
                () = tokio::time::sleep_until(next_at) => false,
            };
        }
        while let Ok(more) = committed.try_recv() {
            changes.merge(more);
        }
        next_at = tokio::time::Instant::now() + ANNOUNCE_GAP;
        if !changes.is_empty()
            && let Err(err) = notify(&planned, origin, &changes).await
        {
            tracing::warn!(error = %err, "could not notify other replicas; they will poll");
        }
        if stopping {
            return;
        }
    }
}

/// One NOTIFY of `changes`, on a hot-path connection: it is as frequent as
/// the hot path's statements, and those connections go back without a ping.
async fn notify(planned: &HotPool, origin: Uuid, changes: &Changes) -> Result<(), sqlx::Error> {
    let mut conn = planned.acquire().await?;
    sqlx::query("SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS p(payload)")
        .bind(CHANNEL)
        .bind(changes.payloads(origin))
        .execute(&mut *conn)
        .await?;
    conn.finish();
    Ok(())
}

/// A pool of `size` connections with the settings both pools share.
fn pool_options(size: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(|conn, _| {
            Box::pin(async move { sqlx::raw_sql(SESSION_LIMITS).execute(conn).await.map(drop) })
        })
        // sqlx pings every connection it hands out (and again when it takes
        // it back): a round trip before each transaction. A connection that
        // died is found by its first statement instead, which fails
        // UNAVAILABLE like any outage (callers retry) and is then closed by
        // the pool's release ping.
        .test_before_acquire(false)
}

impl PgStore {
    /// Connects, migrates and starts listening for other replicas' changes.
    pub async fn open(settings: &Settings, notifier: Arc<Notifier>) -> StoreResult<PgStore> {
        // The connection budget is split: half for the hot path (and the
        // notifications to other replicas, as frequent), the rest for
        // everything else (heartbeats, reads, the reaper, counts), of
        // which the listener below holds one for good. So the other pool
        // needs two at least; the CLI asks for 3 in all.
        let planned_size = (settings.max_connections / 2).max(1);
        let pool = pool_options(settings.max_connections.saturating_sub(planned_size).max(2))
            .connect(&settings.database_url)
            .await?;
        let planned = Arc::new(HotPool::new(
            &settings.database_url,
            planned_size,
            &[PLANNER_SETTINGS, SESSION_LIMITS],
        )?);
        let migrator = migrator(false);
        // Without SESSION_LIMITS: it may wait for another replica's migration.
        let migrating = PgPoolOptions::new()
            .max_connections(1)
            .connect(&settings.database_url)
            .await?;
        migrator.run(&migrating).await?;
        migrating.close().await;
        let applied: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
            .fetch_one(&pool)
            .await?;
        super::migrations_ahead(&migrator, applied);
        if settings.breaker.threshold == 0 {
            let cleared = sqlx::query("DELETE FROM breakers").execute(&pool).await?;
            super::breakers_cleared(cleared.rows_affected());
        }
        let listener_stop = CancellationToken::new();
        // Listening before the store opens: a replica that cannot would
        // miss every other replica's changes until its fallback polls.
        let listener = new_listener(&pool).await?;
        // Names this replica in its notifications, so it can skip its own.
        let origin = Uuid::new_v4();
        tokio::spawn(listen(
            listener,
            pool.clone(),
            origin,
            Arc::clone(&notifier),
            listener_stop.clone(),
        ));
        let (committed, to_announce) = mpsc::unbounded_channel();
        let announcer = tokio::spawn(announce(
            Arc::clone(&planned),
            origin,
            to_announce,
            listener_stop.clone(),
        ));
        let store = PgStore {
            counts: Counts::new(pool.clone(), Arc::clone(&planned)),
            pool,
            planned,
            notifier,
            caps: RunningCaps::from_settings(settings),
            breaker: settings.breaker.clone(),
            committed,
            listener_stop,
            announcer: std::sync::Mutex::new(Some(announcer)),
            unreadable: Unreadable::default(),
            leased: Leased::default(),
            clock: DbClock::default(),
        };
        store.read_clock().await?;
        Ok(store)
    }

    /// Reads again the rows the reaper set aside as unreadable, by primary
    /// key and a chunk at a time, and lets back in those mended or deleted
    /// (see `unreadable`). A failed read is logged and tried again at the
    /// next look: the pass goes on without it. One primary-key probe per
    /// row, then the rows by tuple id, on a connection with the hot path's
    /// planner settings: a join to the keys was planned (generic plans on a
    /// young table) as a scan of the whole table.
    async fn recheck_unreadable(&self, keys: &[RowKey]) {
        for chunk in keys.chunks(RECHECK_CHUNK) {
            let (tenants, ids): (Vec<&str>, Vec<Uuid>) = chunk
                .iter()
                .filter_map(|k| Some((k.tenant.as_str(), k.id.parse::<Uuid>().ok()?)))
                .unzip();
            let read = async {
                let mut conn = self.planned.acquire().await?;
                let rows = sqlx::query(
                    "SELECT * FROM jobs WHERE ctid = ANY(ARRAY(
                         SELECT (SELECT f.ctid FROM jobs f WHERE f.tenant = k.tenant AND f.id = k.id)
                         FROM unnest($1::text[], $2::uuid[]) AS k(tenant, id)))",
                )
                .bind(&tenants)
                .bind(&ids)
                .fetch_all(&mut *conn)
                .await?;
                conn.finish();
                StoreResult::Ok(rows)
            };
            match read.await {
                Ok(rows) => self
                    .unreadable
                    .rechecked(chunk, &rows, job_from_row, row_key),
                Err(err) => {
                    tracing::warn!(error = %err, "reading the unreadable job rows again failed; trying again later");
                    return;
                }
            }
        }
    }

    /// `Complete` in one transaction that locks the jobs' rows (and, when
    /// an outcome counts against a circuit breaker, the breakers' rows).
    async fn complete_locked(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>> {
        // A generic plan: left to choose, PostgreSQL planned the locking read
        // again for 80 % of the calls and the save for 35 %, and that
        // planning took longer than running them (pg_stat_statements with
        // track_planning, e2e: 1.4 s of 3.2 s). Both statements only ever
        // take the primary key.
        let mut conn = self.planned.acquire().await?;
        let mut tx = conn.begin().await?;
        // Locked in id order, so concurrent batches cannot deadlock.
        let ids: Vec<Uuid> = items.iter().map(|item| item.job_id).collect();
        let mut read = CompleteRead::load(
            &mut tx,
            complete_read!("FOR UPDATE"),
            &ids,
            tenant,
            &self.unreadable,
        )
        .await?;
        let failures = items
            .iter()
            .any(|item| breaker::failure_of(&item.outcome).is_some());
        let mut breakers = if self.breaker.threshold > 0 && (failures || read.has_breaker) {
            Breakers::load(&mut tx, tenant, read.jobs.values()).await?
        } else {
            Breakers::default()
        };
        let results = self.apply_outcomes(&mut read, items, &mut breakers);
        save(&mut tx, &ended_pairs(&results)).await?;
        breakers.write(&mut tx, tenant).await?;
        tx.commit().await?;
        conn.finish();
        let mut changes = Changes::default();
        for ended in results.iter().flatten() {
            changes.job_event(&ended.job, &ended.event);
        }
        self.committed(changes);
        Ok(results)
    }

    /// `Complete` in two round trips instead of the four of
    /// [`Self::complete_locked`] (`BEGIN`, read, write, `COMMIT`), and in
    /// one for the jobs this replica leased: the rows are read without a
    /// lock (or taken as their lease left them, see `pg_leased`) and written
    /// by one autocommitted statement that skips every row changed since or
    /// locked by another transaction, and every row whose kind has a circuit
    /// breaker. Those jobs go through
    /// [`Self::complete_locked`], as does the whole batch when an outcome
    /// would change a circuit breaker, since breakers are written in the
    /// outcome's transaction. An error found in the read (a stale lease
    /// token, a job already ended) stands: leases only move away from a
    /// token once it has been handed out.
    ///
    /// With a `claim` the write carries it ([`WRITE_THEN_CLAIM`]), and its
    /// jobs come back beside the outcomes; `None` in their place when the
    /// write could not take it (nothing to write, or the batch went through
    /// [`Self::complete_locked`]), and the caller claims on its own.
    async fn complete_unlocked(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
        claim: Option<&Claim<'_>>,
    ) -> StoreResult<(Vec<StoreResult<Ended>>, Option<StoreResult<Vec<Vec<Job>>>>)> {
        let mut conn = self.planned.acquire().await?;
        let (mut read, from_lease) = self.read_for_complete(&mut conn, &items, tenant).await?;
        if self.breaker.threshold > 0 && read.has_breaker {
            conn.finish();
            return Ok((self.complete_locked(tenant, items).await?, None));
        }
        // Kept for the jobs that change under the write; cheap beside a commit.
        let spare = items.clone();
        let mut breakers = Breakers::default();
        let mut results = self.apply_outcomes(&mut read, items, &mut breakers);
        if breakers.changed() {
            conn.finish();
            return Ok((self.complete_locked(tenant, spare).await?, None));
        }
        let saved = ended_pairs(&results);
        // Every job saved was read with its version; a missing one would
        // write without the guard, so it fails the batch instead.
        let versions = saved
            .iter()
            .map(|(job, _)| {
                read.versions
                    .get(&job.id)
                    .map(String::as_str)
                    .ok_or_else(|| StoreError::Internal("a job read without its version".into()))
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let breakers_count = self.breaker.threshold > 0;
        let mut changes = Changes::default();
        let (written, claimed) = match claim {
            Some(claim) if !saved.is_empty() => {
                let versions: Vec<Option<&str>> = versions.iter().copied().map(Some).collect();
                let query = bind_write(
                    sqlx::query(WRITE_THEN_CLAIM.as_str()),
                    &saved,
                    &versions,
                    breakers_count,
                )?;
                let rows = claim.bind(query, &self.caps).fetch_all(&mut *conn).await?;
                let written = match rows.first() {
                    Some(row) => row.try_get::<Option<Vec<Uuid>>, _>("written")?,
                    None => None,
                };
                // The row standing for "no job claimed" has no slot.
                let rows: Vec<PgRow> = rows
                    .into_iter()
                    .filter(|row| !matches!(row.try_get::<Option<i64>, _>("slot"), Ok(None)))
                    .collect();
                (
                    written.unwrap_or_default(),
                    Some(self.claimed(claim, &rows, &mut changes)),
                )
            }
            _ => (
                save_unchanged(&mut conn, &saved, &versions, breakers_count).await?,
                None,
            ),
        };
        let written: HashSet<Uuid> = written.into_iter().collect();
        conn.finish();
        let mut redo = Vec::new();
        for (index, result) in results.iter().enumerate() {
            match result {
                Ok(ended) if written.contains(&ended.job.id) => {
                    changes.job_event(&ended.job, &ended.event);
                }
                Ok(_) => redo.push(index),
                // A refusal decided from what a lease left may be out of
                // date (the lease extended, or granted again, through
                // another replica): only the row itself may refuse.
                Err(_) if from_lease[index] => redo.push(index),
                Err(_) => {}
            }
        }
        self.committed(changes);
        if redo.is_empty() {
            return Ok((results, claimed));
        }
        tracing::debug!(
            jobs = redo.len(),
            "jobs changed or locked elsewhere between Complete's read and write, or refused from a kept lease; redone under lock"
        );
        let again: Vec<CompleteSpec> = redo.iter().map(|&i| spare[i].clone()).collect();
        // The others have committed: a failure here is only these items'.
        match self.complete_locked(tenant, again).await {
            Ok(redone) => {
                for (index, result) in redo.into_iter().zip(redone) {
                    results[index] = result;
                }
            }
            Err(err) => {
                for index in redo {
                    results[index] = Err(err.clone());
                }
            }
        }
        Ok((results, claimed))
    }

    /// Applies each outcome to its job in call order, counting it against
    /// `breakers`; one result per item. A job ended earlier in the batch
    /// answers a second outcome with `LeaseLost`.
    fn apply_outcomes(
        &self,
        read: &mut CompleteRead,
        items: Vec<CompleteSpec>,
        breakers: &mut Breakers,
    ) -> Vec<StoreResult<Ended>> {
        let now = read.now;
        let mut ended_ids = HashSet::new();
        let mut results = Vec::with_capacity(items.len());
        for item in items {
            let Some(mut job) = read.jobs.remove(&item.job_id) else {
                results.push(Err(if ended_ids.contains(&item.job_id) {
                    StoreError::LeaseLost
                } else if read.unreadable.contains(&item.job_id) {
                    unreadable::refused()
                } else {
                    StoreError::NotFound
                }));
                continue;
            };
            let attempt = job.running_attempt();
            let failure = breaker::failure_of(&item.outcome);
            match transition::complete(
                &mut job,
                &item.lease_token,
                item.outcome,
                item.cost_cents,
                now,
                rand::random::<f64>(),
            ) {
                Ok(event) => {
                    if self.breaker.threshold > 0 {
                        breakers.outcome(&job, failure.as_ref(), now, &self.breaker);
                    }
                    ended_ids.insert(job.id);
                    // A successful complete always ended a running attempt.
                    results.push(
                        Ended::new(attempt, job, event)
                            .ok_or_else(|| StoreError::Internal("no running attempt".into())),
                    );
                }
                Err(err) => {
                    read.jobs.insert(job.id, job);
                    results.push(Err(err.into()));
                }
            }
        }
        results
    }

    /// Keeps a job this replica has just leased for its `Complete`: `row`
    /// is the claim's or the hand-off's, with the row version it wrote.
    fn keep_leased(&self, row: &PgRow, job: &Job) {
        let version = row.try_get::<String, _>("row_version");
        let payload_bytes = row.try_get::<i32, _>("payload_bytes");
        if let (Ok(version), Ok(payload_bytes)) = (version, payload_bytes) {
            let payload_bytes = usize::try_from(payload_bytes).unwrap_or(usize::MAX);
            self.leased.keep(job.clone(), version, payload_bytes);
        }
    }

    /// `submit_handing`, with `rounds` more inserts for items whose key
    /// holder retention deletes before it is read.
    async fn submit_rounds(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
        handoffs: Vec<Option<Handoff>>,
        rounds: u32,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        let n = jobs.len();
        // Running caps are counted by the claim; a job under one is never
        // handed off.
        let handoff = |i: usize| {
            handoffs
                .get(i)
                .and_then(Option::as_ref)
                .filter(|_| jobs.get(i).is_some_and(|j| !self.caps.covers(&j.queue)))
        };
        let handoff_workers: Vec<Option<&str>> = (0..n)
            .map(|i| handoff(i).map(|h| h.worker_id.as_str()))
            .collect();
        let handoff_lease_ms: Vec<Option<i64>> = (0..n)
            .map(|i| handoff(i).map(|h| millis(h.lease_duration)))
            .collect();
        let ids: Vec<Uuid> = jobs.iter().map(|_| Uuid::now_v7()).collect();
        let mut max_attempts = Vec::with_capacity(n);
        let mut initial = Vec::with_capacity(n);
        let mut max = Vec::with_capacity(n);
        for new in &jobs {
            max_attempts
                .push(i32::try_from(new.max_attempts).map_err(|_| corrupt("max_attempts"))?);
            initial.push(millis(new.backoff.initial()));
            max.push(millis(new.backoff.max()));
        }
        let column = |f: fn(&NewJob) -> Option<&str>| jobs.iter().map(f).collect::<Vec<_>>();
        // All items in one statement, in key order, committed on its own (no
        // BEGIN and COMMIT round trips around it); a key already taken (also
        // by an earlier item of this statement) inserts nothing and is
        // answered below from the row that holds it.
        let hands_off = handoff_workers.iter().any(Option::is_some);
        let statement = if hands_off { SUBMIT_HANDING } else { SUBMIT };
        let query = sqlx::query(statement)
            .bind(tenant)
            .bind(&ids)
            .bind(jobs.iter().map(|j| j.queue.as_str()).collect::<Vec<_>>())
            .bind(jobs.iter().map(|j| j.kind.as_str()).collect::<Vec<_>>())
            .bind(jobs.iter().map(|j| Json(&j.payload)).collect::<Vec<_>>())
            .bind(&max_attempts)
            .bind(jobs.iter().map(|j| j.priority).collect::<Vec<_>>())
            .bind(column(|j| j.idempotency_key.as_deref()))
            .bind(
                jobs.iter()
                    .map(|j| j.input_hash.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(jobs.iter().map(|j| Json(&j.labels)).collect::<Vec<_>>())
            .bind(jobs.iter().map(|j| j.run_at).collect::<Vec<_>>())
            .bind(jobs.iter().map(|j| j.deadline).collect::<Vec<_>>())
            .bind(&initial)
            .bind(&max)
            .bind(column(|j| j.callback_url.as_deref()))
            .bind(jobs.iter().map(|j| j.max_cost_cents).collect::<Vec<_>>())
            .bind(column(|j| j.trace_parent.as_deref()))
            .bind(&handoff_workers)
            .bind(&handoff_lease_ms);
        // A submit that hands off runs on the planned connections:
        // PostgreSQL kept planning the hand-off's guard afresh (0.6 ms,
        // twice what running it costs), and as for the claim, a plan made on
        // stale statistics must not sort: it sorted a million queued jobs
        // per probe (350-400 ms) where the claim index gives them in order
        // (0.5-1.8 ms). A plain submit has no guard to plan; on those
        // connections, without sqlx's release ping, it ran 7 % slower at 16
        // in flight (docs/performance-log.md, "Changes of 2026-12-05").
        let rows = if hands_off {
            let mut conn = self.planned.acquire().await?;
            let rows = query.fetch_all(&mut *conn).await?;
            conn.finish();
            rows
        } else {
            query.fetch_all(&self.pool).await?
        };
        // The statement has committed: from here on nothing may fail the
        // call as a whole. Its callers would be told that jobs which are
        // stored were not, and a caller retrying without a key would store
        // its job twice. A row that cannot be read, or a holder read that
        // fails, fails only the items it answers.
        let mut created: HashMap<Uuid, StoreResult<Job>> = HashMap::with_capacity(rows.len());
        for row in &rows {
            let id: Uuid = match row.try_get("id") {
                Ok(id) => id,
                Err(err) => {
                    tracing::error!(error = %err, "a submitted row without its id");
                    continue;
                }
            };
            let job = job_from_row(row);
            if let Ok(job) = &job
                && job.state == JobState::Running
            {
                self.keep_leased(row, job);
            }
            created.insert(id, job);
        }
        // Keys that were taken: committed before the insert returned (a
        // concurrent insert of the same key is waited for), so readable now.
        let mut changes = Changes::default();
        let mut results: Vec<Option<StoreResult<Submitted>>> = Vec::with_capacity(n);
        let mut taken = Vec::new();
        for (i, (new, id)) in jobs.iter().zip(&ids).enumerate() {
            results.push(match created.remove(id) {
                Some(job) => Some(job.map(|job| {
                    changes.submitted(&job);
                    Submitted { job, created: true }
                })),
                None => match new.idempotency_key.as_deref() {
                    Some(key) => {
                        taken.push((i, key, new));
                        None
                    }
                    None => Some(Err(StoreError::Internal(
                        "the submitted job cannot be read back".into(),
                    ))),
                },
            });
        }
        self.committed(changes);
        for (i, answer) in self.answer_taken(tenant, &taken, rounds).await {
            results[i] = Some(answer);
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(StoreError::Internal("an item went unanswered".into())))
            })
            .collect())
    }

    /// Answers the items whose key another job held when their insert ran,
    /// from the row that holds it. Where retention deleted that row between
    /// the insert and this read, the key is free again and the item is
    /// inserted anew, at most `rounds` more times: a caller resubmitting
    /// under its key must not be told to try again for the server's race.
    fn answer_taken<'a>(
        &'a self,
        tenant: &'a str,
        taken: &'a [(usize, &'a str, &'a NewJob)],
        rounds: u32,
    ) -> BoxFuture<'a, Vec<(usize, StoreResult<Submitted>)>> {
        Box::pin(async move {
            if taken.is_empty() {
                return Vec::new();
            }
            let keys: Vec<&str> = taken.iter().map(|&(_, key, _)| key).collect();
            let holders = match self.key_holders(tenant, &keys).await {
                Ok(holders) => holders,
                Err(err) => return taken.iter().map(|&(i, ..)| (i, Err(err.clone()))).collect(),
            };
            let mut answers = Vec::with_capacity(taken.len());
            let mut vanished = Vec::new();
            for &(i, key, new) in taken {
                answers.push((
                    i,
                    match holders.get(key) {
                        None => {
                            vanished.push((i, new));
                            continue;
                        }
                        Some(Err(err)) => Err(err.clone()),
                        Some(Ok(holder)) if holder.input_hash == new.input_hash => Ok(Submitted {
                            job: holder.clone(),
                            created: false,
                        }),
                        Some(Ok(_)) => Err(StoreError::IdempotencyConflict),
                    },
                ));
            }
            if vanished.is_empty() {
                return answers;
            }
            let again = match rounds.checked_sub(1) {
                Some(left) => {
                    let jobs = vanished.iter().map(|&(_, new)| new.clone()).collect();
                    self.submit_rounds(tenant, jobs, vec![None; vanished.len()], left)
                        .await
                }
                None => Err(StoreError::Internal(
                    "the job holding this idempotency key was deleted meanwhile; submit again"
                        .into(),
                )),
            };
            match again {
                Ok(results) => answers.extend(vanished.iter().map(|&(i, _)| i).zip(results)),
                Err(err) => answers.extend(vanished.iter().map(|&(i, _)| (i, Err(err.clone())))),
            }
            answers
        })
    }

    /// The jobs holding idempotency `keys`, by key; a holder row that
    /// cannot be read answers only its own key.
    async fn key_holders(
        &self,
        tenant: &str,
        keys: &[&str],
    ) -> StoreResult<HashMap<String, StoreResult<Job>>> {
        let rows =
            sqlx::query("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = ANY($2)")
                .bind(tenant)
                .bind(keys)
                .fetch_all(&self.pool)
                .await?;
        let mut holders = HashMap::with_capacity(rows.len());
        for row in &rows {
            let Some(key) = row.try_get::<Option<String>, _>("idempotency_key")? else {
                continue;
            };
            let holder = self
                .unreadable
                .read_one(row, job_from_row, row_key, "submit");
            holders.insert(key, holder);
        }
        Ok(holders)
    }

    /// `Complete`'s unlocked read: the jobs this replica leased are taken
    /// from what their leases returned, and only the others are read. Says
    /// for each item whether its job came from a lease.
    async fn read_for_complete(
        &self,
        conn: &mut PgConnection,
        items: &[CompleteSpec],
        tenant: &str,
    ) -> StoreResult<(CompleteRead, Vec<bool>)> {
        let mut kept = Vec::with_capacity(items.len());
        let mut missing = Vec::new();
        let mut from_lease = Vec::with_capacity(items.len());
        for item in items {
            let taken = self.leased.take(tenant, item.job_id);
            from_lease.push(taken.is_some());
            match taken {
                Some(job) => kept.push(job),
                None => missing.push(item.job_id),
            }
        }
        let mut read = if missing.is_empty() {
            CompleteRead::empty(kept.len())
        } else {
            CompleteRead::load(conn, complete_read!(""), &missing, tenant, &self.unreadable).await?
        };
        // The database's own time, when a row brought it, beats an estimate.
        if read.jobs.is_empty()
            && let Some(now) = kept.iter().map(|k| k.now).max()
        {
            read.now = now;
        }
        for k in kept {
            read.versions.insert(k.job.id, k.version);
            read.jobs.insert(k.job.id, k.job);
        }
        Ok((read, from_lease))
    }

    /// Whether an outcome of `items` counts against a circuit breaker, which
    /// only [`Self::complete_locked`] may change.
    fn needs_breaker_locks(&self, items: &[CompleteSpec]) -> bool {
        self.breaker.threshold > 0
            && items
                .iter()
                .any(|item| breaker::failure_of(&item.outcome).is_some())
    }

    /// The jobs a committed claim returned, per caller in claim order, each
    /// kept for its `Complete`. A row that cannot be read stays leased to
    /// nobody (see `unreadable`), and the others are answered.
    fn claimed(
        &self,
        claim: &Claim<'_>,
        rows: &[PgRow],
        changes: &mut Changes,
    ) -> StoreResult<Vec<Vec<Job>>> {
        let jobs = self
            .unreadable
            .readable(rows, job_from_row, row_key, "a claim");
        let mut claimed: Vec<Vec<Job>> = claim.specs.iter().map(|_| Vec::new()).collect();
        for (row, job) in jobs {
            let slot: i64 = row.try_get("slot")?;
            let caller = usize::try_from(slot - 1)
                .ok()
                .and_then(|i| claim.slot_caller.get(i))
                .ok_or_else(|| corrupt("slot"))?;
            changes.job_event(&job, &JobEvent::leased(&job));
            self.keep_leased(row, &job);
            claimed[*caller].push(job);
        }
        // Candidates are locked up to a full batch per queue (and tenant),
        // and a claim beside this one skipped those left over; they are
        // free once this one commits, so their queues' waiters look again.
        // Left over means the batch was full: a claim that took less (held
        // back by caps, say) wakes nobody, its own caller included. Only a
        // hint, read after the commit: a row without it fails nothing.
        let passed = |row: &PgRow, column: &str| {
            row.try_get::<Option<Vec<String>>, _>(column).ok().flatten()
        };
        if let Some((tenants, queues)) = rows.iter().find_map(|row| {
            Some((
                passed(row, "passed_tenants")?,
                passed(row, "passed_queues")?,
            ))
        }) {
            for (tenant, queue) in tenants.iter().zip(&queues) {
                changes.queue(tenant, queue);
            }
        }
        for jobs in &mut claimed {
            jobs.sort_by(|a, b| {
                b.priority
                    .cmp(&a.priority)
                    .then(a.run_at.cmp(&b.run_at))
                    .then(a.id.cmp(&b.id))
            });
        }
        Ok(claimed)
    }

    /// After a commit: wakes this replica's waiters at once and queues the
    /// changes for the other replicas.
    fn committed(&self, mut changes: Changes) {
        changes.capped_slots_freed(&self.caps);
        if changes.is_empty() {
            return;
        }
        changes.wake(&self.notifier, &self.caps);
        // Fails once the store is closed: a commit after that (a call the
        // shutdown grace cut loose, a give-back) reaches other replicas at
        // their next poll.
        if self.committed.send(changes).is_err() {
            tracing::debug!("a commit after the store closed is not announced");
        }
    }

    /// Runs `apply` on the locked job and saves what it decided, in one
    /// transaction; `Ok(None)` from `apply` means "nothing to write".
    async fn transition<F>(&self, tenant: &str, id: Uuid, apply: F) -> StoreResult<Job>
    where
        F: FnOnce(&mut Job, DateTime<Utc>) -> Result<Option<JobEvent>, TransitionError> + Send,
    {
        let mut tx = self.pool.begin().await?;
        let (mut job, now) = load_for_update(&mut tx, tenant, id).await?;
        let mut changes = Changes::default();
        let decided = match apply(&mut job, now) {
            Ok(decided) => decided,
            Err(refused) => {
                // A dropped transaction's ROLLBACK is only queued on its
                // connection, and the row lock stays until the pool sends
                // it: meanwhile claims skip the row as locked.
                tx.rollback().await?;
                return Err(refused.into());
            }
        };
        if let Some(event) = decided {
            save(&mut tx, &[(&job, &event)]).await?;
            changes.job_event(&job, &event);
        }
        tx.commit().await?;
        self.committed(changes);
        Ok(job)
    }
}

/// Forwards other replicas' NOTIFY payloads to the local notifier until
/// `stop` fires, skipping those this replica (`own`) sent. Notifications
/// sent while the connection was down are lost, so everything is woken
/// once the `LISTEN` is back: sqlx reconnects and listens again by itself
/// on most losses (`try_recv` then answers `None`); after any other error
/// the listener, whose connection sqlx keeps, is replaced here first.
async fn listen(
    listener: PgListener,
    pool: PgPool,
    own: Uuid,
    notifier: Arc<Notifier>,
    stop: CancellationToken,
) {
    let mut listener = Some(listener);
    loop {
        let Some(current) = listener.as_mut() else {
            tokio::select! {
                () = stop.cancelled() => return,
                fresh = listen_again(&pool) => listener = Some(fresh),
            }
            wake_everything(&notifier);
            continue;
        };
        tokio::select! {
            () = stop.cancelled() => return,
            received = current.try_recv() => match received {
                Ok(Some(note)) => wake_from_payload(note.payload(), own, &notifier),
                Ok(None) => {
                    tracing::warn!("notification listener lost its connection and listens again");
                    wake_everything(&notifier);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "notification listener lost its connection; retrying");
                    listener = None;
                }
            }
        }
    }
}

/// A new listener on [`CHANNEL`], retried each second until one connects.
async fn listen_again(pool: &PgPool) -> PgListener {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        match new_listener(pool).await {
            Ok(listener) => return listener,
            Err(err) => tracing::warn!(error = %err, "notification listener cannot reconnect yet"),
        }
    }
}

/// A listener on [`CHANNEL`], on a connection of its own from `pool`.
async fn new_listener(pool: &PgPool) -> sqlx::Result<PgListener> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}

#[async_trait]
impl Store for PgStore {
    #[tracing::instrument(name = "store.submit", skip_all, fields(count = jobs.len()))]
    async fn submit_handing(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
        handoffs: Vec<Option<Handoff>>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        self.submit_rounds(tenant, jobs, handoffs, RESUBMITS).await
    }

    #[tracing::instrument(name = "store.get", skip_all, fields(job_id = %id))]
    async fn get(&self, tenant: &str, id: Uuid) -> StoreResult<Job> {
        let row = sqlx::query("SELECT * FROM jobs WHERE id = $1 AND tenant = $2")
            .bind(id)
            .bind(tenant)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound)?;
        job_from_row(&row)
    }

    async fn get_by_key(&self, tenant: &str, key: &str) -> StoreResult<Option<Job>> {
        sqlx::query("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job_from_row)
            .transpose()
    }

    #[tracing::instrument(name = "store.cancel", skip_all, fields(job_id = %id))]
    async fn cancel(
        &self,
        tenant: &str,
        id: Uuid,
        reason: Option<&str>,
        grace: Duration,
    ) -> StoreResult<Job> {
        self.transition(tenant, id, |job, now| {
            transition::cancel(job, now, reason, grace)
        })
        .await
    }

    async fn give_back(&self, tenant: &str, id: Uuid, lease_token: &str) -> StoreResult<Job> {
        self.leased.forget(tenant, id);
        self.transition(tenant, id, |job, now| {
            transition::give_back(job, lease_token, now).map(Some)
        })
        .await
    }

    #[tracing::instrument(name = "store.events_after", skip_all, fields(job_id = %id, after))]
    async fn events_after(
        &self,
        tenant: &str,
        id: Uuid,
        after: u64,
        limit: u32,
    ) -> StoreResult<Vec<JobEvent>> {
        let rows = sqlx::query(
            "SELECT e.* FROM job_events e JOIN jobs j ON j.id = e.job_id
             WHERE e.job_id = $1 AND j.tenant = $2 AND e.sequence > $3
             ORDER BY e.sequence LIMIT $4",
        )
        .bind(id)
        .bind(tenant)
        .bind(i64::try_from(after).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    #[tracing::instrument(name = "store.list", skip_all)]
    async fn list(&self, tenant: &str, filter: &ListFilter) -> StoreResult<Vec<Job>> {
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let replayable = !states.is_empty() && filter.states.iter().all(|s| s.is_replayable());
        let statement = match (replayable, filter.with_payloads) {
            (true, true) => LIST_REPLAYABLE,
            (true, false) => LIST_REPLAYABLE_BASIC,
            (false, true) => LIST,
            (false, false) => LIST_BASIC,
        };
        let rows = sqlx::query(statement)
            .bind(tenant)
            .bind(filter.before)
            .bind(filter.queue.as_deref())
            .bind(filter.kind.as_deref())
            .bind(&states)
            .bind(filter.error_class.as_deref())
            .bind(Json(&filter.labels))
            .bind(i64::from(filter.page_size))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(job_from_row).collect()
    }

    #[tracing::instrument(name = "store.retry_one", skip_all, fields(job_id = %id))]
    async fn retry_one(&self, tenant: &str, id: Uuid) -> StoreResult<Job> {
        self.transition(tenant, id, |job, now| {
            transition::replay(job, now).map(Some)
        })
        .await
    }

    #[tracing::instrument(name = "store.group_matching", skip_all)]
    async fn group_matching(&self, tenant: &str, filter: &RetryFilter) -> StoreResult<Grouped> {
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        // A job's cost saturates at the largest bigint, and so does the sum
        // of a group's (a numeric): what workers report cannot make the
        // dead set unreadable.
        let rows = sqlx::query(concat!(
            "SELECT error_class, queue, count(*) AS jobs,
                    LEAST(COALESCE(sum(cost_cents), 0), 9223372036854775807)::int8 AS cost_cents
             FROM (SELECT error_class, queue, cost_cents FROM jobs WHERE ",
            replay_filter!(),
            "
                   LIMIT $6) matching
             GROUP BY error_class, queue
             ORDER BY jobs DESC, error_class, queue"
        ))
        .bind(tenant)
        .bind(&states)
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .bind(i64::from(filter.limit))
        .fetch_all(&self.pool)
        .await?;
        let groups = rows
            .iter()
            .map(|row| {
                Ok(JobGroup {
                    error_class: row.try_get("error_class")?,
                    queue: row.try_get("queue")?,
                    jobs: to_u64(row.try_get("jobs")?, "count")?,
                    cost_cents: row.try_get("cost_cents")?,
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(Grouped::new(groups, filter.limit))
    }

    #[tracing::instrument(name = "store.retry_matching", skip_all, fields(dry_run))]
    async fn retry_matching(
        &self,
        tenant: &str,
        filter: &RetryFilter,
        dry_run: bool,
    ) -> StoreResult<Retried> {
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let mut tx = self.pool.begin().await?;
        let matched: i64 = sqlx::query_scalar(concat!(
            "SELECT count(*) FROM jobs WHERE ",
            replay_filter!()
        ))
        .bind(tenant)
        .bind(&states)
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .fetch_one(&mut *tx)
        .await?;
        let matched = to_u64(matched, "count")?;
        if dry_run {
            return Ok(Retried {
                retried: Vec::new(),
                matched,
            });
        }
        let rows = sqlx::query(concat!(
            "SELECT *, now() AS db_now FROM jobs WHERE ",
            replay_filter!(),
            "
             ORDER BY id
             LIMIT $6
             FOR UPDATE SKIP LOCKED"
        ))
        .bind(tenant)
        .bind(&states)
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .bind(i64::from(filter.limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut changes = Changes::default();
        let mut replayed = Vec::with_capacity(rows.len());
        for row in &rows {
            let mut job = job_from_row(row)?;
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let event = transition::replay(&mut job, now)?;
            changes.job(&job);
            replayed.push((job, event));
        }
        save(&mut tx, &pairs(&replayed)).await?;
        tx.commit().await?;
        self.committed(changes);
        let retried = replayed.iter().map(|(job, _)| job.id).collect();
        Ok(Retried { retried, matched })
    }

    #[tracing::instrument(name = "store.stats", skip_all)]
    async fn stats(
        &self,
        tenant: &str,
        queue: Option<&str>,
        workers_since: Duration,
    ) -> StoreResult<Stats> {
        let counts = self.counts.read(Some(tenant), queue).await?;
        let oldest = self.counts.oldest_due(&counts).await?;
        let workers = sqlx::query(
            "SELECT w.worker_id, w.queues, w.last_lease_at, r.held, r.last_heartbeat_at
             FROM workers w
             LEFT JOIN (
                SELECT lease_owner, count(*) AS held, max(updated_at) AS last_heartbeat_at
                FROM jobs WHERE tenant = $1 AND state = 'running' GROUP BY lease_owner
             ) r ON r.lease_owner = w.worker_id
             WHERE w.tenant = $1
               AND (w.last_lease_at > now() - $2 * interval '1 millisecond' OR r.held > 0)
             ORDER BY w.worker_id",
        )
        .bind(tenant)
        .bind(millis(workers_since))
        .fetch_all(&self.pool)
        .await?;
        let paused: Vec<String> = sqlx::query_scalar(
            "SELECT queue FROM paused_queues WHERE tenant = $1 AND ($2::text IS NULL OR queue = $2)",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;

        let mut by_queue = QueueStatsBuilder::default();
        for count in counts {
            let state = JobState::parse(&count.state).ok_or_else(|| corrupt("state"))?;
            by_queue.count(count.queue, state, count.n);
        }
        for (_, queue, age) in &oldest {
            by_queue.oldest(queue, *age);
        }
        for queue in paused {
            by_queue.paused(queue);
        }
        let breakers = sqlx::query(
            "SELECT queue, kind, failures, max_retry_after_ms, open_until, probe_job FROM breakers
             WHERE tenant = $1 AND ($2::text IS NULL OR queue = $2) ORDER BY queue, kind",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;
        for row in &breakers {
            let queue: String = row.try_get("queue")?;
            let breaker = breaker_from_row(row)?;
            by_queue.breaker(queue, row.try_get("kind")?, breaker);
        }
        let workers = workers
            .iter()
            .map(|row| {
                Ok(WorkerSeen {
                    worker_id: row.try_get("worker_id")?,
                    queues: row.try_get::<Json<Vec<String>>, _>("queues")?.0,
                    last_lease_at: row.try_get("last_lease_at")?,
                    last_heartbeat_at: row.try_get("last_heartbeat_at")?,
                    leases_held: to_u64(
                        row.try_get::<Option<i64>, _>("held")?.unwrap_or(0),
                        "held",
                    )?,
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(Stats {
            queues: by_queue.finish(),
            workers,
        })
    }

    #[tracing::instrument(name = "store.lease", skip_all, fields(callers = specs.len()))]
    async fn lease(&self, tenant: &str, specs: &[LeaseSpec]) -> StoreResult<Vec<Vec<Job>>> {
        let Some(claim) = Claim::new(tenant, specs, &self.caps) else {
            return Ok(Vec::new());
        };
        // The settings of the `planned` pool's sessions are what the claim
        // needs (see `Claim::statement`), so it runs autocommitted, in one
        // round trip. Under caps it takes three: `BEGIN` with its locks
        // (see `pg_caps`), the claim, `COMMIT`.
        let mut conn = self.planned.acquire().await?;
        let query = claim.bind(sqlx::query(claim.statement()), &self.caps);
        let rows = if claim.capped {
            // A failure on the way drops `conn` unfinished, which closes it
            // and rolls the transaction back.
            let begin = pg_caps::begin_and_lock(claim.only_tenant, claim.queues);
            sqlx::raw_sql(sqlx::AssertSqlSafe(begin))
                .execute(&mut *conn)
                .await?;
            let rows = query.fetch_all(&mut *conn).await?;
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
            rows
        } else {
            query.fetch_all(&mut *conn).await?
        };
        conn.finish();
        let mut changes = Changes::default();
        let claimed = self.claimed(&claim, &rows, &mut changes);
        self.committed(changes);
        claimed
    }

    #[tracing::instrument(
        name = "store.complete_and_lease",
        skip_all,
        fields(count = items.len(), callers = specs.len())
    )]
    async fn complete_and_lease(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
        specs: &[LeaseSpec],
    ) -> StoreResult<(Vec<StoreResult<Ended>>, StoreResult<Vec<Vec<Job>>>)> {
        let claim = Claim::new(tenant, specs, &self.caps);
        let with_write = claim.as_ref().filter(|claim| {
            claim.follows_a_write() && !items.is_empty() && !self.needs_breaker_locks(&items)
        });
        let Some(claim) = with_write else {
            return super::complete_then_lease(self, tenant, items, specs).await;
        };
        let (ended, leased) = self.complete_unlocked(tenant, items, Some(claim)).await?;
        let leased = match leased {
            Some(leased) => leased,
            None => self.lease(tenant, specs).await,
        };
        Ok((ended, leased))
    }

    #[tracing::instrument(name = "store.touch_worker", skip_all, fields(worker_id))]
    async fn touch_worker(
        &self,
        tenant: &str,
        worker_id: &str,
        queues: &[String],
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO workers (tenant, worker_id, queues, last_lease_at) VALUES ($1, $2, $3, now())
             ON CONFLICT (tenant, worker_id) DO UPDATE SET queues = EXCLUDED.queues, last_lease_at = now()",
        )
        .bind(tenant)
        .bind(worker_id)
        .bind(Json(queues))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    #[tracing::instrument(name = "store.heartbeat", skip_all, fields(job_id = %spec.job_id))]
    async fn heartbeat(&self, tenant: &str, spec: &HeartbeatSpec) -> StoreResult<HeartbeatAck> {
        let with_event = spec.progress.is_some() || spec.message.is_some();
        // Once a cancel is requested the lease no longer grows: it ends at the
        // cancel grace at the latest.
        let row = sqlx::query(
            "WITH upd AS (
                UPDATE jobs SET
                    lease_expires_at = CASE WHEN cancel_requested THEN lease_expires_at
                        ELSE LEAST(now() + LEAST(COALESCE($4, lease_ms, $8), $9)
                                           * interval '1 millisecond',
                                   COALESCE(deadline, 'infinity'::timestamptz)) END,
                    progress = COALESCE($5, progress),
                    updated_at = GREATEST(updated_at, now()),
                    event_seq = event_seq + CASE WHEN $7 THEN 1 ELSE 0 END
                WHERE id = $1 AND tenant = $2 AND lease_token = $3 AND state = 'running'
                  -- Past its cancel grace the lease is revoked (SPEC 2).
                  AND NOT (cancel_requested AND lease_expires_at <= now())
                RETURNING id, event_seq, attempt, lease_owner, lease_expires_at, cancel_requested,
                    progress, updated_at, xmin::text AS row_version
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at, detail)
                SELECT id, event_seq, 'progress', 'running', attempt, lease_owner, updated_at,
                       jsonb_strip_nulls(jsonb_build_object('progress', progress, 'message', $6::text))
                FROM upd WHERE $7
             )
             SELECT * FROM upd",
        )
        .bind(spec.job_id)
        .bind(tenant)
        .bind(&spec.lease_token)
        .bind(spec.extend_by.map(millis))
        .bind(spec.progress)
        .bind(spec.message.as_deref())
        .bind(with_event)
        .bind(millis(spec.unrecorded_lease))
        .bind(millis(spec.max_lease))
        .fetch_optional(&self.pool)
        .await;
        let row = match row {
            Ok(Some(row)) => row,
            Ok(None) => {
                self.leased.forget(tenant, spec.job_id);
                self.get(tenant, spec.job_id).await?;
                return Err(StoreError::LeaseLost);
            }
            Err(e) => {
                self.leased.forget(tenant, spec.job_id);
                return Err(e.into());
            }
        };
        if with_event {
            let mut changes = Changes::default();
            changes.watched(spec.job_id);
            self.committed(changes);
        }
        let ack = HeartbeatAck {
            lease_expires_at: row.try_get("lease_expires_at")?,
            cancel_requested: row.try_get("cancel_requested")?,
        };
        match beat_from_row(&row, with_event) {
            Ok(beat) => self.leased.beat(tenant, spec.job_id, beat),
            Err(_) => self.leased.forget(tenant, spec.job_id),
        }
        Ok(ack)
    }

    #[tracing::instrument(name = "store.complete", skip_all, fields(count = items.len()))]
    async fn complete(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>> {
        if self.needs_breaker_locks(&items) {
            return self.complete_locked(tenant, items).await;
        }
        Ok(self.complete_unlocked(tenant, items, None).await?.0)
    }

    #[tracing::instrument(name = "store.reap", skip_all)]
    async fn reap(&self, batch: u32, retention: Option<Duration>) -> StoreResult<Reaped> {
        if let Some(keys) = self.unreadable.due_again() {
            self.recheck_unreadable(&keys).await;
        }
        // Rows that cannot be read are read past (see `unreadable`). Each
        // expired row is compared with every id set aside, which their cap
        // keeps small.
        let set_aside: Vec<Uuid> = self
            .unreadable
            .set_aside()
            .iter()
            .filter_map(|id| id.parse().ok())
            .collect();
        let mut tx = self.pool.begin().await?;
        let expired_leases = sqlx::query(
            "SELECT *, now() AS db_now FROM jobs
             WHERE state = 'running' AND lease_expires_at <= now() AND NOT (id = ANY($2))
             ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::from(batch))
        .bind(&set_aside)
        .fetch_all(&mut *tx)
        .await?;
        let past_deadline = sqlx::query(
            "SELECT *, now() AS db_now FROM jobs
             WHERE state = 'queued' AND deadline <= now() AND NOT (id = ANY($2))
             ORDER BY deadline LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::from(batch))
        .bind(&set_aside)
        .fetch_all(&mut *tx)
        .await?;
        let (expired_jobs, past_jobs) = self.unreadable.reaper_readable(
            (&expired_leases, &past_deadline),
            job_from_row,
            row_key,
        );
        let mut changes = Changes::default();
        let mut reclaimed = Vec::with_capacity(expired_jobs.len());
        for (row, mut job) in expired_jobs {
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let attempt = job.running_attempt();
            let event = transition::lease_expired(&mut job, now);
            changes.job_event(&job, &event);
            reclaimed.push((attempt, job, event));
        }
        let mut past = Vec::with_capacity(past_jobs.len());
        for (row, mut job) in past_jobs {
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let event = transition::deadline_passed(&mut job, now);
            changes.job_event(&job, &event);
            past.push((job, event));
        }
        let mut saved: Vec<(&Job, &JobEvent)> = reclaimed
            .iter()
            .map(|(_, job, event)| (job, event))
            .collect();
        saved.extend(pairs(&past));
        save(&mut tx, &saved).await?;
        tx.commit().await?;
        self.committed(changes);
        let Some(retention) = retention else {
            return Ok(Reaped::new(reclaimed, past, 0));
        };
        // Separate, small statement: deleting history must not hold the
        // reaper's row locks longer, nor block claims (it only touches
        // finished rows, which no claim reads). Events have no foreign key
        // (migration 0007): they go in the same statement as their jobs.
        // The locked rows go by tuple id: no key to plan around. A job whose
        // callback is still pending stays until it is delivered or given
        // up: its delivery row would go with it, unrecorded.
        let deleted = sqlx::query_scalar::<_, i64>(
            "WITH gone AS (
                DELETE FROM jobs WHERE ctid = ANY(ARRAY(
                    SELECT ctid FROM jobs
                    WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired')
                      AND finished_at < now() - $1 * interval '1 millisecond'
                      AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                                      WHERE d.job_id = jobs.id AND d.status = 'pending')
                    ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED
                )) RETURNING id
             ), events AS (
                DELETE FROM job_events WHERE job_id IN (SELECT id FROM gone)
             )
             SELECT count(*) FROM gone",
        )
        .bind(millis(retention))
        .bind(i64::from(batch))
        .fetch_one(&self.pool)
        .await
        .map_err(StoreError::from)
        .and_then(|n| to_u64(n, "deleted"));
        // What was reclaimed is committed: a failed deletion must not lose
        // its report (metrics, attempt spans, the reaper's next pass).
        let deleted = deleted.unwrap_or_else(|err| {
            tracing::warn!(error = %err, "deleting finished jobs past retention failed; trying again next pass");
            0
        });
        // Workers are named per process (hostname-pid by default), so every
        // restart adds one: those unseen for the retention and holding no
        // job go, or the table (and Stats) would grow for good.
        let forgotten = sqlx::query(
            "DELETE FROM workers WHERE ctid = ANY(ARRAY(
                SELECT w.ctid FROM workers w
                WHERE w.last_lease_at < now() - $1 * interval '1 millisecond'
                  AND NOT EXISTS (SELECT 1 FROM jobs j
                                  WHERE j.tenant = w.tenant AND j.state = 'running'
                                    AND j.lease_owner = w.worker_id)
                LIMIT $2))",
        )
        .bind(millis(retention))
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await;
        if let Err(err) = forgotten {
            tracing::warn!(error = %err, "forgetting workers past retention failed; trying again next pass");
        }
        Ok(Reaped::new(reclaimed, past, deleted))
    }

    #[tracing::instrument(name = "store.set_paused", skip_all, fields(queue, paused))]
    async fn set_paused(&self, tenant: &str, queue: &str, paused: bool) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        let mut changes = Changes::default();
        if paused {
            sqlx::query(
                "INSERT INTO paused_queues (tenant, queue, paused_at) VALUES ($1, $2, now())
                 ON CONFLICT (tenant, queue) DO NOTHING",
            )
            .bind(tenant)
            .bind(queue)
            .execute(&mut *tx)
            .await?;
        } else {
            sqlx::query("DELETE FROM paused_queues WHERE tenant = $1 AND queue = $2")
                .bind(tenant)
                .bind(queue)
                .execute(&mut *tx)
                .await?;
            // Waiting workers may claim again.
            changes.queue(tenant, queue);
        }
        tx.commit().await?;
        self.committed(changes);
        Ok(())
    }

    #[tracing::instrument(name = "store.queued_count", skip_all, fields(queue))]
    async fn queued_count(&self, tenant: &str, queue: &str) -> StoreResult<u64> {
        let counts = self.counts.read(Some(tenant), Some(queue)).await?;
        Ok(counts
            .iter()
            .filter(|c| c.state == JobState::Queued.as_str())
            .map(|c| c.n)
            .sum())
    }

    #[tracing::instrument(name = "store.queue_depths", skip_all)]
    async fn queue_depths(&self) -> StoreResult<Vec<QueueDepth>> {
        let counts = self.counts.read(None, None).await?;
        let oldest = self.counts.oldest_due(&counts).await?;
        let mut depths: BTreeMap<(String, String), QueueDepth> = BTreeMap::new();
        for count in counts {
            let state = JobState::parse(&count.state).ok_or_else(|| corrupt("state"))?;
            depths
                .entry((count.tenant.clone(), count.queue.clone()))
                .or_insert_with(|| QueueDepth {
                    tenant: count.tenant,
                    queue: count.queue,
                    ..Default::default()
                })
                .counts
                .insert(state.as_str(), count.n);
        }
        for (tenant, queue, age) in oldest {
            if let Some(depth) = depths.get_mut(&(tenant, queue)) {
                depth.oldest_runnable_age = Some(age);
            }
        }
        Ok(depths.into_values().collect())
    }

    async fn active_workers(&self, since: Duration) -> StoreResult<Vec<QueueWorkers>> {
        let rows = sqlx::query(
            "SELECT w.tenant, q.queue, count(*) AS workers
             FROM workers w CROSS JOIN LATERAL jsonb_array_elements_text(w.queues) AS q(queue)
             WHERE w.last_lease_at > now() - $1 * interval '1 millisecond'
                OR EXISTS (SELECT 1 FROM jobs j
                           WHERE j.tenant = w.tenant AND j.state = 'running'
                             AND j.lease_owner = w.worker_id)
             GROUP BY w.tenant, q.queue",
        )
        .bind(millis(since))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(queue_workers).collect()
    }

    async fn close(&self) {
        self.listener_stop.cancel();
        let announcer = self.announcer.lock().ok().and_then(|mut a| a.take());
        if let Some(announcer) = announcer
            && tokio::time::timeout(CLOSE_WAIT, announcer).await.is_err()
        {
            tracing::warn!("the last notification to other replicas did not go out in time");
        }
    }

    fn unreadable_rows(&self) -> u64 {
        self.unreadable.left_out()
    }

    fn outbox(&self) -> Arc<dyn super::outbox::Outbox> {
        Arc::new(super::outbox::PgOutbox::new(self.pool.clone()))
    }

    fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// The connection is taken first, so that only the query's round trip
    /// is timed.
    async fn read_clock(&self) -> StoreResult<()> {
        let mut conn = self.pool.acquire().await?;
        let sent = Utc::now();
        let db_time: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *conn)
            .await?;
        self.clock.observe(sent, db_time, Utc::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Executor;

    use super::*;
    use crate::domain::fixtures::{lease_spec, new_job};
    use crate::domain::{JobState, Outcome};

    /// The admin URL the integration tests use.
    fn admin_url() -> String {
        std::env::var("INTRAY_TEST_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    /// What a claim statement returns, in slot order: job, slot, worker.
    async fn claimed_by(
        conn: &mut PgConnection,
        statement: &'static str,
        workers: &[&str],
    ) -> Vec<(Uuid, i64, String)> {
        let mut tx = conn.begin().await.expect("begin");
        let lease_ms = vec![30_000i64; workers.len()];
        let rows = sqlx::query(statement)
            .bind("a")
            .bind(["q1", "q2", "q3"])
            .bind(Vec::<String>::new())
            .bind(i64::try_from(workers.len()).expect("a few slots"))
            .bind(workers)
            .bind(&lease_ms)
            .bind(Vec::<String>::new())
            .bind(Vec::<i64>::new())
            .bind(i64::MAX)
            .bind(false)
            .fetch_all(&mut *tx)
            .await
            .expect("the claim runs");
        tx.rollback().await.expect("rollback");
        let mut claimed: Vec<(Uuid, i64, String)> = rows
            .iter()
            .map(|row| {
                (
                    row.get("id"),
                    row.get("slot"),
                    row.get::<String, _>("lease_owner"),
                )
            })
            .collect();
        claimed.sort_by_key(|c| c.1);
        claimed
    }

    /// A claim locks only the jobs it takes. Each priority level's scan
    /// locked as many jobs as were asked for, though only the best were
    /// taken: a claim beside it skipped the rest, and its caller found
    /// nothing while a job was runnable (until the next poll).
    #[tokio::test]
    async fn a_claim_locks_only_the_jobs_it_takes() {
        let scratch = Scratch::new("intray_claim_locks_taken").await;
        let store = PgStore::open(&Settings::new(&scratch.url), Arc::new(Notifier::new()))
            .await
            .expect("open the store");
        let tenant = "default";
        let mut high = new_job();
        high.priority = 10;
        let ids: Vec<Uuid> = store
            .submit(tenant, vec![high, new_job()])
            .await
            .expect("submit")
            .into_iter()
            .map(|s| s.expect("stored").job.id)
            .collect();
        let mut holder = PgConnection::connect(&scratch.url).await.expect("connect");
        holder
            .execute(PLANNER_SETTINGS)
            .await
            .expect("the store's planner settings");
        let mut open = holder.begin().await.expect("begin");
        let specs = [lease_spec("first", 1)];
        let claim = Claim::new(tenant, &specs, &store.caps).expect("a claim");
        let first = claim
            .bind(sqlx::query(claim.statement()), &store.caps)
            .fetch_all(&mut *open)
            .await
            .expect("the first claim");
        let first: Vec<Uuid> = first.iter().map(|row| row.get("id")).collect();
        assert_eq!(first, [ids[0]], "the higher priority first");

        let second = tokio::time::timeout(
            Duration::from_secs(30),
            store.lease(tenant, &[lease_spec("second", 1)]),
        )
        .await
        .expect("the second claim does not wait")
        .expect("the second claim");
        let second: Vec<Uuid> = second.concat().iter().map(|j| j.id).collect();
        assert_eq!(second, [ids[1]], "the job the first claim did not take");
        open.rollback().await.expect("rollback");
        drop(store);
    }

    /// The queue keys `woken` has been told of, in order, without waiting.
    fn woken_keys(woken: &mut tokio::sync::broadcast::Receiver<Arc<str>>) -> Vec<String> {
        let mut keys = Vec::new();
        while let Ok(key) = woken.try_recv() {
            keys.push(key.to_string());
        }
        keys.sort();
        keys
    }

    /// A claim over several queues locks up to a full batch in each and
    /// takes the best across them; a claim beside it skips the rest, and
    /// its caller may park while they are runnable. The queues where a
    /// candidate was left over wake once the claim commits (nothing woke
    /// them before, until the parked caller's next poll). A claim that took
    /// less than a full batch left nothing over and wakes nobody: under a
    /// running cap, not even its own caller (a wake-up tried earlier and
    /// taken back woke it without end).
    #[tokio::test]
    async fn a_full_claim_wakes_the_queues_it_left_jobs_in() {
        let scratch = Scratch::new("intray_claim_left_over").await;
        let notifier = Arc::new(Notifier::new());
        let mut settings = Settings::new(&scratch.url);
        settings.queue_max_running_per_tenant.insert("c1".into(), 1);
        settings.queue_max_running_per_tenant.insert("c2".into(), 1);
        settings.queue_max_running_per_tenant.insert("d1".into(), 5);
        settings.queue_max_running_per_tenant.insert("d2".into(), 5);
        let store = PgStore::open(&settings, Arc::clone(&notifier))
            .await
            .expect("open the store");
        let tenant = "default";
        let mut woken = notifier.subscribe_queues();
        let submit = |queues: &[&str]| {
            let batch = queues
                .iter()
                .map(|queue| {
                    let mut job = new_job();
                    job.queue = (*queue).into();
                    job
                })
                .collect();
            let store = &store;
            async move {
                for stored in store.submit(tenant, batch).await.expect("submit") {
                    stored.expect("stored");
                }
            }
        };
        let lease = |queues: [&str; 2], max_jobs: u32| {
            let mut spec = lease_spec("w", max_jobs);
            spec.queues = queues.map(String::from).to_vec();
            let store = &store;
            async move { store.lease(tenant, &[spec]).await.expect("lease").concat() }
        };

        // A job in each queue, a claim of one: the other queue wakes, and
        // the claim that takes that job leaves nothing over.
        for (pair, what) in [
            (["q1", "q2"], "an uncapped claim"),
            // The general claim, counting loads under caps.
            (["d1", "d2"], "a capped claim"),
        ] {
            submit(&pair).await;
            woken_keys(&mut woken);
            let first = lease(pair, 1).await;
            assert_eq!(first.len(), 1, "{what}");
            let other = if first[0].queue == pair[0] {
                pair[1]
            } else {
                pair[0]
            };
            assert_eq!(
                woken_keys(&mut woken),
                [format!("default/{other}")],
                "{what}: the queue whose job was left over"
            );
            assert_eq!(lease(pair, 5).await.len(), 1, "{what}: the job left over");
            assert!(
                woken_keys(&mut woken).is_empty(),
                "{what}: nothing left over"
            );
        }

        submit(&["c1", "c1", "c2", "c2"]).await;
        woken_keys(&mut woken);
        let capped = lease(["c1", "c2"], 5).await;
        assert_eq!(capped.len(), 2, "one job per capped queue");
        assert!(
            woken_keys(&mut woken).is_empty(),
            "the caps held the rest back"
        );
        assert!(lease(["c1", "c2"], 5).await.is_empty(), "the caps are full");
        assert!(
            woken_keys(&mut woken).is_empty(),
            "a claim held back wakes nobody"
        );
        drop(store);
        scratch.drop().await;
    }

    /// A cap on one queue leaves the others alone: a claim from an uncapped
    /// queue takes no queue lock (it waited for a lock held on its queue as
    /// if capped), and a job submitted to it is still handed off to an idle
    /// worker (any cap anywhere turned the hand-off off for every queue).
    #[tokio::test]
    async fn a_cap_on_one_queue_leaves_the_others_uncapped() {
        let scratch = Scratch::new("intray_cap_one_queue").await;
        let mut settings = Settings::new(&scratch.url);
        settings
            .queue_max_running_per_tenant
            .insert("gpu".into(), 2);
        let store = PgStore::open(&settings, Arc::new(Notifier::new()))
            .await
            .expect("open the store");
        let tenant = "default";
        let mut holder = scratch.hold_queue_lock(tenant, "q").await;
        let handed = store
            .submit_handing(
                tenant,
                vec![new_job()],
                vec![Some(Handoff {
                    worker_id: "idle".into(),
                    lease_duration: Duration::from_secs(30),
                })],
            )
            .await
            .expect("submit")
            .pop()
            .expect("one result")
            .expect("stored");
        assert_eq!(
            handed.job.state,
            JobState::Running,
            "handed off to the idle worker"
        );
        store
            .submit(tenant, vec![new_job()])
            .await
            .expect("submit")
            .into_iter()
            .collect::<StoreResult<Vec<_>>>()
            .expect("stored");
        let leased = tokio::time::timeout(
            Duration::from_secs(5),
            store.lease(tenant, &[lease_spec("w", 1)]),
        )
        .await
        .expect("a claim from an uncapped queue takes no lock")
        .expect("lease");
        assert_eq!(leased.concat().len(), 1);
        sqlx::raw_sql("COMMIT")
            .execute(&mut holder)
            .await
            .expect("release the lock");
        drop(store);
    }

    /// A server of this build starts on a database a newer build migrated
    /// further (a rollout under way, or a rollback): an unknown migration
    /// is tolerated when the store opens, and only `intray migrate`
    /// refuses it. Before, the open refused it too, and old pods crash-looped.
    #[tokio::test]
    async fn a_store_opens_on_a_database_a_newer_build_migrated() {
        let scratch = Scratch::new("intray_newer_schema").await;
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        db.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99999, 'from a newer build', true, '\\x00', 0)",
        )
        .await
        .expect("a newer build's migration");
        let store = scratch.store().await;
        drop(store);
        assert!(
            migrate(&scratch.url, true).await.is_err(),
            "intray migrate stays strict"
        );
    }

    /// A capped claim's transaction begins before it waits for its queue's
    /// lock: a job whose deadline passes during that wait is not leased
    /// (the claim's filters read the transaction's start, and leased it
    /// with a lease already over).
    #[tokio::test]
    async fn a_capped_claim_leases_no_job_whose_deadline_passed_while_it_waited() {
        let scratch = Scratch::new("intray_cap_deadline").await;
        let mut settings = Settings::new(&scratch.url);
        settings.max_running_per_tenant = Some(10);
        let store = PgStore::open(&settings, Arc::new(Notifier::new()))
            .await
            .expect("open the store");
        let tenant = "default";
        let mut job = new_job();
        job.deadline = Some(Utc::now() + chrono::Duration::milliseconds(500));
        store
            .submit(tenant, vec![job])
            .await
            .expect("submit")
            .into_iter()
            .collect::<StoreResult<Vec<_>>>()
            .expect("stored");
        let mut holder = scratch.hold_queue_lock(tenant, "q").await;
        let specs = [lease_spec("w", 1)];
        let claim = tokio::spawn({
            let store = Arc::new(store);
            let specs = specs.clone();
            async move { store.lease(tenant, &specs).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        sqlx::raw_sql("COMMIT")
            .execute(&mut holder)
            .await
            .expect("release the lock");
        let leased = tokio::time::timeout(Duration::from_secs(30), claim)
            .await
            .expect("the claim goes on once the lock is free")
            .expect("the claim's task")
            .expect("the claim");
        let leased = leased.concat();
        assert!(
            leased.is_empty(),
            "leased past its deadline: {:?}",
            leased
                .iter()
                .map(|j| (j.deadline, j.lease_expires_at))
                .collect::<Vec<_>>()
        );
    }

    /// The one-tenant claim must pick what the general one picks for one
    /// tenant without caps: the same jobs for the same slots, with
    /// priorities, times not yet due, passed deadlines, a paused queue,
    /// an open breaker and a half-open one (one probe of its kind) in play.
    #[tokio::test]
    async fn the_one_tenant_claim_picks_what_the_general_claim_picks() {
        let scratch = Scratch::new("intray_claim_eq").await;
        let mut db = PgConnection::connect(&scratch.url)
            .await
            .expect("connect to it");
        db.execute(
            "INSERT INTO jobs (id, tenant, queue, kind, state, payload, max_attempts, priority,
                 input_hash, run_at, deadline, backoff_initial_ms, backoff_max_ms, created_at,
                 updated_at, event_seq)
             SELECT gen_random_uuid(), CASE WHEN n % 11 = 0 THEN 'b' ELSE 'a' END,
                 'q' || (1 + n % 3), 'k' || (1 + n % 4), 'queued', '{}', 3, (n % 3) * 5 - 5, 'h',
                 now() + CASE WHEN n % 13 = 0 THEN interval '1 hour'
                              ELSE (n % 7) * interval '-1 second' END,
                 CASE WHEN n % 17 = 0 THEN now() - interval '1 second' END,
                 1000, 60000, now(), now(), 1
             FROM generate_series(1, 400) AS n;
             INSERT INTO paused_queues (tenant, queue, paused_at) VALUES ('a', 'q3', now());
             INSERT INTO breakers (tenant, queue, kind, failures, max_retry_after_ms, open_until,
                 updated_at)
             VALUES ('a', 'q1', 'k2', 5, 0, now() - interval '1 second', now()),
                    ('a', 'q2', 'k3', 5, 0, now() + interval '1 hour', now());",
        )
        .await
        .expect("the jobs, a pause and breakers");
        for slots in [1, 7, 60, 400] {
            let workers: Vec<String> = (0..slots).map(|i| format!("w{}", i % 5)).collect();
            let workers: Vec<&str> = workers.iter().map(String::as_str).collect();
            let general = claimed_by(&mut db, CLAIM, &workers).await;
            let one_tenant = claimed_by(&mut db, CLAIM_ONE_TENANT, &workers).await;
            assert!(!general.is_empty(), "{slots} slots claimed nothing");
            assert_eq!(one_tenant, general, "{slots} slots");
        }
        db.close().await.expect("close");
        scratch.drop().await;
    }

    #[test]
    fn parameters_shift_past_the_writes() {
        assert_eq!(
            shift_parameters("a = $1 AND b = ANY($10::text[]) OR $ IS NULL", 24),
            "a = $25 AND b = ANY($34::text[]) OR $ IS NULL"
        );
        let merged = WRITE_THEN_CLAIM.as_str();
        assert!(merged.contains("$24::text[]") && merged.contains("$34"));
        assert!(!merged.contains("$35"), "the claim takes ten parameters");
    }

    /// The outcome `outcome` for a job leased as `job`.
    fn outcome_for(job: &Job, outcome: Outcome) -> CompleteSpec {
        CompleteSpec {
            job_id: job.id,
            lease_token: job.lease_token.clone().unwrap_or_default(),
            outcome,
            cost_cents: 0,
        }
    }

    /// Outcomes and a claim in one statement ([`WRITE_THEN_CLAIM`]): each
    /// outcome lands with its event, the claim leases other jobs than the
    /// ones ended (a retried job is not due), and the counts follow both.
    /// An id missing from what the statement says it wrote would be redone
    /// under lock and refused, its job having ended. A batch with nothing
    /// to write (a stale token) still claims.
    #[tokio::test]
    async fn outcomes_and_a_claim_share_one_statement() {
        let scratch = Scratch::new("intray_write_then_claim").await;
        let mut settings = Settings::new(&scratch.url);
        // Without breakers a failure may share the statement too.
        settings.breaker.threshold = 0;
        let store = PgStore::open(&settings, Arc::new(Notifier::new()))
            .await
            .expect("open the store");
        let tenant = "default";
        store
            .submit(tenant, (0..6).map(|_| new_job()).collect())
            .await
            .expect("submit")
            .into_iter()
            .collect::<StoreResult<Vec<_>>>()
            .expect("every job stored");
        let first = store
            .lease(tenant, &[lease_spec("a", 2)])
            .await
            .expect("lease")
            .concat();
        assert_eq!(first.len(), 2);
        let items = vec![
            outcome_for(
                &first[0],
                Outcome::Success {
                    result: serde_json::json!({"ok": true}),
                },
            ),
            outcome_for(
                &first[1],
                Outcome::Failure {
                    error: JobError {
                        class: "flaky".into(),
                        message: "again".into(),
                    },
                    retryable: true,
                    retry_after: None,
                },
            ),
        ];
        let specs = [lease_spec("b", 2), lease_spec("c", 1)];
        let claim = Claim::new(tenant, &specs, &store.caps).expect("a claim");
        let (ended, leased) = store
            .complete_unlocked(tenant, items, Some(&claim))
            .await
            .expect("one statement");
        let leased = leased.expect("the write carried the claim");
        let ended: Vec<Ended> = ended
            .into_iter()
            .collect::<StoreResult<_>>()
            .expect("both outcomes apply");
        assert_eq!(ended[0].job.state, JobState::Succeeded);
        assert_eq!(ended[1].job.state, JobState::Queued);
        let leased = leased.expect("the claim");
        assert_eq!(leased.iter().map(Vec::len).collect::<Vec<_>>(), [2, 1]);
        for (jobs, worker) in leased.iter().zip(["b", "c"]) {
            for job in jobs {
                assert_eq!(job.state, JobState::Running);
                assert_eq!(job.lease_owner.as_deref(), Some(worker));
                assert!(first.iter().all(|f| f.id != job.id), "an ended job claimed");
            }
        }
        for (job, state) in [(&first[0], "succeeded"), (&first[1], "queued")] {
            let stored = store.get(tenant, job.id).await.expect("get");
            assert_eq!(stored.state.as_str(), state);
            let events = store
                .events_after(tenant, job.id, 0, 100)
                .await
                .expect("events");
            let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
            assert_eq!(sequences, [1, 2, 3], "{state}: one event per transition");
        }
        // The count triggers saw both updates of the one statement.
        let mut counted: Vec<(String, u64)> = store
            .counts
            .read(Some(tenant), Some("q"))
            .await
            .expect("counts")
            .into_iter()
            .filter(|c| c.n > 0)
            .map(|c| (c.state, c.n))
            .collect();
        counted.sort();
        let in_table: Vec<(String, i64)> = sqlx::query_as(
            "SELECT state, count(*) FROM jobs WHERE tenant = 'default' GROUP BY state ORDER BY state",
        )
        .fetch_all(&store.pool)
        .await
        .expect("count the table");
        let in_table: Vec<(String, u64)> = in_table
            .into_iter()
            .map(|(state, n)| (state, n.unsigned_abs()))
            .collect();
        assert_eq!(counted, in_table);
        assert_eq!(
            in_table,
            [
                ("queued".to_owned(), 2),
                ("running".to_owned(), 3),
                ("succeeded".to_owned(), 1)
            ]
        );

        // A stale token: nothing to write, and the claim runs on its own.
        let stale = outcome_for(
            &first[0],
            Outcome::Success {
                result: serde_json::json!(null),
            },
        );
        let (ended, leased) = store
            .complete_and_lease(tenant, vec![stale], &[lease_spec("d", 5)])
            .await
            .expect("the batch");
        assert!(matches!(ended[..], [Err(_)]), "{ended:?}");
        assert_eq!(leased.expect("the claim").concat().len(), 1);
        assert_eq!(store.queued_count(tenant, "q").await.expect("count"), 1);
        drop(store);
        scratch.drop().await;
    }

    /// A capped claim waits for the lock of its tenant's queue, and only
    /// for that one: a transaction holding the lock of queue `q` holds back
    /// a claim from `q` and not one from `r`.
    #[tokio::test]
    async fn a_capped_claim_waits_for_its_queue_lock_only() {
        let scratch = Scratch::new("intray_cap_locks").await;
        let mut settings = Settings::new(&scratch.url);
        settings.max_running_per_tenant = Some(10);
        let store = PgStore::open(&settings, Arc::new(Notifier::new()))
            .await
            .expect("open the store");
        let tenant = "default";
        let mut jobs = vec![new_job(), new_job()];
        jobs[1].queue = "r".into();
        store
            .submit(tenant, jobs)
            .await
            .expect("submit")
            .into_iter()
            .collect::<StoreResult<Vec<_>>>()
            .expect("both jobs stored");
        let mut holder = scratch.hold_queue_lock(tenant, "q").await;

        let from_r = LeaseSpec {
            queues: vec!["r".into()],
            ..lease_spec("a", 1)
        };
        let leased = tokio::time::timeout(Duration::from_secs(30), store.lease(tenant, &[from_r]))
            .await
            .expect("a claim from r does not wait for q's lock")
            .expect("lease from r");
        assert_eq!(leased.concat().len(), 1);

        let specs = [lease_spec("b", 1)];
        let mut from_q = Box::pin(store.lease(tenant, &specs));
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut from_q)
                .await
                .is_err(),
            "a claim from q waits while its lock is held"
        );
        sqlx::raw_sql("COMMIT")
            .execute(&mut holder)
            .await
            .expect("release the lock");
        let released = Utc::now();
        let leased = tokio::time::timeout(Duration::from_secs(30), from_q)
            .await
            .expect("the claim from q goes on once the lock is free")
            .expect("lease from q");
        let leased = leased.concat();
        assert_eq!(leased.len(), 1);
        // Leased when the claim ran, not when its transaction began (before
        // its 300 ms wait for the lock), so the lease is as long as asked.
        let at = leased[0].leased_at.expect("leased_at");
        assert!(
            at > released - chrono::Duration::milliseconds(100),
            "leased at {at}, the lock was released at {released}"
        );
        drop(store);
        scratch.drop().await;
    }

    /// Two replicas that each count the first failure of a queue and kind
    /// at the same time: both count, though neither finds a breaker row to
    /// lock (without the advisory lock, each wrote a count of one).
    #[tokio::test]
    async fn first_failures_on_two_replicas_both_count() {
        let scratch = Scratch::new("intray_breaker_race").await;
        let settings = Settings::new(&scratch.url);
        let open = || PgStore::open(&settings, Arc::new(Notifier::new()));
        let (a, b) = (
            open().await.expect("replica a"),
            open().await.expect("replica b"),
        );
        let tenant = "default";
        let failure = || Outcome::Failure {
            error: crate::domain::JobError {
                class: "rate_limited".into(),
                message: "429".into(),
            },
            retryable: true,
            retry_after: None,
        };
        for round in 0..20 {
            a.submit(tenant, vec![new_job(), new_job()])
                .await
                .expect("submit")
                .into_iter()
                .collect::<StoreResult<Vec<_>>>()
                .expect("stored");
            let leased = a
                .lease(tenant, &[lease_spec("w", 2)])
                .await
                .expect("lease")
                .concat();
            assert_eq!(leased.len(), 2, "round {round}");
            let (ended_a, ended_b) = tokio::join!(
                a.complete(tenant, vec![outcome_for(&leased[0], failure())]),
                b.complete(tenant, vec![outcome_for(&leased[1], failure())]),
            );
            for ended in [ended_a, ended_b] {
                assert!(ended.expect("complete")[0].is_ok(), "round {round}");
            }
            let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
            let failures: i32 = sqlx::query_scalar(
                "SELECT failures FROM breakers WHERE queue = 'q' AND kind = 'k'",
            )
            .fetch_one(&mut db)
            .await
            .expect("the breaker row");
            assert_eq!(failures, 2, "round {round}: both failures counted");
            sqlx::query("DELETE FROM breakers")
                .execute(&mut db)
                .await
                .expect("reset");
        }
        drop((a, b));
        scratch.drop().await;
    }

    /// A job given back returns to the queue with its attempt, once, and
    /// only under its own token.
    #[tokio::test]
    async fn a_job_given_back_is_queued_with_its_attempt_returned() {
        let scratch = Scratch::new("intray_give_back").await;
        let store = scratch.store().await;
        let mut job = new_job();
        job.max_attempts = 1;
        store.submit("default", vec![job]).await.expect("submit");
        let leased = store
            .lease("default", &[lease_spec("w", 1)])
            .await
            .expect("lease")
            .concat();
        let leased = leased.first().expect("leased");
        let token = leased.lease_token.clone().expect("token");
        assert!(matches!(
            store.give_back("default", leased.id, "not-the-token").await,
            Err(StoreError::LeaseLost)
        ));
        let back = store
            .give_back("default", leased.id, &token)
            .await
            .expect("given back");
        assert_eq!((back.state, back.attempt), (JobState::Queued, 0));
        let stored = store.get("default", leased.id).await.expect("get");
        assert_eq!(
            (stored.attempt, stored.started_at),
            (0, None),
            "stored as never started"
        );
        assert!(matches!(
            store.give_back("default", leased.id, &token).await,
            Err(StoreError::LeaseLost)
        ));
        let again = store
            .lease("default", &[lease_spec("w", 1)])
            .await
            .expect("lease")
            .concat();
        assert_eq!(
            again.first().map(|j| (j.id, j.attempt)),
            Some((leased.id, 1))
        );
        drop(store);
        scratch.drop().await;
    }

    /// A database that turns read-only under a running store (a primary
    /// failed over to a standby not yet promoted) is unavailable, as a lost
    /// one is, not an internal error: callers are told to retry.
    #[tokio::test]
    async fn a_database_turned_read_only_is_unavailable() {
        let scratch = Scratch::new("intray_read_only").await;
        let store = scratch.store().await;
        store
            .submit("default", vec![new_job()])
            .await
            .expect("submit while writable");
        let mut admin = PgConnection::connect(&scratch.url).await.expect("connect");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET default_transaction_read_only = on",
            scratch.name
        )))
        .execute(&mut admin)
        .await
        .expect("make the database read-only");
        // The setting holds for new sessions: end the store's.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .execute(&mut admin)
        .await
        .expect("end the store's sessions");
        let mut read_only_seen = false;
        for _ in 0..10 {
            match store.submit("default", vec![new_job()]).await {
                Err(StoreError::Unavailable(err)) => {
                    read_only_seen |= err.to_string().contains("read-only");
                }
                other => panic!("a read-only database answered {other:?}"),
            }
            if read_only_seen {
                break;
            }
        }
        assert!(read_only_seen, "a submit reached the read-only database");
        let leased = store.lease("default", &[lease_spec("w", 1)]).await;
        assert!(
            matches!(leased, Err(StoreError::Unavailable(_))),
            "{leased:?}"
        );
        drop(store);
        drop(admin);
        scratch.drop().await;
    }

    /// A replica that stops with a transaction open (a paused VM) holds
    /// its locks until its session is ended for idling in it; meanwhile a
    /// statement of another replica waiting for one of them gives up after
    /// `lock_timeout`, `UNAVAILABLE`, and frees its connection: they queued
    /// behind it until the pool was full, and the stopped replica's jobs
    /// were never reclaimed.
    #[tokio::test]
    async fn a_stopped_replicas_locks_hold_no_one_for_long() {
        let scratch = Scratch::new("intray_stopped_replica").await;
        let store = scratch.store().await;
        let ids = store
            .submit("default", vec![new_job()])
            .await
            .expect("submit");
        let id = ids
            .first()
            .expect("one")
            .as_ref()
            .expect("submitted")
            .job
            .id;
        // The stopped replica: its session's settings, a row locked, idle.
        let mut stopped = PgConnection::connect(&scratch.url).await.expect("connect");
        stopped.execute(SESSION_LIMITS).await.expect("limits");
        stopped
            .execute(sqlx::AssertSqlSafe(format!(
                "BEGIN; SELECT 1 FROM jobs WHERE id = '{id}' FOR UPDATE"
            )))
            .await
            .expect("lock the row");
        let started = std::time::Instant::now();
        let waited = store.cancel("default", id, None, Duration::ZERO).await;
        assert!(
            matches!(waited, Err(StoreError::Unavailable(_))),
            "{waited:?}"
        );
        let took = started.elapsed();
        assert!(
            (Duration::from_secs(4)..Duration::from_secs(9)).contains(&took),
            "gave up after {took:?}"
        );
        // Its session is ended for idling in its transaction, and the row
        // is free again.
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(
            sqlx::query("SELECT 1").execute(&mut stopped).await.is_err(),
            "the stopped replica's session was ended"
        );
        let cancelled = store
            .cancel("default", id, None, Duration::ZERO)
            .await
            .expect("cancel once the lock is gone");
        assert_eq!(cancelled.state, JobState::Cancelled);
        drop(store);
        scratch.drop().await;
    }

    /// A refused transition has released its row lock when it returns: a
    /// claim right after it must not skip the row as locked.
    #[tokio::test]
    async fn a_refused_transition_leaves_no_row_locked() {
        let scratch = Scratch::new("intray_refused_unlocks").await;
        let store = scratch.store().await;
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        store
            .submit("default", vec![new_job()])
            .await
            .expect("submit");
        let leased = store
            .lease("default", &[lease_spec("w", 1)])
            .await
            .expect("lease")
            .concat();
        let id = leased.first().expect("leased").id;
        for round in 0..50 {
            assert!(matches!(
                store.give_back("default", id, "not-the-token").await,
                Err(StoreError::LeaseLost)
            ));
            let locked: Vec<Uuid> =
                sqlx::query_scalar("SELECT id FROM jobs WHERE id = $1 FOR UPDATE SKIP LOCKED")
                    .bind(id)
                    .fetch_all(&mut db)
                    .await
                    .expect("probe the lock");
            assert_eq!(locked, vec![id], "round {round}: the row is still locked");
        }
        drop(store);
        drop(db);
        scratch.drop().await;
    }

    /// Two locked `Complete` batches naming the same jobs in opposite
    /// orders lock them in one order, so neither deadlocks the other.
    #[tokio::test]
    async fn locked_completes_of_the_same_jobs_do_not_deadlock() {
        let scratch = Scratch::new("intray_lock_order").await;
        let store = Arc::new(scratch.store().await);
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        store
            .submit("default", vec![new_job(), new_job()])
            .await
            .expect("submit");
        let mut leased = store
            .lease("default", &[lease_spec("w", 2)])
            .await
            .expect("lease")
            .concat();
        leased.sort_by_key(|job| job.id);
        let success = || Outcome::Success {
            result: serde_json::json!(1),
        };
        let forward = vec![
            outcome_for(&leased[0], success()),
            outcome_for(&leased[1], success()),
        ];
        let backward = vec![
            outcome_for(&leased[1], success()),
            outcome_for(&leased[0], success()),
        ];
        // The first job held, so that both batches queue behind it: one
        // that locked the second job first would then hold it against the
        // other.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "BEGIN; SELECT 1 FROM jobs WHERE id = '{}' FOR UPDATE",
            leased[0].id
        )))
        .execute(&mut db)
        .await
        .expect("hold the first job");
        let mut waiters = Vec::new();
        for (i, items) in [forward, backward].into_iter().enumerate() {
            let store = Arc::clone(&store);
            waiters.push(tokio::spawn(async move {
                store.complete_locked("default", items).await
            }));
            await_lock_waiters(&scratch.url, i + 1).await;
        }
        sqlx::raw_sql("COMMIT")
            .execute(&mut db)
            .await
            .expect("release the first job");
        let mut succeeded = 0;
        for waiter in waiters {
            let results = waiter
                .await
                .expect("joined")
                .expect("no batch fails as a whole");
            succeeded += results.iter().filter(|r| r.is_ok()).count();
        }
        assert_eq!(succeeded, 2, "each job ended once");
        drop(store);
        drop(db);
        scratch.drop().await;
    }

    /// Waits until at least `n` sessions of the database at `url` wait for
    /// a lock.
    async fn await_lock_waiters(url: &str, n: usize) {
        let mut admin = PgConnection::connect(url).await.expect("connect");
        let n = i64::try_from(n).expect("small");
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&mut admin)
            .await
            .expect("count the waiters");
            if waiting >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// An unlocked `Complete` write and a locked batch naming the same two
    /// jobs do not deadlock, though the locked batch locks them in id order
    /// and the write would in tuple order: the write skips a row it cannot
    /// lock at once and redoes it under lock.
    #[tokio::test]
    async fn an_unlocked_and_a_locked_complete_do_not_deadlock() {
        let scratch = Scratch::new("intray_lock_paths").await;
        let store = Arc::new(scratch.store().await);
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        store
            .submit("default", vec![new_job(), new_job()])
            .await
            .expect("submit");
        let mut leased = store
            .lease("default", &[lease_spec("w", 2)])
            .await
            .expect("lease")
            .concat();
        leased.sort_by_key(|job| job.id);
        // The first job by id moved past the second in tuple order, so that
        // the two orders differ.
        sqlx::query("UPDATE jobs SET updated_at = updated_at WHERE id = $1")
            .bind(leased[0].id)
            .execute(&mut db)
            .await
            .expect("move the first job");
        let by_tuple: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM jobs ORDER BY ctid")
            .fetch_all(&mut db)
            .await
            .expect("read the tuple order");
        assert_eq!(by_tuple, vec![leased[1].id, leased[0].id]);
        let success = || Outcome::Success {
            result: serde_json::json!(1),
        };
        let outcomes = vec![
            outcome_for(&leased[0], success()),
            outcome_for(&leased[1], success()),
        ];
        // The first job held: the locked batch queues behind it holding
        // nothing. The write takes the second job first (tuple order); had
        // it waited for the first, it would hold the second against the
        // locked batch. It skips the first instead, and its redo queues.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "BEGIN; SELECT 1 FROM jobs WHERE id = '{}' FOR UPDATE",
            leased[0].id
        )))
        .execute(&mut db)
        .await
        .expect("hold the first job");
        let locked = {
            let store = Arc::clone(&store);
            let items = outcomes.clone();
            tokio::spawn(async move { store.complete_locked("default", items).await })
        };
        await_lock_waiters(&scratch.url, 1).await;
        // Through another replica, which reads the rows as they are now,
        // the moved one included, without the versions its lease left.
        let replica = scratch.store().await;
        let unlocked = tokio::spawn(async move { replica.complete("default", outcomes).await });
        await_lock_waiters(&scratch.url, 2).await;
        sqlx::raw_sql("COMMIT")
            .execute(&mut db)
            .await
            .expect("release the first job");
        let mut succeeded = 0;
        for batch in [locked, unlocked] {
            let results = batch
                .await
                .expect("joined")
                .expect("no batch fails as a whole");
            succeeded += results.iter().filter(|r| r.is_ok()).count();
        }
        assert_eq!(succeeded, 2, "each job ended once");
        drop(store);
        drop(db);
        scratch.drop().await;
    }

    /// An unreadable expired lease is set aside by the reaper, stays aside
    /// while a second look by key finds it still broken or fails, and once
    /// mended is let back in and reclaimed.
    #[tokio::test]
    async fn a_mended_row_set_aside_by_the_reaper_is_let_back_in() {
        let scratch = Scratch::new("intray_set_aside").await;
        let store = scratch.store().await;
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        let id = crate::store::a_briefly_leased_job(&store).await;
        let set_labels = |labels: &'static str| {
            sqlx::query("UPDATE jobs SET labels = $1::jsonb WHERE id = $2")
                .bind(labels)
                .bind(id)
        };
        set_labels("[1]")
            .execute(&mut db)
            .await
            .expect("break the row");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reaped = store
            .reap(10, Some(Duration::from_secs(3600)))
            .await
            .expect("reap");
        assert_eq!(reaped.expired_leases, 0);
        assert_eq!(store.unreadable.set_aside(), [id.to_string()]);
        let keys = store
            .unreadable
            .due_again()
            .expect("the first look is due at once");
        store.recheck_unreadable(&keys).await;
        assert_eq!(
            store.unreadable.set_aside(),
            [id.to_string()],
            "still broken"
        );
        set_labels("{}")
            .execute(&mut db)
            .await
            .expect("mend the row");
        // Every connection of the store is cut. The hot pool hands out the
        // one just used first, so the next look fails, and the row stays
        // aside.
        let cut_at: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut db)
            .await
            .expect("read the clock");
        let cut: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut db)
        .await
        .expect("read pg_stat_activity");
        assert!(!cut.is_empty(), "the store holds connections");
        sqlx::query("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid")
            .bind(&cut)
            .execute(&mut db)
            .await
            .expect("cut the store's connections");
        let gone = async {
            while sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE pid = ANY($1) AND backend_start < $2)",
            )
            .bind(&cut)
            .bind(cut_at)
            .fetch_one(&mut db)
            .await
            .expect("read pg_stat_activity")
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the cut backends exit");
        store.recheck_unreadable(&keys).await;
        assert_eq!(
            store.unreadable.set_aside(),
            [id.to_string()],
            "a failed look lets nothing in"
        );
        // Each of the hot pool's other cut connections fails one look too.
        for _ in 0..cut.len() {
            store.recheck_unreadable(&keys).await;
            if store.unreadable.set_aside().is_empty() {
                break;
            }
        }
        assert!(store.unreadable.set_aside().is_empty(), "mended");
        // And each cut connection of the sqlx pool fails one pass (the
        // reaper's next tick tries again).
        let mut reaped = store.reap(10, Some(Duration::from_secs(3600))).await;
        for _ in 0..cut.len() {
            if reaped.is_ok() {
                break;
            }
            reaped = store.reap(10, Some(Duration::from_secs(3600))).await;
        }
        let reaped = reaped.expect("reap");
        assert_eq!(reaped.expired_leases, 1, "reclaimed once mended");
        drop(store);
        drop(db);
        scratch.drop().await;
    }

    /// A reaper pass whose deletion of old jobs fails still reports the
    /// leases it reclaimed (committed before): their metrics and attempt
    /// spans come from that report.
    #[tokio::test]
    async fn a_failed_deletion_keeps_the_reapers_report() {
        let scratch = Scratch::new("intray_reap_report").await;
        let store = scratch.store().await;
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        store
            .submit("default", vec![new_job(), new_job()])
            .await
            .expect("submit");
        // One job finished (for retention to delete), one leased briefly.
        let done = store
            .lease("default", &[lease_spec("w", 1)])
            .await
            .expect("lease")
            .concat();
        let success = Outcome::Success {
            result: serde_json::json!(1),
        };
        let ended = store
            .complete("default", vec![outcome_for(&done[0], success)])
            .await
            .expect("complete");
        assert!(ended[0].is_ok());
        let short = LeaseSpec {
            lease_duration: Duration::from_millis(50),
            ..lease_spec("w", 1)
        };
        let leased = store.lease("default", &[short]).await.expect("lease");
        assert_eq!(leased.concat().len(), 1);
        sqlx::raw_sql(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'no deleting today'; END $$;
             CREATE TRIGGER no_delete BEFORE DELETE ON jobs
                 FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .execute(&mut db)
        .await
        .expect("refuse deletions");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reaped = store
            .reap(10, Some(Duration::ZERO))
            .await
            .expect("the pass reports despite the failed deletion");
        assert_eq!((reaped.expired_leases, reaped.deleted), (1, 0));
        drop(store);
        drop(db);
        scratch.drop().await;
    }

    #[tokio::test]
    async fn only_the_intervals_pass_deletes() {
        let scratch = Scratch::new("intray_booked_pass").await;
        let store = scratch.store().await;
        crate::store::only_the_intervals_pass_deletes(&store).await;
        drop(store);
        scratch.drop().await;
    }

    /// An item whose idempotency key's holder is deleted (by retention)
    /// between the insert and the read of holders is inserted again, since
    /// its key is free: the caller gets a new job, not an error. Before, it
    /// was answered INTERNAL ("submit again").
    #[tokio::test]
    async fn a_holder_deleted_meanwhile_gives_its_key_to_the_resubmit() {
        let scratch = Scratch::new("intray_holder_gone").await;
        let store = scratch.store().await;
        let mut keyed = new_job();
        keyed.idempotency_key = Some("doomed".into());
        let holder = store
            .submit("default", vec![keyed.clone()])
            .await
            .expect("submit the holder")
            .remove(0)
            .expect("stored")
            .job;
        // Retention, played by a one-shot trigger: the holder goes within
        // the insert that found its key taken.
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        sqlx::raw_sql(
            "CREATE TABLE doom_once (x int); INSERT INTO doom_once VALUES (1);
             CREATE FUNCTION doom() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 DELETE FROM doom_once;
                 IF FOUND THEN DELETE FROM jobs WHERE idempotency_key = 'doomed'; END IF;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER doom AFTER INSERT ON jobs
                 FOR EACH STATEMENT EXECUTE FUNCTION doom();",
        )
        .execute(&mut db)
        .await
        .expect("the trigger");
        let results = store
            .submit("default", vec![new_job(), keyed])
            .await
            .expect("the call is answered");
        assert!(matches!(&results[0], Ok(Submitted { created: true, .. })));
        let Ok(Submitted { created: true, job }) = &results[1] else {
            panic!("the resubmit is stored afresh: {results:?}");
        };
        assert_ne!(job.id, holder.id);
        let stored: Vec<Uuid> =
            sqlx::query_scalar("SELECT id FROM jobs WHERE idempotency_key = 'doomed'")
                .fetch_all(&mut db)
                .await
                .expect("read the key's holder");
        assert_eq!(stored, vec![job.id], "the new holder, once");
        drop(store);
        scratch.drop().await;
    }

    /// Submits take their keys in one order, the keys' own: a batch
    /// inserting in request order held `k2` while it waited for `k1`, and a
    /// submit elsewhere holding `k1` and then inserting `k2` closed the
    /// cycle. PostgreSQL broke the deadlock after a second by failing one
    /// of them whole (UNAVAILABLE), neighbours included; SQLite, one
    /// writer, answered both.
    #[tokio::test]
    async fn submits_sharing_keys_in_different_orders_do_not_deadlock() {
        let scratch = Scratch::new("intray_key_order").await;
        let store = Arc::new(scratch.store().await);
        let tenant = "default";
        let plain: Vec<Uuid> = store
            .submit(tenant, vec![new_job(), new_job()])
            .await
            .expect("submit")
            .into_iter()
            .map(|s| s.expect("stored").job.id)
            .collect();
        // Another submit, in key order: `k1` taken, not yet committed.
        let mut other = PgConnection::connect(&scratch.url).await.expect("connect");
        let mut open = other.begin().await.expect("begin");
        let take = "UPDATE jobs SET idempotency_key = $1 WHERE id = $2";
        sqlx::query(take)
            .bind("k1")
            .bind(plain[0])
            .execute(&mut *open)
            .await
            .expect("take k1");
        let keyed = |key: &str| {
            let mut job = new_job();
            job.idempotency_key = Some(key.into());
            job
        };
        let batch = tokio::spawn({
            let store = Arc::clone(&store);
            let jobs = vec![keyed("k2"), keyed("k1")];
            async move { store.submit(tenant, jobs).await }
        });
        await_lock_waiters(&scratch.url, 1).await;
        sqlx::query(take)
            .bind("k2")
            .bind(plain[1])
            .execute(&mut *open)
            .await
            .expect("take k2 (a deadlock victim fails here)");
        open.commit().await.expect("commit");
        let results = batch
            .await
            .expect("the batch's task")
            .expect("the batch is answered (a deadlock victim fails here)");
        let answered: Vec<(Uuid, bool)> = results
            .into_iter()
            .map(|r| r.map(|s| (s.job.id, s.created)).expect("an item"))
            .collect();
        assert_eq!(answered, [(plain[1], false), (plain[0], false)]);
        drop(store);
        scratch.drop().await;
    }

    /// Notifications sent while the `LISTEN` connection is down are lost,
    /// so once it is back every waiter is woken to read for itself. sqlx
    /// reconnects by itself when the server ends the connection, and
    /// `recv` hid that: nobody was woken, and another replica's change
    /// reached this one's watchers only at their fallback poll (30 s).
    #[tokio::test]
    async fn a_lost_listen_connection_wakes_every_waiter_once_back() {
        let scratch = Scratch::new("intray_listen_lost").await;
        let notifier = Arc::new(Notifier::new());
        let store = PgStore::open(&Settings::new(&scratch.url), Arc::clone(&notifier))
            .await
            .expect("open the store");
        let mut woken = notifier.subscribe_queues();
        let mut admin = PgConnection::connect(&scratch.url).await.expect("connect");
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_all(&mut admin)
        .await
        .expect("end the listener's connection");
        assert_eq!(ended, [true], "one listener");
        let key = tokio::time::timeout(Duration::from_secs(10), woken.recv())
            .await
            .expect("woken once the listener is back")
            .expect("a wake-up");
        assert_eq!(&*key, crate::engine::notifier::ANY_QUEUE);
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_one(&mut admin)
        .await
        .expect("count the listeners");
        assert_eq!(listening, 1, "listening again");
        drop(store);
        scratch.drop().await;
    }

    /// What a replica commits just before it stops still reaches the other
    /// replicas: the announcer sent nothing once stopped, so a change
    /// within [`ANNOUNCE_GAP`] of the previous notification (as in the
    /// calls finished during a shutdown's grace) was never announced.
    #[tokio::test]
    async fn a_stopping_replica_announces_what_it_committed_last() {
        let scratch = Scratch::new("intray_last_word").await;
        let notifier = Arc::new(Notifier::new());
        let other = PgStore::open(&Settings::new(&scratch.url), Arc::clone(&notifier))
            .await
            .expect("open the other replica's store");
        let mut woken = notifier.subscribe_queues();
        let stopping = scratch.store().await;
        for queue in ["first", "last"] {
            let mut job = new_job();
            job.queue = queue.into();
            stopping
                .submit("default", vec![job])
                .await
                .expect("submit")
                .remove(0)
                .expect("stored");
        }
        stopping.close().await;
        drop(stopping);
        tokio::time::timeout(Duration::from_secs(10), async {
            while &*woken.recv().await.expect("a wake-up") != "default/last" {}
        })
        .await
        .expect("the last submit is announced");
        drop(other);
        scratch.drop().await;
    }

    /// An item whose idempotency key's holder cannot be read fails alone:
    /// the statement that stored its neighbours has committed, and telling
    /// them otherwise would have them submit again.
    #[tokio::test]
    async fn an_unreadable_holder_fails_only_its_item() {
        let scratch = Scratch::new("intray_holder_unreadable").await;
        let store = scratch.store().await;
        let mut keyed = new_job();
        keyed.idempotency_key = Some("mangled".into());
        store
            .submit("default", vec![keyed.clone()])
            .await
            .expect("submit the holder");
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        sqlx::raw_sql("UPDATE jobs SET labels = '[1]' WHERE idempotency_key = 'mangled'")
            .execute(&mut db)
            .await
            .expect("mangle the holder");
        let results = store
            .submit("default", vec![new_job(), keyed])
            .await
            .expect("the call is answered");
        let Ok(Submitted { created: true, job }) = &results[0] else {
            panic!("the neighbour is answered as stored: {results:?}");
        };
        assert!(
            matches!(&results[1], Err(StoreError::Internal(_))),
            "{results:?}"
        );
        let stored: Vec<Uuid> =
            sqlx::query_scalar("SELECT id FROM jobs WHERE idempotency_key IS NULL")
                .fetch_all(&mut db)
                .await
                .expect("count");
        assert_eq!(stored, vec![job.id], "the neighbour, once");
        drop(store);
        scratch.drop().await;
    }

    /// A batch of outcomes whose read meets a row that cannot be read
    /// refuses only that row's outcome, through the unlocked read (another
    /// replica, which did not lease the jobs) and the locked one alike.
    #[tokio::test]
    async fn an_unreadable_row_refuses_only_its_own_outcome() {
        let scratch = Scratch::new("intray_complete_unreadable").await;
        let store = scratch.store().await;
        let replica = scratch.store().await;
        let mut db = PgConnection::connect(&scratch.url).await.expect("connect");
        let success = || Outcome::Success {
            result: serde_json::json!(1),
        };
        for locked in [false, true] {
            store
                .submit("default", vec![new_job(), new_job()])
                .await
                .expect("submit");
            let leased = store
                .lease("default", &[lease_spec("w", 2)])
                .await
                .expect("lease")
                .remove(0);
            sqlx::query("UPDATE jobs SET labels = '[1]' WHERE id = $1")
                .bind(leased[0].id)
                .execute(&mut db)
                .await
                .expect("mangle the first");
            let outcomes = vec![
                outcome_for(&leased[0], success()),
                outcome_for(&leased[1], success()),
            ];
            let results = if locked {
                replica.complete_locked("default", outcomes).await
            } else {
                replica.complete("default", outcomes).await
            }
            .expect("the batch is answered");
            assert!(
                matches!(&results[0], Err(StoreError::Internal(_))),
                "locked {locked}: {results:?}"
            );
            assert!(results[1].is_ok(), "locked {locked}: {results:?}");
        }
        assert_eq!(replica.unreadable.left_out(), 2, "each met, counted");
        drop((store, replica));
        scratch.drop().await;
    }

    /// A migrated database of its own for one test, dropped by
    /// [`Scratch::drop`], or when it goes out of scope (a test that
    /// panicked).
    struct Scratch {
        admin: PgConnection,
        name: String,
        url: String,
        dropped: bool,
    }

    impl Scratch {
        async fn new(prefix: &str) -> Scratch {
            let admin_url = admin_url();
            let name = format!("{prefix}_{}", Uuid::now_v7().simple());
            let mut admin = PgConnection::connect(&admin_url).await.expect("connect");
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&mut admin)
                .await
                .expect("create the database");
            let (base, _) = admin_url
                .rsplit_once('/')
                .expect("the URL names a database");
            let url = format!("{base}/{name}");
            migrate(&url, true).await.expect("migrate");
            Scratch {
                admin,
                name,
                url,
                dropped: false,
            }
        }

        /// A connection holding the claim lock of `tenant`'s `queue` (as a
        /// capped claim takes it) in an open transaction.
        async fn hold_queue_lock(&self, tenant: &str, queue: &str) -> PgConnection {
            let mut holder = PgConnection::connect(&self.url).await.expect("connect");
            let hold = pg_caps::begin_and_lock(Some(tenant), &[queue.to_owned()]);
            sqlx::raw_sql(sqlx::AssertSqlSafe(hold))
                .execute(&mut holder)
                .await
                .expect("hold the queue's lock");
            holder
        }

        /// A store on this database with the default settings.
        async fn store(&self) -> PgStore {
            PgStore::open(&Settings::new(&self.url), Arc::new(Notifier::new()))
                .await
                .expect("open the store")
        }

        async fn drop(mut self) {
            // FORCE: a store under test may still hold pooled connections.
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE {} WITH (FORCE)",
                self.name
            )))
            .execute(&mut self.admin)
            .await
            .expect("drop the database");
            self.dropped = true;
        }
    }

    impl Drop for Scratch {
        /// A test that panicked before [`Scratch::drop`] leaves no database
        /// behind: dropped from a thread of its own, since this may run
        /// inside the test's runtime, which cannot be blocked on.
        fn drop(&mut self) {
            if self.dropped {
                return;
            }
            let statement = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
            let dropped = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                runtime.block_on(async {
                    let mut admin = PgConnection::connect(&admin_url()).await.ok()?;
                    sqlx::query(sqlx::AssertSqlSafe(statement))
                        .execute(&mut admin)
                        .await
                        .ok()
                })
            })
            .join();
            if !matches!(dropped, Ok(Some(_))) {
                eprintln!("could not drop the test database {}", self.name);
            }
        }
    }

    /// The plan of `EXPLAIN EXECUTE {execute}`, as text.
    async fn plan_of(db: &mut PgConnection, execute: &str) -> String {
        let rows: Vec<String> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN EXECUTE {execute}")))
                .fetch_all(&mut *db)
                .await
                .expect("explain");
        rows.join("\n")
    }

    /// The hot path's generic plans last as long as their connection, so a
    /// plan made while the jobs table was empty must still read jobs by key
    /// or by tuple id once it holds many: a key condition planned as a
    /// filter over the tenant's jobs made burn-down eight times slower.
    #[tokio::test]
    async fn hot_statements_planned_on_an_empty_table_read_jobs_by_key() {
        const CLAIM_TYPES: &str = "text, text[], text[], int8, text[], int8[], text[], int8[], \
                                   int8, bool";
        const CLAIM_ARGS: &str = "'a', ARRAY['q'], ARRAY[]::text[], 10, \
            array_fill('w'::text, ARRAY[10]), array_fill(1000::int8, ARRAY[10]), \
            ARRAY[]::text[], ARRAY[]::int8[], NULL, false";
        const WRITE_TYPES: &str = "uuid[], text[], jsonb[], text[], text[], int4[], float8[], \
            bool[], timestamptz[], int8[], text[], text[], timestamptz[], timestamptz[], \
            timestamptz[], timestamptz[], timestamptz[], int8[], text[], text[], jsonb[], \
            text[], bool, text[]";
        const WRITE_ARGS: &str = "ARRAY[gen_random_uuid()], ARRAY['succeeded'], ARRAY['{}'::jsonb], \
            ARRAY[NULL::text], ARRAY[NULL::text], ARRAY[1], ARRAY[1.0::float8], ARRAY[false], \
            ARRAY[NULL::timestamptz], ARRAY[0::int8], ARRAY[NULL::text], ARRAY[NULL::text], \
            ARRAY[NULL::timestamptz], ARRAY[now()], ARRAY[NULL::timestamptz], ARRAY[now()], \
            ARRAY[now()], ARRAY[3::int8], ARRAY['succeeded'], ARRAY['w'], ARRAY[NULL::jsonb], \
            ARRAY['1'], true, ARRAY['a']";
        let statements = [
            ("one_tenant", CLAIM_TYPES, CLAIM_ONE_TENANT, CLAIM_ARGS),
            ("general", CLAIM_TYPES, CLAIM, CLAIM_ARGS),
            (
                "read_locked",
                "uuid[], text",
                complete_read!("FOR UPDATE"),
                "ARRAY[gen_random_uuid()], 'a'",
            ),
            (
                "read",
                "uuid[], text",
                complete_read!(""),
                "ARRAY[gen_random_uuid()], 'a'",
            ),
            ("write", WRITE_TYPES, WRITE_JOBS, WRITE_ARGS),
            (
                "write_then_claim",
                &format!("{WRITE_TYPES}, {CLAIM_TYPES}"),
                WRITE_THEN_CLAIM.as_str(),
                &format!("{WRITE_ARGS}, {CLAIM_ARGS}"),
            ),
        ];
        let scratch = Scratch::new("intray_young_plans").await;
        let mut db = PgConnection::connect(&scratch.url)
            .await
            .expect("connect to it");
        db.execute(PLANNER_SETTINGS).await.expect("settings");
        for (name, types, sql, args) in statements {
            let prepare = format!("PREPARE {name}({types}) AS {sql}");
            db.execute(sqlx::AssertSqlSafe(prepare))
                .await
                .expect("prepare");
            plan_of(&mut db, &format!("{name}({args})")).await;
        }
        db.execute(
            "INSERT INTO jobs (id, tenant, queue, kind, state, payload, max_attempts, priority,
                 input_hash, run_at, backoff_initial_ms, backoff_max_ms, created_at, updated_at,
                 event_seq)
             SELECT gen_random_uuid(), 'a', 'q', 'k', 'queued', '{}', 3, 0, 'h', now(), 1000,
                 60000, now(), now(), 1
             FROM generate_series(1, 20000)",
        )
        .await
        .expect("fill");
        for (name, _, _, args) in statements {
            let plan = plan_of(&mut db, &format!("{name}({args})")).await;
            for wrong in ["Seq Scan on jobs", "Filter: (id = "] {
                assert!(!plan.contains(wrong), "{name}: {wrong}\n{plan}");
            }
            let claims = "TID Cond: (ctid = ANY (";
            let writes = "Index Cond: ((tenant = w.tenant) AND (id = w.id))";
            let right: &[&str] = match name {
                "one_tenant" | "general" => &[claims],
                "read_locked" | "read" => &["Index Cond: ((tenant = $2) AND (id = k.id))"],
                "write" => &[writes],
                _ => &[claims, writes],
            };
            for right in right {
                assert!(plan.contains(right), "{name}: no {right}\n{plan}");
            }
        }
        db.close().await.expect("close");
        scratch.drop().await;
    }

    #[test]
    fn the_dead_set_in_sql_is_the_domains() {
        for state in JobState::ALL {
            assert_eq!(
                in_dead_set!().contains(&format!("'{}'", state.as_str())),
                state.is_replayable(),
                "{state:?}"
            );
        }
    }
}
