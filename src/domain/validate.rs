//! Validation of what callers send, with the offending field named so the
//! API can answer `INVALID_ARGUMENT` with a `BadRequest` field violation.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::hash::{HashInput, input_hash};
use super::webhook::{AddressPolicy, Target};
use super::{
    Backoff, CompleteSpec, HeartbeatSpec, JobError, JobState, LeaseSpec, ListFilter, NewJob,
    Outcome, RetryFilter,
};

/// A field that failed validation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ValidationError {
    /// Path of the field in the request, e.g. `backoff.initial`.
    pub field: String,
    pub reason: String,
}

impl ValidationError {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ValidationError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

type Result<T> = std::result::Result<T, ValidationError>;

/// Server-side defaults and bounds that validation applies.
#[derive(Clone, Debug)]
pub struct Limits {
    pub default_max_attempts: u32,
    pub default_backoff: Backoff,
    pub max_payload_bytes: usize,
    pub default_lease: Duration,
    pub max_lease: Duration,
}

/// Largest number of attempts a job may have.
pub const MAX_ATTEMPTS: u32 = 100;
/// Priority range; larger runs first.
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;
/// Longest long-poll a `Lease` may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Most jobs one `Lease` may claim.
pub const MAX_LEASE_JOBS: u32 = 100;
/// Shortest lease a worker may take or extend by; the server's default
/// and longest leases must not be shorter, or a `Lease` that leaves its
/// length unset would be refused.
pub const MIN_LEASE: Duration = Duration::from_secs(1);
/// Most items in `SubmitBatch` / `CompleteBatch`.
pub const MAX_BATCH: usize = 1000;
/// Deepest JSON nesting accepted in a payload or result. protobuf's decoder
/// refuses messages nested beyond 100 levels and a JSON object level costs
/// three (Value, Struct, map entry), so 32 keeps every value the bound
/// allows decodable.
pub const MAX_JSON_DEPTH: usize = 32;
/// Most labels on one job.
pub const MAX_LABELS: usize = 32;
/// Largest `List` page.
pub const MAX_PAGE_SIZE: u32 = 1000;
/// `List` page size when none is given.
pub const DEFAULT_PAGE_SIZE: u32 = 50;
/// Most jobs one bulk `Retry` touches.
pub const MAX_RETRY_LIMIT: u32 = 10_000;
/// Bulk `Retry` limit when none is given.
pub const DEFAULT_RETRY_LIMIT: u32 = 1000;

/// A submission as received, before validation.
#[derive(Clone, Debug, Default)]
pub struct SubmitInput {
    pub queue: String,
    pub kind: String,
    pub payload: Value,
    pub idempotency_key: String,
    pub priority: i32,
    pub run_at: Option<DateTime<Utc>>,
    pub deadline: Option<DateTime<Utc>>,
    pub max_attempts: Option<u32>,
    pub backoff_initial: Option<Duration>,
    pub backoff_max: Option<Duration>,
    pub labels: BTreeMap<String, String>,
    pub callback_url: String,
    pub max_cost_cents: Option<i64>,
}

fn name(field: &str, value: &str, extra: &[char]) -> Result<String> {
    if value.is_empty() {
        return Err(ValidationError::new(field, "must not be empty"));
    }
    if value.len() > 128 {
        return Err(ValidationError::new(
            field,
            "must be at most 128 characters",
        ));
    }
    let ok = value.chars().all(|c| {
        c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-') || extra.contains(&c)
    });
    if !ok {
        let extra: String = extra.iter().map(|c| format!(" {c}")).collect();
        return Err(ValidationError::new(
            field,
            format!("may only contain letters, digits and _ . : -{extra}"),
        ));
    }
    Ok(value.to_owned())
}

/// A queue name: 1..=128 characters of `[A-Za-z0-9_.:-]`.
pub fn queue(field: &str, value: &str) -> Result<String> {
    name(field, value, &[])
}

/// A kind: like a queue name, and `/` is allowed too.
pub fn kind(field: &str, value: &str) -> Result<String> {
    name(field, value, &['/'])
}

/// A job id: UUID text.
pub fn job_id(field: &str, value: &str) -> Result<Uuid> {
    Uuid::parse_str(value).map_err(|_| ValidationError::new(field, "must be a UUID"))
}

fn json_depth(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(json_depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(json_depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// PostgreSQL's text and jsonb cannot hold U+0000, so a job that carries it
/// would be accepted by one backend and refused by the other: it is refused
/// by both, here.
const NUL_REASON: &str = "must not contain the NUL character (U+0000)";

fn json_has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(json_has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v)),
        _ => false,
    }
}

/// Free text: at most `max` characters, and no NUL (see [`NUL_REASON`]).
fn text(field: &str, value: &str, max: usize) -> Result<()> {
    if value.len() > max && value.chars().count() > max {
        return Err(ValidationError::new(
            field,
            format!("must be at most {max} characters"),
        ));
    }
    if value.contains('\0') {
        return Err(ValidationError::new(field, NUL_REASON));
    }
    Ok(())
}

/// A `Cancel` call's reason: up to 1024 characters; `None` when empty.
pub fn cancel_reason(value: &str) -> Result<Option<&str>> {
    text("reason", value, 1024)?;
    Ok((!value.is_empty()).then_some(value))
}

/// A payload or result: bounded size and nesting, no NUL characters.
pub fn json_value(field: &str, value: &Value, max_bytes: usize) -> Result<()> {
    if json_has_nul(value) {
        return Err(ValidationError::new(field, NUL_REASON));
    }
    if json_depth(value) > MAX_JSON_DEPTH {
        return Err(ValidationError::new(
            field,
            format!("must not nest deeper than {MAX_JSON_DEPTH} levels"),
        ));
    }
    let size = serde_json::to_vec(value)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > max_bytes {
        return Err(ValidationError::new(
            field,
            format!("is {size} bytes as JSON; the limit is {max_bytes}"),
        ));
    }
    Ok(())
}

fn labels(field: &str, labels: &BTreeMap<String, String>) -> Result<()> {
    if labels.len() > MAX_LABELS {
        return Err(ValidationError::new(
            field,
            format!("at most {MAX_LABELS} labels"),
        ));
    }
    for (key, value) in labels {
        let key_ok = !key.is_empty()
            && key.len() <= 63
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-/".contains(c));
        if !key_ok {
            return Err(ValidationError::new(
                format!("{field}[{}]", cut_key(key)),
                "label keys are 1..=63 characters of a-z 0-9 _ . - /",
            ));
        }
        text("", value, 256).map_err(|mut err| {
            err.field = format!("{field}[{key}]");
            err
        })?;
    }
    Ok(())
}

/// A refused label key as its error names it: cut past 64 characters. The
/// field travels in the status's trailers, twice (message and details), and
/// a key of tens of kilobytes made common gRPC clients, which take 16 KiB
/// of trailers at most, fail the call as `RESOURCE_EXHAUSTED` instead.
fn cut_key(key: &str) -> String {
    const SHOWN: usize = 64;
    match key.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}…", &key[..end]),
        None => key.to_owned(),
    }
}

