//! Observability through the real server: the spans of a job's attempts
//! arrive at an in-process fake OTLP collector as one trace under the
//! submitter's context (also when the lease and the outcome go to different
//! replicas, and when the reaper ends an attempt), and `/metrics` shows the
//! jobs the test made.
//!
//! Each server gets its own trace pipeline (`Settings::tracing`), so these
//! tests run in parallel with each other and with the rest of the suite.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use intray::pb;
use intray::telemetry::{TraceParent, Tracing};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, Tracer as _};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use serde_json::json;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

backend_tests!(
    a_failed_then_successful_job_is_one_trace,
    an_http_submit_is_traced_like_a_grpc_one,
    http_actions_name_their_span_and_health_checks_have_none,
    an_attempt_the_reaper_ends_has_its_span,
    metrics_show_the_jobs_made,
    an_attempt_whose_complete_caller_left_is_still_reported,
    an_attempt_whose_complete_batch_caller_left_is_still_reported,
    a_call_its_client_gave_up_on_is_counted,
    without_tracing_a_worker_continues_the_submitters_trace,
);

/// (PostgreSQL: the call is held on a row lock, and SQLite's writer lock
/// would hold every write.)
mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_http_call_its_client_left_is_counted() {
        super::an_http_call_its_client_left_is_counted().await
    }
}

// ---------------------------------------------------------------------------
// Fake collector
// ---------------------------------------------------------------------------

struct FakeCollector {
    tx: mpsc::UnboundedSender<ExportTraceServiceRequest>,
}

