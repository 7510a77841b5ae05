//! The JSON API on the HTTP port, through real HTTP/1.1 on both backends:
//! every route, the error mapping, the event stream's resume with
//! `Last-Event-ID`, authentication and roles, and the OpenAPI document
//! against what the router serves. Jobs are driven through their states
//! with the gRPC clients, so both faces are seen to share one service.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use intray::config::{HttpReadTimeouts, RateLimit};
use intray::pb::JobState;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

backend_tests!(
    submit_poll_and_idempotency,
    bad_input_is_400_naming_the_field,
    list_filters_and_pages,
    cancel_and_its_errors,
    retry_by_filter_with_dry_run,
    dead_set_is_grouped_by_error_class_and_queue,
    stats_and_pause_resume,
    event_stream_resumes_after_last_event_id,
    open_event_stream_ends_at_shutdown,
    authentication_and_roles,
    rate_limit_and_queue_bound_are_429_with_retry_after,
    submit_batch_answers_each_item,
    null_fields_are_fields_left_out,
    routes_refuse_what_they_do_not_take,
    openapi_lists_every_route_the_router_serves,
    dashboard_and_metrics_are_served,
    unknown_host_names_are_refused_in_open_mode,
    probes_answer_any_host_and_readiness_fails_while_draining,
    a_resumed_event_stream_draws_one_token,
    clients_that_stall_are_cut_off,
);

/// One HTTP answer.
struct Reply {
    status: u16,
    headers: hyper::HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {} body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
    }

    /// Asserts an error answer: the status and the gRPC code's name.
    fn expect_error(&self, status: u16, code: &str) -> Value {
        let body = self.json();
        assert_eq!(
            (self.status, body["code"].as_str()),
            (status, Some(code)),
            "{body}"
        );
        assert!(
            body["message"].is_string() && body["details"].is_array(),
            "{body}"
        );
        body
    }
}

/// A client of the HTTP port: a fresh connection per request.
#[derive(Clone)]
struct Http {
    addr: SocketAddr,
    host: String,
    headers: Vec<(String, String)>,
}

impl Http {
    fn new(server: &TestServer) -> Http {
        Http {
            addr: server.http_addr,
            host: "localhost".into(),
            headers: Vec::new(),
        }
    }

    /// Requests naming `host` as the server's host name.
    fn host(mut self, host: &str) -> Http {
        self.host = host.into();
        self
    }

