//! The pure core: job states and events, the state machine, backoff, input
//! hashing and validation. Nothing here does I/O or reads a clock; callers
//! pass the time in (the database's time where it matters).

pub mod backoff;
pub mod breaker;
#[cfg(test)]
pub mod fixtures;
pub mod hash;
pub mod json;
pub mod transition;
pub mod validate;
pub mod webhook;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

pub use backoff::Backoff;

/// Where a job is in its life (SPEC section 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Expired,
}

impl JobState {
    /// Every state, in lifecycle order.
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Expired,
    ];

    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Expired => "expired",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|state| state.as_str() == s)
    }

    /// Terminal states change only through an explicit `Retry`.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobState::Queued | JobState::Running)
    }

    /// States a `Retry` may move back to `Queued`.
    pub fn is_replayable(self) -> bool {
        matches!(
            self,
            JobState::Failed | JobState::Cancelled | JobState::Expired
        )
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an event records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Submitted,
    Leased,
    Progress,
    RetryScheduled,
    LeaseExpired,
    CancelRequested,
    Succeeded,
    Failed,
    Cancelled,
    Expired,
    Replayed,
}

impl EventType {
    const ALL: [EventType; 11] = [
        EventType::Submitted,
        EventType::Leased,
        EventType::Progress,
        EventType::RetryScheduled,
        EventType::LeaseExpired,
        EventType::CancelRequested,
        EventType::Succeeded,
        EventType::Failed,
        EventType::Cancelled,
        EventType::Expired,
        EventType::Replayed,
    ];

    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Submitted => "submitted",
            EventType::Leased => "leased",
            EventType::Progress => "progress",
            EventType::RetryScheduled => "retry_scheduled",
            EventType::LeaseExpired => "lease_expired",
            EventType::CancelRequested => "cancel_requested",
            EventType::Succeeded => "succeeded",
            EventType::Failed => "failed",
            EventType::Cancelled => "cancelled",
            EventType::Expired => "expired",
            EventType::Replayed => "replayed",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// An error reported by a worker, or by intray itself (`lease_expired`).
#[derive(Clone, Debug, PartialEq)]
pub struct JobError {
    pub class: String,
    pub message: String,
}

/// A job as stored: the row of `jobs`.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub id: Uuid,
    pub tenant: String,
    pub queue: String,
    pub kind: String,
    pub state: JobState,
    pub payload: Value,
    pub result: Option<Value>,
    pub error: Option<JobError>,
    /// Current (or last) attempt; 0 before the first lease.
    pub attempt: u32,
    pub max_attempts: u32,
    pub priority: i32,
    pub idempotency_key: Option<String>,
    pub input_hash: String,
    pub labels: BTreeMap<String, String>,
    pub progress: f64,
    pub cancel_requested: bool,
    pub cancel_requested_at: Option<DateTime<Utc>>,
    pub cost_cents: i64,
    pub lease_owner: Option<String>,
    pub lease_token: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub run_at: DateTime<Utc>,
    pub deadline: Option<DateTime<Utc>>,
    pub backoff: Backoff,
    pub callback_url: Option<String>,
    /// Spend limit over all attempts; a failure once it is reached is final.
    pub max_cost_cents: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Sequence of the job's last event; the next event gets `event_seq + 1`.
    pub event_seq: u64,
    /// The submitter's W3C `traceparent`: every attempt's span is its child.
    pub trace_parent: Option<String>,
    /// When the current (or last) attempt was leased.
    pub leased_at: Option<DateTime<Utc>>,
}

impl Job {
    /// The attempt this job is running, as it must be remembered after the
    /// attempt ends (its span and metrics need the lease); `None` unless
    /// running.
    pub fn running_attempt(&self) -> Option<RunningAttempt> {
        if self.state != JobState::Running {
            return None;
        }
        Some(RunningAttempt {
            number: self.attempt,
            worker_id: self.lease_owner.clone(),
            lease_token: self.lease_token.clone().unwrap_or_default(),
            leased_at: self.leased_at,
            runnable_at: self.run_at,
            cost_cents_before: self.cost_cents,
        })
    }
}

/// What an attempt was while it ran: taken before the transition that ends
/// it, because that transition drops the lease.
#[derive(Clone, Debug, PartialEq)]
pub struct RunningAttempt {
    /// 1 for the first attempt.
    pub number: u32,
    pub worker_id: Option<String>,
    /// The attempt's identity: its span id is derived from it.
    pub lease_token: String,
    /// `None` only for attempts leased before this was recorded.
    pub leased_at: Option<DateTime<Utc>>,
    /// When the job became runnable for this attempt (its queue wait
    /// started).
    pub runnable_at: DateTime<Utc>,
    /// The job's cost before this attempt reported its own.
    pub cost_cents_before: i64,
}

/// One row of the append-only `job_events` table.
#[derive(Clone, Debug, PartialEq)]
pub struct JobEvent {
    pub job_id: Uuid,
    pub sequence: u64,
    pub kind: EventType,
    /// The job's state after the event.
    pub state: JobState,
    pub attempt: u32,
    pub worker_id: Option<String>,
    pub at: DateTime<Utc>,
    pub detail: Option<Value>,
}

