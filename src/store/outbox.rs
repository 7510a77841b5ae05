//! The webhook outbox: delivery rows of completion callbacks.
//!
//! Rows are written by a database trigger on the update that makes a job
//! with a callback terminal (migrations `0006_webhooks.sql` on PostgreSQL,
//! `0005_webhooks.sql` on SQLite), so they commit with the transition; this
//! module only claims, records and lists them, and sweeps up terminal jobs
//! that have none (jobs finished before the migration).

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use uuid::Uuid;

use super::{StoreError, StoreResult};

/// Where a delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryStatus {
    /// Not yet accepted by the receiver; retried when due.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Given up after the retry window (or no secret to sign with).
    Failed,
}

impl DeliveryStatus {
    /// The column value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }

    fn parse(s: &str) -> StoreResult<DeliveryStatus> {
        match s {
            "pending" => Ok(DeliveryStatus::Pending),
            "delivered" => Ok(DeliveryStatus::Delivered),
            "failed" => Ok(DeliveryStatus::Failed),
            _ => Err(StoreError::Internal(
                "corrupt value in column status".into(),
            )),
        }
    }
}

/// One callback of one terminal event.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// `webhook-id`: the same for every attempt of this event.
    pub webhook_id: String,
    pub job_id: Uuid,
    pub tenant: String,
    /// Sequence of the terminal event.
    pub sequence: u64,
    /// Type of the terminal event (`succeeded`, ...).
    pub event_type: String,
    pub url: String,
    pub status: DeliveryStatus,
    /// Attempts made so far.
    pub attempts: u32,
    pub created_at: DateTime<Utc>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// HTTP status of the last attempt, when there was an answer.
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
}

/// A delivery taken by [`Outbox::claim_due`], until its hold runs out.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimed {
    pub delivery: Delivery,
    /// The URL's authority, lower-cased (`host:port`): the receiver whose
    /// attempts in flight [`ReceiverLoad`] counts.
    pub receiver: String,
    /// When the hold runs out: the row's next attempt as this claim set it,
    /// which a later claim (after the hold) changes. It names the claim, so
    /// that a record arriving after another replica took the row over is
    /// not written over that replica's.
    pub held_until: DateTime<Utc>,
}

/// What one attempt came to.
#[derive(Clone, Debug, PartialEq)]
pub enum Attempted {
    /// 2xx.
    Delivered { status: u16 },
    /// Try again after `delay`.
    Retry {
        status: Option<u16>,
        error: String,
        delay: Duration,
    },
    /// Give up.
    Failed { status: Option<u16>, error: String },
}

impl Attempted {
    fn columns(&self) -> (DeliveryStatus, Option<i32>, Option<&str>, i64) {
        match self {
            Attempted::Delivered { status } => {
                (DeliveryStatus::Delivered, Some(i32::from(*status)), None, 0)
            }
            Attempted::Retry {
                status,
                error,
                delay,
            } => (
                DeliveryStatus::Pending,
                status.map(i32::from),
                Some(error),
                i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
            ),
            Attempted::Failed { status, error } => (
                DeliveryStatus::Failed,
                status.map(i32::from),
                Some(error),
                0,
            ),
        }
    }
}

/// How many attempts one replica may have in flight at each receiver, and
/// how many it has: a claim takes no more for a receiver than it has room
/// for, so that a receiver that never answers cannot fill every slot.
#[derive(Clone, Copy, Debug)]
pub struct ReceiverLoad<'a> {
    /// Most attempts in flight at one receiver.
    pub per_receiver: u32,
    /// Attempts in flight now, by [`Claimed::receiver`].
    pub in_flight: &'a HashMap<String, u32>,
}

impl ReceiverLoad<'_> {
    /// The receivers with no room left.
    fn full(&self) -> Vec<&str> {
        self.in_flight
            .iter()
            .filter(|(_, n)| **n >= self.per_receiver)
            .map(|(r, _)| r.as_str())
            .collect()
    }
}

/// Candidate rows a claim looks at for `limit` deliveries: more than it
/// takes, so that one receiver's backlog does not hide the others' rows
/// from a claim (receivers already full are skipped before this).
fn scan_for(limit: u32) -> i64 {
    i64::from(limit).saturating_mul(4)
}