    fn with(mut self, name: &str, value: &str) -> Http {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn token(self, token: &str) -> Http {
        self.with("authorization", &format!("Bearer {token}"))
    }

    async fn open(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> hyper::Response<hyper::body::Incoming> {
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .expect("connect to the HTTP port");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP/1.1 handshake");
        tokio::spawn(conn);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        if body.is_some() {
            request = request.header("content-type", "application/json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("valid request");
        tokio::time::timeout(Duration::from_secs(20), sender.send_request(request))
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no answer within 20 s"))
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    async fn send(&self, method: &str, path: &str, body: Option<String>) -> Reply {
        let response = self.open(method, path, body).await;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = tokio::time::timeout(Duration::from_secs(20), response.into_body().collect())
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: body not complete within 20 s"))
            .expect("read body")
            .to_bytes()
            .to_vec();
        Reply {
            status,
            headers,
            body,
        }
    }

    async fn get(&self, path: &str) -> Reply {
        self.send("GET", path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Reply {
        self.send("POST", path, Some(body.to_string())).await
    }
}

fn job_body(queue: &str, kind: &str, payload: Value) -> Value {
    json!({"queue": queue, "kind": kind, "payload": payload})
}

async fn submit_http(http: &Http, queue: &str, kind: &str) -> Value {
    let reply = http
        .post("/api/v1/jobs", job_body(queue, kind, json!({"n": 1})))
        .await;
    assert_eq!(
        reply.status,
        202,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()
}

fn id_of(job: &Value) -> String {
    job["id"].as_str().expect("job id").to_owned()
}

async fn submit_poll_and_idempotency(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);

    let keyed = http.clone().with("idempotency-key", "order-42");
    let body = job_body("mail", "send", json!({"to": "a@example.com", "n": 5}));
    let first = keyed.post("/api/v1/jobs", body.clone()).await;
    assert_eq!(first.status, 202);
    let job = first.json();
    let id = id_of(&job);
    assert_eq!(first.header("location"), format!("/api/v1/jobs/{id}"));
    assert_eq!(job["state"], "JOB_STATE_QUEUED");
    assert_eq!(job["idempotencyKey"], "order-42");
    assert_eq!(
        job["payload"],
        json!({"to": "a@example.com", "n": 5}),
        "a whole number comes back as it was written, not as 5.0"
    );

    // Poll it where Location says, and see the gRPC face agree.
    let polled = http.get(first.header("location")).await;
    assert_eq!(polled.status, 200);
    assert_eq!(polled.json()["id"], job["id"]);
    let mut grpc = server.jobs_client("default");
    assert_eq!(get(&mut grpc, &id).await.idempotency_key, "order-42");

    let again = keyed.post("/api/v1/jobs", body).await;
    assert_eq!(again.status, 200, "same key and input: the original job");
    assert_eq!(id_of(&again.json()), id);
    assert_eq!(again.header("location"), format!("/api/v1/jobs/{id}"));

    let other = keyed
        .post(
            "/api/v1/jobs",
            job_body("mail", "send", json!({"to": "b@example.com"})),
        )
        .await;
    other.expect_error(409, "ALREADY_EXISTS");

    let mismatch = keyed
        .post(
            "/api/v1/jobs",
            json!({"queue": "mail", "kind": "send", "idempotencyKey": "other"}),
        )
        .await;
    let err = mismatch.expect_error(400, "INVALID_ARGUMENT");
    assert_eq!(
        err["details"][0]["fieldViolations"][0]["field"],
        "Idempotency-Key"
    );

    // A job submitted over gRPC is served over HTTP too.
    let from_grpc = submit(&mut grpc, "mail", "send", json!({})).await;
    let got = http.get(&format!("/api/v1/jobs/{}", from_grpc.id)).await;
    assert_eq!(
        (got.status, got.json()["kind"].clone()),
        (200, json!("send"))
    );

    http.get("/api/v1/jobs/00000000-0000-4000-8000-000000000000")
        .await
        .expect_error(404, "NOT_FOUND");

    // The caller's trace context goes with the job to its worker.
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    http.clone()
        .with("traceparent", trace)
        .post("/api/v1/jobs", job_body("traced", "k", json!({})))
        .await;
    let mut workers = server.workers_client("default");
    let leased = lease_one(&mut workers, "w", "traced").await;
    assert!(
        leased
            .traceparent
            .contains("4bf92f3577b34da6a3ce929d0e0e4736"),
        "{}",
        leased.traceparent
    );
    server.stop().await;
}

async fn submit_batch_answers_each_item(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let reply = http
        .post(
            "/api/v1/jobs:batch",
            json!({"jobs": [job_body("b", "k", json!({"i": 1})), job_body("", "k", json!({}))]}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let results = reply.json()["results"].clone();
    assert_eq!(
        results[0]["ok"]["job"]["state"], "JOB_STATE_QUEUED",
        "{results}"
    );
    assert_eq!(results[1]["error"]["field"], "jobs[1].queue", "{results}");
    assert_eq!(results[1]["error"]["code"], 3, "INVALID_ARGUMENT");
    let listed = http.get("/api/v1/jobs?queue=b").await.json();
    assert_eq!(listed["jobs"].as_array().map(Vec::len), Some(1));
    http.post("/api/v1/jobs:batch", json!({"jobs": []}))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    // Too many items are refused while counting, before any is built (a
    // 16 MiB body of `{}` items is millions of messages).
    let too_many = format!("{{\"jobs\": [{}{{}}]}}", "{},".repeat(1000));
    let refused = http
        .send("POST", "/api/v1/jobs:batch", Some(too_many))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    assert_eq!(
        refused["details"][0]["fieldViolations"][0]["description"], "send at most 1000 items",
        "{refused}"
    );
    let listed = http.get("/api/v1/jobs?queue=b").await.json();
    assert_eq!(
        listed["jobs"].as_array().map(Vec::len),
        Some(1),
        "nothing more was stored"
    );
    server.stop().await;
}

/// A client that writes every field, unset ones as `null` (as proto3 JSON
/// allows), is answered as if it had left them out; a payload keeps its
/// nulls, and a field named twice or unknown is still refused.
async fn null_fields_are_fields_left_out(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let unset = json!({
        "priority": null, "idempotencyKey": null, "runAt": null, "deadline": null,
        "maxAttempts": null, "backoff": {"initial": null, "max": "60s"}, "labels": null,
        "callbackUrl": null, "maxCostCents": null,
    });
    let mut body = unset.clone();
    body["queue"] = json!("nulls");
    body["kind"] = json!("k");
    body["payload"] = json!({"a": null, "b": [null]});
    let reply = http.post("/api/v1/jobs", body).await;
    assert_eq!(
        reply.status,
        202,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let job = reply.json();
    assert_eq!(job["payload"], json!({"a": null, "b": [null]}));
    assert_eq!(job["maxAttempts"], 3, "the default: {job}");
    let decimal = http
        .send(
            "POST",
            "/api/v1/jobs",
            Some(r#"{"queue": "nulls", "kind": "k", "maxAttempts": 2.0, "priority": null}"#.into()),
        )
        .await;
    assert_eq!(
        decimal.status,
        202,
        "{}",
        String::from_utf8_lossy(&decimal.body)
    );
    assert_eq!(decimal.json()["maxAttempts"], 2, "2.0 is the integer 2");
    assert_eq!(job["backoff"]["max"], "60s", "{job}");

    let mut item = unset;
    item["queue"] = json!("nulls");
    item["kind"] = json!("k");
    let batch = http
        .post("/api/v1/jobs:batch", json!({"jobs": [item]}))
        .await;
    assert_eq!(
        batch.status,
        200,
        "{}",
        String::from_utf8_lossy(&batch.body)
    );
    assert_eq!(
        batch.json()["results"][0]["ok"]["job"]["state"],
        "JOB_STATE_QUEUED"
    );
    let listed = http
        .get("/api/v1/jobs?queue=nulls&page_size=10")
        .await
        .json();
    assert_eq!(listed["jobs"].as_array().map(Vec::len), Some(3), "{listed}");

    for (refused, reason) in [
        (
            r#"{"queue": "nulls", "kind": "k", "queue": null}"#,
            "duplicate field `queue`",
        ),
        (
            r#"{"queue": "nulls", "kind": "k", "colour": null}"#,
            "unknown field `colour`",
        ),
        (
            r#"{"queue": "nulls", "kind": "k", "priority": null, "maxAttempts": "many"}"#,
            "max_attempts: ",
        ),
    ] {
        let body = http
            .send("POST", "/api/v1/jobs", Some(refused.into()))
            .await
            .expect_error(400, "INVALID_ARGUMENT");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains(reason), "{refused}: {body}");
    }
    let listed = http.get("/api/v1/jobs?queue=nulls").await.json();
    assert_eq!(
        listed["jobs"].as_array().map(Vec::len),
        Some(3),
        "nothing more was stored"
    );
    server.stop().await;
}

/// A query parameter, a body or a method a route does not take is
/// refused, not ignored, and an unknown path under `/api` answers JSON.
async fn routes_refuse_what_they_do_not_take(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let job = submit_http(&http, "strict", "k").await;
    let id = id_of(&job);
    for (method, path) in [
        ("POST", "/api/v1/jobs?queue=strict".to_owned()),
        ("POST", "/api/v1/jobs:batch?x=1".to_owned()),
        ("GET", format!("/api/v1/jobs/{id}?x=1")),
        ("GET", format!("/api/v1/jobs/{id}/deliveries?x=1")),
        ("POST", format!("/api/v1/jobs/{id}:cancel?now=1")),
        ("POST", "/api/v1/jobs:retry?x=1".to_owned()),
        ("POST", "/api/v1/queues/strict:pause?x=1".to_owned()),
    ] {
        let body = (method == "POST").then(|| job_body("strict", "k", json!({})).to_string());
        let refused = http.send(method, &path, body).await;
        let error = refused.expect_error(400, "INVALID_ARGUMENT");
        assert_eq!(
            error["details"][0]["fieldViolations"][0]["description"], "unknown query parameter",
            "{method} {path}: {error}"
        );
    }
    let posted = http.send("POST", &format!("/api/v1/jobs/{id}"), None).await;
    posted.expect_error(405, "UNIMPLEMENTED");
    assert_eq!(posted.header("allow"), "GET,HEAD");
    let got = http.get(&format!("/api/v1/jobs/{id}:cancel")).await;
    got.expect_error(405, "UNIMPLEMENTED");
    assert_eq!(got.header("allow"), "POST");
    http.send("POST", &format!("/api/v1/jobs/{id}:frobnicate"), None)
        .await
        .expect_error(404, "NOT_FOUND");
    for path in ["/api", "/api/", "/api/v1", "/api/v1/", "/api/v2/jobs"] {
        http.get(path).await.expect_error(404, "NOT_FOUND");
    }
    for body in ["not json", r#"{"queue": "other"}"#, r#"{"colour": 1}"#] {
        http.send("POST", "/api/v1/queues/strict:pause", Some(body.into()))
            .await
            .expect_error(400, "INVALID_ARGUMENT");
    }
    let unnamed = http
        .clone()
        .with("idempotency-key", "")
        .post("/api/v1/jobs", job_body("strict", "k", json!({})))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    assert_eq!(
        unnamed["details"][0]["fieldViolations"][0]["field"], "Idempotency-Key",
        "{unnamed}"
    );
    // Nothing of the refused calls took effect.
    let stats = http.get("/api/v1/stats?queue=strict").await.json();
    assert!(queue_stats(&stats, "strict")["paused"].is_null(), "{stats}");
    let listed = http.get("/api/v1/jobs?queue=strict").await.json();
    assert_eq!(listed["jobs"].as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed["jobs"][0]["state"], "JOB_STATE_QUEUED");
    // The body, when it names the queue, names the path's.
    let paused = http
        .post("/api/v1/queues/strict:pause", json!({"queue": "strict"}))
        .await;
    assert_eq!(paused.status, 200);
    assert_eq!(paused.json()["paused"], true);
    server.stop().await;
}

async fn bad_input_is_400_naming_the_field(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let field_of = |reply: &Reply| {
        let body = reply.expect_error(400, "INVALID_ARGUMENT");
        assert_eq!(
            body["details"][0]["@type"],
            "type.googleapis.com/google.rpc.BadRequest"
        );
        body["details"][0]["fieldViolations"][0]["field"]
            .as_str()
            .expect("field")
            .to_owned()
    };
    let not_json = http
        .send("POST", "/api/v1/jobs", Some("{not json".into()))
        .await;
    assert_eq!(field_of(&not_json), "body");
    let wrong_type = http
        .post(
            "/api/v1/jobs",
            json!({"queue": "q", "kind": "k", "maxAttempts": "many"}),
        )
        .await;
    assert_eq!(field_of(&wrong_type), "max_attempts");
    let out_of_range = http
        .post(
            "/api/v1/jobs",
            json!({"queue": "q", "kind": "k", "backoff": {"initial": "1s"}, "priority": 1e12}),
        )
        .await;
    assert_eq!(field_of(&out_of_range), "priority");
    let inexact = http
        .send(
            "POST",
            "/api/v1/jobs",
            Some(r#"{"queue": "q", "kind": "k", "payload": {"id": 9223372036854775807}}"#.into()),
        )
        .await;
    assert_eq!(field_of(&inexact), "payload");
    assert!(
        inexact.json()["message"]
            .as_str()
            .is_some_and(|m| m.contains("send it as a string")),
        "{}",
        inexact.json()
    );
    let empty_queue = http
        .post("/api/v1/jobs", job_body("", "k", json!({})))
        .await;
    assert_eq!(field_of(&empty_queue), "queue");
    let zero_attempts = http
        .post(
            "/api/v1/jobs",
            json!({"queue": "q", "kind": "k", "maxAttempts": 0}),
        )
        .await;
    assert_eq!(field_of(&zero_attempts), "max_attempts");
    assert_eq!(field_of(&http.get("/api/v1/jobs/not-a-uuid").await), "id");
    assert_eq!(
        field_of(&http.get("/api/v1/jobs?state=done").await),
        "state"
    );
    assert_eq!(
        field_of(&http.get("/api/v1/jobs?colour=red").await),
        "colour"
    );
    // Nothing was written.
    let all = http.get("/api/v1/jobs").await.json();
    assert!(all["jobs"].as_array().is_none_or(Vec::is_empty), "{all}");
    server.stop().await;
}

async fn list_filters_and_pages(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let mut grpc = server.jobs_client("default");
    let mut workers = server.workers_client("default");
    let failed = make_failed(&mut grpc, &mut workers, "list", "bad_input").await;
    let mut queued = Vec::new();
    for kind in ["a", "b", "a"] {
        queued.push(id_of(&submit_http(&http, "list", kind).await));
    }
    submit_http(&http, "elsewhere", "a").await;

    let ids = |reply: &Reply| -> Vec<String> {
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        reply.json()["jobs"]
            .as_array()
            .map(|jobs| jobs.iter().map(id_of).collect())
            .unwrap_or_default()
    };
    let dead = http.get("/api/v1/jobs?queue=list&state=failed").await;
    assert_eq!(ids(&dead), vec![failed.id.clone()]);
    assert_eq!(dead.json()["jobs"][0]["error"]["class"], "bad_input");
    let by_class = http.get("/api/v1/jobs?error_class=bad_input").await;
    assert_eq!(ids(&by_class), vec![failed.id.clone()]);
    let kind_a = http
        .get("/api/v1/jobs?queue=list&kind=a&state=queued")
        .await;
    assert_eq!(
        ids(&kind_a),
        [queued[2].clone(), queued[0].clone()],
        "newest first"
    );
    let both = http
        .get("/api/v1/jobs?queue=list&state=QUEUED,JOB_STATE_FAILED")
        .await;
    assert_eq!(ids(&both).len(), 4);

    // view=basic: the same jobs, each without its payload (and result), on
    // the dead set's plan and on the general one.
    for query in ["queue=list&state=failed", "queue=list"] {
        let full = http.get(&format!("/api/v1/jobs?{query}")).await.json();
        let basic = http.get(&format!("/api/v1/jobs?{query}&view=basic")).await;
        let mut expected = full["jobs"].as_array().cloned().unwrap_or_default();
        assert!(expected.iter().all(|job| job.get("payload").is_some()));
        for job in &mut expected {
            if let Some(job) = job.as_object_mut() {
                job.remove("payload");
                job.remove("result");
            }
        }
        assert_eq!(basic.json()["jobs"], json!(expected), "{query}");
    }

    // Pages of two, following nextPageToken to the end.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = http
            .get(&format!(
                "/api/v1/jobs?queue=list&page_size=2&page_token={token}"
            ))
            .await;
        seen.extend(ids(&page));
        match page.json()["nextPageToken"].as_str() {
            Some(next) if !next.is_empty() => token = next.to_owned(),
            _ => break,
        }
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 4, "no job twice");
    http.get("/api/v1/jobs?page_size=0")
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    server.stop().await;
}

async fn cancel_and_its_errors(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let mut workers = server.workers_client("default");
    let job = submit_http(&http, "c", "k").await;
    let id = id_of(&job);
    let path = format!("/api/v1/jobs/{id}:cancel");
    let cancelled = http.post(&path, json!({"reason": "not needed"})).await;
    assert_eq!(cancelled.status, 200);
    assert_eq!(cancelled.json()["state"], "JOB_STATE_CANCELLED");
    let again = http.send("POST", &path, None).await;
    assert_eq!(again.status, 200, "cancelling a cancelled job is OK");

    let done = submit_http(&http, "c", "k").await;
    let leased = lease_one(&mut workers, "w", "c").await;
    assert_eq!(leased.job_id, id_of(&done));
    complete_ok(&mut workers, &leased).await;
    http.post(&format!("/api/v1/jobs/{}:cancel", leased.job_id), json!({}))
        .await
        .expect_error(412, "FAILED_PRECONDITION");
    http.post(&format!("/api/v1/jobs/{id}:explode"), json!({}))
        .await
        .expect_error(404, "NOT_FOUND");
    http.post(&path, json!({"id": leased.job_id}))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    http.post(
        "/api/v1/jobs/00000000-0000-4000-8000-000000000000:cancel",
        json!({}),
    )
    .await
    .expect_error(404, "NOT_FOUND");
    server.stop().await;
}

async fn retry_by_filter_with_dry_run(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let mut grpc = server.jobs_client("default");
    let mut workers = server.workers_client("default");
    let mut dead = Vec::new();
    for _ in 0..3 {
        dead.push(
            make_failed(&mut grpc, &mut workers, "r", "timeout")
                .await
                .id,
        );
    }
    make_failed(&mut grpc, &mut workers, "other", "timeout").await;
    let filter = json!({"queue": "r", "states": ["JOB_STATE_FAILED"]});

    let dry = http
        .post(
            "/api/v1/jobs:retry",
            json!({"filter": filter, "dryRun": true}),
        )
        .await;
    assert_eq!(dry.status, 200);
    let dry = dry.json();
    assert_eq!(
        dry["matched"], "3",
        "uint64 is a string in proto3 JSON: {dry}"
    );
    assert!(dry["retried"].as_array().is_none_or(Vec::is_empty));
    for id in &dead {
        assert_eq!(
            state(&get(&mut grpc, id).await),
            JobState::Failed,
            "dry run moved nothing"
        );
    }

    let done = http
        .post("/api/v1/jobs:retry", json!({"filter": filter}))
        .await
        .json();
    let mut retried: Vec<String> = done["retried"]
        .as_array()
        .expect("retried ids")
        .iter()
        .map(|v| v.as_str().expect("id").to_owned())
        .collect();
    retried.sort();
    dead.sort();
    assert_eq!(retried, dead);
    for id in &dead {
        assert_eq!(state(&get(&mut grpc, id).await), JobState::Queued);
    }
    let one = make_failed(&mut grpc, &mut workers, "one", "x").await;
    let single = http
        .post("/api/v1/jobs:retry", json!({"id": one.id}))
        .await
        .json();
    assert_eq!(single["retried"], json!([one.id]));
    http.post("/api/v1/jobs:retry", json!({"id": one.id}))
        .await
        .expect_error(412, "FAILED_PRECONDITION");
    http.post("/api/v1/jobs:retry", json!({}))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    server.stop().await;
}

/// `GET /api/v1/dead-set`: the tenant's failed jobs counted per error
/// class and queue, most first, under the replay filter's fields.
async fn dead_set_is_grouped_by_error_class_and_queue(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    // A bad parameter is named as sent (it was `filter.states`).
    for (query, field) in [("state=queued", "state"), ("queue=a%20b", "queue")] {
        let refused = http
            .get(&format!("/api/v1/dead-set?{query}"))
            .await
            .expect_error(400, "INVALID_ARGUMENT");
        assert_eq!(
            refused["details"][0]["fieldViolations"][0]["field"], field,
            "{query}"
        );
    }
    let mut grpc = server.jobs_client("default");
    let mut workers = server.workers_client("default");
    for (queue, class) in [
        ("a", "timeout"),
        ("b", "timeout"),
        ("a", "bad_input"),
        ("a", "timeout"),
    ] {
        make_failed(&mut grpc, &mut workers, queue, class).await;
    }
    // Neither another tenant's failed job nor a queued one counts.
    make_failed(
        &mut server.jobs_client("other"),
        &mut server.workers_client("other"),
        "a",
        "timeout",
    )
    .await;
    submit(&mut grpc, "a", "k", json!({})).await;
    let group = |class: &str, queue: &str, jobs: u64| json!({"error_class": class, "queue": queue, "jobs": jobs, "cost_cents": 0});
    let all = http.get("/api/v1/dead-set").await;
    assert_eq!(all.status, 200);
    assert_eq!(
        all.json(),
        json!({"complete": true, "groups": [
            group("timeout", "a", 2),
            group("bad_input", "a", 1),
            group("timeout", "b", 1),
        ]})
    );
    assert_eq!(
        http.get("/api/v1/dead-set?queue=b").await.json()["groups"],
        json!([group("timeout", "b", 1)])
    );
    assert_eq!(
        http.get("/api/v1/dead-set?error_class=bad_input&kind=fail")
            .await
            .json()["groups"],
        json!([group("bad_input", "a", 1)])
    );
    assert_eq!(
        http.get("/api/v1/dead-set?state=cancelled").await.json(),
        json!({"complete": true, "groups": []})
    );
    http.get("/api/v1/dead-set?state=queued")
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    http.get("/api/v1/dead-set?page_size=3")
        .await
        .expect_error(400, "INVALID_ARGUMENT");

    // Costs past any budget, as a buggy or hostile worker may report them:
    // each job's saturates, and so does their group's sum (it overflowed,
    // and the dead set answered INTERNAL until retention took the jobs).
    for _ in 0..2 {
        submit(&mut grpc, "costly", "k", json!({})).await;
        let leased = lease_one(&mut workers, "w", "costly").await;
        let mut report = failure_req(&leased, "pricey", Some(false), None);
        report.cost_cents = i64::MAX;
        workers.complete(report).await.expect("a costly failure");
    }
    assert_eq!(
        http.get("/api/v1/dead-set?queue=costly").await.json()["groups"],
        json!([{"error_class": "pricey", "queue": "costly", "jobs": 2, "cost_cents": i64::MAX}])
    );
    server.stop().await;
}

fn queue_stats<'a>(stats: &'a Value, queue: &str) -> &'a Value {
    stats["queues"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["queue"] == queue))
        .unwrap_or_else(|| panic!("no queue {queue} in {stats}"))
}

async fn stats_and_pause_resume(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let mut grpc = server.jobs_client("default");
    let mut workers = server.workers_client("default");
    make_failed(&mut grpc, &mut workers, "s", "bad_input").await;
    submit_http(&http, "s", "k").await;
    submit_http(&http, "s", "k").await;

    let stats = http.get("/api/v1/stats").await;
    assert_eq!(stats.status, 200);
    let stats = stats.json();
    let s = queue_stats(&stats, "s");
    assert_eq!(s["dead"], "1");
    let queued = s["counts"]
        .as_array()
        .expect("counts")
        .iter()
        .find(|c| c["state"] == "JOB_STATE_QUEUED")
        .expect("a queued count");
    assert_eq!(queued["count"], "2");
    let one = http.get("/api/v1/stats?queue=s").await.json();
    assert_eq!(one["queues"].as_array().map(Vec::len), Some(1));

    let paused = http.post("/api/v1/queues/s:pause", json!({})).await;
    assert_eq!(paused.status, 200);
    assert_eq!(paused.json(), json!({"queue": "s", "paused": true}));
    assert_eq!(
        queue_stats(&http.get("/api/v1/stats").await.json(), "s")["paused"],
        true
    );
    let leased = lease_now(&mut workers, "w", "s").await;
    assert!(leased.is_empty(), "a paused queue hands out nothing");
    // Queue names may contain ':'; the verb follows the last one.
    let odd = http
        .post("/api/v1/queues/team:a:pause", json!({}))
        .await
        .json();
    assert_eq!(odd["queue"], "team:a");
    let resumed = http.post("/api/v1/queues/s:resume", json!({})).await;
    assert_eq!(resumed.status, 200);
    assert!(queue_stats(&http.get("/api/v1/stats").await.json(), "s")["paused"].is_null());
    http.post("/api/v1/queues/s:drain", json!({}))
        .await
        .expect_error(404, "NOT_FOUND");
    http.post("/api/v1/queues/bad%20name:pause", json!({}))
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    // A browser's post for another site's page changes nothing.
    for site in ["cross-site", "same-site"] {
        http.clone()
            .with("sec-fetch-site", site)
            .post("/api/v1/queues/s:pause", json!({}))
            .await
            .expect_error(403, "PERMISSION_DENIED");
    }
    // To a plain-http address a browser sends no Sec-Fetch-Site, but an
    // Origin with every cross-origin post: it must be the server's own.
    let lan = Http::new(&server).host("192.168.1.5:8080");
    for origin in ["http://evil.example", "null", "http://192.168.1.5:8081"] {
        lan.clone()
            .with("origin", origin)
            .post("/api/v1/queues/s:pause", json!({}))
            .await
            .expect_error(403, "PERMISSION_DENIED");
    }
    assert!(queue_stats(&http.get("/api/v1/stats").await.json(), "s")["paused"].is_null());
    // Basic credentials a browser adds by itself do not vouch for a post.
    lan.clone()
        .with("origin", "http://evil.example")
        .with("authorization", "Basic dXNlcjpwYXNz")
        .post("/api/v1/queues/s:pause", json!({}))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    // A bearer token no page can attach by itself: the dashboard's, behind
    // a proxy that rewrote Host, whose Origin names the proxy.
    let proxied = lan
        .clone()
        .with("origin", "http://intray.corp")
        .with("authorization", "Bearer the-dashboards-token-0123456789")
        .post("/api/v1/queues/s:pause", json!({}))
        .await;
    assert_eq!(proxied.status, 200, "a post with a bearer token passes");
    let own = lan
        .clone()
        .with("origin", "http://192.168.1.5:8080")
        .post("/api/v1/queues/s:pause", json!({}))
        .await;
    assert_eq!(own.status, 200, "a post from the server's own page passes");
    let own = http
        .clone()
        .with("sec-fetch-site", "same-origin")
        .post("/api/v1/queues/s:pause", json!({}))
        .await;
    assert_eq!(own.status, 200, "the dashboard's own requests pass");
    server.stop().await;
}

/// One parsed server-sent event.
#[derive(Debug)]
struct Sse {
    id: Option<String>,
    event: Option<String>,
    data: String,
}

/// Reads events until `count` have come (`Some`) or the stream ends.
async fn read_events(
    response: hyper::Response<hyper::body::Incoming>,
    count: Option<usize>,
) -> (Vec<Sse>, bool) {
    let mut body = response.into_body();
    let mut buffer = String::new();
    let mut events = Vec::new();
    let read = async {
        loop {
            if count.is_some_and(|n| events.len() >= n) {
                return false;
            }
            let Some(frame) = body.frame().await else {
                return true;
            };
            let frame = frame.expect("read the event stream");
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buffer.push_str(std::str::from_utf8(&data).expect("UTF-8 stream"));
            while let Some(end) = buffer.find("\n\n") {
                let block: String = buffer.drain(..end + 2).collect();
                let mut event = Sse {
                    id: None,
                    event: None,
                    data: String::new(),
                };
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        event.id = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("event:") {
                        event.event = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        event.data.push_str(v.trim_start());
                    }
                }
                // Keep-alive comments carry no data.
                if !event.data.is_empty() {
                    events.push(event);
                }
            }
        }
    };
    let ended = tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("events within 20 s");
    (events, ended)
}

async fn event_stream_resumes_after_last_event_id(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let mut workers = server.workers_client("default");
    let job = submit_http(&http, "sse", "k").await;
    let id = id_of(&job);
    let leased = lease_one(&mut workers, "w", "sse").await;
    let path = format!("/api/v1/jobs/{id}/events");

    // Two events so far; read them and hang up while the job runs.
    let response = http.open("GET", &path, None).await;
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"].to_str().expect("ascii");
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let (first, ended) = read_events(response, Some(2)).await;
    assert!(!ended, "a running job's stream stays open");
    let ids: Vec<_> = first.iter().map(|e| e.id.clone().expect("id")).collect();
    assert_eq!(ids, ["1", "2"]);
    let event: Value = serde_json::from_str(&first[1].data).expect("JobEvent JSON");
    assert_eq!(event["type"], "JOB_EVENT_TYPE_LEASED");
    assert_eq!(event["sequence"], "2");

    // The reconnect picks up after 2 and gets the next event live, when the
    // worker completes the job while the stream is open.
    let resumed = http
        .clone()
        .with("last-event-id", "2")
        .open("GET", &path, None)
        .await;
    assert_eq!(resumed.status(), 200);
    let completer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        complete_ok(&mut workers, &leased).await;
    });
    let (rest, ended) = read_events(resumed, None).await;
    completer.await.expect("completion task");
    assert!(ended, "the stream closes after the terminal event");
    let ids: Vec<_> = rest.iter().map(|e| e.id.clone().expect("id")).collect();
    assert_eq!(ids, ["3"], "no gap and no duplicate: {rest:?}");
    let last: Value = serde_json::from_str(&rest[0].data).expect("JSON");
    assert_eq!(last["type"], "JOB_EVENT_TYPE_SUCCEEDED");

    // After the terminal event there is nothing more: 204 stops an EventSource.
    let after_end = http.clone().with("last-event-id", "3").get(&path).await;
    assert_eq!(after_end.status, 204);
    assert!(after_end.body.is_empty());

    // A curl user can say where to start in the query instead.
    let from_query = http
        .open("GET", &format!("{path}?after_sequence=1"), None)
        .await;
    let (events, ended) = read_events(from_query, None).await;
    assert!(ended);
    assert_eq!(events.len(), 2);
    assert!(events.iter().all(|e| e.event.is_none()));

    http.get("/api/v1/jobs/00000000-0000-4000-8000-000000000000/events")
        .await
        .expect_error(404, "NOT_FOUND");
    http.clone()
        .with("last-event-id", "soon")
        .get(&path)
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    server.stop().await;
}

async fn open_event_stream_ends_at_shutdown(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let job = submit_http(&http, "quiet", "k").await;
    let path = format!("/api/v1/jobs/{}/events", id_of(&job));
    let response = http.open("GET", &path, None).await;
    let reader = tokio::spawn(read_events(response, None));
    // The job never finishes; stopping must still end the stream (the
    // harness fails the test if the server takes longer than 15 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.stop().await;
    let (events, ended) = reader.await.expect("reader task");
    assert!(ended, "the stream ended");
    assert_eq!(events.len(), 1, "{events:?}");
}

const PRODUCER: &str = "acme-producer-0123456789";
const WORKER: &str = "acme-worker-0123456789ab";
const OTHER_PRODUCER: &str = "globex-producer-01234567";
const ADMIN: &str = "ops-admin-0123456789abcd";

async fn authentication_and_roles(backend: Backend) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens");
    std::fs::write(
        &file,
        format!(
            "{PRODUCER} acme producer\n{WORKER} acme worker\n\
             {OTHER_PRODUCER} globex producer\n{ADMIN} ops admin\n"
        ),
    )
    .expect("write token file");
    let server = TestServer::start_with(backend, |s| s.auth_file = Some(file)).await;
    let anonymous = Http::new(&server);
    let producer = Http::new(&server).token(PRODUCER);

    let missing = anonymous.get("/api/v1/stats").await;
    missing.expect_error(401, "UNAUTHENTICATED");
    assert_eq!(missing.header("www-authenticate"), "Bearer");
    // An unknown caller is refused before its body or query is read: what
    // it sent is not looked at (it was 400 for the bad JSON, the unknown
    // parameter and the mismatched key).
    anonymous
        .send("POST", "/api/v1/jobs:batch", Some("not json".into()))
        .await
        .expect_error(401, "UNAUTHENTICATED");
    anonymous
        .get("/api/v1/jobs?bogus=1")
        .await
        .expect_error(401, "UNAUTHENTICATED");
    anonymous
        .clone()
        .with("idempotency-key", "a")
        .post("/api/v1/jobs", json!({"idempotencyKey": "b"}))
        .await
        .expect_error(401, "UNAUTHENTICATED");
    Http::new(&server)
        .token("not-a-token-at-all-000")
        .post("/api/v1/jobs", job_body("q", "k", json!({})))
        .await
        .expect_error(401, "UNAUTHENTICATED");
    Http::new(&server)
        .token(WORKER)
        .post("/api/v1/jobs", job_body("q", "k", json!({})))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    // The role is checked before the input is read, as on gRPC: a caller
    // without it is not told what is wrong with what it sent.
    let worker = Http::new(&server).token(WORKER);
    worker
        .send("POST", "/api/v1/jobs", Some("not json".into()))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    let too_many = format!("{{\"jobs\": [{}{{}}]}}", "{},".repeat(1000));
    worker
        .send("POST", "/api/v1/jobs:batch", Some(too_many))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    worker
        .send("POST", "/api/v1/queues/q:pause", Some("not json".into()))
        .await
        .expect_error(403, "PERMISSION_DENIED");

    let job = submit_http(&producer, "q", "k").await;
    assert_eq!(job["tenant"], "acme", "the tenant comes from the token");
    let id = id_of(&job);
    // A tenant header is ignored for a producer, as on gRPC.
    let elsewhere = producer
        .clone()
        .with("x-intray-tenant", "globex")
        .get(&format!("/api/v1/jobs/{id}"))
        .await;
    assert_eq!(elsewhere.status, 200);
    Http::new(&server)
        .token(OTHER_PRODUCER)
        .get(&format!("/api/v1/jobs/{id}"))
        .await
        .expect_error(404, "NOT_FOUND");
    Http::new(&server)
        .token(OTHER_PRODUCER)
        .get(&format!("/api/v1/jobs/{id}/events"))
        .await
        .expect_error(404, "NOT_FOUND");

    // Replays and pauses are operators' acts.
    let retry = json!({"filter": {"queue": "q"}, "dryRun": true});
    producer
        .post("/api/v1/jobs:retry", retry.clone())
        .await
        .expect_error(403, "PERMISSION_DENIED");
    producer
        .post("/api/v1/queues/q:pause", json!({}))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    let admin = Http::new(&server)
        .token(ADMIN)
        .with("x-intray-tenant", "acme");
    let counted = admin.post("/api/v1/jobs:retry", retry).await;
    assert_eq!(counted.status, 200);
    assert_eq!(
        admin.post("/api/v1/queues/q:pause", json!({})).await.status,
        200
    );
    let seen = admin.get(&format!("/api/v1/jobs/{id}")).await;
    assert_eq!(seen.status, 200, "an admin acts for the tenant it names");

    // whoami tells each caller what it may call, so the dashboard offers
    // no act that would be refused.
    let me = producer
        .clone()
        .with("x-intray-tenant", "globex")
        .get("/api/v1/whoami")
        .await;
    assert_eq!(me.status, 200);
    assert_eq!(
        me.json(),
        json!({
            "tenant": "acme",
            "roles": ["producer"],
            "methods": ["Submit", "SubmitBatch", "Get", "Cancel", "WatchJob", "List", "Stats"],
        }),
        "a producer's own tenant, its header ignored, and no operator's act"
    );
    let me = admin.get("/api/v1/whoami").await.json();
    assert_eq!(me["tenant"], "acme", "an admin's named tenant");
    assert_eq!(me["roles"], json!(["admin"]));
    assert_eq!(me["methods"].as_array().map(Vec::len), Some(10), "{me}");
    let me = worker.get("/api/v1/whoami").await.json();
    assert_eq!(
        (&me["roles"], &me["methods"]),
        (&json!(["worker"]), &json!([])),
        "a worker calls none of the JSON API"
    );
    anonymous
        .get("/api/v1/whoami")
        .await
        .expect_error(401, "UNAUTHENTICATED");
    producer
        .get("/api/v1/whoami?x=1")
        .await
        .expect_error(400, "INVALID_ARGUMENT");
    // The spec and the dashboard need no token (they hold no data).
    assert_eq!(anonymous.get("/api/v1/openapi.json").await.status, 200);
    assert_eq!(anonymous.get("/").await.status, 200);
    server.stop().await;
}

async fn rate_limit_and_queue_bound_are_429_with_retry_after(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.rate_limit = Some(RateLimit {
            per_second: 0.2,
            burst: 3,
        });
        s.queue_bound = 1;
    })
    .await;
    let http = Http::new(&server);
    submit_http(&http, "bounded", "k").await;
    let full = http
        .post("/api/v1/jobs", job_body("bounded", "k", json!({"n": 2})))
        .await;
    let body = full.expect_error(429, "RESOURCE_EXHAUSTED");
    assert!(full.header("retry-after").parse::<u64>().expect("seconds") >= 1);
    assert_eq!(
        body["details"][0]["@type"],
        "type.googleapis.com/google.rpc.RetryInfo"
    );

    // Two calls made, one left in the burst; then the bucket is empty.
    assert_eq!(http.get("/api/v1/stats").await.status, 200);
    let limited = http.get("/api/v1/stats").await;
    limited.expect_error(429, "RESOURCE_EXHAUSTED");
    let wait: u64 = limited.header("retry-after").parse().expect("seconds");
    assert!((1..=5).contains(&wait), "{wait}");
    // The gRPC port draws from the same bucket.
    let mut grpc = server.jobs_client_no_tenant();
    let status = grpc
        .stats(intray::pb::StatsRequest::default())
        .await
        .expect_err("limited on gRPC too");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    server.stop().await;
}

async fn openapi_lists_every_route_the_router_serves(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let doc = http.get("/api/v1/openapi.json").await;
    assert_eq!(doc.status, 200);
    let doc = doc.json();
    assert!(doc["openapi"].as_str().expect("version").starts_with("3."));
    // What a generated client needs to call the routes as they are: the
    // list's repeatable filters and numbers, the stream's 204.
    let list_params = &doc["paths"]["/api/v1/jobs"]["get"]["parameters"];
    let param = |name: &str| {
        list_params
            .as_array()
            .expect("parameters")
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} is documented"))
    };
    assert_eq!(param("state")["schema"]["type"], "array");
    assert_eq!(param("label")["schema"]["type"], "array");
    assert_eq!(param("page_size")["schema"]["type"], "integer");
    assert_eq!(
        (
            &param("page_size")["schema"]["minimum"],
            &param("page_size")["schema"]["maximum"]
        ),
        (&json!(1), &json!(1000)),
        "the bounds the server holds it to"
    );
    assert!(
        doc["paths"]["/api/v1/jobs/{id}/events"]["get"]["responses"]["204"].is_object(),
        "the stream's 204 is documented"
    );
    // A finished job, so that its event stream ends.
    let job = submit_http(&http, "doc", "k").await;
    let id = id_of(&job);
    http.post(&format!("/api/v1/jobs/{id}:cancel"), json!({}))
        .await;

