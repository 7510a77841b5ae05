//! Webhooks (issue 7), both directions, on SQLite and PostgreSQL.
//!
//! - Ingress: `POST /hooks/{source}` signed here with HMAC code written in
//!   this file (not the server's): a valid message makes one job, the same
//!   `webhook-id` again makes none, and bad signatures, stale timestamps,
//!   unknown sources, oversized bodies and malformed JSON are refused with
//!   their codes and make none.
//! - Callbacks: a Python receiver (`tests/webhooks/receiver.py`) verifies
//!   every delivery with the Standard Webhooks reference library from PyPI,
//!   installed into a virtualenv this test makes (pinned in
//!   `tests/webhooks/requirements.txt`, reused while unchanged). It is down
//!   while the jobs finish, then up and refusing its first requests with
//!   503: every event still arrives, each webhook-id accepted once. A real
//!   `intray serve` killed with SIGKILL after the transition and before any
//!   delivery still delivers once restarted, and its reconciliation sweep
//!   writes a delivery row that went missing. Over `https`, the receiver's
//!   certificate is checked against the configured CA.
//! - The webhooks file, rewritten while the server runs: a callback refused
//!   by a receiver that already has the rotated secret arrives once the file
//!   lists it beside the old one, and a receiver still on the old secret
//!   accepts callbacks signed with both; a widened allow-list admits a
//!   callback at `Submit`; a swapped ingress source answers to either of
//!   its secrets and the removed one is `404`; a broken file then keeps all
//!   of it.
//!
//! A missing python3, venv module or pip fails the test: it never skips.

mod common;
#[allow(dead_code)]
#[path = "faults/harness.rs"]
mod harness;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command as StdCommand, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use common::*;
use hmac::{Hmac, KeyInit, Mac};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use intray::config::Settings;
use intray::config::webhooks::IngressSource;
use intray::domain::Backoff;
use intray::domain::webhook::{AddressPolicy, Keyring};
use intray::pb;
use serde_json::{Value, json};
use sha2::Sha256;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

common::backend_tests!(
    ingress_verifies_dedupes_and_refuses,
    callbacks_over_https_check_the_receiver_certificate,
    callbacks_to_names_of_private_addresses_are_refused_at_delivery,
    callbacks_reach_a_verifying_receiver_after_an_outage,
    callbacks_survive_a_server_killed_before_delivery,
    the_webhooks_file_is_reloaded_while_serving,
    a_lapsed_claims_record_leaves_the_later_claims,
    a_receiver_that_never_answers_holds_up_only_its_own_callbacks,
    a_fast_receiver_is_held_to_its_limit_at_a_time_not_per_poll,
    a_claim_takes_no_more_per_receiver_than_it_has_room_for,
    retention_keeps_a_job_until_its_callback_is_delivered,
);

const TENANT: &str = "acme";
/// 32 bytes of key: `whsec_` + base64.
const SECRET: &str = "whsec_c2VjcmV0LWtleS1mb3ItaW50cmF5LXdlYmhvb2tzISE=";
const SOURCE_SECRET: &str = "whsec_cHJvdmlkZXIta2V5LWZvci10aGUtaW5ncmVzcy10ZXN0";
const LONG: Duration = Duration::from_secs(40);

// ---------------------------------------------------------------------------
// An HMAC signer independent of the server's code
// ---------------------------------------------------------------------------

fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> String {
    let key = B64
        .decode(secret.strip_prefix("whsec_").expect("whsec_ prefix"))
        .expect("base64 key");
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC key");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!("v1,{}", B64.encode(mac.finalize().into_bytes()))
}

/// One request on a fresh HTTP/1.1 connection: the status and the body.
async fn send(
    addr: SocketAddr,
    request: hyper::http::request::Builder,
    body: Vec<u8>,
) -> (u16, Bytes) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(conn);
    let request = request
        .header("host", "localhost")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let response = within(
        Duration::from_secs(20),
        "an HTTP answer",
        sender.send_request(request),
    )
    .await
    .expect("the server answers");
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, body)
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or(Value::Null)
}

async fn post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
) -> (u16, Value) {
    let mut request = hyper::Request::post(path).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let (status, body) = send(addr, request, body).await;
    (status, json_of(&body))
}

async fn post_signed(
    addr: SocketAddr,
    source: &str,
    id: &str,
    timestamp: i64,
    secret: &str,
    body: &[u8],
) -> (u16, Value) {
    let headers = [
        ("webhook-id", id.to_owned()),
        ("webhook-timestamp", timestamp.to_string()),
        ("webhook-signature", sign(secret, id, timestamp, body)),
    ];
    post(addr, &format!("/hooks/{source}"), &headers, body.to_vec()).await
}

fn webhook_settings(s: &mut Settings) {
    s.webhooks.keys.default_secret = Some(Keyring::parse(&[SECRET]).expect("secret"));
    s.webhooks.keys.allow = AddressPolicy::parse(&["127.0.0.1"]).expect("allow-list");
    s.webhooks.backoff =
        Backoff::try_new(Duration::from_millis(100), Duration::from_millis(500)).expect("backoff");
    s.webhooks.poll = Duration::from_millis(100);
    s.reaper_interval = Duration::from_millis(200);
    s.webhooks.max_body_bytes = 4096;
    s.webhooks.keys.sources.insert(
        "payments".into(),
        IngressSource {
            secret: Keyring::parse(&[SOURCE_SECRET]).expect("secret"),
            tenant: TENANT.into(),
            queue: "hooks".into(),
            kind: "payment.event".into(),
        },
    );
    // The same provider also posts every message to a second endpoint.
    s.webhooks.keys.sources.insert(
        "ledger".into(),
        IngressSource {
            secret: Keyring::parse(&[SOURCE_SECRET]).expect("secret"),
            tenant: TENANT.into(),
            queue: "ledger".into(),
            kind: "payment.event".into(),
        },
    );
}

async fn hook_jobs(server: &TestServer) -> Vec<pb::Job> {
    let mut jobs = server.jobs_client(TENANT);
    let mut filter = list_req();
    filter.queue = "hooks".into();
    list_all(&mut jobs, filter).await
}

