//! The PostgreSQL store: several stateless replicas share one database.
//!
//! Claims use `FOR UPDATE SKIP LOCKED`; decisions that need the time use the
//! database's `now()`, so replicas with skewed clocks agree. Other replicas
//! learn about changes through one `NOTIFY` per transaction on [`CHANNEL`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::changes::{CHANNEL, Changes, wake_from_payload};
use super::{
    Ended, QueueDepth, QueueStatsBuilder, Reaped, Retried, RunningCaps, Stats, Store, StoreError,
    StoreResult, Submitted,
};
use crate::config::Settings;
use crate::domain::breaker::{self, Breaker, BreakerChange, BreakerPolicy};
use crate::domain::transition::{self, TransitionError};
use crate::domain::{
    Backoff, CompleteSpec, EventType, HeartbeatAck, HeartbeatSpec, Job, JobError, JobEvent,
    JobState, LeaseSpec, ListFilter, NewJob, RetryFilter, WorkerSeen,
};
use crate::engine::notifier::Notifier;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// Applies the PostgreSQL migrations.
pub async fn migrate(url: &str) -> StoreResult<()> {
    let pool = PgPoolOptions::new().max_connections(1).connect(url).await?;
    MIGRATOR.run(&pool).await?;
    pool.close().await;
    Ok(())
}

/// The PostgreSQL implementation of [`Store`].
pub struct PgStore {
    pool: PgPool,
    notifier: Arc<Notifier>,
    caps: RunningCaps,
    breaker: BreakerPolicy,
    /// Stops the LISTEN task when the store is dropped.
    listener_stop: CancellationToken,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.listener_stop.cancel();
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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

/// Writes a job after a domain transition together with its event, in one
/// statement. The `event_seq` guard turns a lost update into an error rather
/// than a silent overwrite (the row lock makes it unreachable in practice).
async fn save(conn: &mut PgConnection, job: &Job, event: &JobEvent) -> StoreResult<()> {
    let previous_seq = i64::try_from(event.sequence - 1).map_err(|_| corrupt("event_seq"))?;
    let done = sqlx::query(
        "WITH upd AS (
            UPDATE jobs SET state = $2, result = $3, error_class = $4, error_message = $5,
                attempt = $6, progress = $7, cancel_requested = $8, cancel_requested_at = $9,
                cost_cents = $10, lease_owner = $11, lease_token = $12, lease_expires_at = $13,
                run_at = $14, deadline = $15, updated_at = $16, finished_at = $17, event_seq = $18
            WHERE id = $1 AND event_seq = $19
            RETURNING id
         )
         INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at, detail)
         SELECT id, $18, $20, $2, $6, $21, $16, $22 FROM upd",
    )
    .bind(job.id)
    .bind(job.state.as_str())
    .bind(job.result.as_ref().map(Json))
    .bind(job.error.as_ref().map(|e| e.class.as_str()))
    .bind(job.error.as_ref().map(|e| e.message.as_str()))
    .bind(i32::try_from(job.attempt).map_err(|_| corrupt("attempt"))?)
    .bind(job.progress)
    .bind(job.cancel_requested)
    .bind(job.cancel_requested_at)
    .bind(job.cost_cents)
    .bind(job.lease_owner.as_deref())
    .bind(job.lease_token.as_deref())
    .bind(job.lease_expires_at)
    .bind(job.run_at)
    .bind(job.deadline)
    .bind(job.updated_at)
    .bind(job.finished_at)
    .bind(previous_seq + 1)
    .bind(previous_seq)
    .bind(event.kind.as_str())
    .bind(event.worker_id.as_deref())
    .bind(event.detail.as_ref().map(Json))
    .execute(&mut *conn)
    .await?;
    if done.rows_affected() != 1 {
        return Err(StoreError::Internal("job changed concurrently".into()));
    }
    Ok(())
}