fn callback_url(value: &str, policy: &AddressPolicy) -> Result<Option<String>> {
    if value.is_empty() {
        return Ok(None);
    }
    let target = Target::parse(value).filter(|_| value.len() <= 2048);
    match target {
        Some(target) if policy.allows_target(&target) => Ok(Some(value.to_owned())),
        // A literal private address is refused now; a name that resolves to
        // one is refused at every delivery (after DNS, against rebinding).
        Some(_) => Err(ValidationError::new(
            "callback_url",
            "must not name a private, loopback or link-local address",
        )),
        None => Err(ValidationError::new(
            "callback_url",
            "must be an http:// or https:// URL of at most 2048 characters, without credentials",
        )),
    }
}

/// Validates a submission and applies the defaults. `callbacks` says which
/// non-public addresses a `callback_url` may name; `now` is only used to
/// refuse a deadline that has already passed ([`not_expired`]).
pub fn submit(
    input: SubmitInput,
    limits: &Limits,
    callbacks: &AddressPolicy,
    now: DateTime<Utc>,
) -> Result<NewJob> {
    let job = submission(input, limits, callbacks)?;
    not_expired(&job, now)?;
    Ok(job)
}

/// Idempotency keys that start with this are the webhook ingress's
/// (`hook/{source}/{webhook-id}`): a producer's key must not take one
/// before the provider's message arrives, which would then be refused.
pub const INGRESS_KEY_PREFIX: &str = "hook/";

