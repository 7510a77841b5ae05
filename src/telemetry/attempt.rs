//! One attempt as telemetry sees it: its outcome and figures (pure), and its
//! `job.attempt` span, emitted when the attempt ends with the ids decided at
//! lease time, on whichever replica ends it.

use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use super::otlp::with_ids;
use super::traceparent::TraceParent;
use crate::domain::EventType;
use crate::domain::transition::LEASE_EXPIRED_CLASS;
use crate::store::Ended;

/// Name of every attempt span.
pub const ATTEMPT_SPAN: &str = "job.attempt";

/// What an ended attempt amounts to, for its span, metrics and log line.
#[derive(Clone, Debug, PartialEq)]
pub struct AttemptSummary {
    /// `succeeded`, `retry_scheduled`, `failed`, `cancelled`,
    /// `lease_expired` or `expired`: the event that ended it.
    pub outcome: &'static str,
    /// The attempt's own error class (a worker's, or `lease_expired`).
    pub error_class: Option<String>,
    /// The attempt failed (its span's status is ERROR).
    pub is_error: bool,
    /// The job entered the dead set (FAILED).
    pub dead: bool,
    /// Lease to end; `None` when the lease time is unknown.
    pub duration: Option<Duration>,
    /// Runnable to leased.
    pub queue_wait: Option<Duration>,
    /// What this attempt cost (the job's total grows by it).
    pub cost_cents: i64,
}

fn between(from: chrono::DateTime<chrono::Utc>, to: chrono::DateTime<chrono::Utc>) -> Duration {
    (to - from).to_std().unwrap_or_default()
}

impl AttemptSummary {
    /// Reads the ended attempt.
    pub fn of(ended: &Ended) -> AttemptSummary {
        let event = &ended.event;
        // The worker's own error is in the event's detail (the job's error
        // may be intray's verdict, e.g. budget_exhausted).
        let detail_class = event
            .detail
            .as_ref()
            .and_then(|d| d.pointer("/error/class"))
            .and_then(|c| c.as_str())
            .map(str::to_owned);
        let (outcome, error_class, is_error) = match event.kind {
            EventType::Succeeded => ("succeeded", None, false),
            EventType::RetryScheduled => ("retry_scheduled", detail_class, true),
            EventType::Failed => (
                "failed",
                detail_class.or_else(|| ended.job.error.as_ref().map(|e| e.class.clone())),
                true,
            ),
            EventType::LeaseExpired => ("lease_expired", Some(LEASE_EXPIRED_CLASS.into()), true),
            EventType::Expired => ("expired", Some("deadline_exceeded".into()), true),
            // A cancel is the producer's decision, not the attempt's failure.
            _ => ("cancelled", None, false),
        };
        let leased_at = ended.attempt.leased_at;
        AttemptSummary {
            outcome,
            error_class,
            is_error,
            dead: event.kind == EventType::Failed,
            duration: leased_at.map(|l| between(l, event.at)),
            queue_wait: leased_at.map(|l| between(ended.attempt.runnable_at, l)),
            cost_cents: ended.job.cost_cents - ended.attempt.cost_cents_before,
        }
    }
}

/// The attempt's span context as decided at lease time.
pub fn attempt_traceparent(ended: &Ended) -> TraceParent {
    TraceParent::for_attempt(
        ended.job.id,
        ended.job.trace_parent.as_deref(),
        &ended.attempt.lease_token,
    )
}

/// Emits the attempt's `job.attempt` span: child of the submitter's
/// context, from the lease to the end, with the ids the worker was given.
pub fn emit_span(tracer: &SdkTracer, ended: &Ended, summary: &AttemptSummary) {
    let ids = attempt_traceparent(ended);
    let parent = match ended
        .job
        .trace_parent
        .as_deref()
        .and_then(TraceParent::parse)
    {
        Some(p) => Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_bytes(p.trace_id),
            SpanId::from_bytes(p.span_id),
            TraceFlags::new(p.flags),
            true,
            TraceState::default(),
        )),
        None => Context::new(),
    };
    let job = &ended.job;
    let end: SystemTime = ended.event.at.into();
    let start: SystemTime = ended.attempt.leased_at.map_or(end, Into::into);
    let mut attributes = vec![
        KeyValue::new("job.id", job.id.to_string()),
        KeyValue::new("job.kind", job.kind.clone()),
        KeyValue::new("job.queue", job.queue.clone()),
        KeyValue::new("tenant", job.tenant.clone()),
        KeyValue::new("job.attempt", i64::from(ended.attempt.number)),
        KeyValue::new("job.outcome", summary.outcome),
        KeyValue::new("job.cost_cents", summary.cost_cents),
        // OpenTelemetry's messaging conventions for a consumer span, so
        // that backends that group by them find the attempts.
        KeyValue::new("messaging.system", "intray"),
        KeyValue::new("messaging.operation.type", "process"),
        KeyValue::new("messaging.destination.name", job.queue.clone()),
    ];
    if let Some(worker) = &ended.attempt.worker_id {
        attributes.push(KeyValue::new("worker.id", worker.clone()));
    }
    if let Some(class) = &summary.error_class {
        attributes.push(KeyValue::new("error.class", class.clone()));
        // The conventions' name for the same.
        attributes.push(KeyValue::new("error.type", class.clone()));
    } else if summary.is_error {
        // The conventions' value for an error without a known type.
        attributes.push(KeyValue::new("error.type", "_OTHER"));
    }
    if let Some(wait) = summary.queue_wait {
        attributes.push(KeyValue::new(
            "job.queue_wait_ms",
            i64::try_from(wait.as_millis()).unwrap_or(i64::MAX),
        ));
    }
    let builder = tracer
        .span_builder(ATTEMPT_SPAN)
        .with_kind(SpanKind::Consumer)
        .with_start_time(start)
        .with_attributes(attributes);
    let mut span = with_ids(
        TraceId::from_bytes(ids.trace_id),
        SpanId::from_bytes(ids.span_id),
        || tracer.build_with_context(builder, &parent),
    );
    if summary.is_error {
        span.set_status(Status::error(format!(
            "{}: {}",
            summary.outcome,
            summary.error_class.as_deref().unwrap_or("error")
        )));
    } else if summary.outcome == "succeeded" {
        span.set_status(Status::Ok);
    }
    span.end_with_timestamp(end);
}
