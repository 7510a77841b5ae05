//! The embedded SQLite store: one file, one process.
//!
//! All writes go through a single connection, the job writes in `BEGIN
//! IMMEDIATE` transactions (the webhook outbox's single statements
//! autocommit), so claims never race; reads use a separate pool (WAL lets
//! them run beside the writer). `synchronous = FULL` makes every commit
//! durable before the caller hears about it. Timestamps are Unix milliseconds
//! of this process's clock, which is the only clock that writes this file.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use nix::fcntl::{Flock, FlockArg};
use serde_json::Value;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Row, SqliteConnection, Transaction};
use uuid::Uuid;

use super::changes::Changes;
use super::unreadable::{RECHECK_CHUNK, RowKey, Unreadable};
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

/// The SQLite migrations. `intray migrate` is strict: a database with a
/// migration this build does not know is refused. A server opening the
/// store is not (see [`super::migrations_ahead`]): migrations are additive,
/// so that a pod of the previous build, restarted during a rollout or
/// after a rollback, starts on a schema a newer build migrated.
fn migrator(strict: bool) -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("./migrations/sqlite");
    migrator.set_ignore_missing(!strict);
    migrator
}

/// Bytes the write-ahead log is cut back to after a checkpoint.
const WAL_SIZE_LIMIT: u64 = 64 * 1024 * 1024;

/// A page of `ListJobs`, newest first, reading `$columns`. Label
/// selectors: no selector pair may differ from the job's label.
macro_rules! list_statement {
    ($columns:expr) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM jobs
             WHERE tenant = ?1
               AND (?2 IS NULL OR id < ?2)
               AND (?3 IS NULL OR queue = ?3)
               AND (?4 IS NULL OR kind = ?4)
               AND (?5 = '[]' OR state IN (SELECT value FROM json_each(?5)))
               AND (?6 IS NULL OR error_class = ?6)
               AND NOT EXISTS (
                   SELECT 1 FROM json_each(?7) sel
                   WHERE (SELECT l.value FROM json_each(jobs.labels) l WHERE l.key = sel.key) IS NOT sel.value
               )
             ORDER BY id DESC
             LIMIT ?8"
        )
    };
}

/// A page of `ListJobs`.
const LIST: &str = list_statement!("*");

/// [`LIST`] without payloads and results, which are not read.
const LIST_BASIC: &str = list_statement!(concat!(
    job_columns_but_payloads!(),
    ", 'null' AS payload, NULL AS result"
));

fn options(url: &str) -> StoreResult<SqliteConnectOptions> {
    // An in-memory database lives only while a connection to it is open,
    // and the pools close idle and aged connections: once all were closed
    // at once, every acknowledged job would be gone, and the server would
    // answer from an empty database without its schema.
    if url.contains(":memory:") || url.contains("mode=memory") {
        return Err(StoreError::Config(
            "an in-memory SQLite database would lose its jobs; name a file, e.g. sqlite://intray.db"
                .into(),
        ));
    }
    let parsed = SqliteConnectOptions::from_str(url)?;
    // An empty name (`sqlite://${DB}` with DB unset) is worse: SQLite gives
    // each connection a private temporary database, so the readers never
    // saw the writer's schema. `%3Amemory%3A` decodes to an in-memory one.
    let name = parsed.get_filename().to_string_lossy();
    if name.is_empty() || name == ":memory:" {
        return Err(StoreError::Config(format!(
            "{url:?} names no SQLite file; name one, e.g. sqlite://intray.db"
        )));
    }
    Ok(parsed
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        // A write-ahead log grown by a large batch (a thousand 1 MiB
        // payloads is a gigabyte) is cut back to this once checkpointed;
        // without a limit the file kept its largest size until the end.
        .pragma("journal_size_limit", WAL_SIZE_LIMIT.to_string())
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(5)))
}

/// Turns on SQLite's query planner stability guarantee for a connection.
///
/// Without it SQLite plans with the values bound to some parameters (a
/// `LIMIT ?`, for one) and marks the prepared statement expired whenever
/// such a parameter is bound again, so a cached statement was parsed and
/// planned anew at every execution: the claim (its CTEs and window
/// functions) spent 38 % of the server's CPU on it in SQLite's e2e, inside
/// the single writer. With the guarantee a statement is prepared once. No
/// plan here needs the values: the partial indexes are matched by literals.
async fn stable_plans(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    use std::ffi::c_int;
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is the open connection `handle` holds locked for this
    // call; the option takes an int (1: on) and an int pointer to read the
    // setting back into, which may be null.
    let rc = unsafe {
        libsqlite3_sys::sqlite3_db_config(
            db,
            libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG,
            1 as c_int,
            std::ptr::null_mut::<c_int>(),
        )
    };
    if rc != libsqlite3_sys::SQLITE_OK {
        return Err(sqlx::Error::Configuration(
            format!("SQLite refused its query planner stability guarantee (code {rc})").into(),
        ));
    }
    Ok(())
}

/// A pool of at most `max_connections` whose every connection prepares a
/// statement once ([`stable_plans`]).
fn pool_options(max_connections: u32) -> SqlitePoolOptions {
    SqlitePoolOptions::new()
        .max_connections(max_connections)
        .after_connect(|conn, _| Box::pin(stable_plans(conn)))
}

/// Applies the SQLite migrations (creating the file if needed).
pub async fn migrate(url: &str, strict: bool) -> StoreResult<()> {
    let options = options(url)?;
    // Before the first connection: connecting a new file switches it to
    // WAL, and processes doing that at once could find it busy.
    let _lock = lock_for_migrations(&options).await?;
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await?;
    // The open that follows (`serve`) warns of migrations a newer build
    // applied.
    migrator(strict).run(&pool).await?;
    pool.close().await;
    Ok(())
}

/// An exclusive `flock` on `<database>-migrate-lock` beside the database
/// file, to hold while migrations run. sqlx's SQLite migrator takes no
/// lock (on PostgreSQL it takes an advisory one): two processes starting
/// together on a new file both applied the first migration, and the
/// second to commit failed ("table jobs already exists") and exited.
///
/// Never the database file itself: closing any descriptor of a file drops
/// every POSIX lock the process holds on it, SQLite's own among them, and
/// another process could then take the database for unused, checkpoint it
/// and delete the write-ahead log a live connection still writes to.
async fn lock_for_migrations(options: &SqliteConnectOptions) -> StoreResult<Flock<std::fs::File>> {
    let mut path = options.get_filename().as_os_str().to_owned();
    path.push("-migrate-lock");
    let path = std::path::PathBuf::from(path);
    tokio::task::spawn_blocking(move || {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|err| {
                StoreError::Internal(format!("cannot open {} to lock it: {err}", path.display()))
            })?;
        Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| {
            StoreError::Internal(format!(
                "cannot lock {} for migrations: {errno}",
                path.display()
            ))
        })
    })
    .await
    .map_err(|err| StoreError::Internal(format!("the migration lock's task ended: {err}")))?
}

/// The SQLite implementation of [`Store`].
pub struct SqliteStore {
    /// Exactly one connection: SQLite has one writer, and queueing writers
    /// here is cheaper than letting them collide on the file lock.
    writer: SqlitePool,
    reader: SqlitePool,
    notifier: Arc<Notifier>,
    caps: RunningCaps,
    breaker: BreakerPolicy,
    unreadable: Unreadable,
}

type Tx = Transaction<'static, sqlx::Sqlite>;

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// The time in whole milliseconds, as the columns keep it: a job a
/// transition returns (and the event its watchers get) must read as it is
/// stored.
fn stored_now() -> DateTime<Utc> {
    let now = Utc::now();
    DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now)
}

fn opt_ms(t: Option<DateTime<Utc>>) -> Option<i64> {
    t.map(ms)
}

fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A row of [`Store::active_workers`]' statement.
fn queue_workers(row: &SqliteRow) -> StoreResult<QueueWorkers> {
    Ok(QueueWorkers {
        tenant: row.try_get("tenant")?,
        queue: row.try_get("queue")?,
        workers: u64::try_from(row.try_get::<i64, _>("workers")?).unwrap_or(0),
    })
}

fn corrupt(column: &str) -> StoreError {
    StoreError::Internal(format!("corrupt value in column {column}"))
}

fn ts(row: &SqliteRow, column: &str) -> StoreResult<DateTime<Utc>> {
    DateTime::from_timestamp_millis(row.try_get(column)?).ok_or_else(|| corrupt(column))
}

fn opt_ts(row: &SqliteRow, column: &str) -> StoreResult<Option<DateTime<Utc>>> {
    match row.try_get::<Option<i64>, _>(column)? {
        None => Ok(None),
        Some(v) => DateTime::from_timestamp_millis(v)
            .map(Some)
            .ok_or_else(|| corrupt(column)),
    }
}

fn json<T: serde::de::DeserializeOwned>(row: &SqliteRow, column: &str) -> StoreResult<T> {
    let text: String = row.try_get(column)?;
    serde_json::from_str(&text).map_err(|_| corrupt(column))
}

fn opt_json<T: serde::de::DeserializeOwned>(
    row: &SqliteRow,
    column: &str,
) -> StoreResult<Option<T>> {
    match row.try_get::<Option<String>, _>(column)? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|_| corrupt(column)),
    }
}