/// Refuses a producer's idempotency key in the ingress's space.
pub fn producer_key(job: &NewJob) -> Result<()> {
    match &job.idempotency_key {
        Some(key) if key.starts_with(INGRESS_KEY_PREFIX) => Err(ValidationError::new(
            "idempotency_key",
            "keys starting with hook/ are the webhook ingress's",
        )),
        _ => Ok(()),
    }
}

/// Refuses a job whose deadline has passed at `now`. Apart from
/// [`submission`] because it is the one check that depends on when the
/// request is read: a producer that sends an accepted job again after its
/// deadline must still get the original back (SPEC: same key, same input).
pub fn not_expired(job: &NewJob, now: DateTime<Utc>) -> Result<()> {
    match job.deadline {
        Some(deadline) if deadline <= now => {
            Err(ValidationError::new("deadline", "must be in the future"))
        }
        _ => Ok(()),
    }
}

/// Every check of [`submit`] but [`not_expired`], and the defaults.
pub fn submission(
    input: SubmitInput,
    limits: &Limits,
    callbacks: &AddressPolicy,
) -> Result<NewJob> {
    let queue = queue("queue", &input.queue)?;
    let kind = kind("kind", &input.kind)?;
    json_value("payload", &input.payload, limits.max_payload_bytes)?;
    text("idempotency_key", &input.idempotency_key, 256)?;
    if !PRIORITY_RANGE.contains(&input.priority) {
        return Err(ValidationError::new(
            "priority",
            "must be between -1000 and 1000",
        ));
    }
    let max_attempts = input.max_attempts.unwrap_or(limits.default_max_attempts);
    if !(1..=MAX_ATTEMPTS).contains(&max_attempts) {
        return Err(ValidationError::new(
            "max_attempts",
            "must be between 1 and 100",
        ));
    }
    let backoff = match (input.backoff_initial, input.backoff_max) {
        (None, None) => limits.default_backoff,
        (initial, max) => {
            let initial = initial.unwrap_or(limits.default_backoff.initial());
            let max = max.unwrap_or(limits.default_backoff.max().max(initial));
            Backoff::try_new(initial, max)
                .map_err(|e| ValidationError::new(format!("backoff.{}", e.field), e.reason))?
        }
    };
    // In whole milliseconds, as the stores keep times: within one
    // millisecond SQLite would store the two equal, and the job expire
    // before it could run, where PostgreSQL (microseconds) kept them apart.
    if let Some(deadline) = input.deadline
        && input
            .run_at
            .is_some_and(|run_at| run_at.timestamp_millis() >= deadline.timestamp_millis())
    {
        return Err(ValidationError::new("deadline", "must be after run_at"));
    }
    labels("labels", &input.labels)?;
    let callback_url = callback_url(&input.callback_url, callbacks)?;
    if input.max_cost_cents.is_some_and(|max| max < 1) {
        return Err(ValidationError::new(
            "max_cost_cents",
            "must be at least 1 (leave it unset for no limit)",
        ));
    }
    let input_hash = input_hash(&HashInput {
        queue: &queue,
        kind: &kind,
        payload: &input.payload,
        priority: input.priority,
        run_at: input.run_at,
        deadline: input.deadline,
        max_attempts,
        backoff,
        labels: &input.labels,
        callback_url: callback_url.as_deref(),
        max_cost_cents: input.max_cost_cents,
    });
    Ok(NewJob {
        queue,
        kind,
        payload: input.payload,
        idempotency_key: (!input.idempotency_key.is_empty()).then_some(input.idempotency_key),
        input_hash,
        priority: input.priority,
        run_at: input.run_at,
        deadline: input.deadline,
        max_attempts,
        backoff,
        labels: input.labels,
        callback_url,
        max_cost_cents: input.max_cost_cents,
        trace_parent: None,
    })
}

/// A `Lease` call as received.
#[derive(Clone, Debug, Default)]
pub struct LeaseInput {
    pub worker_id: String,
    pub queues: Vec<String>,
    pub kinds: Vec<String>,
    pub max_jobs: Option<u32>,
    pub lease_duration: Option<Duration>,
    pub wait: Option<Duration>,
    pub all_tenants: bool,
}