/// Sends one NOTIFY for the whole transaction (delivered at commit).
async fn notify(conn: &mut PgConnection, changes: &Changes) -> StoreResult<()> {
    if changes.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(changes.payload())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

impl PgStore {
    /// Connects, migrates and starts listening for other replicas' changes.
    pub async fn open(settings: &Settings, notifier: Arc<Notifier>) -> StoreResult<PgStore> {
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&settings.database_url)
            .await?;
        MIGRATOR.run(&pool).await?;
        let listener_stop = CancellationToken::new();
        let mut listener = PgListener::connect_with(&pool).await?;
        listener.listen(CHANNEL).await?;
        tokio::spawn(listen(
            listener,
            Arc::clone(&notifier),
            listener_stop.clone(),
        ));
        Ok(PgStore {
            pool,
            notifier,
            caps: RunningCaps::from_settings(settings),
            breaker: settings.breaker.clone(),
            listener_stop,
        })
    }

    /// Counts an attempt's outcome against its queue and kind's breaker, in
    /// the caller's transaction. A success touches nothing when the breaker
    /// has no row (the common case): one primary-key read.
    async fn update_breaker(
        &self,
        conn: &mut PgConnection,
        job: &Job,
        failure: Option<&(String, Option<Duration>)>,
        now: DateTime<Utc>,
    ) -> StoreResult<()> {
        if self.breaker.threshold == 0 {
            return Ok(());
        }
        let row = sqlx::query(
            "SELECT failures, max_retry_after_ms, open_until, probe_job FROM breakers
             WHERE tenant = $1 AND queue = $2 AND kind = $3 FOR UPDATE",
        )
        .bind(&job.tenant)
        .bind(&job.queue)
        .bind(&job.kind)
        .fetch_optional(&mut *conn)
        .await?;
        let current = row
            .map(|row| -> StoreResult<Breaker> {
                Ok(Breaker {
                    failures: to_u32(row.try_get("failures")?, "failures")?,
                    max_retry_after: Duration::from_millis(to_u64(
                        row.try_get("max_retry_after_ms")?,
                        "max_retry_after_ms",
                    )?),
                    open_until: row.try_get("open_until")?,
                    probe_job: row.try_get("probe_job")?,
                })
            })
            .transpose()?;
        let failure = failure.map(|(class, retry_after)| (class.as_str(), *retry_after));
        match breaker::on_outcome(current.as_ref(), failure, job.id, now, &self.breaker) {
            BreakerChange::Unchanged => {}
            BreakerChange::Reset => {
                sqlx::query("DELETE FROM breakers WHERE tenant = $1 AND queue = $2 AND kind = $3")
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
                     VALUES ($1, $2, $3, $4, $5, $6, $7, now())
                     ON CONFLICT (tenant, queue, kind) DO UPDATE SET failures = EXCLUDED.failures,
                        max_retry_after_ms = EXCLUDED.max_retry_after_ms,
                        open_until = EXCLUDED.open_until, probe_job = EXCLUDED.probe_job,
                        updated_at = now()",
                )
                .bind(&job.tenant)
                .bind(&job.queue)
                .bind(&job.kind)
                .bind(i32::try_from(breaker.failures).unwrap_or(i32::MAX))
                .bind(millis(breaker.max_retry_after))
                .bind(breaker.open_until)
                .bind(breaker.probe_job)
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

    /// Runs `apply` on the locked job and saves what it decided, in one
    /// transaction; `Ok(None)` from `apply` means "nothing to write".
    async fn transition<F>(&self, tenant: &str, id: Uuid, apply: F) -> StoreResult<Job>
    where
        F: FnOnce(&mut Job, DateTime<Utc>) -> Result<Option<JobEvent>, TransitionError> + Send,
    {
        let mut tx = self.pool.begin().await?;
        let (mut job, now) = load_for_update(&mut tx, tenant, id).await?;
        let mut changes = Changes::default();
        if let Some(event) = apply(&mut job, now)? {
            save(&mut tx, &job, &event).await?;
            changes.job(&job);
            notify(&mut tx, &changes).await?;
        }
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(job)
    }

    async fn submit_one(
        &self,
        conn: &mut PgConnection,
        tenant: &str,
        new: NewJob,
    ) -> StoreResult<StoreResult<Submitted>> {
        let inserted = sqlx::query(
            "WITH ins AS (
                INSERT INTO jobs (id, tenant, queue, kind, state, payload, max_attempts, priority,
                    idempotency_key, input_hash, labels, run_at, deadline, backoff_initial_ms,
                    backoff_max_ms, callback_url, max_cost_cents, created_at, updated_at, event_seq,
                    trace_parent)
                VALUES ($1, $2, $3, $4, 'queued', $5, $6, $7, $8, $9, $10, COALESCE($11, now()), $12,
                    $13, $14, $15, $16, now(), now(), 1, $17)
                ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                RETURNING *
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, at)
                SELECT id, 1, 'submitted', 'queued', 0, created_at FROM ins
             )
             SELECT * FROM ins",
        )
        .bind(Uuid::now_v7())
        .bind(tenant)
        .bind(&new.queue)
        .bind(&new.kind)
        .bind(Json(&new.payload))
        .bind(i32::try_from(new.max_attempts).map_err(|_| corrupt("max_attempts"))?)
        .bind(new.priority)
        .bind(new.idempotency_key.as_deref())
        .bind(&new.input_hash)
        .bind(Json(&new.labels))
        .bind(new.run_at)
        .bind(new.deadline)
        .bind(millis(new.backoff.initial()))
        .bind(millis(new.backoff.max()))
        .bind(new.callback_url.as_deref())
        .bind(new.max_cost_cents)
        .bind(new.trace_parent.as_deref())
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(row) = inserted {
            return Ok(Ok(Submitted {
                job: job_from_row(&row)?,
                created: true,
            }));
        }
        // The key exists (possibly committed by a concurrent submit we waited for).
        let row = sqlx::query("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
            .bind(tenant)
            .bind(new.idempotency_key.as_deref())
            .fetch_one(&mut *conn)
            .await?;
        let job = job_from_row(&row)?;
        if job.input_hash != new.input_hash {
            return Ok(Err(StoreError::IdempotencyConflict));
        }
        Ok(Ok(Submitted {
            job,
            created: false,
        }))
    }
}

/// Forwards other replicas' NOTIFY payloads to the local notifier until
/// `stop` fires. On a lost connection everything is woken, since messages
/// may have been missed meanwhile; `PgListener` reconnects on the next `recv`.
async fn listen(mut listener: PgListener, notifier: Arc<Notifier>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            received = listener.recv() => match received {
                Ok(note) => wake_from_payload(note.payload(), &notifier),
                Err(err) => {
                    tracing::warn!(error = %err, "notification listener lost its connection; retrying");
                    wake_from_payload("*", &notifier);
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Store for PgStore {
    #[tracing::instrument(name = "store.submit", skip_all, fields(count = jobs.len()))]
    async fn submit(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        let mut tx = self.pool.begin().await?;
        let mut results = Vec::with_capacity(jobs.len());
        let mut changes = Changes::default();
        for new in jobs {
            let result = self.submit_one(&mut tx, tenant, new).await?;
            if let Ok(submitted) = &result
                && submitted.created
            {
                changes.submitted(&submitted.job);
            }
            results.push(result);
        }
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(results)
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
        let rows = sqlx::query(
            "SELECT * FROM jobs
             WHERE tenant = $1
               AND ($2::uuid IS NULL OR id < $2)
               AND ($3::text IS NULL OR queue = $3)
               AND ($4::text IS NULL OR kind = $4)
               AND (cardinality($5::text[]) = 0 OR state = ANY($5))
               AND ($6::text IS NULL OR error_class = $6)
               AND labels @> $7
             ORDER BY id DESC
             LIMIT $8",
        )
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

    #[tracing::instrument(name = "store.retry_matching", skip_all, fields(dry_run))]
    async fn retry_matching(
        &self,
        tenant: &str,
        filter: &RetryFilter,
        dry_run: bool,
    ) -> StoreResult<Retried> {
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let mut tx = self.pool.begin().await?;
        let matched: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs
             WHERE tenant = $1 AND state = ANY($2)
               AND ($3::text IS NULL OR queue = $3)
               AND ($4::text IS NULL OR kind = $4)
               AND ($5::text IS NULL OR error_class = $5)",
        )
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
        let rows = sqlx::query(
            "SELECT *, now() AS db_now FROM jobs
             WHERE tenant = $1 AND state = ANY($2)
               AND ($3::text IS NULL OR queue = $3)
               AND ($4::text IS NULL OR kind = $4)
               AND ($5::text IS NULL OR error_class = $5)
             ORDER BY id
             LIMIT $6
             FOR UPDATE SKIP LOCKED",
        )
        .bind(tenant)
        .bind(&states)
        .bind(filter.queue.as_deref())
        .bind(filter.kind.as_deref())
        .bind(filter.error_class.as_deref())
        .bind(i64::from(filter.limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut changes = Changes::default();
        let mut retried = Vec::with_capacity(rows.len());
        for row in &rows {
            let mut job = job_from_row(row)?;
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let event = transition::replay(&mut job, now)?;
            save(&mut tx, &job, &event).await?;
            changes.job(&job);
            retried.push(job.id);
        }
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(Retried { retried, matched })
    }

    #[tracing::instrument(name = "store.stats", skip_all)]
    async fn stats(
        &self,
        tenant: &str,
        queue: Option<&str>,
        workers_since: Duration,
    ) -> StoreResult<Stats> {
        let counts = sqlx::query(
            "SELECT queue, state, count(*) AS n FROM jobs
             WHERE tenant = $1 AND ($2::text IS NULL OR queue = $2)
             GROUP BY queue, state",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;
        let oldest = sqlx::query(
            "SELECT queue, (EXTRACT(EPOCH FROM now() - min(run_at)) * 1000)::bigint AS age_ms FROM jobs
             WHERE tenant = $1 AND ($2::text IS NULL OR queue = $2) AND state = 'queued' AND run_at <= now()
             GROUP BY queue",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;
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
            "SELECT queue, kind, failures, max_retry_after_ms, open_until, probe_job FROM breakers
             WHERE tenant = $1 AND ($2::text IS NULL OR queue = $2) ORDER BY queue, kind",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;
        for row in &breakers {
            let queue: String = row.try_get("queue")?;
            let breaker = Breaker {
                failures: to_u32(row.try_get("failures")?, "failures")?,
                max_retry_after: Duration::from_millis(to_u64(
                    row.try_get("max_retry_after_ms")?,
                    "max_retry_after_ms",
                )?),
                open_until: row.try_get("open_until")?,
                probe_job: row.try_get("probe_job")?,
            };
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

    #[tracing::instrument(name = "store.lease", skip_all, fields(worker_id = %spec.worker_id, max_jobs = spec.max_jobs))]
    async fn lease(&self, tenant: &str, spec: &LeaseSpec) -> StoreResult<Vec<Job>> {
        let mut tx = self.pool.begin().await?;
        let only_tenant = (!spec.all_tenants).then_some(tenant);
        // Tenants: the caller's, or every tenant with queued jobs, found by a
        // skip scan over the claim index (one probe per tenant). Per tenant
        // and queue the claim index gives the best candidates in order. Each
        // candidate's load is its tenant's running jobs plus its rank, so
        // tenants far below their share go first and interleave; within a
        // tenant that is priority order. A candidate that would lift its
        // tenant above the queue's cap is skipped. A lease never outlives
        // the deadline.
        let rows = sqlx::query(
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
                SELECT tenant, queue, count(*) AS n FROM jobs
                WHERE state = 'running' AND ($1::text IS NULL OR tenant = $1)
                GROUP BY tenant, queue
             ), candidates AS (
                SELECT c.id, c.priority, c.run_at, c.kind, c.half_open,
                    t.tenant || '/' || q.name AS tenant_load_key,
                    COALESCE((SELECT sum(r.n) FROM running r WHERE r.tenant = t.tenant), 0)
                      + row_number() OVER (PARTITION BY t.tenant
                                           ORDER BY c.priority DESC, c.run_at, c.id) AS tenant_load,
                    COALESCE((SELECT r.n FROM running r WHERE r.tenant = t.tenant AND r.queue = q.name), 0)
                      + row_number() OVER (PARTITION BY t.tenant, q.name
                                           ORDER BY c.priority DESC, c.run_at, c.id) AS queue_load,
                    COALESCE((SELECT o.cap FROM unnest($7::text[], $8::bigint[]) AS o(queue, cap)
                              WHERE o.queue = q.name), $9) AS cap
                FROM tenants t
                CROSS JOIN unnest($2::text[]) AS q(name)
                CROSS JOIN LATERAL (
                    SELECT id, priority, run_at, kind,
                        EXISTS (SELECT 1 FROM breakers b
                                WHERE b.tenant = t.tenant AND b.queue = q.name AND b.kind = jobs.kind
                                  AND b.open_until IS NOT NULL) AS half_open
                    FROM jobs
                    WHERE tenant = t.tenant AND queue = q.name AND state = 'queued' AND run_at <= now()
                      AND (cardinality($3::text[]) = 0 OR kind = ANY($3))
                      AND (deadline IS NULL OR deadline > now())
                      AND NOT EXISTS (
                          SELECT 1 FROM breakers b
                          WHERE b.tenant = t.tenant AND b.queue = q.name AND b.kind = jobs.kind
                            AND (b.open_until > now()
                                 OR EXISTS (SELECT 1 FROM jobs p
                                            WHERE p.id = b.probe_job AND p.state = 'running'))
                      )
                    ORDER BY priority DESC, run_at, id
                    LIMIT $4
                    FOR UPDATE SKIP LOCKED
                ) c
                WHERE NOT EXISTS (
                    SELECT 1 FROM paused_queues p WHERE p.tenant = t.tenant AND p.queue = q.name
                )
             ), picked AS (
                SELECT id FROM (
                    SELECT *, row_number() OVER (PARTITION BY tenant_load_key, kind
                                                 ORDER BY priority DESC, run_at, id) AS kind_rank
                    FROM candidates
                ) ranked
                WHERE queue_load <= cap AND (NOT half_open OR kind_rank = 1)
                ORDER BY tenant_load, priority DESC, run_at, id
                LIMIT $4
             ), upd AS (
                UPDATE jobs j SET state = 'running', attempt = j.attempt + 1, lease_owner = $5,
                    lease_token = gen_random_uuid()::text,
                    lease_expires_at = LEAST(now() + $6 * interval '1 millisecond',
                                             COALESCE(j.deadline, 'infinity'::timestamptz)),
                    started_at = COALESCE(j.started_at, now()),
                    leased_at = now(),
                    updated_at = GREATEST(j.updated_at, now()),
                    progress = 0,
                    event_seq = j.event_seq + 1
                FROM picked WHERE j.id = picked.id
                RETURNING j.*
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at)
                SELECT id, event_seq, 'leased', 'running', attempt, lease_owner, updated_at FROM upd
             ), probes AS (
                -- A job leased from a half-open breaker is its probe.
                UPDATE breakers b SET probe_job = u.id, updated_at = now()
                FROM upd u
                WHERE b.tenant = u.tenant AND b.queue = u.queue AND b.kind = u.kind
                  AND b.open_until <= now()
                  AND (b.probe_job IS NULL
                       OR NOT EXISTS (SELECT 1 FROM jobs p WHERE p.id = b.probe_job AND p.state = 'running'))
             )
             SELECT * FROM upd",
        )
        .bind(only_tenant)
        .bind(&spec.queues)
        .bind(&spec.kinds)
        .bind(i64::from(spec.max_jobs))
        .bind(&spec.worker_id)
        .bind(millis(spec.lease_duration))
        .bind(&self.caps.queues)
        .bind(&self.caps.caps)
        .bind(self.caps.default)
        .fetch_all(&mut *tx)
        .await?;
        let mut jobs = rows
            .iter()
            .map(job_from_row)
            .collect::<StoreResult<Vec<_>>>()?;
        jobs.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then(a.run_at.cmp(&b.run_at))
                .then(a.id.cmp(&b.id))
        });
        let mut changes = Changes::default();
        for job in &jobs {
            changes.job(job);
        }
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(jobs)
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
                        ELSE LEAST(now() + $4 * interval '1 millisecond',
                                   COALESCE(deadline, 'infinity'::timestamptz)) END,
                    progress = COALESCE($5, progress),
                    updated_at = GREATEST(updated_at, now()),
                    event_seq = event_seq + CASE WHEN $7 THEN 1 ELSE 0 END
                WHERE id = $1 AND tenant = $2 AND lease_token = $3 AND state = 'running'
                RETURNING id, event_seq, attempt, lease_owner, lease_expires_at, cancel_requested, progress, updated_at
             ), ev AS (
                INSERT INTO job_events (job_id, sequence, type, state, attempt, worker_id, at, detail)
                SELECT id, event_seq, 'progress', 'running', attempt, lease_owner, updated_at,
                       jsonb_strip_nulls(jsonb_build_object('progress', progress, 'message', $6::text))
                FROM upd WHERE $7
             )
             SELECT lease_expires_at, cancel_requested FROM upd",
        )
        .bind(spec.job_id)
        .bind(tenant)
        .bind(&spec.lease_token)
        .bind(millis(spec.extend_by))
        .bind(spec.progress)
        .bind(spec.message.as_deref())
        .bind(with_event)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => {
                if with_event {
                    self.notifier.job_changed(spec.job_id);
                }
                Ok(HeartbeatAck {
                    lease_expires_at: row.try_get("lease_expires_at")?,
                    cancel_requested: row.try_get("cancel_requested")?,
                })
            }
            None => {
                self.get(tenant, spec.job_id).await?;
                Err(StoreError::LeaseLost)
            }
        }
    }

    #[tracing::instrument(name = "store.complete", skip_all, fields(count = items.len()))]
    async fn complete(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>> {
        let mut tx = self.pool.begin().await?;
        let mut changes = Changes::default();
        let mut results = Vec::with_capacity(items.len());
        for item in items {
            let (mut job, now) = match load_for_update(&mut tx, tenant, item.job_id).await {
                Ok(loaded) => loaded,
                Err(StoreError::NotFound) => {
                    results.push(Err(StoreError::NotFound));
                    continue;
                }
                Err(other) => return Err(other),
            };
            let jitter = rand::random::<f64>();
            let attempt = job.running_attempt();
            let failure = breaker::failure_of(&item.outcome);
            match transition::complete(
                &mut job,
                &item.lease_token,
                item.outcome,
                item.cost_cents,
                now,
                jitter,
            ) {
                Ok(event) => {
                    save(&mut tx, &job, &event).await?;
                    self.update_breaker(&mut tx, &job, failure.as_ref(), now)
                        .await?;
                    changes.job(&job);
                    // A successful complete always ended a running attempt.
                    results.push(
                        Ended::new(attempt, job, event)
                            .ok_or_else(|| StoreError::Internal("no running attempt".into())),
                    );
                }
                Err(err) => results.push(Err(err.into())),
            }
        }
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(results)
    }

    #[tracing::instrument(name = "store.reap", skip_all)]
    async fn reap(&self, batch: u32, retention: Duration) -> StoreResult<Reaped> {
        let mut tx = self.pool.begin().await?;
        let expired_leases = sqlx::query(
            "SELECT *, now() AS db_now FROM jobs
             WHERE state = 'running' AND lease_expires_at <= now()
             ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        let past_deadline = sqlx::query(
            "SELECT *, now() AS db_now FROM jobs
             WHERE state = 'queued' AND deadline <= now()
             ORDER BY deadline LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        let mut changes = Changes::default();
        let mut ended = Vec::with_capacity(expired_leases.len());
        for row in &expired_leases {
            let mut job = job_from_row(row)?;
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let attempt = job.running_attempt();
            let event = transition::lease_expired(&mut job, now);
            save(&mut tx, &job, &event).await?;
            changes.job(&job);
            ended.extend(Ended::new(attempt, job, event));
        }
        let mut expired = Vec::with_capacity(past_deadline.len());
        for row in &past_deadline {
            let mut job = job_from_row(row)?;
            let now: DateTime<Utc> = row.try_get("db_now")?;
            let event = transition::deadline_passed(&mut job, now);
            save(&mut tx, &job, &event).await?;
            changes.job(&job);
            expired.push(event);
        }
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        // Separate, small statement: deleting history must not hold the
        // reaper's row locks longer, nor block claims (it only touches
        // finished rows, which no claim reads).
        let deleted = sqlx::query(
            "DELETE FROM jobs WHERE id IN (
                SELECT id FROM jobs
                WHERE state IN ('succeeded', 'failed', 'cancelled', 'expired')
                  AND finished_at < now() - $1 * interval '1 millisecond'
                ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED
             )",
        )
        .bind(millis(retention))
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(Reaped {
            expired_leases: expired_leases.len() as u64,
            expired_deadlines: past_deadline.len() as u64,
            deleted,
            ended,
            expired,
        })
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
        notify(&mut tx, &changes).await?;
        tx.commit().await?;
        changes.wake(&self.notifier);
        Ok(())
    }

    #[tracing::instrument(name = "store.queued_count", skip_all, fields(queue))]
    async fn queued_count(&self, tenant: &str, queue: &str) -> StoreResult<u64> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE tenant = $1 AND queue = $2 AND state = 'queued'",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_one(&self.pool)
        .await?;
        to_u64(n, "count")
    }

    #[tracing::instrument(name = "store.queue_depths", skip_all)]
    async fn queue_depths(&self) -> StoreResult<Vec<QueueDepth>> {
        let counts = sqlx::query(
            "SELECT tenant, queue, state, count(*) AS n FROM jobs GROUP BY tenant, queue, state",
        )
        .fetch_all(&self.pool)
        .await?;
        let oldest = sqlx::query(
            "SELECT tenant, queue, (EXTRACT(EPOCH FROM now() - min(run_at)) * 1000)::bigint AS age_ms
             FROM jobs WHERE state = 'queued' AND run_at <= now() GROUP BY tenant, queue",
        )
        .fetch_all(&self.pool)
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
}