fn to_json(v: &impl serde::Serialize) -> String {
    // Serialising plain JSON values and string maps cannot fail.
    serde_json::to_string(v).unwrap_or_default()
}

fn uuid(row: &SqliteRow, column: &str) -> StoreResult<Uuid> {
    let text: String = row.try_get(column)?;
    Uuid::parse_str(&text).map_err(|_| corrupt(column))
}

fn to_u32(v: i64, column: &str) -> StoreResult<u32> {
    u32::try_from(v).map_err(|_| corrupt(column))
}

fn to_u64(v: i64, column: &str) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| corrupt(column))
}

/// The jobs a replay filter matches: tenant `?1`, states `?2` (a JSON
/// array), queue `?3`, kind `?4`, error class `?5`.
macro_rules! replay_filter {
    () => {
        "tenant = ?1 AND state IN (SELECT value FROM json_each(?2))
               AND (?3 IS NULL OR queue = ?3)
               AND (?4 IS NULL OR kind = ?4)
               AND (?5 IS NULL OR error_class = ?5)"
    };
}

/// A job row's id alone, for naming a row that cannot be read whole.
fn row_id(row: &SqliteRow) -> Option<String> {
    row.try_get("id").ok()
}

fn row_key(row: &SqliteRow) -> Option<RowKey> {
    Some(RowKey {
        tenant: row.try_get("tenant").ok()?,
        id: row_id(row)?,
    })
}

fn job_from_row(row: &SqliteRow) -> StoreResult<Job> {
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
        id: uuid(row, "id")?,
        tenant: row.try_get("tenant")?,
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        state: JobState::parse(&state).ok_or_else(|| corrupt("state"))?,
        payload: json(row, "payload")?,
        result: opt_json(row, "result")?,
        error: error_class.map(|class| JobError {
            class,
            message: error_message.unwrap_or_default(),
        }),
        attempt: to_u32(row.try_get("attempt")?, "attempt")?,
        max_attempts: to_u32(row.try_get("max_attempts")?, "max_attempts")?,
        priority: row.try_get("priority")?,
        idempotency_key: row.try_get("idempotency_key")?,
        input_hash: row.try_get("input_hash")?,
        labels: json(row, "labels")?,
        progress: row.try_get("progress")?,
        cancel_requested: row.try_get("cancel_requested")?,
        cancel_requested_at: opt_ts(row, "cancel_requested_at")?,
        cost_cents: row.try_get("cost_cents")?,
        lease_owner: row.try_get("lease_owner")?,
        lease_token: row.try_get("lease_token")?,
        lease_expires_at: opt_ts(row, "lease_expires_at")?,
        run_at: ts(row, "run_at")?,
        deadline: opt_ts(row, "deadline")?,
        backoff,
        callback_url: row.try_get("callback_url")?,
        max_cost_cents: row.try_get("max_cost_cents")?,
        created_at: ts(row, "created_at")?,
        updated_at: ts(row, "updated_at")?,
        started_at: opt_ts(row, "started_at")?,
        finished_at: opt_ts(row, "finished_at")?,
        event_seq: to_u64(row.try_get("event_seq")?, "event_seq")?,
        trace_parent: row.try_get("trace_parent")?,
        leased_at: opt_ts(row, "leased_at")?,
    })
}

fn breaker_from_row(row: &SqliteRow) -> StoreResult<Breaker> {
    Ok(Breaker {
        failures: to_u32(row.try_get("failures")?, "failures")?,
        max_retry_after: Duration::from_millis(to_u64(
            row.try_get("max_retry_after_ms")?,
            "max_retry_after_ms",
        )?),
        open_until: opt_ts(row, "open_until")?,
        probe_job: row
            .try_get::<Option<String>, _>("probe_job")?
            .map(|id| Uuid::parse_str(&id).map_err(|_| corrupt("probe_job")))
            .transpose()?,
    })
}

fn event_from_row(row: &SqliteRow) -> StoreResult<JobEvent> {
    let kind: String = row.try_get("type")?;
    let state: String = row.try_get("state")?;
    Ok(JobEvent {
        job_id: uuid(row, "job_id")?,
        sequence: to_u64(row.try_get("sequence")?, "sequence")?,
        kind: EventType::parse(&kind).ok_or_else(|| corrupt("type"))?,
        state: JobState::parse(&state).ok_or_else(|| corrupt("state"))?,
        attempt: to_u32(row.try_get("attempt")?, "attempt")?,
        worker_id: row.try_get("worker_id")?,
        at: ts(row, "at")?,
        detail: opt_json(row, "detail")?,
    })
}

async fn insert_event(conn: &mut SqliteConnection, event: &JobEvent) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at, detail)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )
    .bind(event.job_id.to_string())
    .bind(i64::try_from(event.sequence).map_err(|_| corrupt("sequence"))?)
    .bind(event.kind.as_str())
    .bind(event.state.as_str())
    .bind(i64::from(event.attempt))
    .bind(event.worker_id.as_deref())
    .bind(ms(event.at))
    .bind(event.detail.as_ref().map(to_json))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes a job after a domain transition, and its event, in the caller's
/// transaction; the `event_seq` guard refuses a lost update.
async fn save(conn: &mut SqliteConnection, job: &Job, event: &JobEvent) -> StoreResult<()> {
    let previous_seq = i64::try_from(event.sequence - 1).map_err(|_| corrupt("event_seq"))?;
    let done = sqlx::query(
        "UPDATE jobs SET state = ?2, result = ?3, error_class = ?4, error_message = ?5,
            attempt = ?6, progress = ?7, cancel_requested = ?8, cancel_requested_at = ?9,
            cost_cents = ?10, lease_owner = ?11, lease_token = ?12, lease_expires_at = ?13,
            run_at = ?14, deadline = ?15, updated_at = ?16, finished_at = ?17, event_seq = ?18,
            -- A job with no attempt spent has not started (a first lease
            -- given back, a replay): the rule of domain::transition.
            started_at = CASE WHEN ?6 = 0 THEN NULL ELSE started_at END
         WHERE id = ?1 AND event_seq = ?19",
    )
    .bind(job.id.to_string())
    .bind(job.state.as_str())
    .bind(job.result.as_ref().map(to_json))
    .bind(job.error.as_ref().map(|e| e.class.as_str()))
    .bind(job.error.as_ref().map(|e| e.message.as_str()))
    .bind(i64::from(job.attempt))
    .bind(job.progress)
    .bind(job.cancel_requested)
    .bind(opt_ms(job.cancel_requested_at))
    .bind(job.cost_cents)
    .bind(job.lease_owner.as_deref())
    .bind(job.lease_token.as_deref())
    .bind(opt_ms(job.lease_expires_at))
    .bind(ms(job.run_at))
    .bind(opt_ms(job.deadline))
    .bind(ms(job.updated_at))
    .bind(opt_ms(job.finished_at))
    .bind(previous_seq + 1)
    .bind(previous_seq)
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() != 1 {
        return Err(StoreError::Internal("job changed concurrently".into()));
    }
    insert_event(conn, event).await
}

async fn load(conn: &mut SqliteConnection, tenant: &str, id: Uuid) -> StoreResult<Job> {
    let row = sqlx::query("SELECT * FROM jobs WHERE id = ?1 AND tenant = ?2")
        .bind(id.to_string())
        .bind(tenant)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or(StoreError::NotFound)?;
    job_from_row(&row)
}