/// A worker's id: 1 to 128 characters, no NUL.
pub fn worker_id(value: &str) -> Result<String> {
    if value.is_empty() {
        return Err(ValidationError::new("worker_id", "must not be empty"));
    }
    text("worker_id", value, 128)?;
    Ok(value.to_owned())
}

fn lease_duration(field: &str, value: Option<Duration>, limits: &Limits) -> Result<Duration> {
    let d = value.unwrap_or(limits.default_lease);
    if d < MIN_LEASE || d > limits.max_lease {
        return Err(ValidationError::new(
            field,
            format!(
                "must be between {} and {}",
                humantime::format_duration(MIN_LEASE),
                humantime::format_duration(limits.max_lease)
            ),
        ));
    }
    Ok(d)
}

/// `names` without repeats, in the order of their first appearance: a
/// queue named twice would be a claim's candidate twice, and take two of
/// its slots (and count twice against running caps) for one job.
fn first_of_each(names: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::with_capacity(names.len());
    names
        .into_iter()
        .filter(|name| seen.insert(name.clone()))
        .collect()
}

/// Validates a `Lease` call and applies the defaults.
pub fn lease(input: LeaseInput, limits: &Limits) -> Result<LeaseSpec> {
    let worker_id = worker_id(&input.worker_id)?;
    if input.queues.is_empty() {
        return Err(ValidationError::new("queues", "name at least one queue"));
    }
    if input.queues.len() > 64 {
        return Err(ValidationError::new("queues", "at most 64 queues"));
    }
    let queues = input
        .queues
        .iter()
        .enumerate()
        .map(|(i, q)| queue(&format!("queues[{i}]"), q))
        .collect::<Result<Vec<_>>>()
        .map(first_of_each)?;
    if input.kinds.len() > 64 {
        return Err(ValidationError::new("kinds", "at most 64 kinds"));
    }
    let kinds = input
        .kinds
        .iter()
        .enumerate()
        .map(|(i, k)| kind(&format!("kinds[{i}]"), k))
        .collect::<Result<Vec<_>>>()
        .map(first_of_each)?;
    let max_jobs = input.max_jobs.unwrap_or(1);
    if !(1..=MAX_LEASE_JOBS).contains(&max_jobs) {
        return Err(ValidationError::new(
            "max_jobs",
            "must be between 1 and 100",
        ));
    }
    let lease_duration = lease_duration("lease_duration", input.lease_duration, limits)?;
    let wait = input.wait.unwrap_or(Duration::ZERO);
    if wait > MAX_WAIT {
        return Err(ValidationError::new("wait", "must be at most 60s"));
    }
    Ok(LeaseSpec {
        worker_id,
        queues,
        kinds,
        max_jobs,
        lease_duration,
        wait,
        all_tenants: input.all_tenants,
    })
}

fn lease_token(value: &str) -> Result<String> {
    if value.is_empty() {
        return Err(ValidationError::new("lease_token", "must not be empty"));
    }
    text("lease_token", value, 128)?;
    Ok(value.to_owned())
}

/// A `Heartbeat` call as received.
#[derive(Clone, Debug, Default)]
pub struct HeartbeatInput {
    pub job_id: String,
    pub lease_token: String,
    pub extend_by: Option<Duration>,
    pub progress: Option<f64>,
    pub message: String,
}

/// Validates a `Heartbeat` call. Without `extend_by` the lease is renewed
/// by the length it was taken with.
pub fn heartbeat(input: HeartbeatInput, limits: &Limits) -> Result<HeartbeatSpec> {
    let job_id = job_id("job_id", &input.job_id)?;
    let lease_token = lease_token(&input.lease_token)?;
    let extend_by = input
        .extend_by
        .map(|d| lease_duration("extend_by", Some(d), limits))
        .transpose()?;
    if let Some(p) = input.progress
        && !(0.0..=1.0).contains(&p)
    {
        return Err(ValidationError::new("progress", "must be between 0 and 1"));
    }
    text("message", &input.message, 1024)?;
    Ok(HeartbeatSpec {
        job_id,
        lease_token,
        extend_by,
        unrecorded_lease: limits.default_lease,
        max_lease: limits.max_lease,
        progress: input.progress,
        message: (!input.message.is_empty()).then_some(input.message),
    })
}

