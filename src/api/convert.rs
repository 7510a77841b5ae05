//! Conversions between proto messages and domain types. Public so that
//! `benches/hot_path.rs` can measure them; nothing outside the API layer
//! calls them otherwise.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::domain::breaker::BreakerState;
use crate::domain::json::whole_numbers_as_integers;
use crate::domain::validate::{
    HeartbeatInput, LeaseInput, ListInput, OutcomeInput, SubmitInput, ValidationError,
};
use crate::domain::{EventType, Job, JobEvent, JobState, QueueStats, WorkerSeen};
use crate::pb;
use crate::store::Stats;
use crate::telemetry::TraceParent;

type Result<T> = std::result::Result<T, ValidationError>;

/// A time as a protobuf `Timestamp`.
pub fn timestamp(t: DateTime<Utc>) -> pbjson_types::Timestamp {
    pbjson_types::Timestamp {
        seconds: t.timestamp(),
        // Always below 2e9, so it fits.
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

fn opt_timestamp(t: Option<DateTime<Utc>>) -> Option<pbjson_types::Timestamp> {
    t.map(timestamp)
}

/// The protobuf `Timestamp` range, 0001-01-01 to 9999-12-31 (UTC), in
/// seconds: both backends store any time in it, and PostgreSQL refuses some
/// outside it that chrono would take.
const TIMESTAMP_SECONDS: std::ops::RangeInclusive<i64> = -62_135_596_800..=253_402_300_799;

/// A protobuf `Timestamp` as a time; `field` names it in the error for an
/// out-of-range one.
pub fn from_timestamp(
    field: &str,
    t: Option<pbjson_types::Timestamp>,
) -> Result<Option<DateTime<Utc>>> {
    let Some(t) = t else { return Ok(None) };
    if !TIMESTAMP_SECONDS.contains(&t.seconds) {
        return Err(ValidationError::new(
            field,
            "must be between 0001-01-01 and 9999-12-31",
        ));
    }
    let nanos = u32::try_from(t.nanos)
        .ok()
        .filter(|n| *n < 1_000_000_000)
        .ok_or_else(|| ValidationError::new(field, "nanos must be in 0..1e9"))?;
    DateTime::from_timestamp(t.seconds, nanos)
        .map(Some)
        .ok_or_else(|| ValidationError::new(field, "is not a valid time"))
}

/// A duration as a protobuf `Duration`.
pub fn duration(d: Duration) -> pbjson_types::Duration {
    pbjson_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        // Always below 1e9, so it fits.
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A protobuf `Duration` as a duration; negative ones are refused.
pub fn from_duration(field: &str, d: Option<pbjson_types::Duration>) -> Result<Option<Duration>> {
    let Some(d) = d else { return Ok(None) };
    if d.seconds < 0 || d.nanos < 0 {
        return Err(ValidationError::new(
            field,
            "must be a non-negative duration",
        ));
    }
    if d.nanos >= 1_000_000_000 {
        return Err(ValidationError::new(
            field,
            "nanos must be below 1,000,000,000 (whole seconds go in seconds)",
        ));
    }
    let secs = u64::try_from(d.seconds).unwrap_or(0);
    let nanos = u32::try_from(d.nanos).unwrap_or(0);
    Ok(Some(Duration::new(secs, nanos)))
}

/// A protobuf `Value` as JSON, whole numbers as integers (as they were
/// most likely written); a missing value is `null`. Non-finite numbers have
/// no JSON form and are refused.
pub fn from_value(field: &str, v: Option<pbjson_types::Value>) -> Result<Value> {
    match v {
        None => Ok(Value::Null),
        Some(v) => {
            let mut json = serde_json::to_value(&v).map_err(|_| {
                ValidationError::new(field, "is not representable as JSON (NaN or infinity?)")
            })?;
            whole_numbers_as_integers(&mut json);
            Ok(json)
        }
    }
}

/// JSON as a protobuf `Value`, with a kind at every level: `null` is
/// `NullValue`. (pbjson's own conversion from JSON leaves a null's kind
/// unset, an empty `Value` that other protobuf runtimes refuse to print:
/// grpcurl answered "nil Value" for any job without a payload.) A number
/// is a double, so an integer a double cannot hold exactly (stored by an
/// earlier build, or written by hand) goes as the nearest one.
pub fn value(v: &Value) -> pbjson_types::Value {
    use pbjson_types::value::Kind;
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        // None only with serde_json's arbitrary_precision, not built here.
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(pbjson_types::ListValue {
            values: items.iter().map(value).collect(),
        }),
        Value::Object(map) => Kind::StructValue(struct_of(map)),
    };
    pbjson_types::Value { kind: Some(kind) }
}

fn struct_of(map: &serde_json::Map<String, Value>) -> pbjson_types::Struct {
    pbjson_types::Struct {
        fields: map.iter().map(|(k, v)| (k.clone(), value(v))).collect(),
    }
}

fn detail_struct(v: &Option<Value>) -> Option<pbjson_types::Struct> {
    match v {
        Some(Value::Object(map)) => Some(struct_of(map)),
        _ => None,
    }
}

/// A job state as its proto enum.
pub fn state(s: JobState) -> pb::JobState {
    match s {
        JobState::Queued => pb::JobState::Queued,
        JobState::Running => pb::JobState::Running,
        JobState::Succeeded => pb::JobState::Succeeded,
        JobState::Failed => pb::JobState::Failed,
        JobState::Cancelled => pb::JobState::Cancelled,
        JobState::Expired => pb::JobState::Expired,
    }
}

/// Proto job states as the domain's; unknown or unspecified ones are refused.
pub fn from_states(field: &str, states: &[i32]) -> Result<Vec<JobState>> {
    states
        .iter()
        .map(|raw| match pb::JobState::try_from(*raw) {
            Ok(pb::JobState::Queued) => Ok(JobState::Queued),
            Ok(pb::JobState::Running) => Ok(JobState::Running),
            Ok(pb::JobState::Succeeded) => Ok(JobState::Succeeded),
            Ok(pb::JobState::Failed) => Ok(JobState::Failed),
            Ok(pb::JobState::Cancelled) => Ok(JobState::Cancelled),
            Ok(pb::JobState::Expired) => Ok(JobState::Expired),
            Ok(pb::JobState::Unspecified) | Err(_) => Err(ValidationError::new(
                field,
                format!("{raw} is not a job state"),
            )),
        })
        .collect()
}

fn event_type(t: EventType) -> pb::JobEventType {
    match t {
        EventType::Submitted => pb::JobEventType::Submitted,
        EventType::Leased => pb::JobEventType::Leased,
        EventType::Progress => pb::JobEventType::Progress,
        EventType::RetryScheduled => pb::JobEventType::RetryScheduled,
        EventType::LeaseExpired => pb::JobEventType::LeaseExpired,
        EventType::CancelRequested => pb::JobEventType::CancelRequested,
        EventType::Succeeded => pb::JobEventType::Succeeded,
        EventType::Failed => pb::JobEventType::Failed,
        EventType::Cancelled => pb::JobEventType::Cancelled,
        EventType::Expired => pb::JobEventType::Expired,
        EventType::Replayed => pb::JobEventType::Replayed,
    }
}

/// A job as `GetJob` and `ListJobs` show it.
pub fn job(j: &Job) -> pb::Job {
    pb::Job {
        id: j.id.to_string(),
        tenant: j.tenant.clone(),
        queue: j.queue.clone(),
        kind: j.kind.clone(),
        state: state(j.state) as i32,
        payload: Some(value(&j.payload)),
        result: j.result.as_ref().map(value),
        error: j.error.as_ref().map(|e| pb::JobError {
            class: e.class.clone(),
            message: e.message.clone(),
        }),
        attempt: j.attempt,
        max_attempts: j.max_attempts,
        priority: j.priority,
        idempotency_key: j.idempotency_key.clone().unwrap_or_default(),
        input_hash: j.input_hash.clone(),
        labels: j
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        progress: j.progress,
        cancel_requested: j.cancel_requested,
        cost_cents: j.cost_cents,
        lease_owner: j.lease_owner.clone().unwrap_or_default(),
        lease_expires_at: opt_timestamp(j.lease_expires_at),
        run_at: Some(timestamp(j.run_at)),
        deadline: opt_timestamp(j.deadline),
        created_at: Some(timestamp(j.created_at)),
        updated_at: Some(timestamp(j.updated_at)),
        started_at: opt_timestamp(j.started_at),
        finished_at: opt_timestamp(j.finished_at),
        backoff: Some(pb::Backoff {
            initial: Some(duration(j.backoff.initial())),
            max: Some(duration(j.backoff.max())),
        }),
        callback_url: j.callback_url.clone().unwrap_or_default(),
        max_cost_cents: j.max_cost_cents.unwrap_or(0),
    }
}

/// A claimed job as `Lease` hands it to a worker. With `attempt_spans`
/// (this server exports them) its `traceparent` is the attempt span's
/// context; without, it is the submitter's as given, or none: a worker's
/// spans under an attempt span nobody exports hung from a parent that
/// never existed.
pub fn leased_job(j: &Job, attempt_spans: bool) -> pb::LeasedJob {
    pb::LeasedJob {
        job_id: j.id.to_string(),
        queue: j.queue.clone(),
        kind: j.kind.clone(),
        payload: Some(value(&j.payload)),
        attempt: j.attempt,
        max_attempts: j.max_attempts,
        lease_token: j.lease_token.clone().unwrap_or_default(),
        lease_expires_at: opt_timestamp(j.lease_expires_at),
        deadline: opt_timestamp(j.deadline),
        traceparent: match j.lease_token.as_deref() {
            Some(token) if attempt_spans => {
                TraceParent::for_attempt(j.id, j.trace_parent.as_deref(), token).to_string()
            }
            _ => j.trace_parent.clone().unwrap_or_default(),
        },
        tenant: j.tenant.clone(),
    }
}

/// An event as `WatchJob` and `GetJob` show it.
pub fn event(e: &JobEvent) -> pb::JobEvent {
    pb::JobEvent {
        job_id: e.job_id.to_string(),
        sequence: e.sequence,
        r#type: event_type(e.kind) as i32,
        state: state(e.state) as i32,
        attempt: e.attempt,
        worker_id: e.worker_id.clone().unwrap_or_default(),
        at: Some(timestamp(e.at)),
        detail: detail_struct(&e.detail),
    }
}

/// A `Submit` as the domain's input, before validation.
pub fn submit_input(r: pb::SubmitRequest) -> Result<SubmitInput> {
    let backoff = r.backoff.unwrap_or_default();
    Ok(SubmitInput {
        payload: from_value("payload", r.payload)?,
        run_at: from_timestamp("run_at", r.run_at)?,
        deadline: from_timestamp("deadline", r.deadline)?,
        backoff_initial: from_duration("backoff.initial", backoff.initial)?,
        backoff_max: from_duration("backoff.max", backoff.max)?,
        queue: r.queue,
        kind: r.kind,
        idempotency_key: r.idempotency_key,
        priority: r.priority,
        max_attempts: r.max_attempts,
        labels: r.labels.into_iter().collect(),
        callback_url: r.callback_url,
        max_cost_cents: r.max_cost_cents,
    })
}

/// A `Lease` as the domain's input, before validation.
pub fn lease_input(r: pb::LeaseRequest) -> Result<LeaseInput> {
    Ok(LeaseInput {
        lease_duration: from_duration("lease_duration", r.lease_duration)?,
        wait: from_duration("wait", r.wait)?,
        worker_id: r.worker_id,
        queues: r.queues,
        kinds: r.kinds,
        max_jobs: r.max_jobs,
        all_tenants: r.all_tenants,
    })
}

/// A `Heartbeat` as the domain's input, before validation.
pub fn heartbeat_input(r: pb::HeartbeatRequest) -> Result<HeartbeatInput> {
    Ok(HeartbeatInput {
        extend_by: from_duration("extend_by", r.extend_by)?,
        job_id: r.job_id,
        lease_token: r.lease_token,
        progress: r.progress,
        message: r.message,
    })
}

/// A `Complete`'s outcome as the domain's input, before validation.
pub fn outcome_input(o: Option<pb::complete_request::Outcome>) -> Result<Option<OutcomeInput>> {
    use pb::complete_request::Outcome;
    Ok(match o {
        None => None,
        Some(Outcome::Success(s)) => Some(OutcomeInput::Success {
            result: from_value("success.result", s.result)?,
        }),
        Some(Outcome::Failure(f)) => Some(OutcomeInput::Failure {
            retry_after: from_duration("failure.retry_after", f.retry_after)?,
            error_class: f.error_class,
            message: f.message,
            retryable: f.retryable,
        }),
    })
}

/// A `ListJobs` as the domain's input, before validation.
pub fn list_input(r: pb::ListJobsRequest) -> Result<ListInput> {
    Ok(ListInput {
        states: from_states("states", &r.states)?,
        queue: r.queue,
        kind: r.kind,
        error_class: r.error_class,
        labels: r.labels.into_iter().collect(),
        page_size: r.page_size,
        page_token: r.page_token,
        with_payloads: match pb::JobView::try_from(r.view) {
            Ok(pb::JobView::Unspecified | pb::JobView::Full) => true,
            Ok(pb::JobView::Basic) => false,
            Err(_) => return Err(ValidationError::new("view", "is not a JobView")),
        },
    })
}

fn queue_stats(q: &QueueStats) -> pb::QueueStats {
    pb::QueueStats {
        queue: q.queue.clone(),
        counts: JobState::ALL
            .into_iter()
            .map(|s| pb::StateCount {
                state: state(s) as i32,
                count: q.count(s),
            })
            .collect(),
        oldest_runnable_age: q.oldest_runnable_age.map(duration),
        running: q.count(JobState::Running),
        dead: q.count(JobState::Failed),
        paused: q.paused,
        breakers: q
            .breakers
            .iter()
            .map(|(kind, b)| pb::BreakerInfo {
                kind: kind.clone(),
                state: match b.state(Utc::now()) {
                    BreakerState::Closed => pb::BreakerState::Closed,
                    BreakerState::Open => pb::BreakerState::Open,
                    BreakerState::HalfOpen => pb::BreakerState::HalfOpen,
                } as i32,
                failures: b.failures,
                open_until: opt_timestamp(b.open_until),
            })
            .collect(),
    }
}

fn worker(w: &WorkerSeen) -> pb::WorkerInfo {
    pb::WorkerInfo {
        worker_id: w.worker_id.clone(),
        queues: w.queues.clone(),
        last_lease_at: opt_timestamp(w.last_lease_at),
        last_heartbeat_at: opt_timestamp(w.last_heartbeat_at),
        leases_held: w.leases_held,
    }
}

/// Queue and worker statistics as `Stats` answers them.
pub fn stats(s: &Stats) -> pb::StatsResponse {
    pb::StatsResponse {
        queues: s.queues.iter().map(queue_stats).collect(),
        workers: s.workers.iter().map(worker).collect(),
    }
}

/// A completion-callback delivery as the deliveries listing shows it.
pub fn delivery(d: &crate::store::outbox::Delivery) -> serde_json::Value {
    serde_json::json!({
        "webhook_id": d.webhook_id,
        "sequence": d.sequence,
        "type": crate::domain::webhook::callback_type(&d.event_type),
        "url": d.url,
        "status": d.status.as_str(),
        "attempts": d.attempts,
        "created_at": d.created_at.to_rfc3339(),
        "last_attempt_at": d.last_attempt_at.map(|t| t.to_rfc3339()),
        "last_status": d.last_status,
        "last_error": d.last_error,
    })
}

/// A group of the dead set as `GET /api/v1/dead-set` shows it.
pub fn job_group(g: &crate::store::JobGroup) -> serde_json::Value {
    serde_json::json!({
        "error_class": g.error_class,
        "queue": g.queue,
        "jobs": g.jobs,
        "cost_cents": g.cost_cents,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An integer a double cannot hold (stored by an earlier build) is
    /// shown as the nearest double; it was left out of the answer.
    #[test]
    fn a_stored_integer_past_2_53_is_shown() {
        let shown = value(&serde_json::json!({"id": 9_007_199_254_740_993_u64}));
        let back = serde_json::to_value(shown).expect("JSON");
        assert_eq!(back["id"].as_f64(), Some(9_007_199_254_740_992.0));
        let whole = from_value("payload", Some(value(&serde_json::json!({"n": 5})))).expect("JSON");
        assert_eq!(
            whole["n"].as_u64(),
            Some(5),
            "a whole number comes back whole"
        );
    }

    #[test]
    fn negative_durations_and_bad_timestamps_name_their_field() {
        let neg = pbjson_types::Duration {
            seconds: -1,
            nanos: 0,
        };
        assert_eq!(from_duration("wait", Some(neg)).unwrap_err().field, "wait");
        let bad = pbjson_types::Timestamp {
            seconds: 0,
            nanos: -5,
        };
        assert_eq!(
            from_timestamp("run_at", Some(bad)).unwrap_err().field,
            "run_at"
        );
    }

    #[test]
    fn timestamps_outside_the_protobuf_range_are_refused() {
        let at = |seconds| pbjson_types::Timestamp { seconds, nanos: 0 };
        for seconds in [-62_135_596_800, 0, 253_402_300_799] {
            assert!(
                from_timestamp("run_at", Some(at(seconds))).is_ok(),
                "{seconds}"
            );
        }
        // The last is a time chrono holds and PostgreSQL does not.
        for seconds in [-62_135_596_801, 253_402_300_800, -5_000_000_000_000] {
            let err = from_timestamp("deadline", Some(at(seconds))).unwrap_err();
            assert_eq!(err.field, "deadline", "{seconds}");
        }
    }

    /// Every level has a kind: an empty `Value` (a null's, as pbjson's
    /// own conversion made it) is one other runtimes refuse to print.
    #[test]
    fn nulls_have_a_kind_at_every_level() {
        use pbjson_types::value::Kind;
        fn kinds_set(v: &pbjson_types::Value) -> bool {
            match &v.kind {
                None => false,
                Some(Kind::ListValue(list)) => list.values.iter().all(kinds_set),
                Some(Kind::StructValue(s)) => s.fields.values().all(kinds_set),
                Some(_) => true,
            }
        }
        assert_eq!(
            value(&Value::Null).kind,
            Some(Kind::NullValue(0)),
            "a job without a payload"
        );
        let nested = serde_json::json!({"a": null, "b": [null, {"c": null}]});
        assert!(kinds_set(&value(&nested)), "{:?}", value(&nested));
        assert_eq!(
            from_value("payload", Some(value(&nested))).expect("back"),
            nested
        );
        // And a null without a kind, as pbjson-based clients send one, is
        // still read as null.
        let kindless = pbjson_types::Value {
            kind: Some(Kind::StructValue(pbjson_types::Struct {
                fields: [("a".to_string(), pbjson_types::Value { kind: None })].into(),
            })),
        };
        assert_eq!(
            from_value("payload", Some(kindless)).expect("read"),
            serde_json::json!({"a": null})
        );
    }

    #[test]
    fn json_values_round_trip() {
        let v = serde_json::json!({"a": [1.5, "x", null, true], "b": {"c": "d"}});
        let pb = value(&v);
        assert_eq!(from_value("payload", Some(pb)).expect("back"), v);
    }

    #[test]
    fn unknown_states_are_refused() {
        assert_eq!(from_states("states", &[0]).unwrap_err().field, "states");
        assert_eq!(from_states("states", &[99]).unwrap_err().field, "states");
        assert_eq!(
            from_states("states", &[4]).expect("failed"),
            vec![JobState::Failed]
        );
    }
}