// ---------------------------------------------------------------------------
// Ingress
// ---------------------------------------------------------------------------

async fn ingress_verifies_dedupes_and_refuses(backend: Backend) {
    let server = TestServer::start_with(backend, webhook_settings).await;
    let addr = server.http_addr;
    let now = chrono::Utc::now().timestamp();
    let body = br#"{"event": "charge.succeeded", "amount": 42.5}"#;

    // A producer cannot take the key a provider's message will have: the
    // ingress's `hook/` space is refused to every other caller.
    let mut squatter = submit_req(
        "hooks",
        "payment.event",
        json!({"event": "charge.succeeded", "amount": 42.5}),
    );
    squatter.idempotency_key = "hook/payments/msg_1".into();
    expect_invalid(
        server.jobs_client(TENANT).submit(squatter.clone()).await,
        &["idempotency_key"],
        "a producer's key in the ingress's space",
    );
    let batch = server
        .jobs_client(TENANT)
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![squatter],
        })
        .await
        .expect("SubmitBatch")
        .into_inner();
    match &batch.results[0].result {
        Some(pb::submit_batch_result::Result::Error(e)) => {
            assert_eq!(e.field, "jobs[0].idempotency_key");
        }
        other => panic!("refused in a batch too: {other:?}"),
    }

    let (status, answer) = post_signed(addr, "payments", "msg_1", now, SOURCE_SECRET, body).await;
    assert_eq!(
        (status, answer["created"].as_bool()),
        (200, Some(true)),
        "{answer}"
    );
    let job_id = answer["job_id"].as_str().expect("job_id").to_owned();
    let jobs = hook_jobs(&server).await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].id, job_id);
    assert_eq!(
        (jobs[0].kind.as_str(), jobs[0].idempotency_key.as_str()),
        ("payment.event", "hook/payments/msg_1")
    );
    let payload = value_to_json(jobs[0].payload.as_ref().expect("payload"));
    assert_eq!(
        payload,
        json!({"event": "charge.succeeded", "amount": 42.5})
    );

    // The provider retries the same message: same job, nothing new.
    let (status, answer) =
        post_signed(addr, "payments", "msg_1", now + 3, SOURCE_SECRET, body).await;
    assert_eq!(
        (status, answer["created"].as_bool()),
        (200, Some(false)),
        "{answer}"
    );
    assert_eq!(answer["job_id"].as_str(), Some(job_id.as_str()));

    // The same message to another source of the tenant is that source's
    // own job, and its retry a repeat there.
    for created in [true, false] {
        let (status, answer) = post_signed(addr, "ledger", "msg_1", now, SOURCE_SECRET, body).await;
        assert_eq!(
            (status, answer["created"].as_bool()),
            (200, Some(created)),
            "{answer}"
        );
        assert_ne!(answer["job_id"].as_str(), Some(job_id.as_str()));
    }

    let other_secret = "whsec_d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXkh";
    let refused: Vec<(&str, (u16, Value))> = vec![
        (
            "bad signature",
            post_signed(addr, "payments", "msg_2", now, other_secret, body).await,
        ),
        (
            "stale timestamp",
            post_signed(addr, "payments", "msg_3", now - 301, SOURCE_SECRET, body).await,
        ),
        (
            "future timestamp",
            post_signed(addr, "payments", "msg_4", now + 400, SOURCE_SECRET, body).await,
        ),
        (
            "no signature headers",
            post(addr, "/hooks/payments", &[], body.to_vec()).await,
        ),
        (
            "unknown source",
            post_signed(addr, "nobody", "msg_5", now, SOURCE_SECRET, body).await,
        ),
        ("oversized body", {
            let big = format!(r#"{{"pad": "{}"}}"#, "x".repeat(5000));
            post_signed(
                addr,
                "payments",
                "msg_6",
                now,
                SOURCE_SECRET,
                big.as_bytes(),
            )
            .await
        }),
        (
            "malformed JSON",
            post_signed(addr, "payments", "msg_7", now, SOURCE_SECRET, b"{not json").await,
        ),
        (
            "an integer beyond 2^53",
            post_signed(
                addr,
                "payments",
                "msg_9",
                now,
                SOURCE_SECRET,
                br#"{"id": 12345678901234567890}"#,
            )
            .await,
        ),
    ];
    let codes: Vec<(&str, u16)> = refused
        .iter()
        .map(|(what, (status, _))| (*what, *status))
        .collect();
    assert_eq!(
        codes,
        vec![
            ("bad signature", 401),
            ("stale timestamp", 401),
            ("future timestamp", 401),
            ("no signature headers", 401),
            ("unknown source", 404),
            ("oversized body", 413),
            ("malformed JSON", 400),
            ("an integer beyond 2^53", 400),
        ]
    );
    let (_, said) = &refused[refused.len() - 1].1;
    assert!(
        said["error"].as_str().is_some_and(|e| e.contains("2^53")),
        "says what to change: {said}"
    );
    // A body that cannot be read (a malformed chunk) is not too large: it
    // was answered 413.
    let (head, _) = http_exchange(
        addr,
        "POST /hooks/payments HTTP/1.1\r\nhost: localhost\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\nzz\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    // A declared length over the limit is refused before any body is sent
    // (a client declaring 10 GB was read, and waited for).
    let (head, _) = tokio::time::timeout(
        Duration::from_secs(5),
        http_exchange(
            addr,
            "POST /hooks/payments HTTP/1.1\r\nhost: localhost\r\n\
             content-length: 10000000000\r\nconnection: close\r\n\r\n",
        ),
    )
    .await
    .expect("answered without the body");
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    // A tampered body under a valid signature of another body.
    let headers = [
        ("webhook-id", "msg_8".to_owned()),
        ("webhook-timestamp", now.to_string()),
        ("webhook-signature", sign(SOURCE_SECRET, "msg_8", now, body)),
    ];
    let (status, _) = post(
        addr,
        "/hooks/payments",
        &headers,
        br#"{"amount": 1}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 401);

    assert_eq!(
        hook_jobs(&server).await.len(),
        1,
        "refused messages made no job"
    );
    let metrics = metrics_text(&server).await;
    assert!(
        metrics.contains(r#"intray_webhook_ingress_total{source="payments",code="200"} 2"#),
        "{metrics}"
    );
    server.stop().await;
}

async fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let request = hyper::Request::get(path).header("x-intray-tenant", TENANT);
    let (status, body) = send(addr, request, Vec::new()).await;
    (status, json_of(&body))
}

async fn metrics_text(server: &TestServer) -> String {
    let (_, body) = send(
        server.http_addr,
        hyper::Request::get("/metrics"),
        Vec::new(),
    )
    .await;
    String::from_utf8_lossy(&body).into_owned()
}

// ---------------------------------------------------------------------------
// The Python receiver
// ---------------------------------------------------------------------------

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The virtualenv's python, made once per run and reused while the
/// requirements file is unchanged.
fn python() -> &'static PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let requirements_path = manifest_dir().join("tests/webhooks/requirements.txt");
        let requirements = std::fs::read_to_string(&requirements_path)
            .unwrap_or_else(|e| panic!("read {}: {e}", requirements_path.display()));
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let venv = tmp.join("webhooks-venv");
        let stamp = venv.join("intray-requirements.txt");
        if std::fs::read_to_string(&stamp).ok().as_deref() != Some(requirements.as_str()) {
            // Built beside and renamed into place: a run that dies half way
            // leaves no half-made venv to be reused.
            let fresh = tmp.join(format!("webhooks-venv.{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&fresh);
            run_setup(
                StdCommand::new("python3").arg("-m").arg("venv").arg(&fresh),
                "create the virtualenv",
            );
            run_setup(
                StdCommand::new(fresh.join("bin/python"))
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--disable-pip-version-check",
                        "-r",
                    ])
                    .arg(&requirements_path),
                "install tests/webhooks/requirements.txt",
            );
            std::fs::write(fresh.join("intray-requirements.txt"), &requirements).expect("stamp");
            let _ = std::fs::remove_dir_all(&venv);
            std::fs::rename(&fresh, &venv).expect("move the virtualenv into place");
        }
        venv.join("bin/python")
    })
}