#[tonic::async_trait]
impl TraceService for FakeCollector {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let _ = self.tx.send(req.into_inner());
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A collector on 127.0.0.1:0 and the spans it received so far.
struct Collector {
    addr: SocketAddr,
    rx: mpsc::UnboundedReceiver<ExportTraceServiceRequest>,
    spans: Vec<Span>,
}

impl Collector {
    async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the collector");
        let addr = listener.local_addr().expect("collector address");
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(FakeCollector { tx }))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Collector {
            addr,
            rx,
            spans: Vec::new(),
        }
    }

    /// A trace pipeline exporting here; built inside the test's runtime.
    fn pipeline(&self) -> Tracing {
        Tracing::to_endpoint(&format!("http://{}", self.addr)).expect("build the OTLP exporter")
    }

    /// Receives until `done` holds for the spans so far, from a server in
    /// another process (which exports on its own schedule), or panics after
    /// 15 s.
    async fn received(&mut self, what: &str, done: impl Fn(&[Span]) -> bool) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(15);
        while !done(&self.spans) {
            let next = tokio::time::timeout_at(give_up, self.rx.recv()).await;
            let Ok(Some(req)) = next else {
                panic!(
                    "collector never saw {what}; got {:#?}",
                    self.spans.iter().map(|s| &s.name).collect::<Vec<_>>()
                );
            };
            for rs in req.resource_spans {
                for ss in rs.scope_spans {
                    self.spans.extend(ss.spans);
                }
            }
        }
    }

    /// Receives until `done` holds for the spans so far (flushing `tracing`
    /// meanwhile), or panics after 15 s.
    async fn until(&mut self, tracing: &Tracing, what: &str, done: impl Fn(&[Span]) -> bool) {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(15);
        while !done(&self.spans) {
            tracing.flush().await;
            while let Ok(req) = self.rx.try_recv() {
                for rs in req.resource_spans {
                    for ss in rs.scope_spans {
                        self.spans.extend(ss.spans);
                    }
                }
            }
            if done(&self.spans) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "collector never saw {what}; got {:#?}",
                self.spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
        .map(|v| match v {
            AnyValue::StringValue(s) => s.clone(),
            AnyValue::IntValue(i) => i.to_string(),
            AnyValue::BoolValue(b) => b.to_string(),
            AnyValue::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
}

fn status_code(span: &Span) -> i32 {
    span.status.as_ref().map_or(0, |s| s.code)
}

fn attempts_in(spans: &[Span], trace_id: &[u8]) -> Vec<Span> {
    let mut attempts: Vec<Span> = spans
        .iter()
        .filter(|s| s.name == "job.attempt" && s.trace_id == trace_id)
        .cloned()
        .collect();
    attempts.sort_by_key(|s| attr(s, "job.attempt"));
    attempts
}

/// The spans of one trace as an indented tree, for the eye.
fn tree(spans: &[Span], trace_id: &[u8]) -> String {
    let in_trace: Vec<&Span> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let mut children: BTreeMap<Vec<u8>, Vec<&Span>> = BTreeMap::new();
    for s in &in_trace {
        children
            .entry(s.parent_span_id.clone())
            .or_default()
            .push(s);
    }
    let known: Vec<Vec<u8>> = in_trace.iter().map(|s| s.span_id.clone()).collect();
    let mut out = format!("trace {}\n", hex::encode(trace_id));
    fn walk(
        out: &mut String,
        children: &BTreeMap<Vec<u8>, Vec<&Span>>,
        parent: &[u8],
        depth: usize,
    ) {
        let mut kids = children.get(parent).cloned().unwrap_or_default();
        kids.sort_by_key(|s| s.start_time_unix_nano);
        for s in kids {
            let ms = s.end_time_unix_nano.saturating_sub(s.start_time_unix_nano) / 1_000_000;
            let mut attrs: Vec<String> = s
                .attributes
                .iter()
                .filter(|kv| !kv.key.starts_with("rpc."))
                .map(|kv| format!("{}={}", kv.key, attr(s, &kv.key).unwrap_or_default()))
                .collect();
            attrs.sort();
            let status = match StatusCode::try_from(status_code(s)) {
                Ok(StatusCode::Error) => " ERROR",
                Ok(StatusCode::Ok) => " OK",
                _ => "",
            };
            out.push_str(&format!(
                "{}{} [{}] {ms} ms{status} {}\n",
                "  ".repeat(depth + 1),
                s.name,
                hex::encode(&s.span_id),
                attrs.join(" ")
            ));
            walk(out, children, &s.span_id, depth + 1);
        }
    }
    // Roots: spans whose parent is not in the collected trace (the caller's).
    let roots: Vec<Vec<u8>> = children
        .keys()
        .filter(|p| !known.contains(p))
        .cloned()
        .collect();
    for root in roots {
        out.push_str(&format!("  (caller {})\n", hex::encode(&root)));
        walk(&mut out, &children, &root, 1);
    }
    out
}

/// A submit carrying the caller's `traceparent`.
fn traced_submit(traceparent: &str, r: pb::SubmitRequest) -> tonic::Request<pb::SubmitRequest> {
    traced(traceparent, r)
}

/// A request carrying the caller's `traceparent`.
fn traced<T>(traceparent: &str, r: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(r);
    request.metadata_mut().insert(
        "traceparent",
        traceparent.parse().expect("traceparent is valid metadata"),
    );
    request
}

/// `POST /api/v1/jobs` with `body` for tenant `acme`, carrying the caller's
/// `traceparent`: the status line and the JSON body of the answer.
async fn http_submit(
    addr: SocketAddr,
    traceparent: &str,
    body: &serde_json::Value,
) -> (String, serde_json::Value) {
    http_post(addr, "/api/v1/jobs", traceparent, body).await
}

/// `POST path` with `body` for tenant `acme`, carrying the caller's
/// `traceparent`: the status line and the JSON body of the answer.
async fn http_post(
    addr: SocketAddr,
    path: &str,
    traceparent: &str,
    body: &serde_json::Value,
) -> (String, serde_json::Value) {
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nx-intray-tenant: acme\r\n\
         traceparent: {traceparent}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (head, body) = http_exchange(addr, &request).await;
    let status = head.lines().next().unwrap_or_default().to_owned();
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    (status, json)
}

fn caller_context() -> (TraceParent, String) {
    let caller = TraceParent {
        trace_id: rand::random(),
        span_id: rand::random(),
        flags: 1,
    };
    (caller, caller.to_string())
}

// ---------------------------------------------------------------------------
// Traces
// ---------------------------------------------------------------------------

/// The HTTP API's `POST /api/v1/jobs` has a server span of its own in the
/// caller's trace, and the job's attempt nests under it, as under a gRPC
/// `Submit`.
async fn an_http_submit_is_traced_like_a_grpc_one(backend: Backend) {
    let mut collector = Collector::start().await;
    let tracing = collector.pipeline();
    let server = TestServer::start_with(backend, |s| s.tracing = tracing.clone()).await;
    let mut workers = server.workers_client("acme");
    let (caller, header) = caller_context();

    let (status, job) = http_submit(
        server.http_addr,
        &header,
        &json!({"queue": "obs-http", "kind": "embed", "payload": {}}),
    )
    .await;
    assert!(status.contains(" 202 "), "{status}: {job}");
    let leased = lease_one(&mut workers, "w-1", "obs-http").await;
    assert_eq!(Some(leased.job_id.as_str()), job["id"].as_str());
    complete_ok(&mut workers, &leased).await;

    let trace_id = caller.trace_id.to_vec();
    collector
        .until(&tracing, "the HTTP call's span and the attempt", |spans| {
            attempts_in(spans, &trace_id).len() == 1
                && spans.iter().any(|s| s.name == "POST /api/v1/jobs")
        })
        .await;
    let spans = &collector.spans;
    eprintln!("{}", tree(spans, &trace_id));
    let call = spans
        .iter()
        .find(|s| s.name == "POST /api/v1/jobs" && s.trace_id == trace_id)
        .expect("the HTTP call's span in the caller's trace");
    assert_eq!(
        call.parent_span_id,
        caller.span_id.to_vec(),
        "under the caller's span"
    );
    assert_eq!(call.kind, SpanKind::Server as i32);
    assert_eq!(attr(call, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(attr(call, "http.route").as_deref(), Some("/api/v1/jobs"));
    assert_eq!(
        attr(call, "http.response.status_code").as_deref(),
        Some("202")
    );
    assert_eq!(status_code(call), StatusCode::Unset as i32);
    let attempts = attempts_in(spans, &trace_id);
    assert_eq!(
        attempts[0].parent_span_id, call.span_id,
        "the attempt under the HTTP call"
    );
    let given = TraceParent::parse(&leased.traceparent).expect("LeasedJob.traceparent");
    assert_eq!(
        given.trace_id.to_vec(),
        trace_id,
        "the worker got the caller's trace"
    );
    server.stop().await;
}

/// A custom method's span is named with its action (a cancel and a pause
/// would otherwise share `POST /api/v1/...{id}` with every other `POST`
/// there), and a gRPC health check, which a kubelet sends every few
/// seconds, makes no span, even when it carries a `traceparent`.
async fn http_actions_name_their_span_and_health_checks_have_none(backend: Backend) {
    let mut collector = Collector::start().await;
    let tracing = collector.pipeline();
    let server = TestServer::start_with(backend, |s| s.tracing = tracing.clone()).await;
    let (caller, header) = caller_context();

    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel());
    health
        .check(traced(
            &header,
            tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            },
        ))
        .await
        .expect("health check");
    let (status, job) = http_submit(
        server.http_addr,
        &header,
        &json!({"queue": "obs-action", "kind": "embed", "payload": {}}),
    )
    .await;
    assert!(status.contains(" 202 "), "{status}: {job}");
    let id = job["id"].as_str().expect("the job's id");
    let (status, cancelled) = http_post(
        server.http_addr,
        &format!("/api/v1/jobs/{id}:cancel"),
        &header,
        &json!({"reason": "test"}),
    )
    .await;
    assert!(status.contains(" 200 "), "{status}: {cancelled}");

    let trace_id = caller.trace_id.to_vec();
    let route = "/api/v1/jobs/{id}:cancel";
    let name = format!("POST {route}");
    collector
        .until(&tracing, "the cancel's span", |spans| {
            spans.iter().any(|s| s.name == name)
        })
        .await;
    let spans = &collector.spans;
    let cancel = spans
        .iter()
        .find(|s| s.name == name)
        .expect("the cancel's span");
    assert_eq!(cancel.trace_id, trace_id, "in the caller's trace");
    assert_eq!(attr(cancel, "http.route").as_deref(), Some(route));
    assert_eq!(
        attr(cancel, "url.path").as_deref(),
        Some(format!("/api/v1/jobs/{id}:cancel").as_str())
    );
    // The health check ended before the cancel began, so a span of it
    // would have been exported by the same flush or an earlier one.
    let health_spans: Vec<_> = spans
        .iter()
        .filter(|s| s.name.starts_with("grpc.health.v1.Health"))
        .map(|s| &s.name)
        .collect();
    assert!(health_spans.is_empty(), "{health_spans:?}");
    server.stop().await;
}

/// A server that exports no spans hands a worker the submitter's own trace
/// context, or none: the attempt span's context, which it used to hand,
/// left the worker's spans under a parent that was never exported.
/// The built binary, which installs the process's tracing subscriber (an
/// in-process test server has its own trace pipeline but no global
/// subscriber, so the store's spans of `tracing` reach no exporter there).
mod binary {
    #[tokio::test]
    async fn a_detached_writes_span_nests_under_its_call() {
        super::a_detached_writes_span_nests_under_its_call().await
    }
}

/// A write a handler runs in a task of its own, so that it commits though
/// the caller leaves (`Cancel`'s), still has its span under the call's: a
/// spawned task starts outside every span, and `store.cancel` was a trace
/// of its own.
async fn a_detached_writes_span_nests_under_its_call() {
    let mut collector = Collector::start().await;
    let dir = tempfile::tempdir().expect("temporary directory");
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
    };
    let (grpc, http) = (free(), free());
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_intray"));
    for (key, _) in std::env::vars() {
        if key.starts_with("INTRAY_") || key.starts_with("OTEL_") {
            command.env_remove(key);
        }
    }
    let _serve = command
        .arg("serve")
        .args([
            "--database-url",
            &format!("sqlite://{}", dir.path().join("t.db").display()),
        ])
        .args([
            "--grpc-addr",
            &grpc.to_string(),
            "--http-addr",
            &http.to_string(),
        ])
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://{}", collector.addr),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start intray serve");
    let channel = within(Duration::from_secs(20), "the server to listen", async {
        loop {
            let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                .expect("endpoint");
            if let Ok(channel) = endpoint.connect().await {
                return channel;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let mut jobs = pb::job_service_client::JobServiceClient::new(channel);
    let job = jobs
        .submit(submit_req("obs", "k", json!({})))
        .await
        .expect("Submit")
        .into_inner()
        .job
        .expect("job");
    let (caller, header) = caller_context();
    let cancel = pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "traced".into(),
    };
    jobs.cancel(traced(&header, cancel)).await.expect("Cancel");

    let trace_id = caller.trace_id.to_vec();
    let in_trace = |spans: &[Span], name: &str| {
        spans
            .iter()
            .find(|s| s.name == name && s.trace_id == trace_id)
            .cloned()
    };
    collector
        .received("Cancel and store.cancel in one trace", |spans| {
            in_trace(spans, "intray.v1.JobService/Cancel").is_some()
                && in_trace(spans, "store.cancel").is_some()
        })
        .await;
    let call = in_trace(&collector.spans, "intray.v1.JobService/Cancel").expect("the call");
    let write = in_trace(&collector.spans, "store.cancel").expect("the write");
    assert_eq!(
        write.parent_span_id, call.span_id,
        "the write under its call"
    );
}

async fn without_tracing_a_worker_continues_the_submitters_trace(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("acme");
    let mut workers = server.workers_client("acme");
    let (_, header) = caller_context();
    jobs.submit(traced_submit(&header, submit_req("plain", "k", json!({}))))
        .await
        .expect("Submit");
    let leased = lease_one(&mut workers, "w", "plain").await;
    assert_eq!(leased.traceparent, header, "the submitter's, as given");
    submit(&mut jobs, "plain", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "plain").await;
    assert_eq!(leased.traceparent, "", "none to continue");
    server.stop().await;
}

async fn a_failed_then_successful_job_is_one_trace(backend: Backend) {
    let mut collector = Collector::start().await;
    let tracing = collector.pipeline();
    let server = TestServer::start_with(backend, |s| s.tracing = tracing.clone()).await;
    let mut jobs = server.jobs_client("acme");
    let mut workers = server.workers_client("acme");
    let (caller, header) = caller_context();

    let mut r = submit_req("obs", "embed", json!({"doc": "secret payload"}));
    r.max_attempts = Some(3);
    let job = jobs
        .submit(traced_submit(&header, r))
        .await
        .expect("Submit succeeds")
        .into_inner()
        .job
        .expect("job");

    let first = lease_one(&mut workers, "w-1", "obs").await;
    let mut failure = failure_req(
        &first,
        "rate_limited",
        Some(true),
        Some(Duration::from_millis(10)),
    );
    failure.cost_cents = 2;
    workers
        .complete(failure)
        .await
        .expect("Complete(failure) succeeds");
    let second = lease_one(&mut workers, "w-2", "obs").await;
    assert_eq!(second.attempt, 2);

    // The worker nests its own span under the attempt, as a worker library would.
    let carrier = HashMap::from([("traceparent".to_owned(), second.traceparent.clone())]);
    let worker_cx = TraceContextPropagator::new().extract(&carrier);
    let tracer = tracing.tracer().expect("tracing is on");
    let mut worker_span = tracer.start_with_context("worker.embed", &worker_cx);
    worker_span.end();
    complete_ok(&mut workers, &second).await;

    let trace_id = caller.trace_id.to_vec();
    collector
        .until(
            &tracing,
            "two attempts, the worker span and Submit",
            |spans| {
                attempts_in(spans, &trace_id).len() == 2
                    && spans.iter().any(|s| s.name == "worker.embed")
                    && spans.iter().any(|s| s.name.ends_with("JobService/Submit"))
            },
        )
        .await;
    let spans = &collector.spans;
    eprintln!("{}", tree(spans, &trace_id));

    // Submit's server span continues the caller's context...
    let submit = spans
        .iter()
        .find(|s| s.name == "intray.v1.JobService/Submit" && s.trace_id == trace_id)
        .expect("a Submit server span in the caller's trace");
    assert_eq!(submit.parent_span_id, caller.span_id.to_vec());
    // ... and each attempt is exactly one span, a child of it.
    let attempts = attempts_in(spans, &trace_id);
    assert_eq!(attempts.len(), 2, "exactly one span per attempt");
    for (i, (span, leased)) in attempts.iter().zip([&first, &second]).enumerate() {
        assert_eq!(
            span.parent_span_id, submit.span_id,
            "attempt {i} under Submit"
        );
        let given = TraceParent::parse(&leased.traceparent).expect("LeasedJob.traceparent");
        assert_eq!(
            given.trace_id.to_vec(),
            trace_id,
            "the worker got the job's trace"
        );
        assert_eq!(
            span.span_id,
            given.span_id.to_vec(),
            "the span the worker was told"
        );
        assert_eq!(attr(span, "job.id").as_deref(), Some(job.id.as_str()));
        assert_eq!(attr(span, "job.kind").as_deref(), Some("embed"));
        assert_eq!(attr(span, "job.queue").as_deref(), Some("obs"));
        assert_eq!(attr(span, "tenant").as_deref(), Some("acme"));
        assert_eq!(attr(span, "job.attempt"), Some((i + 1).to_string()));
        assert!(
            attr(span, "job.queue_wait_ms").is_some(),
            "queue wait recorded"
        );
        assert!(span.start_time_unix_nano <= span.end_time_unix_nano);
    }
    let (a1, a2) = (&attempts[0], &attempts[1]);
    assert_eq!(attr(a1, "worker.id").as_deref(), Some("w-1"));
    assert_eq!(attr(a1, "job.outcome").as_deref(), Some("retry_scheduled"));
    assert_eq!(attr(a1, "error.class").as_deref(), Some("rate_limited"));
    assert_eq!(attr(a1, "error.type").as_deref(), Some("rate_limited"));
    assert_eq!(attr(a1, "messaging.system").as_deref(), Some("intray"));
    assert_eq!(
        attr(a1, "messaging.operation.type").as_deref(),
        Some("process")
    );
    assert_eq!(
        attr(a1, "messaging.destination.name").as_deref(),
        Some("obs")
    );
    assert_eq!(attr(a1, "job.cost_cents").as_deref(), Some("2"));
    assert_eq!(status_code(a1), StatusCode::Error as i32);
    assert_eq!(attr(a2, "worker.id").as_deref(), Some("w-2"));
    assert_eq!(attr(a2, "job.outcome").as_deref(), Some("succeeded"));
    assert_eq!(attr(a2, "error.class"), None);
    assert_eq!(status_code(a2), StatusCode::Ok as i32);
    assert!(
        a1.end_time_unix_nano <= a2.start_time_unix_nano,
        "attempts in order"
    );

    let worker = spans
        .iter()
        .find(|s| s.name == "worker.embed")
        .expect("worker span");
    assert_eq!(worker.trace_id, trace_id);
    assert_eq!(
        worker.parent_span_id, a2.span_id,
        "worker span under its attempt"
    );
    // Payloads never reach spans.
    assert!(spans.iter().all(|s| {
        s.attributes
            .iter()
            .all(|kv| !format!("{:?}", kv.value).contains("secret payload"))
    }));

    server.stop().await;
    tracing.shutdown().await;
}

/// Lease on one replica, outcome on another: the attempt's span comes from
/// the replica that ended it, with the ids the first one gave the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_and_complete_on_two_replicas() {
    let mut leaser_collector = Collector::start().await;
    let mut completer_collector = Collector::start().await;
    let leaser_tracing = leaser_collector.pipeline();
    let completer_tracing = completer_collector.pipeline();
    let leaser = TestServer::start_with(Backend::Postgres, |s| {
        s.tracing = leaser_tracing.clone();
    })
    .await;
    let completer = leaser
        .start_replica_with(|s| s.tracing = completer_tracing.clone())
        .await;
    let (caller, header) = caller_context();
    let mut jobs = leaser.jobs_client("acme");
    jobs.submit(traced_submit(
        &header,
        submit_req("obs", "embed", json!({})),
    ))
    .await
    .expect("Submit succeeds");
    let leased = lease_one(&mut leaser.workers_client("acme"), "w-1", "obs").await;
    complete_ok(&mut completer.workers_client("acme"), &leased).await;

    let trace_id = caller.trace_id.to_vec();
    leaser_collector
        .until(&leaser_tracing, "Submit", |spans| {
            spans.iter().any(|s| s.name.ends_with("JobService/Submit"))
        })
        .await;
    completer_collector
        .until(&completer_tracing, "the attempt", |spans| {
            attempts_in(spans, &trace_id).len() == 1
        })
        .await;
    let submit = leaser_collector
        .spans
        .iter()
        .find(|s| s.name.ends_with("JobService/Submit"))
        .expect("Submit span");
    let attempt = &attempts_in(&completer_collector.spans, &trace_id)[0];
    let given = TraceParent::parse(&leased.traceparent).expect("LeasedJob.traceparent");
    assert_eq!(attempt.span_id, given.span_id.to_vec());
    assert_eq!(attempt.parent_span_id, submit.span_id);
    assert_eq!(attr(attempt, "job.outcome").as_deref(), Some("succeeded"));
    assert_eq!(attr(attempt, "worker.id").as_deref(), Some("w-1"));
    assert!(
        attempts_in(&leaser_collector.spans, &trace_id).is_empty(),
        "only the replica that ended the attempt emits it"
    );
    completer.stop().await;
    leaser.stop().await;
    leaser_tracing.shutdown().await;
    completer_tracing.shutdown().await;
}

async fn an_attempt_the_reaper_ends_has_its_span(backend: Backend) {
    let mut collector = Collector::start().await;
    let tracing = collector.pipeline();
    let server = TestServer::start_with(backend, |s| {
        s.tracing = tracing.clone();
        s.reaper_interval = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("acme");
    let mut workers = server.workers_client("acme");
    // No caller context: the job joins the trace its Submit call started.
    submit(&mut jobs, "obs", "embed", json!({})).await;
    let leased = workers
        .lease(short_lease_req("w-gone", "obs", 1, Duration::from_secs(5)))
        .await
        .expect("Lease succeeds")
        .into_inner()
        .jobs
        .pop()
        .expect("one job");
    let given = TraceParent::parse(&leased.traceparent).expect("LeasedJob.traceparent");
    let trace_id = given.trace_id.to_vec();
    collector
        .until(&tracing, "the reclaimed attempt", |spans| {
            attempts_in(spans, &trace_id).len() == 1
        })
        .await;
    let submit = collector
        .spans
        .iter()
        .find(|s| s.name.ends_with("JobService/Submit"))
        .expect("Submit span");
    assert_eq!(submit.trace_id, trace_id, "the Submit call's trace");
    assert!(submit.parent_span_id.is_empty(), "Submit started the trace");
    let attempt = &attempts_in(&collector.spans, &trace_id)[0];
    assert_eq!(attempt.span_id, given.span_id.to_vec());
    assert_eq!(attempt.parent_span_id, submit.span_id);
    assert_eq!(
        attr(attempt, "job.outcome").as_deref(),
        Some("lease_expired")
    );
    assert_eq!(
        attr(attempt, "error.class").as_deref(),
        Some("lease_expired")
    );
    assert_eq!(status_code(attempt), StatusCode::Error as i32);
    let metrics = parse(&scrape(server.http_addr).await);
    assert_eq!(
        metrics.get("intray_lease_expirations_total{queue=\"obs\"}"),
        Some(&1.0),
        "the lease that ran out is counted"
    );
    server.stop().await;
    tracing.shutdown().await;
}

/// The status a client sees when its own deadline ends its call.
fn gave_up(status: tonic::Status) {
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
}

/// Scrapes `/metrics` until the series `keys` add up to 1.
async fn counted_once(server: &TestServer, keys: &[&str], what: &str) {
    within(Duration::from_secs(10), what, async {
        loop {
            let metrics = parse(&scrape(server.http_addr).await);
            let sum: f64 = keys.iter().filter_map(|k| metrics.get(*k)).sum();
            if sum == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// A `Complete` whose caller gives up (its deadline passes) while the
/// outcome waits for the database still ends the attempt once it commits,
/// and the attempt is reported as any other: its span and its metrics.
/// Before, the answer for a caller gone was dropped with its report.
async fn an_attempt_whose_complete_caller_left_is_still_reported(backend: Backend) {
    reported_though_its_caller_left(backend, false).await;
}

/// The same through `CompleteBatch`, whose handler reported the outcomes
/// after the write: a caller gone mid-commit took the reports with it.
async fn an_attempt_whose_complete_batch_caller_left_is_still_reported(backend: Backend) {
    reported_though_its_caller_left(backend, true).await;
}

/// An outcome sent by `Complete` (or `CompleteBatch` when `batch`) whose
/// caller gives up while the database holds it is reported once it
/// commits.
async fn reported_though_its_caller_left(backend: Backend, batch: bool) {
    use sqlx::Connection;
    let mut collector = Collector::start().await;
    let tracing = collector.pipeline();
    let server = TestServer::start_with(backend, |s| s.tracing = tracing.clone()).await;
    let mut jobs = server.jobs_client("acme");
    let mut workers = server.workers_client("acme");
    submit(&mut jobs, "gone", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "gone").await;
    let trace_id = TraceParent::parse(&leased.traceparent)
        .expect("LeasedJob.traceparent")
        .trace_id
        .to_vec();
    let url = server.settings.database_url.clone();
    // The job's row held (PostgreSQL) or the database's writer (SQLite).
    let release: Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()>> = match backend {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&url).await.expect("connect");
            sqlx::raw_sql("BEGIN").execute(&mut c).await.expect("BEGIN");
            sqlx::query("SELECT 1 FROM jobs WHERE id = $1::uuid FOR UPDATE")
                .bind(&leased.job_id)
                .execute(&mut c)
                .await
                .expect("lock the row");
            Box::new(move || {
                Box::pin(async move {
                    sqlx::raw_sql("COMMIT")
                        .execute(&mut c)
                        .await
                        .expect("COMMIT");
                })
            })
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&url)
                .await
                .expect("connect");
            sqlx::raw_sql("BEGIN IMMEDIATE")
                .execute(&mut c)
                .await
                .expect("take the writer");
            Box::new(move || {
                Box::pin(async move {
                    sqlx::raw_sql("COMMIT")
                        .execute(&mut c)
                        .await
                        .expect("COMMIT");
                })
            })
        }
    };
    let outcome = success_req(&leased, json!({"ok": true}));
    let refused = if batch {
        let mut request = tonic::Request::new(pb::CompleteBatchRequest {
            items: vec![outcome],
        });
        request.set_timeout(Duration::from_millis(300));
        workers
            .complete_batch(request)
            .await
            .expect_err("the caller gives up first")
    } else {
        let mut request = tonic::Request::new(outcome);
        request.set_timeout(Duration::from_millis(300));
        workers
            .complete(request)
            .await
            .expect_err("the caller gives up first")
    };
    gave_up(refused);
    release().await;

    let attempts =
        r#"intray_attempts_total{queue="gone",kind="k",outcome="succeeded",error_class=""}"#;
    counted_once(&server, &[attempts], "the attempt counted").await;
    collector
        .until(&tracing, "the attempt's span", |spans| {
            attempts_in(spans, &trace_id).len() == 1
        })
        .await;
    let attempt = &attempts_in(&collector.spans, &trace_id)[0];
    assert_eq!(attr(attempt, "job.outcome").as_deref(), Some("succeeded"));
    server.stop().await;
    tracing.shutdown().await;
}

/// A call whose client's deadline passes first is dropped by tonic before
/// it answers; it is counted all the same, as `DEADLINE_EXCEEDED` (it was
/// not counted at all, and its span ended without a status), or as
/// `CANCELLED` when the client's reset reaches the server first.
async fn a_call_its_client_gave_up_on_is_counted(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut workers = server.workers_client("acme");
    let mut request = tonic::Request::new(lease_req("w", "nothing", 1, Duration::from_secs(5)));
    request.set_timeout(Duration::from_millis(300));
    gave_up(
        workers
            .lease(request)
            .await
            .expect_err("the long-poll outlasts the client's deadline"),
    );
    // DEADLINE_EXCEEDED when the server's own timer fires first; CANCELLED
    // when the client's reset arrives a moment before it (the server
    // started its clock after the client).
    counted_once(
        &server,
        &[
            r#"intray_rpc_responses_total{method="/intray.v1.WorkerService/Lease",code="DEADLINE_EXCEEDED"}"#,
            r#"intray_rpc_responses_total{method="/intray.v1.WorkerService/Lease",code="CANCELLED"}"#,
        ],
        "the call counted",
    )
    .await;
    server.stop().await;
}

/// An HTTP call whose client closes the connection before the answer is
/// counted, as `CANCELLED` (HTTP has no deadline header), as on the gRPC
/// port. The submit waits on an idempotency key another open transaction
/// holds while its client goes away. Before, the gateway counted a call only
/// when it answered, and a dropped one never.
async fn an_http_call_its_client_left_is_counted() {
    use sqlx::Connection;
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start(Backend::Postgres).await;
    let mut jobs = server.jobs_client("default");
    let other = submit(&mut jobs, "elsewhere", "k", json!({})).await;
    let url = server.settings.database_url.clone();
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("connect");
    take_key(&mut holder, &other.id).await;
    let body = json!({"queue": "left", "kind": "k", "payload": {}, "idempotency_key": "taken"})
        .to_string();
    let mut client = tokio::net::TcpStream::connect(server.http_addr)
        .await
        .expect("connect to the HTTP port");
    client
        .write_all(
            format!(
                "POST /api/v1/jobs HTTP/1.1\r\nhost: localhost\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .expect("send the request");
    waits_on_a_lock(&mut watcher, "the submit waits for the key").await;
    drop(client);
    // Counted while the submit still waits on the lock: the call was
    // dropped, not answered.
    counted_once(
        &server,
        &[r#"intray_rpc_responses_total{method="/intray.v1.JobService/Submit",code="CANCELLED"}"#],
        "the call counted",
    )
    .await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("ROLLBACK");
    server.stop().await;
}

// ---------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------

async fn metrics_show_the_jobs_made(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.metrics_refresh = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("m");
    let mut workers = server.workers_client("m");
    // Three runnable jobs, the oldest runnable since 90 s ago.
    for age in [90, 30, 0] {
        let mut r = submit_req("depth", "embed", json!({}));
        r.run_at = Some(ts(chrono::Utc::now() - chrono::Duration::seconds(age)));
        submit_with(&mut jobs, r).await;
    }
    // Two jobs in the dead set.
    make_failed(&mut jobs, &mut workers, "dead", "bad_input").await;
    make_failed(&mut jobs, &mut workers, "dead", "bad_input").await;

    let queued = r#"intray_jobs{tenant="m",queue="depth",state="queued"}"#;
    let failed = r#"intray_jobs{tenant="m",queue="dead",state="failed"}"#;
    // One worker ("failer") leased both: it counts once, on its queue only.
    let workers = r#"intray_workers{tenant="m",queue="dead"}"#;
    let metrics = within(Duration::from_secs(10), "the gauges to refresh", async {
        loop {
            let metrics = parse(&scrape(server.http_addr).await);
            if metrics.get(queued) == Some(&3.0)
                && metrics.get(failed) == Some(&2.0)
                && metrics.get(workers) == Some(&1.0)
            {
                return metrics;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(
        metrics.get(r#"intray_workers{tenant="m",queue="depth"}"#),
        None,
        "no worker leased from depth"
    );
    let age = metrics[r#"intray_oldest_runnable_job_age_seconds{tenant="m",queue="depth"}"#];
    assert!((90.0..120.0).contains(&age), "oldest runnable age {age}");
    assert_eq!(
        metrics[r#"intray_oldest_runnable_job_age_seconds{tenant="m",queue="dead"}"#], 0.0,
        "nothing runnable"
    );
    assert_eq!(
        metrics[r#"intray_jobs{tenant="m",queue="depth",state="running"}"#],
        0.0
    );
    assert_eq!(
        metrics[r#"intray_dead_set_arrivals_total{queue="dead",kind="fail",error_class="bad_input"}"#],
        2.0
    );
    assert_eq!(
        metrics[r#"intray_attempts_total{queue="dead",kind="fail",outcome="failed",error_class="bad_input"}"#],
        2.0
    );
    assert_eq!(
        metrics[r#"intray_queue_wait_seconds_count{queue="dead"}"#],
        2.0
    );
    assert_eq!(
        metrics[r#"intray_attempt_duration_seconds_count{queue="dead",kind="fail"}"#],
        2.0
    );
    assert!(
        metrics[r#"intray_rpc_responses_total{method="/intray.v1.JobService/Submit",code="OK"}"#]
            >= 5.0
    );
    assert!(metrics.contains_key("intray_long_polling_workers"));
    server.stop().await;
}