    let paths = doc["paths"].as_object().expect("paths");
    let mut documented = Vec::new();
    for (path, methods) in paths {
        for method in methods.as_object().expect("methods").keys() {
            documented.push(format!("{} {path}", method.to_uppercase()));
            let concrete = path.replace("{id}", &id).replace("{queue}", "doc");
            let body = (method == "post").then(|| "{}".to_owned());
            let reply = http.send(&method.to_uppercase(), &concrete, body).await;
            assert!(
                reply.status != 404 && reply.status != 405,
                "{method} {path} is documented but answers {}",
                reply.status
            );
        }
    }
    // The routes exercised by this suite, all documented.
    let mut expected: Vec<String> = [
        "POST /api/v1/jobs",
        "GET /api/v1/jobs",
        "GET /api/v1/jobs/{id}",
        "POST /api/v1/jobs/{id}:cancel",
        "GET /api/v1/jobs/{id}/events",
        "GET /api/v1/jobs/{id}/deliveries",
        "GET /api/v1/dead-set",
        "POST /api/v1/jobs:retry",
        "POST /api/v1/jobs:batch",
        "GET /api/v1/stats",
        "POST /api/v1/queues/{queue}:pause",
        "POST /api/v1/queues/{queue}:resume",
        "GET /api/v1/openapi.json",
        "GET /api/v1/whoami",
    ]
    .map(String::from)
    .to_vec();
    expected.sort();
    documented.sort();
    assert_eq!(documented, expected);
    // And what is not documented is not served.
    http.get("/api/v1/queues")
        .await
        .expect_error(404, "NOT_FOUND");
    // A served path with another method: 405, with the JSON error body
    // every other refusal has (it was empty).
    http.send("DELETE", &format!("/api/v1/jobs/{id}"), None)
        .await
        .expect_error(405, "UNIMPLEMENTED");
    http.get("/api/v1/jobs:retry")
        .await
        .expect_error(405, "UNIMPLEMENTED");
    server.stop().await;
}