/// A running `receiver.py` and the lines it printed.
struct Receiver {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start(port: u16, fail_first: u32) -> Receiver {
        Receiver::start_with(SECRET, port, fail_first, &[]).await
    }

    /// Verifying with `secret`; with `tls` = [certificate file, key file] it
    /// speaks HTTPS.
    async fn start_with(secret: &str, port: u16, fail_first: u32, tls: &[&Path]) -> Receiver {
        let mut child = Command::new(python())
            .arg(manifest_dir().join("tests/webhooks/receiver.py"))
            .args([secret.to_owned(), port.to_string(), fail_first.to_string()])
            .args(tls)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start receiver.py");
        let stdout = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let sink = Arc::clone(&lines);
        tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if line == "READY" {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                    continue;
                }
                sink.lock().expect("lines").push(line);
            }
        });
        within(Duration::from_secs(30), "receiver.py ready", ready_rx)
            .await
            .expect("receiver.py printed READY");
        Receiver { child, lines }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lines").clone()
    }

    /// The ACCEPT lines by webhook-id: `[type, sequence, job id, state]`.
    fn accepted(&self) -> HashMap<String, Vec<Vec<String>>> {
        let mut out: HashMap<String, Vec<Vec<String>>> = HashMap::new();
        for line in self.lines() {
            let words: Vec<String> = line.split(' ').map(String::from).collect();
            if words[0] == "ACCEPT" {
                out.entry(words[1].clone())
                    .or_default()
                    .push(words[2..].to_vec());
            }
        }
        out
    }

    /// Waits until `n` distinct webhook-ids were accepted.
    async fn wait_accepted(&self, n: usize) -> HashMap<String, Vec<Vec<String>>> {
        let started = Instant::now();
        loop {
            let accepted = self.accepted();
            if accepted.len() >= n {
                return accepted;
            }
            assert!(
                started.elapsed() < LONG,
                "{} of {n} callbacks accepted within {LONG:?}; receiver said {:?}",
                accepted.len(),
                self.lines()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// Deletes a job's delivery rows behind the server's back.
async fn delete_delivery_of(db: &harness::Db, job_id: &str) -> u64 {
    use sqlx::Connection;
    let sql = "DELETE FROM webhook_deliveries WHERE webhook_id LIKE $1";
    let pattern = format!("evt_{job_id}_%");
    match db.backend {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&db.url).await.expect("connect");
            let done = sqlx::query(sql).bind(pattern).execute(&mut c).await;
            done.expect("delete").rows_affected()
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&db.url)
                .await
                .expect("connect");
            let done = sqlx::query(sql).bind(pattern).execute(&mut c).await;
            done.expect("delete").rows_affected()
        }
    }
}

fn free_port() -> u16 {
    harness::free_port()
}

// ---------------------------------------------------------------------------
// Callbacks
// ---------------------------------------------------------------------------