/// Access to the outbox. Claims are safe from several replicas at once.
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Takes up to `limit` due deliveries, oldest first and no more per
    /// receiver than `load` leaves room for, and pushes their next attempt
    /// `hold` ahead, so that a replica that dies while sending leaves them
    /// to be taken again after `hold` (never lost, perhaps sent twice).
    async fn claim_due(
        &self,
        limit: u32,
        hold: Duration,
        load: ReceiverLoad<'_>,
    ) -> StoreResult<Vec<Claimed>>;

    /// Records an attempt of `claimed`; `false` when the claim had lapsed
    /// and the row was claimed again (or recorded) meanwhile, which then
    /// stays as it is.
    async fn record(&self, claimed: &Claimed, attempt: &Attempted) -> StoreResult<bool>;

    /// Writes the missing delivery rows of jobs that finished within
    /// `window` with a callback and have none for their terminal event.
    async fn reconcile(&self, window: Duration, limit: u32) -> StoreResult<u64>;

    /// A job's deliveries, oldest event first.
    async fn list(&self, tenant: &str, job_id: Uuid) -> StoreResult<Vec<Delivery>>;
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn to_u64(v: i64, column: &str) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| StoreError::Internal(format!("corrupt value in column {column}")))
}

fn to_u32(v: i32, column: &str) -> StoreResult<u32> {
    u32::try_from(v).map_err(|_| StoreError::Internal(format!("corrupt value in column {column}")))
}

fn status_code(v: Option<i32>) -> Option<u16> {
    v.and_then(|v| u16::try_from(v).ok())
}

/// The outbox on PostgreSQL.
pub struct PgOutbox {
    pool: PgPool,
}

impl PgOutbox {
    /// An outbox on the store's pool.
    pub fn new(pool: PgPool) -> PgOutbox {
        PgOutbox { pool }
    }
}

/// A delivery's receiver in SQL: the URL's authority (`host:port`),
/// lower-cased; [`sqlite_receiver`] is SQLite's.
macro_rules! pg_receiver {
    () => {
        "coalesce(lower(substring(url from '^[^:/?#]*://([^/?#]*)')), '')"
    };
}

/// The columns of a [`Delivery`], as a literal for `concat!`.
macro_rules! columns {
    () => {
        "webhook_id, job_id, tenant, sequence, event_type, url, status, attempts, \
         created_at, last_attempt_at, last_status, last_error"
    };
}

fn pg_delivery(row: &PgRow) -> StoreResult<Delivery> {
    Ok(Delivery {
        webhook_id: row.try_get("webhook_id")?,
        job_id: row.try_get("job_id")?,
        tenant: row.try_get("tenant")?,
        sequence: to_u64(row.try_get("sequence")?, "sequence")?,
        event_type: row.try_get("event_type")?,
        url: row.try_get("url")?,
        status: DeliveryStatus::parse(row.try_get("status")?)?,
        attempts: to_u32(row.try_get("attempts")?, "attempts")?,
        created_at: row.try_get("created_at")?,
        last_attempt_at: row.try_get("last_attempt_at")?,
        last_status: status_code(row.try_get("last_status")?),
        last_error: row.try_get("last_error")?,
    })
}