async fn dashboard_and_metrics_are_served(backend: Backend) {
    let server = TestServer::start(backend).await;
    let http = Http::new(&server);
    let page = http.get("/").await;
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").starts_with("text/html"));
    assert!(
        page.header("content-security-policy")
            .contains("script-src 'self'")
    );
    let html = String::from_utf8_lossy(&page.body);
    assert!(
        html.contains("app.js") && html.contains("app.css"),
        "{html}"
    );
    for asset in ["/app.js", "/app.css"] {
        let reply = http.get(asset).await;
        assert_eq!(reply.status, 200, "{asset}");
        assert!(!reply.body.is_empty(), "{asset}");
    }
    // Without a token file the dashboard's caller may do everything.
    let me = http
        .clone()
        .with("x-intray-tenant", "t1")
        .get("/api/v1/whoami")
        .await
        .json();
    assert_eq!(me["tenant"], "t1");
    assert_eq!(
        me["roles"],
        json!(["producer", "worker", "admin", "metrics"])
    );
    assert_eq!(me["methods"].as_array().map(Vec::len), Some(10), "{me}");
    // API calls are counted under their gRPC method, refusals too.
    submit_http(&http, "m", "k").await;
    http.get("/api/v1/jobs/00000000-0000-4000-8000-000000000000")
        .await
        .expect_error(404, "NOT_FOUND");
    let metrics = http.get("/metrics").await;
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        r#"intray_rpc_responses_total{method="/intray.v1.JobService/Submit",code="OK"} 1"#,
        r#"intray_rpc_responses_total{method="/intray.v1.JobService/Get",code="NOT_FOUND"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
    }
    server.stop().await;
}