async fn callbacks_reach_a_verifying_receiver_after_an_outage(backend: Backend) {
    // Made before the clock of the test starts: the first run installs.
    let _ = python();
    let port = free_port();
    let server = TestServer::start_with(backend, webhook_settings).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let url = format!("http://127.0.0.1:{port}/hooks/intray?x=1");

    // SSRF: literal private addresses are refused unless allowed.
    for private in [
        "http://10.0.0.1/",
        "http://169.254.169.254/latest",
        "http://[::1]:9/",
    ] {
        let mut r = submit_req("cb", "k", json!({}));
        r.callback_url = private.into();
        expect_invalid(jobs.submit(r).await, &["callback_url"], private);
    }

    let with_callback = |n: u32| {
        let mut r = submit_req("cb", "k", json!({ "n": n }));
        r.callback_url = url.clone();
        r
    };
    // Receiver down: every job reaches its terminal state without waiting
    // for a delivery.
    let succeeded = submit_with(&mut jobs, with_callback(1)).await;
    let leased = lease_one(&mut workers, "w", "cb").await;
    assert_eq!(leased.job_id, succeeded.id);
    let started = Instant::now();
    complete_ok(&mut workers, &leased).await;
    let complete_took = started.elapsed();

    let failed = submit_with(&mut jobs, with_callback(2)).await;
    let leased = lease_one(&mut workers, "w", "cb").await;
    workers
        .complete(failure_req(&leased, "bad_input", Some(false), None))
        .await
        .expect("complete with a final failure");

    let cancelled = submit_with(&mut jobs, with_callback(3)).await;
    jobs.cancel(pb::CancelJobRequest {
        id: cancelled.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("cancel");
    // Lease lost on the last attempt: the reaper fails it.
    let mut r = with_callback(5);
    r.max_attempts = Some(1);
    r.queue = "cb-abandoned".into();
    let abandoned = submit_with(&mut jobs, r).await;
    let lease = short_lease_req("w", "cb-abandoned", 1, Duration::from_secs(5));
    let leased = workers.lease(lease).await.expect("lease").into_inner().jobs;
    assert_eq!(leased.len(), 1);

    let mut r = with_callback(4);
    r.deadline = Some(ts(chrono::Utc::now() + chrono::Duration::seconds(1)));
    r.queue = "cb-expiring".into();
    let expired = submit_with(&mut jobs, r).await;
    // No callback: no delivery.
    submit(&mut jobs, "cb-none", "k", json!({})).await;

    // Connections are refused for a while (retries back off), then the
    // receiver comes up and answers its first two requests with 503.
    // A second replica's dispatcher claims from the same outbox: SKIP
    // LOCKED (the single writer on SQLite) keeps them off each other's rows.
    let replica = server.start_replica().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let receiver = Receiver::start(port, 2).await;
    let accepted = receiver.wait_accepted(5).await;
    // A moment more: nothing else may arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = receiver.lines();
    assert!(
        !lines
            .iter()
            .any(|l| l.starts_with("REJECT") || l.starts_with("DUPLICATE")),
        "{lines:?}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("FAIL")).count(),
        2,
        "{lines:?}"
    );
    let accepted = {
        assert_eq!(accepted.len(), receiver.accepted().len(), "{lines:?}");
        receiver.accepted()
    };
    let mut by_job: HashMap<String, Vec<String>> = HashMap::new();
    for (id, seen) in &accepted {
        assert_eq!(seen.len(), 1, "webhook-id {id} accepted once: {lines:?}");
        by_job.insert(seen[0][2].clone(), seen[0].clone());
    }
    for (job, ty, state) in [
        (&succeeded, "job.succeeded", "JOB_STATE_SUCCEEDED"),
        (&failed, "job.failed", "JOB_STATE_FAILED"),
        (&cancelled, "job.cancelled", "JOB_STATE_CANCELLED"),
        (&expired, "job.expired", "JOB_STATE_EXPIRED"),
        (&abandoned, "job.failed", "JOB_STATE_FAILED"),
    ] {
        let seen = by_job
            .get(&job.id)
            .unwrap_or_else(|| panic!("no callback for {}: {lines:?}", job.id));
        assert_eq!((seen[0].as_str(), seen[3].as_str()), (ty, state));
        // The sequence is the terminal event's.
        let events = watch_all(&mut jobs, &job.id, 0, Duration::from_secs(10)).await;
        let last = events.last().expect("events");
        assert_eq!(seen[1], last.sequence.to_string(), "{ty}");
    }
    // Counters are per replica: together they saw every attempt.
    let mut attempts = HashMap::new();
    for replica in [&server, &replica] {
        let metrics = metrics_text(replica).await;
        for outcome in ["delivered", "retry", "failed"] {
            let name = format!("intray_webhook_delivery_attempts_total{{outcome=\"{outcome}\"}} ");
            let n: f64 = metrics
                .lines()
                .find_map(|l| l.strip_prefix(name.as_str()))
                .map_or(0.0, |v| v.parse().expect("a number"));
            *attempts.entry(outcome).or_insert(0.0) += n;
        }
    }
    assert_eq!(attempts["delivered"], 5.0, "{attempts:?}");
    assert_eq!(attempts["failed"], 0.0, "{attempts:?}");
    // At least the two 503s and the refused connections were retried.
    assert!(attempts["retry"] >= 2.0, "{attempts:?}");
    // Each attempt is visible in the job's deliveries listing.
    let path = format!("/api/v1/jobs/{}/deliveries", succeeded.id);
    let (status, listing) = get_json(server.http_addr, &path).await;
    assert_eq!(status, 200, "{listing}");
    let list = listing["deliveries"].as_array().expect("deliveries");
    assert_eq!(list.len(), 1, "{listing}");
    assert_eq!(list[0]["status"], "delivered", "{listing}");
    assert_eq!(list[0]["last_status"], 204, "{listing}");
    assert!(list[0]["attempts"].as_u64() >= Some(1), "{listing}");
    assert_eq!(list[0]["type"], "job.succeeded", "{listing}");
    // Delivery is not on the worker's path: Complete was answered while
    // the receiver was down.
    assert!(
        complete_took < Duration::from_secs(2),
        "Complete took {complete_took:?}"
    );
    receiver.stop().await;
    replica.stop().await;
    server.stop().await;
}

async fn callbacks_over_https_check_the_receiver_certificate(backend: Backend) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    let _ = python();
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "webhooks test CA");
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA");
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])
        .expect("leaf params")
        .signed_by(&key, &ca)
        .expect("leaf");
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write PEM");
        path
    };
    let ca_file = file("ca.pem", &ca.pem());
    let cert_file = file("leaf.pem", &leaf.pem());
    let key_file = file("leaf.key", &key.serialize_pem());

    let port = free_port();
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.ca_file = Some(ca_file.clone());
    })
    .await;
    let receiver = Receiver::start_with(SECRET, port, 0, &[&cert_file, &key_file]).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    // `localhost` resolves to 127.0.0.1, which the allow-list permits; the
    // certificate is checked for that name against the configured CA.
    let mut r = submit_req("tls", "k", json!({}));
    r.callback_url = format!("https://localhost:{port}/cb");
    let job = submit_with(&mut jobs, r).await;
    let leased = lease_one(&mut workers, "w", "tls").await;
    complete_ok(&mut workers, &leased).await;
    let accepted = receiver.wait_accepted(1).await;
    let seen = accepted.values().next().expect("one callback");
    assert_eq!(
        (seen[0][0].as_str(), seen[0][2].as_str()),
        ("job.succeeded", job.id.as_str())
    );
    receiver.stop().await;
    server.stop().await;
}