#[async_trait]
impl Outbox for PgOutbox {
    async fn claim_due(
        &self,
        limit: u32,
        hold: Duration,
        load: ReceiverLoad<'_>,
    ) -> StoreResult<Vec<Claimed>> {
        let (busy, counts): (Vec<&str>, Vec<i64>) = load
            .in_flight
            .iter()
            .map(|(r, n)| (r.as_str(), i64::from(*n)))
            .unzip();
        // Candidates are locked, the chosen ones pushed forward; the rest
        // are unlocked at the commit, untouched.
        let rows = sqlx::query(concat!(
            "WITH candidates AS (
                 SELECT webhook_id, next_attempt_at, ",
            pg_receiver!(),
            " AS receiver
                 FROM webhook_deliveries
                 WHERE status = 'pending' AND next_attempt_at <= now()
                   AND ",
            pg_receiver!(),
            " <> ALL($3)
                 ORDER BY next_attempt_at LIMIT $4
                 FOR UPDATE SKIP LOCKED),
             chosen AS (
                 SELECT c.webhook_id, c.receiver
                 FROM (SELECT *, row_number() OVER (PARTITION BY receiver
                                                    ORDER BY next_attempt_at, webhook_id) AS nth
                       FROM candidates) c
                 LEFT JOIN unnest($5::text[], $6::int8[]) AS busy(receiver, n)
                        ON busy.receiver = c.receiver
                 WHERE c.nth + coalesce(busy.n, 0) <= $7
                 ORDER BY c.next_attempt_at LIMIT $1)
             UPDATE webhook_deliveries d
             SET next_attempt_at = now() + $2 * interval '1 millisecond'
             FROM chosen
             WHERE d.webhook_id = chosen.webhook_id
             RETURNING chosen.receiver, d.webhook_id, d.job_id, d.tenant, d.sequence,
                       d.event_type, d.url, d.status, d.attempts, d.created_at,
                       d.last_attempt_at, d.last_status, d.last_error, d.next_attempt_at",
        ))
        .bind(i64::from(limit))
        .bind(millis(hold))
        .bind(load.full())
        .bind(scan_for(limit))
        .bind(busy)
        .bind(counts)
        .bind(i64::from(load.per_receiver))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(Claimed {
                    delivery: pg_delivery(row)?,
                    receiver: row.try_get("receiver")?,
                    held_until: row.try_get("next_attempt_at")?,
                })
            })
            .collect()
    }

    async fn record(&self, claimed: &Claimed, attempt: &Attempted) -> StoreResult<bool> {
        let (status, code, error, delay) = attempt.columns();
        let done = sqlx::query(
            "UPDATE webhook_deliveries
             SET status = $2, attempts = attempts + 1, last_attempt_at = now(),
                 last_status = $3, last_error = $4,
                 next_attempt_at = now() + $5 * interval '1 millisecond'
             WHERE webhook_id = $1 AND status = 'pending' AND next_attempt_at = $6",
        )
        .bind(&claimed.delivery.webhook_id)
        .bind(status.as_str())
        .bind(code)
        .bind(error)
        .bind(delay)
        .bind(claimed.held_until)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn reconcile(&self, window: Duration, limit: u32) -> StoreResult<u64> {
        let done = sqlx::query(
            "INSERT INTO webhook_deliveries (webhook_id, job_id, sequence, tenant, event_type, url,
                                             next_attempt_at, created_at)
             SELECT 'evt_' || j.id || '_' || j.event_seq, j.id, j.event_seq, j.tenant, e.type,
                    j.callback_url, now(), now()
             FROM jobs j
             JOIN job_events e ON e.job_id = j.id AND e.sequence = j.event_seq
             WHERE j.callback_url IS NOT NULL
               AND j.finished_at > now() - $1 * interval '1 millisecond'
               AND j.state IN ('succeeded', 'failed', 'cancelled', 'expired')
               AND e.type IN ('succeeded', 'failed', 'cancelled', 'expired')
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                               WHERE d.job_id = j.id AND d.sequence = j.event_seq)
             LIMIT $2
             ON CONFLICT DO NOTHING",
        )
        .bind(millis(window))
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn list(&self, tenant: &str, job_id: Uuid) -> StoreResult<Vec<Delivery>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            columns!(),
            " FROM webhook_deliveries WHERE tenant = $1 AND job_id = $2 ORDER BY sequence"
        ))
        .bind(tenant)
        .bind(job_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(pg_delivery).collect()
    }
}

/// The outbox on SQLite: writes go through the store's single writer.
pub struct SqliteOutbox {
    writer: SqlitePool,
    reader: SqlitePool,
}

impl SqliteOutbox {
    /// An outbox on the store's pools.
    pub fn new(writer: SqlitePool, reader: SqlitePool) -> SqliteOutbox {
        SqliteOutbox { writer, reader }
    }
}

/// A delivery's receiver in SQL, as PostgreSQL's claim finds it: the
/// URL's authority, lower-cased. SQLite has no regular expressions: the
/// rest after `://`, with `?` and `#` made `/`, up to the first `/`.
macro_rules! sqlite_receiver {
    () => {
        "lower(substr(replace(replace(substr(url, instr(url, '://') + 3) || '/', '?', '/'), '#', '/'), \
         1, instr(replace(replace(substr(url, instr(url, '://') + 3) || '/', '?', '/'), '#', '/'), '/') - 1))"
    };
}

fn from_ms(v: i64, column: &str) -> StoreResult<DateTime<Utc>> {
    DateTime::from_timestamp_millis(v)
        .ok_or_else(|| StoreError::Internal(format!("corrupt value in column {column}")))
}