impl SqliteStore {
    /// Opens (or creates) the file and migrates it.
    pub async fn open(settings: &Settings, notifier: Arc<Notifier>) -> StoreResult<SqliteStore> {
        let options = options(&settings.database_url)?;
        // Before the first connection, as in `migrate`.
        let lock = lock_for_migrations(&options).await?;
        let writer = pool_options(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await?;
        let migrator = migrator(false);
        migrator.run(&writer).await?;
        drop(lock);
        let applied: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
            .fetch_one(&writer)
            .await?;
        super::migrations_ahead(&migrator, applied);
        if settings.breaker.threshold == 0 {
            let cleared = sqlx::query("DELETE FROM breakers").execute(&writer).await?;
            super::breakers_cleared(cleared.rows_affected());
        }
        let reader = pool_options(4)
            .connect_with(options.read_only(true))
            .await?;
        Ok(SqliteStore {
            writer,
            reader,
            notifier,
            caps: RunningCaps::from_settings(settings),
            breaker: settings.breaker.clone(),
            unreadable: Unreadable::default(),
        })
    }

    async fn begin(&self) -> StoreResult<Tx> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn commit(&self, tx: Tx, changes: &Changes) -> StoreResult<()> {
        tx.commit().await?;
        changes.wake(&self.notifier, &self.caps);
        Ok(())
    }

    /// Reads again the rows the reaper set aside as unreadable, a chunk at
    /// a time, and lets back in those mended or deleted (see `unreadable`).
    /// A failed read is logged and tried again at the next look: the pass
    /// goes on without it.
    async fn recheck_unreadable(&self, keys: &[RowKey]) {
        for chunk in keys.chunks(RECHECK_CHUNK) {
            let ids: Vec<&str> = chunk.iter().map(|k| k.id.as_str()).collect();
            let read =
                sqlx::query("SELECT * FROM jobs WHERE id IN (SELECT value FROM json_each(?1))")
                    .bind(to_json(&ids))
                    .fetch_all(&self.reader)
                    .await;
            match read {
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

    /// Deletes up to `batch` jobs (and their events) that finished before
    /// `cutoff` (milliseconds), and up to `batch` workers unseen since then
    /// that hold no job (workers are named per process, so every restart
    /// adds one), in a short transaction of its own, so that the single
    /// writer is not held long. Returns the jobs deleted. A job whose
    /// callback is still pending stays until it is delivered or given up:
    /// its delivery row would go with it, unrecorded.
    async fn delete_past_retention(&self, cutoff: i64, batch: u32) -> StoreResult<u64> {
        let mut tx = self.begin().await?;
        let deleted = sqlx::query(
            "DELETE FROM jobs WHERE id IN (
                SELECT id FROM jobs
                WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired') AND finished_at < ?1
                  AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                                  WHERE d.job_id = jobs.id AND d.status = 'pending')
                ORDER BY finished_at LIMIT ?2
             )",
        )
        .bind(cutoff)
        .bind(i64::from(batch))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(
            "DELETE FROM workers WHERE rowid IN (
                SELECT w.rowid FROM workers w
                WHERE w.last_lease_at < ?1
                  AND NOT EXISTS (SELECT 1 FROM jobs j
                                  WHERE j.tenant = w.tenant AND j.state = 'running'
                                    AND j.lease_owner = w.worker_id)
                LIMIT ?2
             )",
        )
        .bind(cutoff)
        .bind(i64::from(batch))
        .execute(&mut *tx)
        .await?;
        self.commit(tx, &Changes::default()).await?;
        Ok(deleted)
    }

    /// Counts an attempt's outcome against its queue and kind's breaker, in
    /// the caller's transaction (see the PostgreSQL store).
    async fn update_breaker(
        &self,
        conn: &mut SqliteConnection,
        job: &Job,
        failure: Option<&(String, Option<Duration>)>,
        now: DateTime<Utc>,
    ) -> StoreResult<()> {
        if self.breaker.threshold == 0 {
            return Ok(());
        }
        let current =
            sqlx::query("SELECT * FROM breakers WHERE tenant = ?1 AND queue = ?2 AND kind = ?3")
                .bind(&job.tenant)
                .bind(&job.queue)
                .bind(&job.kind)
                .fetch_optional(&mut *conn)
                .await?
                .map(|row| breaker_from_row(&row))
                .transpose()?;
        let failure = failure.map(|(class, retry_after)| (class.as_str(), *retry_after));
        match breaker::on_outcome(current.as_ref(), failure, job.id, now, &self.breaker) {
            BreakerChange::Unchanged => {}
            BreakerChange::Reset => {
                sqlx::query("DELETE FROM breakers WHERE tenant = ?1 AND queue = ?2 AND kind = ?3")
                    .bind(&job.tenant)
                    .bind(&job.queue)
                    .bind(&job.kind)
                    .execute(&mut *conn)
                    .await?;
                if current.is_some_and(|b| b.open_until.is_some()) {
                    tracing::info!(tenant = %job.tenant, queue = %job.queue, kind = %job.kind, "circuit breaker closed");
                }
            }
            BreakerChange::Update { breaker, opened } => {
                sqlx::query(
                    "INSERT INTO breakers (tenant, queue, kind, failures, max_retry_after_ms, open_until,
                        probe_job, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (tenant, queue, kind) DO UPDATE SET failures = excluded.failures,
                        max_retry_after_ms = excluded.max_retry_after_ms,
                        open_until = excluded.open_until, probe_job = excluded.probe_job,
                        updated_at = excluded.updated_at",
                )
                .bind(&job.tenant)
                .bind(&job.queue)
                .bind(&job.kind)
                .bind(i64::from(breaker.failures))
                .bind(duration_ms(breaker.max_retry_after))
                .bind(opt_ms(breaker.open_until))
                .bind(breaker.probe_job.map(|id| id.to_string()))
                .bind(ms(now))
                .execute(&mut *conn)
                .await?;
                if opened {
                    tracing::warn!(
                        tenant = %job.tenant, queue = %job.queue, kind = %job.kind,
                        failures = breaker.failures, open_until = ?breaker.open_until,
                        "circuit breaker opened"
                    );
                }
            }
        }
        Ok(())
    }

    /// Runs `apply` on the job and saves what it decided, in one transaction.
    async fn transition<F>(&self, tenant: &str, id: Uuid, apply: F) -> StoreResult<Job>
    where
        F: FnOnce(&mut Job, DateTime<Utc>) -> Result<Option<JobEvent>, TransitionError> + Send,
    {
        let mut tx = self.begin().await?;
        let mut job = load(&mut tx, tenant, id).await?;
        let mut changes = Changes::default();
        if let Some(event) = apply(&mut job, stored_now())? {
            save(&mut tx, &job, &event).await?;
            changes.job_event(&job, &event);
        }
        self.commit(tx, &changes).await?;
        Ok(job)
    }

    async fn submit_one(
        &self,
        conn: &mut SqliteConnection,
        tenant: &str,
        new: NewJob,
        now: i64,
    ) -> StoreResult<StoreResult<Submitted>> {
        if let Some(key) = &new.idempotency_key {
            let existing =
                sqlx::query("SELECT * FROM jobs WHERE tenant = ?1 AND idempotency_key = ?2")
                    .bind(tenant)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            if let Some(row) = existing {
                // A holder that cannot be read fails only this item; its
                // neighbours in the batch still commit.
                let job = match self
                    .unreadable
                    .read_one(&row, job_from_row, row_key, "submit")
                {
                    Ok(job) => job,
                    Err(refused) => return Ok(Err(refused)),
                };
                if job.input_hash != new.input_hash {
                    return Ok(Err(StoreError::IdempotencyConflict));
                }
                return Ok(Ok(Submitted {
                    job,
                    created: false,
                }));
            }
        }
        let id = Uuid::now_v7();
        let row = sqlx::query(
            "INSERT INTO jobs (id, tenant, queue, kind, state, payload, max_attempts, priority,
                idempotency_key, input_hash, labels, run_at, deadline, backoff_initial_ms,
                backoff_max_ms, callback_url, max_cost_cents, created_at, updated_at, event_seq,
                trace_parent)
             VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?17, ?16, ?16, 1, ?18)
             RETURNING *",
        )
        .bind(id.to_string())
        .bind(tenant)
        .bind(&new.queue)
        .bind(&new.kind)
        .bind(to_json(&new.payload))
        .bind(i64::from(new.max_attempts))
        .bind(new.priority)
        .bind(new.idempotency_key.as_deref())
        .bind(&new.input_hash)
        .bind(to_json(&new.labels))
        .bind(new.run_at.map(ms).unwrap_or(now))
        .bind(opt_ms(new.deadline))
        .bind(duration_ms(new.backoff.initial()))
        .bind(duration_ms(new.backoff.max()))
        .bind(new.callback_url.as_deref())
        .bind(now)
        .bind(new.max_cost_cents)
        .bind(new.trace_parent.as_deref())
        .fetch_one(&mut *conn)
        .await?;
        let job = job_from_row(&row)?;
        insert_event(
            conn,
            &JobEvent {
                job_id: job.id,
                sequence: 1,
                kind: EventType::Submitted,
                state: JobState::Queued,
                attempt: 0,
                worker_id: None,
                at: job.created_at,
                detail: None,
            },
        )
        .await?;
        Ok(Ok(Submitted { job, created: true }))
    }

    /// One spec's claim inside the caller's transaction.
    async fn claim(
        &self,
        tx: &mut Tx,
        tenant: &str,
        spec: &LeaseSpec,
        now: i64,
        changes: &mut Changes,
    ) -> StoreResult<Vec<Job>> {
        let only_tenant = (!spec.all_tenants).then_some(tenant);
        let caps: serde_json::Map<String, Value> = self
            .caps
            .queues
            .iter()
            .zip(&self.caps.caps)
            .map(|(q, cap)| (q.clone(), Value::from(*cap)))
            .collect();
        // The same claim as PostgreSQL's (see there): tenants by a skip scan,
        // each queue's priority levels by another, the best candidates per
        // queue, fewest running first, running caps respected. The single
        // writer makes it race-free.
        let rows = sqlx::query(
            "WITH RECURSIVE seen(tenant) AS (
                SELECT (SELECT tenant FROM jobs WHERE state = 'queued' AND ?1 IS NULL
                        ORDER BY tenant LIMIT 1)
                UNION ALL
                SELECT (SELECT j.tenant FROM jobs j WHERE j.state = 'queued' AND j.tenant > s.tenant
                        ORDER BY j.tenant LIMIT 1)
                FROM seen s WHERE s.tenant IS NOT NULL
             ), tenants AS (
                SELECT tenant FROM seen WHERE tenant IS NOT NULL
                UNION ALL
                SELECT ?1 WHERE ?1 IS NOT NULL
             ), pairs AS (
                SELECT t.tenant, q.value AS queue FROM tenants t, json_each(?2) q
                WHERE NOT EXISTS (
                    SELECT 1 FROM paused_queues p WHERE p.tenant = t.tenant AND p.queue = q.value
                )
             ), levels(tenant, queue, priority) AS (
                -- One index probe per priority level, highest first. One
                -- scan in (priority, run_at) order would step over every
                -- job a level has scheduled for later before reaching the
                -- next level, so an empty claim would cost as much as that
                -- backlog.
                SELECT p.tenant, p.queue,
                    (SELECT priority FROM jobs
                     WHERE tenant = p.tenant AND queue = p.queue AND state = 'queued'
                     ORDER BY priority DESC LIMIT 1)
                FROM pairs p
                UNION ALL
                SELECT l.tenant, l.queue,
                    (SELECT j.priority FROM jobs j
                     WHERE j.tenant = l.tenant AND j.queue = l.queue AND j.state = 'queued'
                       AND j.priority < l.priority
                     ORDER BY j.priority DESC LIMIT 1)
                FROM levels l WHERE l.priority IS NOT NULL
             ), running AS (
                -- Counted only when caps or fairness need it (?10).
                SELECT tenant, queue, count(*) AS n FROM jobs
                WHERE ?10 AND state = 'running' AND (?1 IS NULL OR tenant = ?1)
                GROUP BY tenant, queue
             ), due AS (
                -- Per level a range scan that stops at the first job not
                -- yet due; of those, the best ?4 per queue, as one scan in
                -- claim order gave them (more would change the loads and
                -- ranks below). Every due level reads up to ?4, where
                -- PostgreSQL's lateral limit stops at the level that fills
                -- the batch: the work is levels times batch, and levels
                -- are few.
                SELECT id, tenant, queue, priority, run_at, kind FROM (
                    SELECT j.id, j.tenant, j.queue, j.priority, j.run_at, j.kind,
                        row_number() OVER (PARTITION BY j.tenant, j.queue
                                           ORDER BY j.priority DESC, j.run_at, j.id) AS pair_rank
                    FROM levels p
                    JOIN jobs j ON p.priority IS NOT NULL AND j.id IN (
                        SELECT id FROM jobs
                        WHERE tenant = p.tenant AND queue = p.queue AND state = 'queued'
                          AND priority = p.priority AND run_at <= ?6
                          AND (?3 = '[]' OR kind IN (SELECT value FROM json_each(?3)))
                          AND (deadline IS NULL OR deadline > ?6)
                          AND NOT EXISTS (
                              SELECT 1 FROM breakers b
                              WHERE b.tenant = p.tenant AND b.queue = p.queue AND b.kind = jobs.kind
                                AND (b.open_until > ?6
                                     OR EXISTS (SELECT 1 FROM jobs pr
                                                WHERE pr.id = b.probe_job AND pr.state = 'running'))
                          )
                        ORDER BY run_at, id
                        LIMIT ?4
                    )
                )
                WHERE pair_rank <= ?4
             ), candidates AS (
                SELECT j.id, j.priority, j.run_at, j.tenant, j.queue, j.kind,
                    EXISTS (SELECT 1 FROM breakers b
                            WHERE b.tenant = j.tenant AND b.queue = j.queue AND b.kind = j.kind
                              AND b.open_until IS NOT NULL) AS half_open,
                    coalesce((SELECT sum(r.n) FROM running r WHERE r.tenant = j.tenant), 0)
                      + row_number() OVER (PARTITION BY j.tenant
                                           ORDER BY j.priority DESC, j.run_at, j.id) AS tenant_load,
                    coalesce((SELECT r.n FROM running r WHERE r.tenant = j.tenant AND r.queue = j.queue), 0)
                      + row_number() OVER (PARTITION BY j.tenant, j.queue
                                           ORDER BY j.priority DESC, j.run_at, j.id) AS queue_load,
                    coalesce((SELECT c.value FROM json_each(?8) c WHERE c.key = j.queue), ?9) AS cap
                FROM due j
             ), picked AS (
                SELECT id FROM (
                    SELECT *, row_number() OVER (PARTITION BY tenant, queue, kind
                                                 ORDER BY priority DESC, run_at, id) AS kind_rank
                    FROM candidates
                )
                WHERE queue_load <= cap AND (NOT half_open OR kind_rank = 1)
                ORDER BY tenant_load, priority DESC, run_at, id
                LIMIT ?4
             )
             UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_owner = ?5,
                lease_token = lower(hex(randomblob(16))),
                lease_expires_at = min(?6 + ?7, coalesce(deadline, ?6 + ?7)),
                lease_ms = ?7,
                started_at = coalesce(started_at, ?6),
                leased_at = ?6,
                updated_at = max(updated_at, ?6),
                progress = 0,
                event_seq = event_seq + 1
             WHERE id IN (SELECT id FROM picked)
             RETURNING *",
        )
        .bind(only_tenant)
        .bind(to_json(&spec.queues))
        .bind(to_json(&spec.kinds))
        .bind(i64::from(spec.max_jobs))
        .bind(&spec.worker_id)
        .bind(now)
        .bind(duration_ms(spec.lease_duration))
        .bind(to_json(&caps))
        .bind(self.caps.default)
        .bind(spec.all_tenants || self.caps.cover_any(&spec.queues))
        .fetch_all(&mut **tx)
        .await?;
        // Every leased row gets its LEASED event from its columns, so one
        // that cannot be read (and is left out below) still records its
        // lease, as PostgreSQL's claim does. A job leased from a half-open
        // breaker is its probe; the claim takes at most one job per
        // half-open kind. One statement each, however many jobs.
        let ids = to_json(&rows.iter().filter_map(row_id).collect::<Vec<_>>());
        sqlx::query(
            "INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at)
             SELECT id, event_seq, 'leased', 'running', attempt, lease_owner, updated_at
             FROM jobs WHERE id IN (SELECT value FROM json_each(?1))",
        )
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "UPDATE breakers SET probe_job = leased.id, updated_at = ?2
             FROM (SELECT id, tenant, queue, kind FROM jobs
                   WHERE id IN (SELECT value FROM json_each(?1))) AS leased
             WHERE breakers.tenant = leased.tenant AND breakers.queue = leased.queue
               AND breakers.kind = leased.kind AND breakers.open_until <= ?2
               AND (breakers.probe_job IS NULL
                    OR NOT EXISTS (SELECT 1 FROM jobs p WHERE p.id = breakers.probe_job
                                                          AND p.state = 'running'))",
        )
        .bind(&ids)
        .bind(now)
        .execute(&mut **tx)
        .await?;
        let mut jobs: Vec<Job> = self
            .unreadable
            .readable(&rows, job_from_row, row_key, "a claim")
            .into_iter()
            .map(|(_, job)| job)
            .collect();
        jobs.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.run_at.cmp(&b.run_at))
                .then(a.id.cmp(&b.id))
        });
        for job in &jobs {
            changes.job_event(job, &JobEvent::leased(job));
        }
        Ok(jobs)
    }
}