/// The outcome half of a `Complete` call as received.
#[derive(Clone, Debug)]
pub enum OutcomeInput {
    Success {
        result: Value,
    },
    Failure {
        error_class: String,
        message: String,
        retryable: Option<bool>,
        retry_after: Option<Duration>,
    },
}

/// Validates a `Complete` call.
pub fn complete(
    job_id_text: &str,
    token: &str,
    outcome: Option<OutcomeInput>,
    cost_cents: i64,
    limits: &Limits,
) -> Result<CompleteSpec> {
    let job_id = job_id("job_id", job_id_text)?;
    let lease_token = lease_token(token)?;
    if cost_cents < 0 {
        return Err(ValidationError::new("cost_cents", "must not be negative"));
    }
    let outcome = match outcome {
        None => {
            return Err(ValidationError::new(
                "outcome",
                "set either success or failure",
            ));
        }
        Some(OutcomeInput::Success { result }) => {
            json_value("success.result", &result, limits.max_payload_bytes)?;
            Outcome::Success { result }
        }
        Some(OutcomeInput::Failure {
            error_class,
            message,
            retryable,
            retry_after,
        }) => {
            let class = name("failure.error_class", &error_class, &['/'])?;
            text("failure.message", &message, 16 * 1024)?;
            if retry_after.is_some_and(|d| d > Duration::from_secs(7 * 24 * 3600)) {
                return Err(ValidationError::new(
                    "failure.retry_after",
                    "must be at most 7 days",
                ));
            }
            Outcome::Failure {
                error: JobError { class, message },
                retryable: retryable.unwrap_or(true),
                retry_after,
            }
        }
    };
    Ok(CompleteSpec {
        job_id,
        lease_token,
        outcome,
        cost_cents,
    })
}

/// A `List` call as received.
#[derive(Clone, Debug, Default)]
pub struct ListInput {
    pub queue: String,
    pub kind: String,
    pub states: Vec<JobState>,
    pub error_class: String,
    pub labels: BTreeMap<String, String>,
    pub page_size: Option<u32>,
    pub page_token: String,
    /// Whether each job's payload and result are wanted.
    pub with_payloads: bool,
}

fn optional<T>(value: &str, check: impl FnOnce(&str) -> Result<T>) -> Result<Option<T>> {
    if value.is_empty() {
        Ok(None)
    } else {
        check(value).map(Some)
    }
}

/// Validates a `List` call.
pub fn list(input: ListInput) -> Result<ListFilter> {
    let page_size = input.page_size.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&page_size) {
        return Err(ValidationError::new(
            "page_size",
            "must be between 1 and 1000",
        ));
    }
    let before = optional(&input.page_token, |t| {
        Uuid::parse_str(t)
            .map_err(|_| ValidationError::new("page_token", "is not a token this server issued"))
    })?;
    labels("labels", &input.labels)?;
    Ok(ListFilter {
        queue: optional(&input.queue, |q| queue("queue", q))?,
        kind: optional(&input.kind, |k| kind("kind", k))?,
        states: input.states,
        error_class: optional(&input.error_class, |c| name("error_class", c, &['/']))?,
        labels: input.labels,
        page_size,
        before,
        with_payloads: input.with_payloads,
    })
}

