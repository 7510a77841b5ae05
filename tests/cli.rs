//! The client commands (the built binary) against a real server, on both
//! backends: a replayed job's whole history, `watch`'s exit status, and
//! `watch` across a server that shuts down.

mod common;

use std::net::SocketAddr;
use std::process::Output;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::*;
use intray::pb;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Command;

common::backend_tests!(
    get_events_shows_a_replayed_jobs_whole_history,
    watch_exits_by_how_the_job_ended,
    watch_resumes_after_a_server_shuts_down,
    exit_codes_tell_a_missing_job_from_a_server_away,
);

const TENANT: &str = "cli";

/// Runs `intray --addr ADDR --tenant cli ARGS`, with no other `INTRAY_*`
/// setting from the environment.
async fn intray(server: &TestServer, args: &[&str]) -> Output {
    intray_at(&server.url(), args).await
}

/// [`intray`] against `addr`, a server's or not.
async fn intray_at(addr: &str, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_intray"));
    for (key, _) in std::env::vars() {
        if key.starts_with("INTRAY_") {
            command.env_remove(key);
        }
    }
    command
        .args(["--addr", addr, "--tenant", TENANT])
        .args(args)
        .kill_on_drop(true);
    within(Duration::from_secs(30), "the CLI", command.output())
        .await
        .expect("run the CLI")
}

/// A script can tell "no such job" (4) from "try again later" (75, as
/// `intray work` reads a command's exit): both exited 1.
async fn exit_codes_tell_a_missing_job_from_a_server_away(backend: Backend) {
    let server = TestServer::start(backend).await;
    let missing = uuid::Uuid::new_v4().to_string();
    let output = intray(&server, &["get", &missing]).await;
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    let url = server.url();
    server.stop().await;
    let output = intray_at(&url, &["get", &missing]).await;
    assert_eq!(output.status.code(), Some(75), "{output:?}");
}

/// A job of `queue` that failed on its only attempt.
async fn failed_job(server: &TestServer, queue: &str) -> pb::Job {
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let mut r = submit_req(queue, "k", json!({}));
    r.max_attempts = Some(1);
    let job = submit_with(&mut jobs, r).await;
    let leased = lease_one(&mut workers, "w", queue).await;
    workers
        .complete(failure_req(&leased, "broken", Some(false), None))
        .await
        .expect("Complete");
    job
}

/// A job that failed, was replayed and then succeeded: `get --events` shows
/// every event, not only those up to the first terminal one.
async fn get_events_shows_a_replayed_jobs_whole_history(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let job = failed_job(&server, "replayed").await;
    jobs.retry(pb::RetryJobRequest {
        target: Some(pb::retry_job_request::Target::Id(job.id.clone())),
        ..Default::default()
    })
    .await
    .expect("Retry");
    let leased = lease_one(&mut workers, "w", "replayed").await;
    complete_ok(&mut workers, &leased).await;

    let output = intray(&server, &["--json", "get", "--events", &job.id]).await;
    assert!(output.status.success(), "{output:?}");
    let answer: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let types: Vec<&str> = answer["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["type"].as_str())
        .collect();
    assert_eq!(
        types,
        [
            "JOB_EVENT_TYPE_SUBMITTED",
            "JOB_EVENT_TYPE_LEASED",
            "JOB_EVENT_TYPE_FAILED",
            "JOB_EVENT_TYPE_REPLAYED",
            "JOB_EVENT_TYPE_LEASED",
            "JOB_EVENT_TYPE_SUCCEEDED",
        ],
        "{answer}"
    );
    server.stop().await;
}

/// `watch` exits 0 for a job that succeeded and 3 for one that ended
/// otherwise, so that `intray watch ID && next-step` stops at a failure.
async fn watch_exits_by_how_the_job_ended(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let failed = failed_job(&server, "watched").await;
    let output = intray(&server, &["watch", &failed.id]).await;
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("failed"),
        "{output:?}"
    );

    let ok = submit(&mut jobs, "watched", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "watched").await;
    complete_ok(&mut workers, &leased).await;
    let output = intray(&server, &["watch", &ok.id]).await;
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    // From past the terminal event the stream is empty, and the job's
    // state decides.
    let output = intray(&server, &["watch", "--after", "10", &failed.id]).await;
    assert_eq!(output.status.code(), Some(3), "{output:?}");

    // Its output closed while the job still runs (`intray watch ID | head
    // -n1 && deploy`): it does not know how the job ends, so not 0.
    let running = submit(&mut jobs, "watched", "k", json!({})).await;
    lease_one(&mut workers, "w", "watched").await;
    let mut command = Command::new(env!("CARGO_BIN_EXE_intray"));
    let mut watch = command
        .args(["--addr", &server.url(), "--tenant", TENANT])
        .args(["watch", &running.id])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start watch");
    drop(watch.stdout.take());
    let status = within(Duration::from_secs(30), "watch to exit", watch.wait())
        .await
        .expect("wait for watch");
    assert_eq!(status.code(), Some(1), "{status:?}");
    server.stop().await;
}