/// DNS rebinding: without a token file the port answers only to IP
/// addresses, `localhost` and the names it is given; the webhook ingress,
/// which its signature guards, to every name. With a token file every name
/// is answered.
async fn unknown_host_names_are_refused_in_open_mode(backend: Backend) {
    let server = TestServer::start(backend).await;
    let port = server.http_addr.port();
    let rebound = Http::new(&server).host(&format!("rebound.example:{port}"));
    for path in ["/api/v1/stats", "/", "/metrics"] {
        rebound
            .get(path)
            .await
            .expect_error(403, "PERMISSION_DENIED");
    }
    rebound
        .post("/api/v1/jobs", job_body("q", "k", json!({})))
        .await
        .expect_error(403, "PERMISSION_DENIED");
    let hook = rebound.post("/hooks/nowhere", json!({})).await;
    assert_eq!(hook.status, 404, "the ingress answers every name");
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ] {
        assert_eq!(
            Http::new(&server)
                .host(&host)
                .get("/api/v1/stats")
                .await
                .status,
            200,
            "{host}"
        );
    }
    let listed = server
        .start_replica_with(|s| s.http_allowed_hosts = Some(vec!["intray.test".into()]))
        .await;
    assert_eq!(
        Http::new(&listed)
            .host("intray.test:1")
            .get("/")
            .await
            .status,
        200
    );
    Http::new(&listed)
        .host("rebound.example")
        .get("/")
        .await
        .expect_error(403, "PERMISSION_DENIED");
    listed.stop().await;
    server.stop().await;

    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens");
    std::fs::write(&file, format!("{PRODUCER} acme producer\n")).expect("write token file");
    let server = TestServer::start_with(backend, |s| s.auth_file = Some(file)).await;
    let reply = Http::new(&server)
        .host("intray.jobs.svc")
        .token(PRODUCER)
        .post("/api/v1/jobs", job_body("q", "k", json!({})))
        .await;
    assert_eq!(
        reply.status,
        202,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    server.stop().await;
}