fn sqlite_delivery(row: &SqliteRow) -> StoreResult<Delivery> {
    let job_id: String = row.try_get("job_id")?;
    Ok(Delivery {
        webhook_id: row.try_get("webhook_id")?,
        job_id: Uuid::parse_str(&job_id)
            .map_err(|_| StoreError::Internal("corrupt value in column job_id".into()))?,
        tenant: row.try_get("tenant")?,
        sequence: to_u64(row.try_get("sequence")?, "sequence")?,
        event_type: row.try_get("event_type")?,
        url: row.try_get("url")?,
        status: DeliveryStatus::parse(row.try_get("status")?)?,
        attempts: to_u32(row.try_get("attempts")?, "attempts")?,
        created_at: from_ms(row.try_get("created_at")?, "created_at")?,
        last_attempt_at: row
            .try_get::<Option<i64>, _>("last_attempt_at")?
            .map(|v| from_ms(v, "last_attempt_at"))
            .transpose()?,
        last_status: status_code(row.try_get("last_status")?),
        last_error: row.try_get("last_error")?,
    })
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

#[async_trait]
impl Outbox for SqliteOutbox {
    async fn claim_due(
        &self,
        limit: u32,
        hold: Duration,
        load: ReceiverLoad<'_>,
    ) -> StoreResult<Vec<Claimed>> {
        let now = now_ms();
        let busy = serde_json::to_string(load.in_flight)
            .map_err(|e| StoreError::Internal(format!("cannot encode the receivers: {e}")))?;
        let rows = sqlx::query(concat!(
            "WITH candidates AS (
                 SELECT webhook_id, next_attempt_at, ",
            sqlite_receiver!(),
            " AS receiver
                 FROM webhook_deliveries
                 WHERE status = 'pending' AND next_attempt_at <= ?1),
             ranked AS (
                 SELECT c.webhook_id, c.next_attempt_at,
                        row_number() OVER (PARTITION BY c.receiver
                                           ORDER BY c.next_attempt_at, c.webhook_id)
                          + coalesce(busy.value, 0) AS nth
                 FROM (SELECT * FROM candidates
                       WHERE receiver NOT IN (SELECT key FROM json_each(?4) WHERE value >= ?5)
                       ORDER BY next_attempt_at LIMIT ?6) c
                 LEFT JOIN json_each(?4) AS busy ON busy.key = c.receiver)
             UPDATE webhook_deliveries SET next_attempt_at = ?1 + ?3
             WHERE webhook_id IN (SELECT webhook_id FROM ranked WHERE nth <= ?5
                                  ORDER BY next_attempt_at LIMIT ?2)
             RETURNING next_attempt_at, ",
            sqlite_receiver!(),
            " AS receiver, ",
            columns!()
        ))
        .bind(now)
        .bind(i64::from(limit))
        .bind(millis(hold))
        .bind(busy)
        .bind(i64::from(load.per_receiver))
        .bind(scan_for(limit))
        .fetch_all(&self.writer)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(Claimed {
                    delivery: sqlite_delivery(row)?,
                    receiver: row.try_get("receiver")?,
                    held_until: from_ms(row.try_get("next_attempt_at")?, "next_attempt_at")?,
                })
            })
            .collect()
    }

    async fn record(&self, claimed: &Claimed, attempt: &Attempted) -> StoreResult<bool> {
        let (status, code, error, delay) = attempt.columns();
        let now = now_ms();
        let done = sqlx::query(
            "UPDATE webhook_deliveries
             SET status = ?2, attempts = attempts + 1, last_attempt_at = ?5,
                 last_status = ?3, last_error = ?4, next_attempt_at = ?5 + ?6
             WHERE webhook_id = ?1 AND status = 'pending' AND next_attempt_at = ?7",
        )
        .bind(&claimed.delivery.webhook_id)
        .bind(status.as_str())
        .bind(code)
        .bind(error)
        .bind(now)
        .bind(delay)
        .bind(claimed.held_until.timestamp_millis())
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn reconcile(&self, window: Duration, limit: u32) -> StoreResult<u64> {
        let now = now_ms();
        let done = sqlx::query(
            "INSERT OR IGNORE INTO webhook_deliveries (webhook_id, job_id, sequence, tenant,
                                                       event_type, url, next_attempt_at, created_at)
             SELECT 'evt_' || j.id || '_' || j.event_seq, j.id, j.event_seq, j.tenant, e.type,
                    j.callback_url, ?1, ?1
             FROM jobs j
             JOIN job_events e ON e.job_id = j.id AND e.sequence = j.event_seq
             WHERE j.callback_url IS NOT NULL
               AND j.finished_at > ?1 - ?2
               AND j.state IN ('succeeded', 'failed', 'cancelled', 'expired')
               AND e.type IN ('succeeded', 'failed', 'cancelled', 'expired')
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                               WHERE d.job_id = j.id AND d.sequence = j.event_seq)
             LIMIT ?3",
        )
        .bind(now)
        .bind(millis(window))
        .bind(i64::from(limit))
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected())
    }

    async fn list(&self, tenant: &str, job_id: Uuid) -> StoreResult<Vec<Delivery>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            columns!(),
            " FROM webhook_deliveries WHERE tenant = ?1 AND job_id = ?2 ORDER BY sequence"
        ))
        .bind(tenant)
        .bind(job_id.to_string())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(sqlite_delivery).collect()
    }
}
