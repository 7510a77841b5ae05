//! Job counts on PostgreSQL without counting the jobs table.
//!
//! Triggers (migration 0008) append every statement's net change per
//! tenant, queue and state to `job_count_deltas`; here a reader folds them
//! into `job_counts` and reads the sum of both. The age of a queue's oldest
//! due job comes from the claim index, one probe per priority level. A
//! reading therefore costs the same with a million queued jobs as with a
//! thousand: it touches a row per queue and state, and the deltas written
//! since the last fold.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::Row;

use super::StoreResult;
use super::pg_hot::HotPool;
use crate::domain::JobState;

/// Key of the advisory lock that lets one fold run at a time across
/// replicas ("intray" in ASCII, then 1); the others read without folding.
const FOLD_LOCK: i64 = 0x696e_7472_6179_0001;

/// How often a replica vacuums the deltas it folded away and drops the
/// counts that fell to zero.
const VACUUM_EVERY: Duration = Duration::from_secs(10);

/// Reads the counts; one per store.
#[derive(Debug)]
pub struct Counts {
    pool: PgPool,
    /// The store's connections with the claim's planner settings.
    planned: Arc<HotPool>,
    vacuumed: Mutex<Option<Instant>>,
}

/// One count: jobs of `tenant`'s `queue` in `state`.
#[derive(Debug)]
pub struct Count {
    /// The tenant.
    pub tenant: String,
    /// The queue.
    pub queue: String,
    /// The state, as stored.
    pub state: String,
    /// How many jobs.
    pub n: u64,
}

impl Counts {
    /// Counts on `pool`'s database; `planned` runs the claim-index probes.
    pub fn new(pool: PgPool, planned: Arc<HotPool>) -> Self {
        Counts {
            pool,
            planned,
            vacuumed: Mutex::new(None),
        }
    }

    /// Moves the pending deltas into `job_counts`, unless another fold
    /// runs. The move is one statement, so a reader sees each change
    /// exactly once: in the deltas before the commit, in the counts after.
    async fn fold(&self) -> StoreResult<()> {
        let folded: bool = sqlx::query_scalar(
            "WITH turn AS (
                SELECT pg_try_advisory_xact_lock($1) AS ours
             ), moved AS (
                DELETE FROM job_count_deltas WHERE (SELECT ours FROM turn)
                RETURNING tenant, queue, state, n
             ), added AS (
                INSERT INTO job_counts (tenant, queue, state, n)
                SELECT tenant, queue, state, sum(n) FROM moved GROUP BY tenant, queue, state
                ON CONFLICT (tenant, queue, state) DO UPDATE SET n = job_counts.n + EXCLUDED.n
             )
             SELECT ours FROM turn",
        )
        .bind(FOLD_LOCK)
        .fetch_one(&self.pool)
        .await?;
        if folded && self.vacuum_due() {
            // Queues come and go (a queue per customer, say): their zero
            // counts would pile up. Only a fold writes job_counts, so
            // under the folders' lock a zero stays zero until deleted.
            sqlx::query(
                "WITH turn AS (SELECT pg_try_advisory_xact_lock($1) AS ours)
                 DELETE FROM job_counts WHERE n = 0 AND (SELECT ours FROM turn)",
            )
            .bind(FOLD_LOCK)
            .execute(&self.pool)
            .await?;
            // Deleted deltas are dead rows that only vacuum clears, and
            // autovacuum may be off or slow: the table would grow and
            // every fold would scan the dead pages. Another replica's
            // vacuum running is as good (SKIP_LOCKED).
            sqlx::raw_sql("VACUUM (SKIP_LOCKED) job_count_deltas")
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    fn vacuum_due(&self) -> bool {
        let mut vacuumed = self.vacuumed.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if vacuumed.is_some_and(|at| now.duration_since(at) < VACUUM_EVERY) {
            return false;
        }
        *vacuumed = Some(now);
        true
    }

    /// The non-zero counts, of one tenant and queue when given.
    pub async fn read(&self, tenant: Option<&str>, queue: Option<&str>) -> StoreResult<Vec<Count>> {
        self.fold().await?;
        let rows = sqlx::query(
            "SELECT tenant, queue, state, sum(n)::int8 AS n FROM (
                SELECT tenant, queue, state, n FROM job_counts
                UNION ALL
                SELECT tenant, queue, state, n FROM job_count_deltas
             ) c
             WHERE ($1::text IS NULL OR tenant = $1) AND ($2::text IS NULL OR queue = $2)
             GROUP BY tenant, queue, state
             HAVING sum(n) > 0",
        )
        .bind(tenant)
        .bind(queue)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let n: i64 = row.try_get("n")?;
                Ok(Count {
                    tenant: row.try_get("tenant")?,
                    queue: row.try_get("queue")?,
                    state: row.try_get("state")?,
                    n: u64::try_from(n).unwrap_or(0),
                })
            })
            .collect()
    }

    /// How long the oldest due queued job has waited, for each queue with
    /// queued jobs in `counts` (a [`Counts::read`]); queues with nothing
    /// due are left out.
    ///
    /// `min(run_at)` over the queued rows would read every one of them. The
    /// claim index orders each priority level by `run_at`, so the oldest job of
    /// a queue is the oldest of the first jobs of its levels, and the levels
    /// are found by skipping from one to the next.
    pub async fn oldest_due(
        &self,
        counts: &[Count],
    ) -> StoreResult<Vec<(String, String, Duration)>> {
        let (tenants, names): (Vec<&str>, Vec<&str>) = counts
            .iter()
            .filter(|c| c.state == JobState::Queued.as_str())
            .map(|c| (c.tenant.as_str(), c.queue.as_str()))
            .unzip();
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        let query = sqlx::query(
            "SELECT c.tenant, c.queue, (EXTRACT(EPOCH FROM now() - o.oldest) * 1000)::int8 AS age_ms
             FROM unnest($1::text[], $2::text[]) AS c(tenant, queue)
             CROSS JOIN LATERAL (
                WITH RECURSIVE levels(priority) AS (
                    SELECT (SELECT priority FROM jobs
                            WHERE tenant = c.tenant AND queue = c.queue AND state = 'queued'
                            ORDER BY priority DESC LIMIT 1)
                    UNION ALL
                    SELECT (SELECT j.priority FROM jobs j
                            WHERE j.tenant = c.tenant AND j.queue = c.queue
                              AND j.state = 'queued' AND j.priority < l.priority
                            ORDER BY j.priority DESC LIMIT 1)
                    FROM levels l WHERE l.priority IS NOT NULL
                )
                SELECT min((SELECT q.run_at FROM jobs q
                            WHERE q.tenant = c.tenant AND q.queue = c.queue
                              AND q.state = 'queued' AND q.priority = l.priority
                            ORDER BY q.run_at LIMIT 1)) AS oldest
                FROM levels l WHERE l.priority IS NOT NULL
             ) o
             WHERE o.oldest <= now()",
        )
        .bind(&tenants)
        .bind(&names);
        // Statistics can be stale enough for a plan that sorts every queued
        // job of the queue (a second at a million) instead of reading the
        // claim index in order: the claim's settings, those of the `planned`
        // pool's sessions, rule that out.
        let mut conn = self.planned.acquire().await?;
        let rows = query.fetch_all(&mut *conn).await?;
        conn.finish();
        rows.iter()
            .map(|row| {
                let age: i64 = row.try_get("age_ms")?;
                Ok((
                    row.try_get("tenant")?,
                    row.try_get("queue")?,
                    Duration::from_millis(u64::try_from(age).unwrap_or(0)),
                ))
            })
            .collect()
    }
}