/// `/healthz` and `/readyz` are what an HTTPS probe can use when TLS keeps
/// the kubelet's gRPC probe out: any host name (the kubelet sends the pod's
/// IP, or the `Host` header a probe sets), no token, and `/readyz` fails from SIGTERM on, through the
/// shutdown delay in which the port still serves, as the gRPC health
/// service turns `NOT_SERVING`.
async fn probes_answer_any_host_and_readiness_fails_while_draining(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.shutdown_delay = Duration::from_secs(5);
    })
    .await;
    let port = server.http_addr.port();
    let pod = Http::new(&server).host(&format!("intray-0.intray.svc:{port}"));
    for path in ["/healthz", "/readyz"] {
        assert_eq!(pod.get(path).await.status, 200, "{path}");
    }
    pod.get("/api/v1/stats")
        .await
        .expect_error(403, "PERMISSION_DENIED");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens");
    std::fs::write(&file, format!("{ADMIN} ops admin\n")).expect("write token file");
    let guarded = server
        .start_replica_with(|s| s.auth_file = Some(file))
        .await;
    let anonymous = Http::new(&guarded);
    anonymous
        .get("/api/v1/stats")
        .await
        .expect_error(401, "UNAUTHENTICATED");
    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            anonymous.get(path).await.status,
            200,
            "{path} without a token"
        );
    }
    guarded.stop().await;
    let stopping = Instant::now();
    server.begin_shutdown();
    within(Duration::from_secs(5), "readiness to fail", async {
        while pod.get("/readyz").await.status != 503 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(pod.get("/healthz").await.status, 200, "still live");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "checked inside the delay"
    );
    server.stop().await;
}

