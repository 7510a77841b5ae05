//! Jobs for unit tests, built the same way wherever one is needed.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use serde_json::json;
use uuid::Uuid;

use super::{Backoff, Job, JobState, LeaseSpec, NewJob};

/// A fixed instant, `secs` seconds after the fixtures' epoch.
pub fn t(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + secs, 0)
        .single()
        .expect("valid time")
}

/// A job of tenant `default` running its `attempt`, leased at `t(0)` to
/// worker `w1` with token `tok` until `t(60)`.
pub fn running(attempt: u32, max_attempts: u32) -> Job {
    Job {
        id: Uuid::now_v7(),
        tenant: "default".into(),
        queue: "q".into(),
        kind: "k".into(),
        state: JobState::Running,
        payload: json!({}),
        result: None,
        error: None,
        attempt,
        max_attempts,
        priority: 0,
        idempotency_key: None,
        input_hash: String::new(),
        labels: BTreeMap::new(),
        progress: 0.0,
        cancel_requested: false,
        cancel_requested_at: None,
        cost_cents: 0,
        lease_owner: Some("w1".into()),
        lease_token: Some("tok".into()),
        lease_expires_at: Some(t(60)),
        run_at: t(0),
        deadline: None,
        backoff: Backoff::try_new(Duration::from_secs(5), Duration::from_secs(300)).expect("valid"),
        callback_url: None,
        max_cost_cents: None,
        created_at: t(0),
        updated_at: t(0),
        started_at: Some(t(0)),
        finished_at: None,
        event_seq: 2,
        trace_parent: None,
        leased_at: Some(t(0)),
    }
}

/// A job of queue `q` and kind `k` to submit.
pub fn new_job() -> NewJob {
    NewJob {
        queue: "q".into(),
        kind: "k".into(),
        payload: json!({}),
        idempotency_key: None,
        input_hash: "h".into(),
        priority: 0,
        run_at: None,
        deadline: None,
        max_attempts: 3,
        backoff: Backoff::try_new(Duration::from_secs(60), Duration::from_secs(60)).expect("valid"),
        labels: BTreeMap::new(),
        callback_url: None,
        max_cost_cents: None,
        trace_parent: None,
    }
}

/// A lease of up to `max_jobs` from queue `q` for `worker`, for 60 s,
/// without waiting.
pub fn lease_spec(worker: &str, max_jobs: u32) -> LeaseSpec {
    LeaseSpec {
        worker_id: worker.into(),
        queues: vec!["q".into()],
        kinds: Vec::new(),
        max_jobs,
        lease_duration: Duration::from_secs(60),
        wait: Duration::ZERO,
        all_tenants: false,
    }
}