async fn callbacks_to_names_of_private_addresses_are_refused_at_delivery(backend: Backend) {
    // No allow-list: `localhost` passes Submit (a name), but it resolves to
    // loopback, so the delivery is refused after resolution (DNS rebinding),
    // without a request, and retried (an allow-list may be fixed meanwhile)
    // until its retry window ends.
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.keys.allow = AddressPolicy::default();
        s.webhooks.retry_window = Duration::from_secs(2);
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let mut r = submit_req("ssrf", "k", json!({}));
    r.callback_url = "http://localhost:9/".into();
    let job = submit_with(&mut jobs, r).await;
    let leased = lease_one(&mut workers, "w", "ssrf").await;
    complete_ok(&mut workers, &leased).await;
    let path = format!("/api/v1/jobs/{}/deliveries", job.id);
    let started = Instant::now();
    let delivery = loop {
        let (status, listing) = get_json(server.http_addr, &path).await;
        assert_eq!(status, 200, "{listing}");
        let delivery = listing["deliveries"][0].clone();
        if delivery["status"] == "failed" {
            break delivery;
        }
        assert!(started.elapsed() < LONG, "{listing}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        delivery["attempts"].as_u64().is_some_and(|n| n > 1),
        "retried: {delivery}"
    );
    assert_eq!(delivery["last_status"], Value::Null, "{delivery}");
    // The kind of failure, not which address the name resolved to.
    assert_eq!(
        delivery["last_error"], "the host does not resolve to an allowed address",
        "{delivery}"
    );
    server.stop().await;
}

async fn callbacks_survive_a_server_killed_before_delivery(backend: Backend) {
    let _ = python();
    let db = harness::Db::create(backend).await;
    let file = db.path("webhooks.json");
    std::fs::write(
        &file,
        json!({ "default_secret": SECRET, "allow": ["127.0.0.1"] }).to_string(),
    )
    .expect("write the webhooks file");
    let file = file.display().to_string();
    let flags = [
        "--webhooks-file",
        file.as_str(),
        "--webhook-backoff-initial",
        "100ms",
        "--webhook-backoff-max",
        "500ms",
    ];
    let mut server = harness::Server::start(&db, "serve", &flags, &[]).await;
    let port = free_port();
    let mut jobs = server.jobs().await;
    let mut workers = server.workers().await;
    let mut ids = Vec::new();
    for n in 0..3 {
        let mut r = submit_req("cb", "k", json!({ "n": n }));
        r.callback_url = format!("http://127.0.0.1:{port}/cb");
        ids.push(submit_with(&mut jobs, r).await.id);
        let leased = lease_one(&mut workers, "w", "cb").await;
        complete_ok(&mut workers, &leased).await;
    }
    // The transitions committed; the receiver is down, so nothing was
    // delivered. The server dies without a chance to clean up.
    server.kill().await;
    // One job's row goes missing (as for a job that ended before the
    // migration): the sweep at start writes it again.
    assert_eq!(delete_delivery_of(&db, &ids[0]).await, 1);
    let receiver = Receiver::start(port, 0).await;
    server.restart().await;
    let accepted = receiver.wait_accepted(ids.len()).await;
    let mut delivered: Vec<String> = accepted.values().map(|seen| seen[0][2].clone()).collect();
    delivered.sort();
    ids.sort();
    assert_eq!(delivered, ids, "{:?}", receiver.lines());
    for (id, seen) in &accepted {
        assert_eq!(seen.len(), 1, "{id} accepted once");
        assert_eq!(seen[0][0], "job.succeeded");
    }
    receiver.stop().await;
    server.stop().await;
}

// ---------------------------------------------------------------------------
// Reloading the webhooks file
// ---------------------------------------------------------------------------

/// A webhooks file: default secrets, an allow-list, one ingress source
/// (secrets: a string or a list).
fn webhooks_file(secret: Value, allow: &[&str], source: &str, source_secret: Value) -> String {
    json!({
        "default_secret": secret,
        "allow": allow,
        "sources": {source: {"secret": source_secret, "tenant": TENANT, "queue": "hooks", "kind": "event"}},
    })
    .to_string()
}

/// Replaces the file by a rename, as a Kubernetes Secret volume does.
fn replace_file(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).expect("write the next file");
    std::fs::rename(&next, path).expect("rename it into place");
}

/// Submits a job with a callback to `url`, leases and completes it.
async fn finish_with_callback(server: &TestServer, url: String) -> pb::Job {
    let mut r = submit_req("reload", "k", json!({"to": url}));
    r.callback_url = url;
    let job = submit_with(&mut server.jobs_client(TENANT), r).await;
    let mut workers = server.workers_client(TENANT);
    let leased = lease_one(&mut workers, "w", "reload").await;
    assert_eq!(leased.job_id, job.id);
    complete_ok(&mut workers, &leased).await;
    job
}

/// The job ids of the events a receiver accepted.
fn accepted_jobs(receiver: &Receiver) -> Vec<String> {
    receiver
        .accepted()
        .values()
        .flatten()
        .map(|words| words[2].clone())
        .collect()
}