/// Resuming an event stream is one call: its check whether the job has
/// ended draws no token of its own and is not counted as a `Get`. It drew
/// one, so each reconnect cost two, and under a burst of one every
/// reconnect was refused `429`, which stops an `EventSource` for good.
async fn a_resumed_event_stream_draws_one_token(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.rate_limit = Some(RateLimit {
            per_second: 0.01,
            burst: 3,
        });
    })
    .await;
    let http = Http::new(&server);
    let job = submit_http(&http, "resumed", "k").await;
    let path = format!("/api/v1/jobs/{}", id_of(&job));
    assert_eq!(
        http.post(&format!("{path}:cancel"), json!({})).await.status,
        200
    );
    let resumed = http
        .clone()
        .with("last-event-id", "1")
        .get(&format!("{path}/events"))
        .await;
    assert_eq!(resumed.status, 200, "the third call of a burst of three");
    let metrics = parse(&scrape(server.http_addr).await);
    assert_eq!(
        metrics.get(r#"intray_rpc_responses_total{method="/intray.v1.JobService/Get",code="OK"}"#),
        None,
        "the route's own look at the job is not a Get"
    );
    // Over its rate, a resume is refused before the job is read.
    http.clone()
        .with("last-event-id", "1")
        .get(&format!("{path}/events"))
        .await
        .expect_error(429, "RESOURCE_EXHAUSTED");
    server.stop().await;
}

