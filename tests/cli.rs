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
    watch_resumes_after_its_connection_stalls,
    exit_codes_tell_a_missing_job_from_a_server_away,
);

const TENANT: &str = "cli";
/// How long a step that takes no time may take on a loaded machine.
const LONG_WAIT: Duration = Duration::from_secs(20);

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

    // The same once what there was has been printed and read, and nothing
    // more is coming (`head -n1` after the line it waited for): it exits
    // then, not at the job's next event, which may be hours away.
    let mut watch = Watching::start(server.addr, &running.id, 2).await;
    drop(watch.stdout);
    let status = within(
        LONG_WAIT,
        "watch to exit with nothing to write",
        watch.child.wait(),
    )
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
    /// Raised by [`Forwarder::stall`]; a connection stalls once it is above
    /// the value it was accepted under.
    stalls: tokio::sync::watch::Sender<u64>,
    accepting: tokio::task::JoinHandle<()>,
}

/// Connections stalled by [`Forwarder::stall`], open until the forwarder goes.
type Held = Arc<Mutex<Vec<(TcpStream, TcpStream)>>>;

impl Forwarder {
    async fn start(target: SocketAddr) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the forwarder");
        let addr = listener.local_addr().expect("forwarder address");
        let target = Arc::new(Mutex::new(target));
        let current = Arc::clone(&target);
        let (stalls, stalled) = tokio::sync::watch::channel(0u64);
        let held: Held = Arc::default();
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = *current.lock().unwrap_or_else(PoisonError::into_inner);
                let mut stalled = stalled.clone();
                let generation = *stalled.borrow_and_update();
                let held = Arc::clone(&held);
                tokio::spawn(async move {
                    // A refused upstream drops the client's connection,
                    // which it sees as the server being away.
                    let Ok(mut server) = TcpStream::connect(to).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = stalled.wait_for(|&g| g > generation) => {
                            held.lock().unwrap_or_else(PoisonError::into_inner).push((client, server));
                        }
                    }
                });
            }
        });
        Forwarder {
            addr,
            target,
            stalls,
            accepting,
        }
    }

    fn point_at(&self, target: SocketAddr) {
        *self.target.lock().unwrap_or_else(PoisonError::into_inner) = target;
    }

    /// Stops every open connection without closing it, as a network that
    /// drops packets (or a NAT that forgot the flow) does; connections
    /// made afterwards go through.
    fn stall(&self) {
        self.stalls.send_modify(|g| *g += 1);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// `intray --json watch ID` through `addr`, its lines read as they come.
struct Watching {
    child: tokio::process::Child,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    printed: Vec<String>,
}

impl Watching {
    /// Starts the watch and waits for its first `n` lines.
    async fn start(addr: SocketAddr, id: &str, n: usize) -> Watching {
        let mut child = Command::new(env!("CARGO_BIN_EXE_intray"))
            .args(["--addr", &format!("http://{addr}")])
            .args(["--tenant", TENANT, "--json", "watch", id])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start watch");
        let stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut watching = Watching {
            child,
            stdout,
            printed: Vec::new(),
        };
        while watching.printed.len() < n {
            let line = within(
                LONG_WAIT,
                "the watch's first events",
                watching.stdout.next_line(),
            )
            .await
            .expect("read watch's output")
            .expect("watch goes on");
            watching.printed.push(line);
        }
        watching
    }

    /// Reads the rest within `limit` (what for: `what`), then waits for the
    /// exit: its status, every line printed, and stderr.
    async fn finish(
        mut self,
        limit: Duration,
        what: &str,
    ) -> (std::process::ExitStatus, Vec<String>, String) {
        let stdout = &mut self.stdout;
        let rest = within(limit, what, async {
            let mut rest = Vec::new();
            while let Some(line) = stdout.next_line().await.expect("read watch's output") {
                rest.push(line);
            }
            rest
        })
        .await;
        self.printed.extend(rest);
        let status = within(LONG_WAIT, "watch to exit", self.child.wait())
            .await
            .expect("wait for watch");
        let mut stderr = String::new();
        if let Some(mut err) = self.child.stderr.take() {
            err.read_to_string(&mut stderr).await.expect("read stderr");
        }
        (status, self.printed, stderr)
    }
}

/// A resumed watch of a job that succeeded: exit 0, each of its three
/// events printed once, and the reconnection said on stderr.
fn resumed_to_the_end(status: std::process::ExitStatus, printed: &[String], stderr: &str) {
    assert_eq!(status.code(), Some(0), "the job succeeded: {stderr}");
    assert_eq!(
        sequences_of(printed),
        [1, 2, 3],
        "each event once: {printed:?}"
    );
    assert!(
        stderr.contains("reconnecting"),
        "the lost connection is reported: {stderr}"
    );
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
    let watch = Watching::start(forwarder.addr, &job.id, 2).await;

    forwarder.point_at(second.addr);
    first.stop().await;
    complete_ok(&mut second.workers_client(TENANT), &leased).await;
    let (status, printed, stderr) = watch
        .finish(Duration::from_secs(30), "the rest of the watch")
        .await;
    resumed_to_the_end(status, &printed, &stderr);
    assert!(
        stderr.contains("UNAVAILABLE"),
        "the interruption is reported, not taken for the end: {stderr}"
    );
    second.stop().await;
}

/// The connection a `watch` streams over stops carrying anything, with no
/// error on either side: HTTP/2 keepalive pings (every 20 s, 10 s to
/// answer) find it dead, and `watch` resumes over a new one, printing the
/// event it missed. Without the pings it would wait forever.
async fn watch_resumes_after_its_connection_stalls(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "stalled", "k", json!({})).await;
    let leased = lease_one(&mut server.workers_client(TENANT), "w", "stalled").await;
    let forwarder = Forwarder::start(server.addr).await;
    let watch = Watching::start(forwarder.addr, &job.id, 2).await;

    forwarder.stall();
    complete_ok(&mut server.workers_client(TENANT), &leased).await;
    let (status, printed, stderr) = watch
        .finish(
            Duration::from_secs(60),
            "a ping to find the connection dead, and the rest of the watch",
        )
        .await;
    resumed_to_the_end(status, &printed, &stderr);
    server.stop().await;
}