async fn the_webhooks_file_is_reloaded_while_serving(backend: Backend) {
    let _ = python();
    const ROTATED: &str = "whsec_cm90YXRlZC1zZWNyZXQtZm9yLXRoZS1yZWxvYWQtdGVzdA==";
    const ORDERS_SECRET: &str = "whsec_b3JkZXJzLXByb3ZpZGVyLWtleS1mb3ItdGhlLXJlbG9hZA==";
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("webhooks.json");
    std::fs::write(
        &file,
        webhooks_file(
            json!(SECRET),
            &["127.0.0.1"],
            "payments",
            json!(SOURCE_SECRET),
        ),
    )
    .expect("write the first file");
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.keys =
            intray::config::webhooks::WebhookKeys::from_file(&file).expect("a valid file");
        s.webhooks.file = Some(file.clone());
        s.reload_interval = Duration::from_millis(100);
    })
    .await;
    let addr = server.http_addr;
    let mut jobs = server.jobs_client(TENANT);
    let now = || chrono::Utc::now().timestamp();
    let body = br#"{"n": 1}"#;

    // A receiver that has already moved to the new secret refuses the
    // callback signed with the old one; it is retried.
    let new_port = free_port();
    let new_side = Receiver::start_with(ROTATED, new_port, 0, &[]).await;
    let first = finish_with_callback(&server, format!("http://127.0.0.1:{new_port}/")).await;
    let started = Instant::now();
    while !new_side.lines().iter().any(|l| l.starts_with("REJECT")) {
        assert!(started.elapsed() < LONG, "{:?}", new_side.lines());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut elsewhere = submit_req("elsewhere", "k", json!({}));
    elsewhere.callback_url = "http://127.0.0.2:9/".into();
    expect_invalid(
        jobs.submit(elsewhere.clone()).await,
        &["callback_url"],
        "a callback to an address the allow-list does not name yet",
    );
    let (status, _) = post_signed(addr, "payments", "p1", now(), SOURCE_SECRET, body).await;
    assert_eq!(status, 200, "the first file's source");

    // Without a restart: callbacks signed with both secrets, a wider
    // allow-list, and another ingress source that takes either of two.
    replace_file(
        &file,
        &webhooks_file(
            json!([ROTATED, SECRET]),
            &["127.0.0.1", "127.0.0.2"],
            "orders",
            json!([ORDERS_SECRET, SOURCE_SECRET]),
        ),
    );
    let started = Instant::now();
    let first_order = loop {
        let (status, answer) = post_signed(addr, "orders", "o1", now(), ORDERS_SECRET, body).await;
        if status == 200 {
            break answer;
        }
        assert_eq!(status, 404, "{answer}");
        assert!(started.elapsed() < LONG, "the new source never appeared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (status, _) = post_signed(addr, "orders", "o2", now(), SOURCE_SECRET, body).await;
    assert_eq!(status, 200, "the source's second secret");
    let (status, _) = post_signed(addr, "payments", "p2", now(), SOURCE_SECRET, body).await;
    assert_eq!(status, 404, "a removed source is gone");
    jobs.submit(elsewhere.clone())
        .await
        .expect("the widened allow-list admits the callback");
    new_side.wait_accepted(1).await;
    assert_eq!(
        accepted_jobs(&new_side),
        vec![first.id.clone()],
        "the retry after the reload carries a signature of the new secret"
    );
    // A receiver still on the old secret accepts the same kind of callback.
    let old_port = free_port();
    let old_side = Receiver::start(old_port, 0).await;
    let second = finish_with_callback(&server, format!("http://127.0.0.1:{old_port}/")).await;
    old_side.wait_accepted(1).await;
    assert_eq!(accepted_jobs(&old_side), vec![second.id.clone()]);
    assert!(
        !old_side.lines().iter().any(|l| l.starts_with("REJECT")),
        "{:?}",
        old_side.lines()
    );

    // A broken file keeps what is in force.
    replace_file(&file, r#"{"sources": {"orders": "#);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (status, _) = post_signed(addr, "orders", "o3", now(), ORDERS_SECRET, body).await;
    assert_eq!(status, 200, "a failed reload kept the source");
    elsewhere.payload = submit_req("elsewhere", "k", json!({"n": 3})).payload;
    jobs.submit(elsewhere)
        .await
        .expect("a failed reload kept the allow-list");

    // A reload that drops the tenant's secret: a callback is then refused
    // at Submit, and one already due is retried, not failed for good (it
    // was lost), and goes out once the secret is back.
    let mut due = submit_req("reload", "k", json!({"n": 4}));
    due.callback_url = format!("http://127.0.0.1:{old_port}/");
    let due = submit_with(&mut jobs, due).await;
    let unsigned = json!({
        "allow": ["127.0.0.1"],
        "sources": {"orders": {"secret": ORDERS_SECRET, "tenant": TENANT, "queue": "hooks", "kind": "event.v2"}},
    });
    replace_file(&file, &unsigned.to_string());
    let started = Instant::now();
    loop {
        let mut probe = submit_req(
            "reload",
            "k",
            json!({"probe": started.elapsed().as_millis() as u64}),
        );
        probe.callback_url = format!("http://127.0.0.1:{old_port}/");
        match jobs.submit(probe).await {
            Err(status) => {
                assert_eq!(bad_request_fields(&status), ["callback_url"], "{status:?}");
                break;
            }
            Ok(_) => assert!(started.elapsed() < LONG, "the secret never went"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The provider retries a message it sent before the source's kind
    // changed: the same message, not "another body" (it was 409).
    let (status, again) = post_signed(addr, "orders", "o1", now(), ORDERS_SECRET, body).await;
    assert_eq!(
        (status, &again["job_id"], &again["created"]),
        (200, &first_order["job_id"], &json!(false)),
        "{again}"
    );
    let (status, _) = post_signed(addr, "orders", "o1", now(), ORDERS_SECRET, br#"{"n": 2}"#).await;
    assert_eq!(status, 409, "another body under the same id");
    let mut workers = server.workers_client(TENANT);
    let mut leased = lease_one(&mut workers, "w", "reload").await;
    // The probes that went in before the reload took are leased first.
    while leased.job_id != due.id {
        complete_ok(&mut workers, &leased).await;
        leased = lease_one(&mut workers, "w", "reload").await;
    }
    complete_ok(&mut workers, &leased).await;
    let path = format!("/api/v1/jobs/{}/deliveries", due.id);
    let started = Instant::now();
    loop {
        let (_, listing) = get_json(addr, &path).await;
        let delivery = &listing["deliveries"][0];
        if delivery["attempts"].as_u64() >= Some(1) {
            assert_eq!(delivery["status"], "pending", "retried: {listing}");
            break;
        }
        assert!(started.elapsed() < LONG, "never attempted: {listing}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    replace_file(
        &file,
        &webhooks_file(
            json!(SECRET),
            &["127.0.0.1"],
            "orders",
            json!(ORDERS_SECRET),
        ),
    );
    old_side.wait_accepted(2).await;
    assert!(
        accepted_jobs(&old_side).contains(&due.id),
        "the callback went out once the secret was back"
    );
    new_side.stop().await;
    old_side.stop().await;
    server.stop().await;
}

/// A claim takes no more of a receiver's deliveries than the replica has
/// room for at that receiver, counting those it has in flight; the
/// receiver is the URL's `host:port`, whatever its path, query or
/// fragment, and both stores name it alike.
async fn a_claim_takes_no_more_per_receiver_than_it_has_room_for(backend: Backend) {
    use intray::store::outbox::ReceiverLoad;
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.poll = Duration::from_secs(3600);
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let busy = [
        "http://127.0.0.1:9/a",
        "http://127.0.0.1:9?job=2",
        "http://127.0.0.1:9#3",
        "http://127.0.0.1:9/b/c?d#e",
    ];
    let quiet = ["http://127.0.0.1:10/", "http://127.0.0.1:10/x"];
    for url in busy.iter().chain(&quiet) {
        let mut r = submit_req("receivers", "k", json!({}));
        r.callback_url = (*url).into();
        let job = submit_with(&mut jobs, r).await;
        jobs.cancel(pb::CancelJobRequest {
            id: job.id,
            reason: String::new(),
        })
        .await
        .expect("Cancel");
    }
    let store = intray::store::open(
        &server.settings,
        Arc::new(intray::engine::notifier::Notifier::new()),
    )
    .await
    .expect("open the store");
    let outbox = store.outbox();
    let in_flight = HashMap::from([("127.0.0.1:9".to_string(), 1)]);
    let load = ReceiverLoad {
        per_receiver: 3,
        in_flight: &in_flight,
    };
    let claimed = outbox
        .claim_due(32, Duration::from_secs(60), load)
        .await
        .expect("claim");
    let mut by_receiver: HashMap<String, usize> = HashMap::new();
    for c in &claimed {
        *by_receiver.entry(c.receiver.clone()).or_default() += 1;
    }
    assert_eq!(
        by_receiver,
        HashMap::from([
            ("127.0.0.1:9".to_string(), 2),
            ("127.0.0.1:10".to_string(), 2)
        ]),
        "two more for the receiver with one in flight (of 3), both of the other's"
    );
    let full = HashMap::from([("127.0.0.1:9".to_string(), 3)]);
    let load = ReceiverLoad {
        per_receiver: 3,
        in_flight: &full,
    };
    let again = outbox
        .claim_due(32, Duration::from_secs(60), load)
        .await
        .expect("claim again");
    assert!(again.is_empty(), "the receiver is full: {again:?}");
    drop(outbox);
    drop(store);
    server.stop().await;
}

/// A replica whose record of an attempt comes after its claim's hold ran
/// out, when another pass has claimed the row and recorded its own
/// attempt, changes nothing: the delivery stays as the later claim left it.
async fn a_lapsed_claims_record_leaves_the_later_claims(backend: Backend) {
    use intray::store::outbox::{Attempted, ReceiverLoad};
    // The server's own dispatcher makes its first pass at start and the
    // next an hour later: the outbox here is the test's alone.
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.poll = Duration::from_secs(3600);
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let mut r = submit_req("lapsed", "k", json!({}));
    r.callback_url = "http://127.0.0.1:9/".into();
    let job = submit_with(&mut jobs, r).await;
    let leased = lease_one(&mut workers, "w", "lapsed").await;
    complete_ok(&mut workers, &leased).await;

    let store = intray::store::open(
        &server.settings,
        Arc::new(intray::engine::notifier::Notifier::new()),
    )
    .await
    .expect("open the store");
    let outbox = store.outbox();
    let idle = HashMap::new();
    let load = ReceiverLoad {
        per_receiver: 8,
        in_flight: &idle,
    };
    let first = outbox
        .claim_due(10, Duration::ZERO, load)
        .await
        .expect("claim")
        .pop()
        .expect("the delivery is due");
    // Past the first claim's (empty) hold, in the stores' resolution.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = outbox
        .claim_due(10, Duration::from_secs(60), load)
        .await
        .expect("claim again")
        .pop()
        .expect("the lapsed delivery is due again");
    assert!(
        outbox
            .record(&second, &Attempted::Delivered { status: 200 })
            .await
            .expect("record"),
        "the current claim records"
    );
    let late = Attempted::Retry {
        status: Some(503),
        error: "late".into(),
        delay: Duration::ZERO,
    };
    assert!(
        !outbox.record(&first, &late).await.expect("record"),
        "the lapsed claim does not"
    );
    let id: uuid::Uuid = job.id.parse().expect("a UUID");
    let listed = outbox.list(TENANT, id).await.expect("list");
    assert_eq!(
        listed
            .iter()
            .map(|d| (d.status.as_str(), d.attempts, d.last_status))
            .collect::<Vec<_>>(),
        vec![("delivered", 1, Some(200))]
    );
    drop(outbox);
    drop(store);
    server.stop().await;
}

/// A receiver that accepts connections and never answers holds only its
/// own share of the slots (8 of 32) for their timeout (3 s here), however
/// many of its callbacks are due: another receiver's callback, due
/// meanwhile, arrives at once. When the dispatcher waited for a whole
/// claimed batch before claiming again, it waited out the silent
/// receiver's timeout first; with no limit per receiver, 32 of its 40
/// callbacks took every slot.
async fn a_receiver_that_never_answers_holds_up_only_its_own_callbacks(backend: Backend) {
    const PER_RECEIVER: usize = 8;
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.timeout = Duration::from_secs(3);
        s.webhooks.per_receiver = PER_RECEIVER;
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the silent receiver");
    let silent_addr = silent.local_addr().expect("its address");
    let (held_tx, mut held) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            open.push(conn);
            let _ = held_tx.send(());
        }
    });
    // More callbacks due at once than a replica has slots (32), each URL
    // different but all one receiver. Cancelled while queued: terminal at
    // once, a callback each.
    cancel_with_callbacks(&mut jobs, "silent", &format!("http://{silent_addr}/"), 40).await;
    within(LONG, "the silent receiver's first connection", held.recv())
        .await
        .expect("a delivery to the silent receiver started");
    // Within the attempts' 3 s timeout, no more than its share connect.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut connections = 1;
    while held.try_recv().is_ok() {
        connections += 1;
    }
    assert_eq!(
        connections, PER_RECEIVER,
        "attempts in flight at the silent receiver"
    );

    let (answering_url, mut arrived, _) = answering_receiver(Duration::ZERO).await;
    let finished = Instant::now();
    finish_with_callback(&server, answering_url).await;
    let at = within(LONG, "the other receiver's callback", arrived.recv())
        .await
        .expect("the callback arrived");
    let took = at.duration_since(finished);
    assert!(
        took < Duration::from_secs(1),
        "the callback waited {took:?}, behind the silent receiver's 3 s timeout"
    );
    server.stop().await;
}

/// A receiver that answers (50 ms each) gets its callbacks `per_receiver`
/// at a time (never more), one after another, not `per_receiver` per
/// `poll` (1 s, the default): 150 arrive within 10 s of the first submit
/// (they took 19 polls). And its backlog hides another receiver's
/// callback due behind it for at most a poll.
async fn a_fast_receiver_is_held_to_its_limit_at_a_time_not_per_poll(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.webhooks.poll = Duration::from_secs(1);
        s.webhooks.per_receiver = 8;
    })
    .await;
    let (busy_url, mut busy, busy_most) = answering_receiver(Duration::from_millis(50)).await;
    let (other_url, mut other, _) = answering_receiver(Duration::ZERO).await;
    let mut jobs = server.jobs_client(TENANT);
    const CALLBACKS: usize = 150;
    let started = Instant::now();
    cancel_with_callbacks(&mut jobs, "busy", &busy_url, CALLBACKS).await;
    finish_with_callback(&server, other_url).await;
    let finished = Instant::now();
    let at = within(LONG, "the other receiver's callback", other.recv())
        .await
        .expect("the callback arrived");
    let waited = at.duration_since(finished);
    assert!(
        waited < Duration::from_secs(3),
        "the other receiver's callback waited {waited:?} behind the busy one's backlog"
    );
    for n in 0..CALLBACKS {
        within(LONG, "the busy receiver's callbacks", busy.recv())
            .await
            .unwrap_or_else(|| panic!("callback {n} arrived"));
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "{CALLBACKS} callbacks at 8 at a time and 50 ms each took {took:?} from the first submit"
    );
    let most = busy_most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most <= 8, "{most} callbacks at once at one receiver");
    server.stop().await;
}

/// `n` jobs of `queue`, each with a callback to `base` (`hook?job=i`),
/// cancelled while queued: terminal at once, a callback each.
async fn cancel_with_callbacks(jobs: &mut JobsClient, queue: &str, base: &str, n: usize) {
    for i in 0..n {
        let mut r = submit_req(queue, "k", json!({}));
        r.callback_url = format!("{base}hook?job={i}");
        let job = submit_with(jobs, r).await;
        jobs.cancel(pb::CancelJobRequest {
            id: job.id,
            reason: String::new(),
        })
        .await
        .expect("Cancel");
    }
}

/// A receiver answering each request `204` after `delay`, on a connection
/// of its own: its URL, the time of each answer, and the most requests it
/// held at once.
async fn answering_receiver(
    delay: Duration,
) -> (
    String,
    tokio::sync::mpsc::UnboundedReceiver<Instant>,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a receiver");
    let url = format!("http://{}/", listener.local_addr().expect("its address"));
    let (arrived_tx, arrived) = tokio::sync::mpsc::unbounded_channel();
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let most_seen = Arc::clone(&most);
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let arrived_tx = arrived_tx.clone();
            let (open, most) = (Arc::clone(&open), Arc::clone(&most));
            tokio::spawn(async move {
                let now_open = open.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now_open, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                answer_one_request(conn).await;
                open.fetch_sub(1, Ordering::SeqCst);
                let _ = arrived_tx.send(Instant::now());
            });
        }
    });
    (url, arrived, most_seen)
}

