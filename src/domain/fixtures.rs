//! Jobs for unit tests, built the same way wherever one is needed.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use serde_json::json;
use uuid::Uuid;

use super::{Backoff, Job, JobState};

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