impl JobEvent {
    /// The `LEASED` event of a job as its claim left it.
    pub fn leased(job: &Job) -> JobEvent {
        JobEvent {
            job_id: job.id,
            sequence: job.event_seq,
            kind: EventType::Leased,
            state: JobState::Running,
            attempt: job.attempt,
            worker_id: job.lease_owner.clone(),
            at: job.updated_at,
            detail: None,
        }
    }

    /// A watcher's stream ends after an event that leaves the job terminal.
    pub fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }
}

/// How long a worker counts as active after its last `Lease` (in `Stats`
/// and the workers gauge); one holding a lease counts until it ends.
pub const WORKERS_WINDOW: Duration = Duration::from_secs(300);

/// A validated submission, ready to store.
#[derive(Clone, Debug, PartialEq)]
pub struct NewJob {
    pub queue: String,
    pub kind: String,
    pub payload: Value,
    pub idempotency_key: Option<String>,
    pub input_hash: String,
    pub priority: i32,
    /// `None` means "now" in the database's clock.
    pub run_at: Option<DateTime<Utc>>,
    pub deadline: Option<DateTime<Utc>>,
    pub max_attempts: u32,
    pub backoff: Backoff,
    pub labels: BTreeMap<String, String>,
    pub callback_url: Option<String>,
    pub max_cost_cents: Option<i64>,
    /// The submitter's W3C `traceparent`, stored with the job.
    pub trace_parent: Option<String>,
}

/// What a worker reports at the end of an attempt.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Success {
        result: Value,
    },
    Failure {
        error: JobError,
        retryable: bool,
        retry_after: Option<Duration>,
    },
}

/// A validated `Lease` call.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseSpec {
    pub worker_id: String,
    pub queues: Vec<String>,
    /// Empty: any kind.
    pub kinds: Vec<String>,
    pub max_jobs: u32,
    pub lease_duration: Duration,
    pub wait: Duration,
    /// Claim from every tenant's queues of these names, fairly.
    pub all_tenants: bool,
}

/// A `Lease` call waiting idle that a new job may go to directly: the job is
/// stored already leased to `worker_id`, in the submit's own transaction,
/// so the worker waits for one commit instead of two.
#[derive(Clone, Debug, PartialEq)]
pub struct Handoff {
    pub worker_id: String,
    pub lease_duration: Duration,
}

/// A validated `Heartbeat` call.
#[derive(Clone, Debug, PartialEq)]
pub struct HeartbeatSpec {
    pub job_id: Uuid,
    pub lease_token: String,
    /// The new lease length from now; `None`: the length the lease was
    /// taken with.
    pub extend_by: Option<Duration>,
    /// The length for a lease taken before the store recorded lengths
    /// (migration 0011 on PostgreSQL, 0006 on SQLite): the server's default.
    pub unrecorded_lease: Duration,
    /// The longest a renewal may run. A recorded length may be longer: one
    /// taken before the server's bound was lowered, or one that the
    /// migration filled in from a lease's time run so far (hours, for a
    /// job heartbeating since it was claimed).
    pub max_lease: Duration,
    pub progress: Option<f64>,
    pub message: Option<String>,
}

/// What a heartbeat tells the worker.
#[derive(Clone, Debug, PartialEq)]
pub struct HeartbeatAck {
    pub lease_expires_at: DateTime<Utc>,
    pub cancel_requested: bool,
}

/// A validated `Complete` call (or one item of `CompleteBatch`).
#[derive(Clone, Debug, PartialEq)]
pub struct CompleteSpec {
    pub job_id: Uuid,
    pub lease_token: String,
    pub outcome: Outcome,
    pub cost_cents: i64,
}

/// Which jobs `List` returns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ListFilter {
    pub queue: Option<String>,
    pub kind: Option<String>,
    pub states: Vec<JobState>,
    pub error_class: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub page_size: u32,
    /// Only jobs older than this id (ids are UUIDv7, so time-ordered).
    pub before: Option<Uuid>,
    /// Whether the payload and result are read; without, a job's payload
    /// is JSON null and its result `None`.
    pub with_payloads: bool,
}

/// Which jobs a bulk `Retry` touches.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryFilter {
    pub queue: Option<String>,
    pub kind: Option<String>,
    pub error_class: Option<String>,
    /// Non-empty, each replayable.
    pub states: Vec<JobState>,
    pub limit: u32,
}

/// Counts of one queue, for `Stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueStats {
    pub queue: String,
    pub counts: BTreeMap<&'static str, u64>,
    pub oldest_runnable_age: Option<Duration>,
    pub paused: bool,
    /// The queue's breakers that are not closed-and-clean, by kind.
    pub breakers: Vec<(String, breaker::Breaker)>,
}

impl QueueStats {
    /// Jobs of this queue in `state`.
    pub fn count(&self, state: JobState) -> u64 {
        self.counts.get(state.as_str()).copied().unwrap_or(0)
    }
}

/// A worker seen recently, for `Stats`.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSeen {
    pub worker_id: String,
    pub queues: Vec<String>,
    pub last_lease_at: Option<DateTime<Utc>>,
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    pub leases_held: u64,
}