/// Validates a bulk `Retry` filter; without states it targets the dead set.
pub fn retry_filter(
    queue_name: &str,
    kind_name: &str,
    error_class: &str,
    states: Vec<JobState>,
    limit: Option<u32>,
) -> Result<RetryFilter> {
    let states = if states.is_empty() {
        vec![JobState::Failed]
    } else {
        states
    };
    if let Some(bad) = states.iter().find(|s| !s.is_replayable()) {
        return Err(ValidationError::new(
            "filter.states",
            format!("{bad} jobs cannot be retried; use failed, cancelled or expired"),
        ));
    }
    let limit = limit.unwrap_or(DEFAULT_RETRY_LIMIT);
    if !(1..=MAX_RETRY_LIMIT).contains(&limit) {
        return Err(ValidationError::new("limit", "must be between 1 and 10000"));
    }
    Ok(RetryFilter {
        queue: optional(queue_name, |q| queue("filter.queue", q))?,
        kind: optional(kind_name, |k| kind("filter.kind", k))?,
        error_class: optional(error_class, |c| name("filter.error_class", c, &['/']))?,
        states,
        limit,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn limits() -> Limits {
        Limits {
            default_max_attempts: 3,
            default_backoff: Backoff::try_new(Duration::from_secs(5), Duration::from_secs(300))
                .expect("valid"),
            max_payload_bytes: 1024,
            default_lease: Duration::from_secs(60),
            max_lease: Duration::from_secs(3600),
        }
    }

    fn good() -> SubmitInput {
        SubmitInput {
            queue: "emails".into(),
            kind: "llm/summarize".into(),
            payload: json!({"doc": "x"}),
            ..Default::default()
        }
    }

    fn field_of(input: SubmitInput) -> String {
        submit(input, &limits(), &AddressPolicy::default(), Utc::now())
            .unwrap_err()
            .field
    }

    #[test]
    fn a_refused_name_lists_what_it_may_hold() {
        let refused = queue("queue", "a b").expect_err("space");
        assert_eq!(
            refused.reason,
            "may only contain letters, digits and _ . : -"
        );
        let refused = kind("failure.error_class", "a b").expect_err("space");
        assert_eq!(
            refused.reason,
            "may only contain letters, digits and _ . : - /"
        );
        assert!(kind("kind", "a/b:c.d-e_f").is_ok());
    }

    #[test]
    fn defaults_are_applied() {
        let job = submit(good(), &limits(), &AddressPolicy::default(), Utc::now()).expect("valid");
        assert_eq!(job.max_attempts, 3);
        assert_eq!(job.backoff, limits().default_backoff);
        assert_eq!(job.idempotency_key, None);
        assert_eq!(job.input_hash.len(), 64);
    }

    #[test]
    fn each_bad_submit_field_is_named() {
        assert_eq!(
            field_of(SubmitInput {
                queue: String::new(),
                ..good()
            }),
            "queue"
        );
        assert_eq!(
            field_of(SubmitInput {
                queue: "a b".into(),
                ..good()
            }),
            "queue"
        );
        assert_eq!(
            field_of(SubmitInput {
                queue: "q".repeat(129),
                ..good()
            }),
            "queue"
        );
        assert_eq!(
            field_of(SubmitInput {
                kind: String::new(),
                ..good()
            }),
            "kind"
        );
        assert_eq!(
            field_of(SubmitInput {
                max_attempts: Some(0),
                ..good()
            }),
            "max_attempts"
        );
        assert_eq!(
            field_of(SubmitInput {
                max_attempts: Some(101),
                ..good()
            }),
            "max_attempts"
        );
        assert_eq!(
            field_of(SubmitInput {
                priority: 1001,
                ..good()
            }),
            "priority"
        );
        assert_eq!(
            field_of(SubmitInput {
                payload: json!("x".repeat(2000)),
                ..good()
            }),
            "payload"
        );
        assert_eq!(
            field_of(SubmitInput {
                idempotency_key: "k".repeat(257),
                ..good()
            }),
            "idempotency_key"
        );
        assert_eq!(
            field_of(SubmitInput {
                backoff_initial: Some(Duration::ZERO),
                ..good()
            }),
            "backoff.initial"
        );
        assert_eq!(
            field_of(SubmitInput {
                deadline: Some(Utc::now() - chrono::Duration::seconds(1)),
                ..good()
            }),
            "deadline"
        );
        assert_eq!(
            field_of(SubmitInput {
                labels: [("Bad Key".to_string(), "v".to_string())].into(),
                ..good()
            }),
            "labels[Bad Key]"
        );
        // A long bad key is named cut, so the status fits any client's trailers.
        let long = "K".repeat(200_000);
        assert_eq!(
            field_of(SubmitInput {
                labels: [(long, "v".to_string())].into(),
                ..good()
            }),
            format!("labels[{}…]", "K".repeat(64))
        );
        assert_eq!(
            field_of(SubmitInput {
                max_cost_cents: Some(0),
                ..good()
            }),
            "max_cost_cents"
        );
        assert_eq!(
            field_of(SubmitInput {
                callback_url: "ftp://x".into(),
                ..good()
            }),
            "callback_url"
        );
        for private in [
            "http://127.0.0.1:9/",
            "https://[::1]/",
            "http://169.254.169.254/",
        ] {
            assert_eq!(
                field_of(SubmitInput {
                    callback_url: private.into(),
                    ..good()
                }),
                "callback_url",
                "{private}"
            );
        }
    }

    #[test]
    fn nul_characters_are_refused_wherever_postgresql_would_refuse_them() {
        assert_eq!(
            field_of(SubmitInput {
                payload: json!({"a": ["ok", "bad\u{0}"]}),
                ..good()
            }),
            "payload"
        );
        assert_eq!(
            field_of(SubmitInput {
                payload: json!({"k\u{0}": 1}),
                ..good()
            }),
            "payload"
        );
        let mut labels = BTreeMap::new();
        labels.insert("team".to_string(), "a\u{0}".to_string());
        assert_eq!(field_of(SubmitInput { labels, ..good() }), "labels[team]");
    }

    #[test]
    fn deep_json_is_refused() {
        let mut v = json!(1);
        for _ in 0..=MAX_JSON_DEPTH {
            v = json!([v]);
        }
        assert_eq!(
            field_of(SubmitInput {
                payload: v,
                ..good()
            }),
            "payload"
        );
    }

    #[test]
    fn a_queue_or_kind_named_twice_counts_once() {
        let spec = lease(
            LeaseInput {
                worker_id: "w".into(),
                queues: vec!["b".into(), "a".into(), "b".into()],
                kinds: vec!["k".into(), "k".into()],
                ..Default::default()
            },
            &limits(),
        )
        .expect("valid");
        assert_eq!(
            (spec.queues, spec.kinds),
            (vec!["b".into(), "a".into()], vec!["k".into()])
        );
    }

    #[test]
    fn lease_bounds() {
        let ok = LeaseInput {
            worker_id: "w".into(),
            queues: vec!["q".into()],
            ..Default::default()
        };
        let spec = lease(ok.clone(), &limits()).expect("valid");
        assert_eq!((spec.max_jobs, spec.wait), (1, Duration::ZERO));
        let field = |input: LeaseInput| lease(input, &limits()).unwrap_err().field;
        assert_eq!(
            field(LeaseInput {
                queues: vec![],
                ..ok.clone()
            }),
            "queues"
        );
        assert_eq!(
            field(LeaseInput {
                worker_id: String::new(),
                ..ok.clone()
            }),
            "worker_id"
        );
        assert_eq!(
            field(LeaseInput {
                max_jobs: Some(0),
                ..ok.clone()
            }),
            "max_jobs"
        );
        assert_eq!(
            field(LeaseInput {
                max_jobs: Some(101),
                ..ok.clone()
            }),
            "max_jobs"
        );
        assert_eq!(
            field(LeaseInput {
                wait: Some(Duration::from_secs(61)),
                ..ok.clone()
            }),
            "wait"
        );
        assert_eq!(
            field(LeaseInput {
                lease_duration: Some(Duration::ZERO),
                ..ok.clone()
            }),
            "lease_duration"
        );
        assert_eq!(
            field(LeaseInput {
                queues: vec!["ok".into(), "".into()],
                ..ok
            }),
            "queues[1]"
        );
    }

    #[test]
    fn complete_needs_an_outcome_and_a_sane_cost() {
        let id = Uuid::now_v7().to_string();
        let field = |o: Option<OutcomeInput>, cost: i64| {
            complete(&id, "tok", o, cost, &limits()).unwrap_err().field
        };
        assert_eq!(field(None, 0), "outcome");
        let ok = Some(OutcomeInput::Success { result: json!(1) });
        assert_eq!(field(ok, -1), "cost_cents");
        let no_class = Some(OutcomeInput::Failure {
            error_class: String::new(),
            message: String::new(),
            retryable: None,
            retry_after: None,
        });
        assert_eq!(field(no_class, 0), "failure.error_class");
    }

    #[test]
    fn retry_filter_defaults_to_the_dead_set_and_refuses_live_states() {
        let f = retry_filter("q", "", "", vec![], None).expect("valid");
        assert_eq!(f.states, vec![JobState::Failed]);
        assert_eq!(f.limit, DEFAULT_RETRY_LIMIT);
        let err = retry_filter("q", "", "", vec![JobState::Succeeded], None).unwrap_err();
        assert_eq!(err.field, "filter.states");
    }
}