/// Leases a job just inserted to a parked worker when a claim made now
/// would pick it (see `Store::submit_handing`), with its `LEASED` event;
/// `None` leaves it queued. Earlier jobs of the same submit are visible
/// here; they come in priority order, so they never outrank it wrongly.
/// A due job at its priority or above is looked for level by level, as
/// the claim does, each level by its first job in `run_at` order: one
/// range scan over the levels would step over every job they have
/// scheduled for later.
async fn hand_off(tx: &mut Tx, job: &Job, handoff: &Handoff, now: i64) -> StoreResult<Option<Job>> {
    let row = sqlx::query(
        "WITH RECURSIVE levels(priority) AS (
            SELECT (SELECT priority FROM jobs
                    WHERE tenant = ?5 AND queue = ?6 AND state = 'queued' AND priority >= ?7
                    ORDER BY priority LIMIT 1)
            UNION ALL
            SELECT (SELECT j.priority FROM jobs j
                    WHERE j.tenant = ?5 AND j.queue = ?6 AND j.state = 'queued'
                      AND j.priority > l.priority
                    ORDER BY j.priority LIMIT 1)
            FROM levels l WHERE l.priority IS NOT NULL
         )
         UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_owner = ?2,
            lease_token = lower(hex(randomblob(16))),
            lease_expires_at = min(?3 + ?4, coalesce(deadline, ?3 + ?4)), lease_ms = ?4,
            started_at = ?3, leased_at = ?3, updated_at = max(updated_at, ?3), progress = 0,
            event_seq = event_seq + 1
         WHERE id = ?1 AND state = 'queued' AND run_at <= ?3
           AND (deadline IS NULL OR deadline > ?3)
           AND NOT EXISTS (SELECT 1 FROM paused_queues p
                           WHERE p.tenant = jobs.tenant AND p.queue = jobs.queue)
           AND NOT EXISTS (SELECT 1 FROM breakers b
                           WHERE b.tenant = jobs.tenant AND b.queue = jobs.queue
                             AND b.kind = jobs.kind)
           AND NOT EXISTS (SELECT 1 FROM levels l
                           WHERE l.priority IS NOT NULL
                             AND (SELECT q.run_at FROM jobs q
                                  WHERE q.tenant = ?5 AND q.queue = ?6 AND q.state = 'queued'
                                    AND q.priority = l.priority AND q.id <> ?1
                                  ORDER BY q.run_at LIMIT 1) <= ?3)
         RETURNING *",
    )
    .bind(job.id.to_string())
    .bind(&handoff.worker_id)
    .bind(now)
    .bind(duration_ms(handoff.lease_duration))
    .bind(&job.tenant)
    .bind(&job.queue)
    .bind(job.priority)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let job = job_from_row(&row)?;
    insert_event(tx, &JobEvent::leased(&job)).await?;
    Ok(Some(job))
}

