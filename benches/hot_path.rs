//! Micro-benchmarks of the CPU work the server does per job outside the
//! database and the transport: decoding, validating and hashing a `Submit`,
//! building a `Lease` answer, and applying a `Complete`. Each is measured
//! with a small payload and with a 16 KiB one, the size of an LLM prompt
//! with its context.
//!
//! `cargo bench --bench hot_path`. These figures say how much of the
//! per-job CPU the domain and the proto conversions account for, beside
//! what `intray bench` measures end to end (docs/performance-log.md).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Duration;

use chrono::{DateTime, Utc};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use prost::Message;
use serde_json::{Value, json};
use uuid::Uuid;

use intray::api::convert;
use intray::domain::hash::{HashInput, canonical_form, input_hash};
use intray::domain::validate::{self, Limits};
use intray::domain::webhook::AddressPolicy;
use intray::domain::{Backoff, Job, JobState, transition};
use intray::pb;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The server's defaults, as `intray serve` starts with them.
fn limits() -> Limits {
    Limits {
        default_max_attempts: 3,
        default_backoff: Backoff::try_new(Duration::from_secs(5), Duration::from_secs(300))
            .expect("the default backoff is valid"),
        max_payload_bytes: 1024 * 1024,
        default_lease: Duration::from_secs(60),
        max_lease: Duration::from_secs(3600),
    }
}

/// A payload like the bench's (`small`) or a chat request with 16 KiB of
/// prompt and a few messages (`16KiB`).
fn payloads() -> [(&'static str, Value); 2] {
    let prompt = "Summarise the following document in three sentences. ".repeat(16 * 1024 / 54);
    [
        ("small", json!({"n": 42, "model": "small"})),
        (
            "16KiB",
            json!({
                "model": "gpt-4o-mini",
                "temperature": 0.2,
                "max_tokens": 512,
                "messages": [
                    {"role": "system", "content": "You are a careful summariser."},
                    {"role": "user", "content": prompt},
                ],
                "metadata": {"document_id": "doc-0001", "tenant_plan": "pro", "retry": false},
            }),
        ),
    ]
}

fn submit_request(payload: &Value) -> pb::SubmitRequest {
    pb::SubmitRequest {
        queue: "embeddings".into(),
        kind: "summarise".into(),
        payload: Some(convert::value(payload)),
        idempotency_key: "doc-0001-summary".into(),
        priority: 0,
        labels: [("team".to_string(), "search".to_string())].into(),
        ..Default::default()
    }
}

/// A job as a claim returns it: running, leased to a worker.
fn running_job(payload: &Value, now: DateTime<Utc>) -> Job {
    Job {
        id: Uuid::now_v7(),
        tenant: "default".into(),
        queue: "embeddings".into(),
        kind: "summarise".into(),
        state: JobState::Running,
        payload: payload.clone(),
        result: None,
        error: None,
        attempt: 1,
        max_attempts: 3,
        priority: 0,
        idempotency_key: Some("doc-0001-summary".into()),
        input_hash: "0".repeat(64),
        labels: BTreeMap::from([("team".to_string(), "search".to_string())]),
        progress: 0.0,
        cancel_requested: false,
        cancel_requested_at: None,
        cost_cents: 0,
        lease_owner: Some("worker-1".into()),
        lease_token: Some(Uuid::new_v4().to_string()),
        lease_expires_at: Some(now + chrono::Duration::seconds(60)),
        run_at: now,
        deadline: None,
        backoff: limits().default_backoff,
        callback_url: None,
        max_cost_cents: None,
        created_at: now,
        updated_at: now,
        started_at: Some(now),
        finished_at: None,
        event_seq: 2,
        trace_parent: None,
        leased_at: Some(now),
    }
}

/// What the server does with one `Submit` before the store: decode the
/// message, convert it to the domain's input, validate it and hash it.
fn submit(c: &mut Criterion) {
    let limits = limits();
    let now = Utc::now();
    let mut group = c.benchmark_group("submit_decode_validate_hash");
    for (name, payload) in payloads() {
        let bytes = submit_request(&payload).encode_to_vec();
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let request = pb::SubmitRequest::decode(black_box(bytes.as_slice()))
                    .expect("the request decodes");
                let input = convert::submit_input(request).expect("the request converts");
                validate::submit(input, &limits, &AddressPolicy::default(), now)
                    .expect("the request is valid")
            })
        });
    }
    group.finish();
}

/// The idempotency hash alone (part of `submit` above), and its canonical
/// form.
fn hash(c: &mut Criterion) {
    let labels = BTreeMap::from([("team".to_string(), "search".to_string())]);
    let backoff = limits().default_backoff;
    let mut group = c.benchmark_group("input_hash");
    for (name, payload) in payloads() {
        let input = HashInput {
            queue: "embeddings",
            kind: "summarise",
            payload: &payload,
            priority: 0,
            run_at: None,
            deadline: None,
            max_attempts: 3,
            backoff,
            labels: &labels,
            callback_url: None,
            max_cost_cents: None,
        };
        group.bench_function(name, |b| b.iter(|| input_hash(black_box(&input))));
        // The canonical form alone: the rest of the hash is the digest.
        group.bench_function(format!("{name}/canonical_form"), |b| {
            b.iter(|| canonical_form(black_box(&input)))
        });
    }
    group.finish();
}

/// A `Lease` answer: claimed jobs to proto, encoded; one job (e2e's
/// `max_jobs` 1) and a hundred (burn-down's).
fn lease_response(c: &mut Criterion) {
    let now = Utc::now();
    let mut group = c.benchmark_group("lease_response_encode");
    for (name, payload) in payloads() {
        for n in [1usize, 100] {
            let jobs: Vec<Job> = (0..n).map(|_| running_job(&payload, now)).collect();
            group.throughput(Throughput::Elements(n as u64));
            group.bench_function(format!("{name}/{n}"), |b| {
                b.iter(|| {
                    pb::LeaseResponse {
                        jobs: black_box(&jobs)
                            .iter()
                            .map(|job| convert::leased_job(job, true))
                            .collect(),
                    }
                    .encode_to_vec()
                })
            });
        }
    }
    group.finish();
}

/// One `Complete` with a result the size of the payload: decode, convert,
/// validate, and the state machine's transition of the job.
fn complete(c: &mut Criterion) {
    let limits = limits();
    let now = Utc::now();
    let mut group = c.benchmark_group("complete_decode_validate_transition");
    for (name, payload) in payloads() {
        let job = running_job(&payload, now);
        let token = job.lease_token.clone().unwrap_or_default();
        let bytes = pb::CompleteRequest {
            job_id: job.id.to_string(),
            lease_token: token.clone(),
            outcome: Some(pb::complete_request::Outcome::Success(
                pb::complete_request::Success {
                    result: Some(convert::value(&payload)),
                },
            )),
            cost_cents: 3,
        }
        .encode_to_vec();
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function(name, |b| {
            b.iter_batched(
                || job.clone(),
                |mut job| {
                    let request = pb::CompleteRequest::decode(black_box(bytes.as_slice()))
                        .expect("the request decodes");
                    let outcome =
                        convert::outcome_input(request.outcome).expect("the outcome converts");
                    let spec = validate::complete(
                        &request.job_id,
                        &request.lease_token,
                        outcome,
                        request.cost_cents,
                        &limits,
                    )
                    .expect("the request is valid");
                    transition::complete(&mut job, &spec.lease_token, spec.outcome, 3, now, 0.5)
                        .expect("the lease is current")
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, submit, hash, lease_response, complete);
criterion_main!(benches);