/// A port that forwards each new connection to the server it is pointed
/// at: a client's reconnect lands on whichever server is up, as behind a
/// load balancer.
struct Forwarder {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(target: SocketAddr) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the forwarder");
        let addr = listener.local_addr().expect("forwarder address");
        let target = Arc::new(Mutex::new(target));
        let current = Arc::clone(&target);
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = *current.lock().unwrap_or_else(PoisonError::into_inner);
                tokio::spawn(async move {
                    // A refused upstream drops the client's connection,
                    // which it sees as the server being away.
                    if let Ok(mut server) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Forwarder {
            addr,
            target,
            accepting,
        }
    }

    fn point_at(&self, target: SocketAddr) {
        *self.target.lock().unwrap_or_else(PoisonError::into_inner) = target;
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// The sequences of `watch --json` lines.
fn sequences_of(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .map(|line| {
            let event: Value = serde_json::from_str(line).expect("an event as JSON");
            event["sequence"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .expect("a sequence")
        })
        .collect()
}

/// The server a `watch` streams from shuts down while the job runs: the
/// stream ends `UNAVAILABLE`, and `watch` picks up after the last event it
/// printed from another server (through the same address), prints the
/// rest once each and exits by how the job ended.
async fn watch_resumes_after_a_server_shuts_down(backend: Backend) {
    let first = TestServer::start(backend).await;
    let second = first.start_replica().await;
    let mut jobs = first.jobs_client(TENANT);
    let job = submit(&mut jobs, "moved", "k", json!({})).await;
    let leased = lease_one(&mut first.workers_client(TENANT), "w", "moved").await;
    let forwarder = Forwarder::start(first.addr).await;

    let mut watch = Command::new(env!("CARGO_BIN_EXE_intray"))
        .args(["--addr", &format!("http://{}", forwarder.addr)])
        .args(["--tenant", TENANT, "--json", "watch", &job.id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start watch");
    let mut stdout = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let mut printed = Vec::new();
    while printed.len() < 2 {
        let line = within(
            Duration::from_secs(20),
            "SUBMITTED and LEASED",
            stdout.next_line(),
        )
        .await
        .expect("read watch's output")
        .expect("watch goes on");
        printed.push(line);
    }

    forwarder.point_at(second.addr);
    first.stop().await;
    complete_ok(&mut second.workers_client(TENANT), &leased).await;
    let rest = within(Duration::from_secs(30), "the rest of the watch", async {
        let mut rest = Vec::new();
        while let Some(line) = stdout.next_line().await.expect("read watch's output") {
            rest.push(line);
        }
        rest
    })
    .await;
    printed.extend(rest);
    let status = within(Duration::from_secs(10), "watch to exit", watch.wait())
        .await
        .expect("wait for watch");
    let mut stderr = String::new();
    if let Some(mut err) = watch.stderr.take() {
        err.read_to_string(&mut stderr).await.expect("read stderr");
    }
    assert_eq!(status.code(), Some(0), "the job succeeded: {stderr}");
    assert_eq!(
        sequences_of(&printed),
        [1, 2, 3],
        "each event once: {printed:?}"
    );
    assert!(
        stderr.contains("UNAVAILABLE") && stderr.contains("reconnecting"),
        "the interruption is reported, not taken for the end: {stderr}"
    );
    second.stop().await;
}