#[async_trait]
impl Store for SqliteStore {
    #[tracing::instrument(name = "store.submit", skip_all, fields(count = jobs.len()))]
    async fn submit_handing(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
        handoffs: Vec<Option<Handoff>>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        let mut tx = self.begin().await?;
        let now = ms(Utc::now());
        let mut results = Vec::with_capacity(jobs.len());
        let mut changes = Changes::default();
        let mut handoffs = handoffs.into_iter();
        for new in jobs {
            let handoff = handoffs
                .next()
                .flatten()
                .filter(|_| !self.caps.covers(&new.queue));
            let mut result = self.submit_one(&mut tx, tenant, new, now).await?;
            if let (Ok(submitted), Some(handoff)) = (&mut result, handoff)
                && submitted.created
                && let Some(job) = hand_off(&mut tx, &submitted.job, &handoff, now).await?
            {
                submitted.job = job;
            }
            if let Ok(submitted) = &result
                && submitted.created
            {
                changes.submitted(&submitted.job);
            }
            results.push(result);
        }
        self.commit(tx, &changes).await?;
        Ok(results)
    }

    #[tracing::instrument(name = "store.get", skip_all, fields(job_id = %id))]
    async fn get(&self, tenant: &str, id: Uuid) -> StoreResult<Job> {
        let mut conn = self.reader.acquire().await?;
        load(&mut conn, tenant, id).await
    }