/// Reads one HTTP/1.1 request (headers, then `content-length` bytes of
/// body) and answers it `204`.
async fn answer_one_request(mut conn: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).await.expect("read the request");
        assert!(n > 0, "the request ended early");
        request.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&request);
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if request.len() >= end + 4 + length {
                break;
            }
        }
    }
    conn.write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
        .await
        .expect("answer");
}

/// Retention (1 s here) does not delete a finished job whose callback is
/// still pending: the delivery row would go with it, unrecorded. The job
/// stays while its receiver is down, the callback arrives once it is up,
/// and then retention takes the job.
async fn retention_keeps_a_job_until_its_callback_is_delivered(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        webhook_settings(s);
        s.retention = Duration::from_secs(1);
    })
    .await;
    let port = free_port();
    let job = finish_with_callback(&server, format!("http://127.0.0.1:{port}/")).await;
    let mut jobs = server.jobs_client(TENANT);
    // Many reaper passes (every 200 ms) past the retention, the receiver down.
    tokio::time::sleep(Duration::from_secs(3)).await;
    get(&mut jobs, &job.id).await;

    let receiver = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the receiver on its port");
    let (conn, _) = within(LONG, "the callback", receiver.accept())
        .await
        .expect("accept");
    answer_one_request(conn).await;
    let started = Instant::now();
    loop {
        let gone = jobs
            .get(pb::GetJobRequest { id: job.id.clone() })
            .await
            .is_err_and(|s| s.code() == tonic::Code::NotFound);
        if gone {
            break;
        }
        assert!(
            started.elapsed() < LONG,
            "retention takes the job once delivered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.stop().await;
}