/// What a raw connection reads until the server closes it (or 10 s pass,
/// which fails the test), and how long that took.
async fn read_until_closed(conn: &mut TcpStream) -> (String, Duration) {
    let started = Instant::now();
    let mut read = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut read)).await;
    assert!(
        closed.is_ok(),
        "the server kept a stalled connection: {}",
        String::from_utf8_lossy(&read)
    );
    (
        String::from_utf8_lossy(&read).into_owned(),
        started.elapsed(),
    )
}

/// A client that stops partway through its headers, or its body, is cut
/// off at `--http-header-timeout` / `--http-body-timeout` (they were held
/// for ever, with what they had sent, by a port that faces the internet).
async fn clients_that_stall_are_cut_off(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.http_read_timeouts = HttpReadTimeouts {
            header: Duration::from_millis(500),
            body: Duration::from_millis(700),
        };
    })
    .await;
    let mut headers_only = TcpStream::connect(server.http_addr).await.expect("connect");
    headers_only
        .write_all(b"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .expect("send part of the headers");
    let (_, waited) = read_until_closed(&mut headers_only).await;
    assert!(waited < Duration::from_secs(5), "{waited:?}");

    let mut part_body = TcpStream::connect(server.http_addr).await.expect("connect");
    part_body
        .write_all(
            b"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n\
              content-type: application/json\r\ncontent-length: 100\r\n\r\n{",
        )
        .await
        .expect("send the headers and one byte");
    let (answer, waited) = read_until_closed(&mut part_body).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("DEADLINE_EXCEEDED") && answer.contains("did not arrive within 700ms"),
        "{answer}"
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // A whole request on a fresh connection is served as before.
    let job = submit_http(&Http::new(&server), "q", "k").await;
    assert_eq!(job["queue"], "q");
    server.stop().await;
}