    async fn get_by_key(&self, tenant: &str, key: &str) -> StoreResult<Option<Job>> {
        let mut conn = self.reader.acquire().await?;
        sqlx::query("SELECT * FROM jobs WHERE tenant = ?1 AND idempotency_key = ?2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *conn)
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
             WHERE e.job_id = ?1 AND j.tenant = ?2 AND e.sequence > ?3
             ORDER BY e.sequence LIMIT ?4",
        )
        .bind(id.to_string())
        .bind(tenant)
        .bind(i64::try_from(after).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    #[tracing::instrument(name = "store.list", skip_all)]
    async fn list(&self, tenant: &str, filter: &ListFilter) -> StoreResult<Vec<Job>> {
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let statement = if filter.with_payloads {
            LIST
        } else {
            LIST_BASIC
        };
        let rows = sqlx::query(statement)
            .bind(tenant)
            .bind(filter.before.map(|id| id.to_string()))
            .bind(filter.queue.as_deref())
            .bind(filter.kind.as_deref())
            .bind(to_json(&states))
            .bind(filter.error_class.as_deref())
            .bind(to_json(&filter.labels))
            .bind(i64::from(filter.page_size))
            .fetch_all(&self.reader)
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
        // sum() fails on an overflow, which reported costs can reach (a
        // job's saturates at the largest integer); total() is a double,
        // exact below 2^53 cents, and the cast saturates.
        let rows = sqlx::query(concat!(
            "SELECT error_class, queue, count(*) AS jobs,
                        CAST(min(total(cost_cents), 9223372036854775807.0) AS INTEGER) AS cost_cents
                 FROM (SELECT error_class, queue, cost_cents FROM jobs WHERE ",
            replay_filter!(),
            " LIMIT ?6)
                 GROUP BY error_class, queue
                 ORDER BY jobs DESC, error_class, queue"
        ))
        .bind(tenant)
        .bind(to_json(&states))
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .bind(i64::from(filter.limit))
        .fetch_all(&self.reader)
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
        let count = sqlx::query_scalar::<_, i64>(concat!(
            "SELECT count(*) FROM jobs WHERE ",
            replay_filter!()
        ))
        .bind(tenant)
        .bind(to_json(&states))
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref());
        if dry_run {
            // On the read pool: a large dead set counted under the one
            // write lock held every write meanwhile, for a mere look.
            let matched = to_u64(count.fetch_one(&self.reader).await?, "count")?;
            return Ok(Retried {
                retried: Vec::new(),
                matched,
            });
        }
        // A retry counts in its own transaction, so that what it reports
        // matched is what it retried from.
        let mut tx = self.begin().await?;
        let matched = to_u64(count.fetch_one(&mut *tx).await?, "count")?;
        let rows = sqlx::query(concat!(
            "SELECT * FROM jobs WHERE ",
            replay_filter!(),
            " ORDER BY id LIMIT ?6"
        ))
        .bind(tenant)
        .bind(to_json(&states))
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .bind(i64::from(filter.limit))
        .fetch_all(&mut *tx)
        .await?;
        let now = stored_now();
        let mut changes = Changes::default();
        let mut retried = Vec::with_capacity(rows.len());
        for row in &rows {
            let mut job = job_from_row(row)?;
            let event = transition::replay(&mut job, now)?;
            save(&mut tx, &job, &event).await?;
            changes.job(&job);
            retried.push(job.id);
        }
        self.commit(tx, &changes).await?;
        Ok(Retried { retried, matched })
    }

    #[tracing::instrument(name = "store.stats", skip_all)]
    async fn stats(
        &self,
        tenant: &str,
        queue: Option<&str>,
        workers_since: Duration,
    ) -> StoreResult<Stats> {
        let now = ms(Utc::now());
        let counts = sqlx::query(
            "SELECT queue, state, count(*) AS n FROM jobs
             WHERE tenant = ?1 AND (?2 IS NULL OR queue = ?2)
             GROUP BY queue, state",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.reader)
        .await?;
        let oldest = sqlx::query(
            "SELECT queue, ?3 - min(run_at) AS age_ms FROM jobs
             WHERE tenant = ?1 AND (?2 IS NULL OR queue = ?2) AND state = 'queued' AND run_at <= ?3
             GROUP BY queue",
        )
        .bind(tenant)
        .bind(queue)
        .bind(now)
        .fetch_all(&self.reader)
        .await?;
        let workers = sqlx::query(
            "SELECT w.worker_id, w.queues, w.last_lease_at, r.held, r.last_heartbeat_at
             FROM workers w
             LEFT JOIN (
                SELECT lease_owner, count(*) AS held, max(updated_at) AS last_heartbeat_at
                FROM jobs WHERE tenant = ?1 AND state = 'running' GROUP BY lease_owner
             ) r ON r.lease_owner = w.worker_id
             WHERE w.tenant = ?1 AND (w.last_lease_at > ?2 OR r.held > 0)
             ORDER BY w.worker_id",
        )
        .bind(tenant)
        .bind(now - duration_ms(workers_since))
        .fetch_all(&self.reader)
        .await?;
        let paused: Vec<String> = sqlx::query_scalar(
            "SELECT queue FROM paused_queues WHERE tenant = ?1 AND (?2 IS NULL OR queue = ?2)",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.reader)
        .await?;

        let mut by_queue = QueueStatsBuilder::default();
        for row in &counts {
            let state: String = row.try_get("state")?;
            let state = JobState::parse(&state).ok_or_else(|| corrupt("state"))?;
            by_queue.count(
                row.try_get("queue")?,
                state,
                to_u64(row.try_get("n")?, "count")?,
            );
        }
        for row in &oldest {
            let queue: String = row.try_get("queue")?;
            let age: i64 = row.try_get("age_ms")?;
            by_queue.oldest(
                &queue,
                Duration::from_millis(u64::try_from(age).unwrap_or(0)),
            );
        }
        for queue in paused {
            by_queue.paused(queue);
        }
        let breakers = sqlx::query(
            "SELECT * FROM breakers WHERE tenant = ?1 AND (?2 IS NULL OR queue = ?2) ORDER BY queue, kind",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.reader)
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
                    queues: json(row, "queues")?,
                    last_lease_at: opt_ts(row, "last_lease_at")?,
                    last_heartbeat_at: opt_ts(row, "last_heartbeat_at")?,
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
        // The single writer makes one claim after another in one
        // transaction as good as one statement: one commit for all.
        let mut tx = self.begin().await?;
        let now = ms(Utc::now());
        let mut changes = Changes::default();
        let mut claimed = Vec::with_capacity(specs.len());
        for spec in specs {
            claimed.push(self.claim(&mut tx, tenant, spec, now, &mut changes).await?);
        }
        self.commit(tx, &changes).await?;
        Ok(claimed)
    }

    #[tracing::instrument(name = "store.touch_worker", skip_all, fields(worker_id))]
    async fn touch_worker(
        &self,
        tenant: &str,
        worker_id: &str,
        queues: &[String],
    ) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO workers (tenant, worker_id, queues, last_lease_at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (tenant, worker_id) DO UPDATE SET queues = excluded.queues, last_lease_at = excluded.last_lease_at",
        )
        .bind(tenant)
        .bind(worker_id)
        .bind(to_json(&queues))
        .bind(ms(Utc::now()))
        .execute(&mut *tx)
        .await?;
        self.commit(tx, &Changes::default()).await
    }

    #[tracing::instrument(name = "store.heartbeat", skip_all, fields(job_id = %spec.job_id))]
    async fn heartbeat(&self, tenant: &str, spec: &HeartbeatSpec) -> StoreResult<HeartbeatAck> {
        let with_event = spec.progress.is_some() || spec.message.is_some();
        let mut tx = self.begin().await?;
        let now = ms(Utc::now());
        // Once a cancel is requested the lease no longer grows.
        let row = sqlx::query(
            "UPDATE jobs SET
                lease_expires_at = CASE WHEN cancel_requested THEN lease_expires_at
                    ELSE min(?4 + min(coalesce(?5, lease_ms, ?8), ?9),
                             coalesce(deadline, ?4 + min(coalesce(?5, lease_ms, ?8), ?9))) END,
                progress = coalesce(?6, progress),
                updated_at = max(updated_at, ?4),
                event_seq = event_seq + ?7
             WHERE id = ?1 AND tenant = ?2 AND lease_token = ?3 AND state = 'running'
               -- Past its cancel grace the lease is revoked (SPEC 2).
               AND NOT (cancel_requested AND lease_expires_at <= ?4)
             RETURNING *",
        )
        .bind(spec.job_id.to_string())
        .bind(tenant)
        .bind(&spec.lease_token)
        .bind(now)
        .bind(spec.extend_by.map(duration_ms))
        .bind(spec.progress)
        .bind(i64::from(with_event))
        .bind(duration_ms(spec.unrecorded_lease))
        .bind(duration_ms(spec.max_lease))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            drop(tx);
            self.get(tenant, spec.job_id).await?;
            return Err(StoreError::LeaseLost);
        };
        let job = job_from_row(&row)?;
        let mut changes = Changes::default();
        if with_event {
            let mut detail = serde_json::Map::new();
            detail.insert("progress".into(), Value::from(job.progress));
            if let Some(message) = &spec.message {
                detail.insert("message".into(), Value::from(message.as_str()));
            }
            insert_event(
                &mut tx,
                &JobEvent {
                    job_id: job.id,
                    sequence: job.event_seq,
                    kind: EventType::Progress,
                    state: JobState::Running,
                    attempt: job.attempt,
                    worker_id: job.lease_owner.clone(),
                    at: job.updated_at,
                    detail: Some(Value::Object(detail)),
                },
            )
            .await?;
            changes.job(&job);
        }
        self.commit(tx, &changes).await?;
        Ok(HeartbeatAck {
            lease_expires_at: job
                .lease_expires_at
                .ok_or_else(|| corrupt("lease_expires_at"))?,
            cancel_requested: job.cancel_requested,
        })
    }

    #[tracing::instrument(name = "store.complete", skip_all, fields(count = items.len()))]
    async fn complete(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>> {
        let mut tx = self.begin().await?;
        let now = stored_now();
        // The batch's jobs in one read. Each outcome applies to the job as
        // the batch left it, so a second outcome for the same job meets
        // the first one's result, as it would in separate calls.
        let ids: Vec<String> = items.iter().map(|i| i.job_id.to_string()).collect();
        let rows = sqlx::query(
            "SELECT *, EXISTS (SELECT 1 FROM breakers b WHERE b.tenant = jobs.tenant
                               AND b.queue = jobs.queue AND b.kind = jobs.kind) AS has_breaker
             FROM jobs WHERE tenant = ?1 AND id IN (SELECT value FROM json_each(?2))",
        )
        .bind(tenant)
        .bind(to_json(&ids))
        .fetch_all(&mut *tx)
        .await?;
        let mut has_breaker = false;
        let mut jobs: HashMap<Uuid, Job> = HashMap::with_capacity(rows.len());
        // A row that cannot be read refuses only its own outcome.
        let (readable, unreadable) =
            self.unreadable
                .readable_by_id(&rows, job_from_row, row_key, "complete");
        for (row, job) in readable {
            has_breaker |= row.try_get::<bool, _>("has_breaker")?;
            jobs.insert(job.id, job);
        }
        // Without a breaker on any of the jobs and without a failure in
        // the batch, no outcome can change a breaker (as on PostgreSQL).
        let breakers = self.breaker.threshold > 0
            && (has_breaker
                || items
                    .iter()
                    .any(|item| breaker::failure_of(&item.outcome).is_some()));
        let mut changes = Changes::default();
        let mut results = Vec::with_capacity(items.len());
        for item in items {
            let Some(job) = jobs.get_mut(&item.job_id) else {
                results.push(Err(if unreadable.contains(&item.job_id) {
                    super::unreadable::refused()
                } else {
                    StoreError::NotFound
                }));
                continue;
            };
            let jitter = rand::random::<f64>();
            let attempt = job.running_attempt();
            let failure = breaker::failure_of(&item.outcome);
            match transition::complete(
                job,
                &item.lease_token,
                item.outcome,
                item.cost_cents,
                now,
                jitter,
            ) {
                Ok(event) => {
                    let job = job.clone();
                    save(&mut tx, &job, &event).await?;
                    if breakers {
                        self.update_breaker(&mut tx, &job, failure.as_ref(), now)
                            .await?;
                    }
                    changes.job_event(&job, &event);
                    // A successful complete always ended a running attempt.
                    results.push(
                        Ended::new(attempt, job, event)
                            .ok_or_else(|| StoreError::Internal("no running attempt".into())),
                    );
                }
                Err(err) => results.push(Err(err.into())),
            }
        }
        self.commit(tx, &changes).await?;
        Ok(results)
    }

    #[tracing::instrument(name = "store.reap", skip_all)]
    async fn reap(&self, batch: u32, retention: Option<Duration>) -> StoreResult<Reaped> {
        if let Some(keys) = self.unreadable.due_again() {
            self.recheck_unreadable(&keys).await;
        }
        // Rows that cannot be read are read past (see `unreadable`).
        let set_aside = to_json(&self.unreadable.set_aside());
        let mut tx = self.begin().await?;
        let now = stored_now();
        let expired_leases = sqlx::query(
            "SELECT * FROM jobs WHERE state = 'running' AND lease_expires_at <= ?1
               AND id NOT IN (SELECT value FROM json_each(?3))
             ORDER BY lease_expires_at LIMIT ?2",
        )
        .bind(ms(now))
        .bind(i64::from(batch))
        .bind(&set_aside)
        .fetch_all(&mut *tx)
        .await?;
        let past_deadline = sqlx::query(
            "SELECT * FROM jobs WHERE state = 'queued' AND deadline <= ?1
               AND id NOT IN (SELECT value FROM json_each(?3))
             ORDER BY deadline LIMIT ?2",
        )
        .bind(ms(now))
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
        for (_, mut job) in expired_jobs {
            let attempt = job.running_attempt();
            let event = transition::lease_expired(&mut job, now);
            save(&mut tx, &job, &event).await?;
            changes.job_event(&job, &event);
            reclaimed.push((attempt, job, event));
        }
        let mut expired = Vec::with_capacity(past_jobs.len());
        for (_, mut job) in past_jobs {
            let event = transition::deadline_passed(&mut job, now);
            save(&mut tx, &job, &event).await?;
            changes.job_event(&job, &event);
            expired.push((job, event));
        }
        self.commit(tx, &changes).await?;
        // What was reclaimed is committed: a failed deletion must not lose
        // its report (metrics, attempt spans, the reaper's next pass).
        let Some(retention) = retention else {
            return Ok(Reaped::new(reclaimed, expired, 0));
        };
        let deleted = self
            .delete_past_retention(ms(now).saturating_sub(duration_ms(retention)), batch)
            .await
            .unwrap_or_else(|err| {
                tracing::warn!(error = %err, "deleting finished jobs past retention failed; trying again next pass");
                0
            });
        Ok(Reaped::new(reclaimed, expired, deleted))
    }

    #[tracing::instrument(name = "store.set_paused", skip_all, fields(queue, paused))]
    async fn set_paused(&self, tenant: &str, queue: &str, paused: bool) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        let mut changes = Changes::default();
        if paused {
            sqlx::query(
                "INSERT INTO paused_queues (tenant, queue, paused_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (tenant, queue) DO NOTHING",
            )
            .bind(tenant)
            .bind(queue)
            .bind(ms(Utc::now()))
            .execute(&mut *tx)
            .await?;
        } else {
            sqlx::query("DELETE FROM paused_queues WHERE tenant = ?1 AND queue = ?2")
                .bind(tenant)
                .bind(queue)
                .execute(&mut *tx)
                .await?;
            changes.queue(tenant, queue);
        }
        self.commit(tx, &changes).await
    }

    #[tracing::instrument(name = "store.queued_count", skip_all, fields(queue))]
    async fn queued_count(&self, tenant: &str, queue: &str) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE tenant = ?1 AND queue = ?2 AND state = 'queued'",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_one(&self.reader)
        .await?;
        to_u64(n, "count")
    }

    #[tracing::instrument(name = "store.queue_depths", skip_all)]
    async fn queue_depths(&self) -> StoreResult<Vec<QueueDepth>> {
        let counts = sqlx::query(
            "SELECT tenant, queue, state, count(*) AS n FROM jobs GROUP BY tenant, queue, state",
        )
        .fetch_all(&self.reader)
        .await?;
        let oldest = sqlx::query(
            "SELECT tenant, queue, ?1 - min(run_at) AS age_ms FROM jobs
             WHERE state = 'queued' AND run_at <= ?1 GROUP BY tenant, queue",
        )
        .bind(ms(Utc::now()))
        .fetch_all(&self.reader)
        .await?;
        let mut depths: BTreeMap<(String, String), QueueDepth> = BTreeMap::new();
        for row in &counts {
            let (tenant, queue): (String, String) = (row.try_get("tenant")?, row.try_get("queue")?);
            let state: String = row.try_get("state")?;
            let state = JobState::parse(&state).ok_or_else(|| corrupt("state"))?;
            depths
                .entry((tenant.clone(), queue.clone()))
                .or_insert_with(|| QueueDepth {
                    tenant,
                    queue,
                    ..Default::default()
                })
                .counts
                .insert(state.as_str(), to_u64(row.try_get("n")?, "count")?);
        }
        for row in &oldest {
            let key: (String, String) = (row.try_get("tenant")?, row.try_get("queue")?);
            let age: i64 = row.try_get("age_ms")?;
            if let Some(depth) = depths.get_mut(&key) {
                depth.oldest_runnable_age =
                    Some(Duration::from_millis(u64::try_from(age).unwrap_or(0)));
            }
        }
        Ok(depths.into_values().collect())
    }

    async fn active_workers(&self, since: Duration) -> StoreResult<Vec<QueueWorkers>> {
        let rows = sqlx::query(
            "SELECT w.tenant, q.value AS queue, count(*) AS workers
             FROM workers w, json_each(w.queues) AS q
             WHERE w.last_lease_at > ?1
                OR EXISTS (SELECT 1 FROM jobs j
                           WHERE j.tenant = w.tenant AND j.state = 'running'
                             AND j.lease_owner = w.worker_id)
             GROUP BY w.tenant, q.value",
        )
        .bind(ms(Utc::now()) - duration_ms(since))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(queue_workers).collect()
    }

    fn unreadable_rows(&self) -> u64 {
        self.unreadable.left_out()
    }

    fn outbox(&self) -> Arc<dyn super::outbox::Outbox> {
        Arc::new(super::outbox::SqliteOutbox::new(
            self.writer.clone(),
            self.reader.clone(),
        ))
    }

    /// The process's own: it is the only writer, and its statements take
    /// the time from it.
    fn now(&self) -> DateTime<Utc> {
        stored_now()
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::{c_char, c_int, c_void};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::domain::fixtures::{lease_spec, new_job};

    /// A store on a new file in `dir`, and the file's path.
    async fn scratch_store(dir: &tempfile::TempDir) -> (SqliteStore, std::path::PathBuf) {
        let path = dir.path().join("jobs.db");
        let url = format!("sqlite://{}", path.display());
        let store = SqliteStore::open(&Settings::new(&url), Arc::new(Notifier::new()))
            .await
            .expect("open");
        (store, path)
    }

    /// A server of this build starts on a database a newer build migrated
    /// further (a rollback); only `intray migrate` refuses the unknown
    /// migration.
    #[tokio::test]
    async fn a_store_opens_on_a_database_a_newer_build_migrated() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, path) = scratch_store(&dir).await;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99999, 'from a newer build', 1, x'00', 0)",
        )
        .execute(&store.writer)
        .await
        .expect("a newer build's migration");
        drop(store);
        let url = format!("sqlite://{}", path.display());
        SqliteStore::open(&Settings::new(&url), Arc::new(Notifier::new()))
            .await
            .expect("opens on the newer schema");
        assert!(
            migrate(&url, true).await.is_err(),
            "intray migrate stays strict"
        );
    }

    /// Processes starting together on a new file each apply the migrations
    /// or find them applied: sqlx's SQLite migrator took no lock, and the
    /// second to apply the first migration failed and exited. Played by
    /// two migrations and an open at once, on several new files.
    #[tokio::test]
    async fn stores_migrating_at_once_all_start() {
        for round in 0..5 {
            let dir = tempfile::tempdir().expect("dir");
            let url = format!("sqlite://{}", dir.path().join("race.db").display());
            let settings = Settings::new(url.clone());
            let (first, second, opened) = tokio::join!(
                migrate(&url, true),
                migrate(&url, false),
                SqliteStore::open(&settings, Arc::new(Notifier::new())),
            );
            first.unwrap_or_else(|e| panic!("round {round}: the first migrate: {e}"));
            second.unwrap_or_else(|e| panic!("round {round}: the second migrate: {e}"));
            opened.unwrap_or_else(|e| panic!("round {round}: the open: {e}"));
        }
    }

    /// Opening the store leaves SQLite's own locks on the database file in
    /// place: the migration lock was once taken on that file, and closing
    /// it dropped every POSIX lock the process held there, so another
    /// process took the live database for unused (/proc/locks shows the
    /// locks by inode and pid).
    #[tokio::test]
    async fn opening_keeps_sqlites_own_locks() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("locks.db");
        let settings = Settings::new(format!("sqlite://{}", path.display()));
        let locks_held = || {
            let inode = std::fs::metadata(&path).expect("the database file").ino();
            let pid = std::process::id().to_string();
            std::fs::read_to_string("/proc/locks")
                .expect("/proc/locks")
                .lines()
                .filter(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    fields.get(1) == Some(&"POSIX")
                        && fields.get(4) == Some(&pid.as_str())
                        && fields
                            .get(5)
                            .is_some_and(|id| id.ends_with(&format!(":{inode}")))
                })
                .count()
        };
        let store = SqliteStore::open(&settings, Arc::new(Notifier::new()))
            .await
            .expect("open");
        store
            .get("t", Uuid::new_v4())
            .await
            .expect_err("no such job");
        assert!(locks_held() > 0, "SQLite's locks on the file are held");
        migrate(&settings.database_url, false)
            .await
            .expect("a migrate beside the open store");
        assert!(locks_held() > 0, "and still held after a migrate beside it");
    }

    /// An in-memory database is refused: it would vanish whenever the
    /// pools happened to close every connection to it, with every job. So
    /// is a URL that names no file, which gave each connection a private
    /// database of its own.
    #[tokio::test]
    async fn an_in_memory_database_is_refused() {
        for url in [
            "sqlite::memory:",
            "sqlite://file:jobs?mode=memory&cache=shared",
        ] {
            let refused = SqliteStore::open(&Settings::new(url), Arc::new(Notifier::new())).await;
            assert!(
                matches!(&refused, Err(StoreError::Config(m)) if m.contains("in-memory")),
                "{url}: {:?}",
                refused.err()
            );
        }
        for url in ["sqlite://", "sqlite:", "sqlite://%3Amemory%3A"] {
            let refused = SqliteStore::open(&Settings::new(url), Arc::new(Notifier::new())).await;
            assert!(
                matches!(&refused, Err(StoreError::Config(m)) if m.contains("names no SQLite file")),
                "{url}: {:?}",
                refused.err()
            );
        }
    }

    /// A database that cannot be written (a volume the kernel remounted
    /// read-only after disk errors, a file moved away) is unavailable, not
    /// an internal error: it was answered INTERNAL. Played by `query_only`,
    /// which fails writes with SQLite's read-only code.
    #[tokio::test]
    async fn a_database_that_cannot_be_written_answers_unavailable() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        sqlx::raw_sql("PRAGMA query_only = 1")
            .execute(&store.writer)
            .await
            .expect("make the writer read-only");
        let refused = store.submit("default", vec![new_job()]).await;
        assert!(
            matches!(refused, Err(StoreError::Unavailable(_))),
            "{refused:?}"
        );
    }

    /// A full disk is the database being unavailable (retry later), as a
    /// lost PostgreSQL is, not an internal error: played by a page limit.
    #[tokio::test]
    async fn a_full_disk_answers_unavailable() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        sqlx::raw_sql("PRAGMA max_page_count = 1")
            .execute(&store.writer)
            .await
            .expect("cap the file at its size");
        let mut big = new_job();
        big.payload = serde_json::json!("x".repeat(1 << 20));
        let refused = store.submit("default", vec![big]).await;
        assert!(
            matches!(refused, Err(StoreError::Unavailable(_))),
            "{refused:?}"
        );
    }

    /// The write-ahead log a large batch grew is cut back to its limit
    /// once it has been checkpointed, instead of keeping its size.
    #[tokio::test]
    async fn a_grown_write_ahead_log_is_cut_back() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, path) = scratch_store(&dir).await;
        let wal = path.with_extension("db-wal");
        let mut big = new_job();
        big.payload = serde_json::json!("x".repeat(1 << 20));
        // One transaction larger than the limit: the log holds it whole.
        store
            .submit("default", vec![big; 70])
            .await
            .expect("a large batch");
        let size = || std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        assert!(size() > WAL_SIZE_LIMIT, "the log grew: {}", size());
        for _ in 0..200 {
            if size() <= WAL_SIZE_LIMIT {
                return;
            }
            store
                .submit("default", vec![new_job()])
                .await
                .expect("a small submit");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the log kept {} bytes", size());
    }

    /// A bulk retry's dry run counts on the read pool: it does not wait for
    /// the one writer, which another transaction holds.
    #[tokio::test]
    async fn a_dry_run_retry_does_not_wait_for_the_writer() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        let mut held = store.writer.acquire().await.expect("the writer");
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *held)
            .await
            .expect("hold the write lock");
        let filter = RetryFilter {
            queue: None,
            kind: None,
            error_class: None,
            states: vec![JobState::Failed],
            limit: 10,
        };
        let counted = tokio::time::timeout(
            Duration::from_secs(2),
            store.retry_matching("default", &filter, true),
        )
        .await
        .expect("counted without the writer")
        .expect("counted");
        assert_eq!(counted.matched, 0);
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut *held)
            .await
            .expect("release");
    }

    /// Counts the virtual machine instructions the writer runs from now on
    /// (SQLite's progress handler, called after every instruction): a
    /// measure of a statement's work that does not depend on the machine.
    async fn count_writer_steps(store: &SqliteStore) -> Arc<std::sync::atomic::AtomicU64> {
        let steps = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut conn = store.writer.acquire().await.expect("the writer");
        let counted = Arc::clone(&steps);
        conn.lock_handle()
            .await
            .expect("the writer's handle")
            .set_progress_handler(1, move || {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            });
        steps
    }

    /// The instructions `work` made the writer run.
    async fn steps_of<F: std::future::Future>(
        steps: &std::sync::atomic::AtomicU64,
        work: F,
    ) -> (u64, F::Output) {
        let before = steps.load(std::sync::atomic::Ordering::Relaxed);
        let output = work.await;
        (
            steps.load(std::sync::atomic::Ordering::Relaxed) - before,
            output,
        )
    }

    /// Counts what the writer compiles from now on, but transaction
    /// control: SQLite asks its authorizer about every table and column a
    /// statement uses while compiling it, and never while running it.
    async fn count_writer_prepares(store: &SqliteStore) -> &'static AtomicUsize {
        unsafe extern "C" fn counted(
            count: *mut c_void,
            action: c_int,
            _a: *const c_char,
            _b: *const c_char,
            _c: *const c_char,
            _d: *const c_char,
        ) -> c_int {
            // BEGIN and COMMIT are text run as it is, never cached.
            if action != libsqlite3_sys::SQLITE_TRANSACTION {
                // SAFETY: the pointer is the leaked counter below, which
                // lives as long as the process.
                unsafe { &*count.cast::<AtomicUsize>() }.fetch_add(1, Ordering::Relaxed);
            }
            libsqlite3_sys::SQLITE_OK
        }
        let count: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(0)));
        let mut conn = store.writer.acquire().await.expect("the writer");
        let mut handle = conn.lock_handle().await.expect("the writer's handle");
        // SAFETY: the connection is open and locked for this call; the
        // callback only counts, through a pointer valid for good.
        let rc = unsafe {
            libsqlite3_sys::sqlite3_set_authorizer(
                handle.as_raw_handle().as_ptr(),
                Some(counted),
                std::ptr::from_ref(count).cast_mut().cast::<c_void>(),
            )
        };
        assert_eq!(rc, libsqlite3_sys::SQLITE_OK);
        count
    }

    /// A claim run again is not compiled again. SQLite plans with the
    /// values bound to a `LIMIT ?` unless its planner stability guarantee
    /// is on, and then expires the statement whenever the parameter is
    /// bound anew: every claim parsed and planned its CTEs again, 38 % of
    /// the server's CPU in e2e, inside the single writer.
    #[tokio::test]
    async fn a_claim_run_again_is_not_prepared_again() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        let prepares = count_writer_prepares(&store).await;
        let submitted: Vec<NewJob> = (0..4).map(|_| new_job()).collect();
        store.submit("default", submitted).await.expect("submit");
        // Setting the authorizer expired every cached statement: the
        // first claim compiles its statements once more.
        for max_jobs in [1, 2] {
            let spec = lease_spec("w", max_jobs);
            store.lease("default", &[spec]).await.expect("lease");
        }
        let before = prepares.load(Ordering::Relaxed);
        let spec = lease_spec("w", 1);
        let leased = store.lease("default", &[spec]).await.expect("lease");
        assert_eq!(leased.concat().len(), 1);
        assert_eq!(
            prepares.load(Ordering::Relaxed) - before,
            0,
            "statements compiled again"
        );
    }

    /// A claim, and a submit's hand-off check, cost about the same with
    /// thousands of jobs scheduled for later at a higher priority as
    /// without them: the levels are probed one by one and each scan stops
    /// at its first job not yet due, as on PostgreSQL. One scan in
    /// (priority, `run_at`) order stepped over every such job, inside the
    /// single writer: 21 times a claim's work here, 28 times a hand-off's,
    /// growing with the backlog.
    #[tokio::test]
    async fn jobs_scheduled_for_later_cost_a_claim_nothing() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        let steps = count_writer_steps(&store).await;
        let handoff = || {
            vec![Some(Handoff {
                worker_id: "parked".into(),
                lease_duration: Duration::from_secs(60),
            })]
        };
        let measure = || async {
            store
                .submit("default", vec![new_job()])
                .await
                .expect("submit")[0]
                .as_ref()
                .expect("accepted");
            let (claim, leased) = steps_of(
                &steps,
                store.lease("default", &[crate::domain::fixtures::lease_spec("w", 1)]),
            )
            .await;
            assert_eq!(leased.expect("lease")[0].len(), 1, "the due job is leased");
            let (hand_off, handed) = steps_of(
                &steps,
                store.submit_handing("default", vec![new_job()], handoff()),
            )
            .await;
            let handed = handed.expect("submit")[0].clone().expect("accepted");
            assert_eq!(handed.job.state, JobState::Running, "handed off");
            (claim, hand_off)
        };
        let (claim_alone, hand_off_alone) = measure().await;
        let mut later = new_job();
        later.priority = 5;
        later.run_at = Some(Utc::now() + chrono::Duration::days(1));
        for _ in 0..5 {
            store
                .submit("default", vec![later.clone(); 1000])
                .await
                .expect("schedule for later");
        }
        let (claim_behind, hand_off_behind) = measure().await;
        assert!(
            claim_behind < claim_alone * 2,
            "a claim took {claim_behind} steps behind 5,000 jobs scheduled for later, \
             {claim_alone} without them"
        );
        assert!(
            hand_off_behind < hand_off_alone * 2,
            "a hand-off took {hand_off_behind} steps behind 5,000 jobs scheduled for later, \
             {hand_off_alone} without them"
        );
    }

    /// A claim weighs the best of a queue's due jobs up to its batch, as
    /// PostgreSQL's does, however many priority levels they span: of a
    /// half-open kind's two jobs it takes the probe, and the job of another
    /// kind one level down waits for the next claim, as on PostgreSQL (the
    /// skip scan, weighing a batch per level, took it too).
    #[tokio::test]
    async fn a_claim_weighs_a_batch_per_queue_across_levels() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        sqlx::query(
            "INSERT INTO breakers (tenant, queue, kind, failures, max_retry_after_ms,
                                   open_until, probe_job, updated_at)
             VALUES ('default', 'q', 'x', 5, 0, 0, NULL, 0)",
        )
        .execute(&store.writer)
        .await
        .expect("a half-open breaker for kind x");
        let job = |kind: &str, priority: i32| {
            let mut job = new_job();
            job.kind = kind.into();
            job.priority = priority;
            job
        };
        let ids: Vec<Uuid> = store
            .submit("default", vec![job("x", 10), job("x", 10), job("y", 5)])
            .await
            .expect("submit")
            .into_iter()
            .map(|s| s.expect("stored").job.id)
            .collect();
        let leased = store
            .lease("default", &[crate::domain::fixtures::lease_spec("w", 2)])
            .await
            .expect("lease");
        let leased: Vec<Uuid> = leased.concat().iter().map(|j| j.id).collect();
        assert_eq!(leased, [ids[0]], "the probe alone");
    }

    #[tokio::test]
    async fn only_the_intervals_pass_deletes() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        crate::store::only_the_intervals_pass_deletes(&store).await;
    }

    /// As on PostgreSQL (`a_mended_row_set_aside_by_the_reaper_is_let_back_in`):
    /// an unreadable expired lease is set aside by the reaper, stays aside
    /// while a second look finds it still broken, and once mended is let
    /// back in and reclaimed.
    #[tokio::test]
    async fn a_mended_row_set_aside_by_the_reaper_is_let_back_in() {
        let dir = tempfile::tempdir().expect("dir");
        let (store, _) = scratch_store(&dir).await;
        let id = crate::store::a_briefly_leased_job(&store).await.to_string();
        let set_labels = |labels: &'static str| {
            sqlx::query("UPDATE jobs SET labels = ?1 WHERE id = ?2")
                .bind(labels)
                .bind(id.clone())
        };
        set_labels("[1]")
            .execute(&store.writer)
            .await
            .expect("break the row");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let reaped = store
            .reap(10, Some(Duration::from_secs(3600)))
            .await
            .expect("reap");
        assert_eq!(reaped.expired_leases, 0);
        assert_eq!(store.unreadable.set_aside(), std::slice::from_ref(&id));
        let keys = store
            .unreadable
            .due_again()
            .expect("the first look is due at once");
        store.recheck_unreadable(&keys).await;
        assert_eq!(
            store.unreadable.set_aside(),
            std::slice::from_ref(&id),
            "still broken"
        );
        set_labels("{}")
            .execute(&store.writer)
            .await
            .expect("mend the row");
        store.recheck_unreadable(&keys).await;
        assert!(store.unreadable.set_aside().is_empty(), "mended");
        let reaped = store
            .reap(10, Some(Duration::from_secs(3600)))
            .await
            .expect("reap");
        assert_eq!(reaped.expired_leases, 1, "reclaimed once mended");
    }
}
