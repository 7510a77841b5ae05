//! The Python example worker (`examples/python/worker.py`) end to end against
//! the real server, on SQLite and PostgreSQL.
//!
//! The test makes its own virtualenv under cargo's target tmp folder (reused
//! while `requirements.txt` is unchanged), installs the pinned requirements
//! from PyPI, and generates the gRPC stubs from `proto/` with grpcio-tools.
//! A missing python3, venv module or pip fails the test with a message
//! naming what is missing: it never skips.
//!
//! Every outcome must go with `CompleteAndLease` (checked by the server's
//! RPC metrics), and a busy worker's next job must come back with it. A
//! blip of failed heartbeats (injected by a proxy) must not lose the job,
//! nor an outcome that cannot be reported the job its call brought, and a
//! heartbeat that hangs must not keep a job running past its lease. No
//! payload may end the worker, a payload within the server's limit must
//! reach it however large it is as protobuf, a rate-limited worker waits
//! out the server's `RetryInfo`, SIGHUP drains as SIGTERM does (unless it
//! was ignored at start), and a second stop signal hands the job in hand
//! back at once.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command as StdCommand, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::proxy::{self, Fault};
use common::*;
use intray::config::RateLimit;
use intray::pb::{self, JobState as St};
use nix::sys::signal::{SigHandler, Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::Command;

common::backend_tests!(
    python_worker_end_to_end,
    python_heartbeats_ride_out_a_blip,
    python_unreported_outcome_holds_the_next_job_back_a_third_of_a_lease,
    python_a_hung_heartbeat_stops_the_job_within_its_lease,
    python_a_success_after_the_grace_stands,
    python_a_deaf_handler_is_left_behind_after_the_grace,
    python_a_payload_cannot_end_the_worker,
    python_a_payload_large_as_protobuf_is_run,
    python_lease_waits_out_the_servers_retry_info,
    python_heartbeat_and_outcome_wait_out_the_servers_retry_info,
    python_sighup_drains,
    python_started_under_nohup_keeps_running_on_sighup,
    python_told_twice_to_stop_hands_the_job_back_at_once,
);

const TENANT: &str = "acme";
const LONG: Duration = Duration::from_secs(20);

/// A virtualenv with the example's requirements, and generated stubs.
struct PythonEnv {
    python: PathBuf,
    stubs: PathBuf,
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Makes (or reuses) the virtualenv and generates the stubs, once per run.
fn python_env() -> &'static PythonEnv {
    static ENV: OnceLock<PythonEnv> = OnceLock::new();
    ENV.get_or_init(|| {
        let python3 = StdCommand::new("python3").arg("--version").output();
        match python3 {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "python3 is missing or broken (python3 --version: {}): install Python 3 with its venv module (Debian: apt-get install python3 python3-venv python3-pip)",
                out.status
            ),
            Err(e) => panic!(
                "python3 is missing ({e}): install Python 3 with its venv module (Debian: apt-get install python3 python3-venv python3-pip)"
            ),
        }
        let requirements_path = manifest_dir().join("examples/python/requirements.txt");
        let requirements = std::fs::read_to_string(&requirements_path)
            .unwrap_or_else(|e| panic!("read {}: {e}", requirements_path.display()));
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let venv = tmp.join("python-worker-venv");
        let stamp = |dir: &Path| dir.join("intray-requirements.txt");
        let current = std::fs::read_to_string(stamp(&venv)).ok();
        if current.as_deref() != Some(requirements.as_str()) || !venv.join("bin/python").exists() {
            // Built beside and renamed into place, so a run that dies half
            // way leaves no half-made venv behind to be reused.
            let fresh = tmp.join(format!("python-worker-venv.{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&fresh);
            run_setup(
                StdCommand::new("python3").args(["-m", "venv"]).arg(&fresh),
                "creating the virtualenv (is python3-venv installed?)",
            );
            let pip_ok = StdCommand::new(fresh.join("bin/python"))
                .args(["-m", "pip", "--version"])
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(
                pip_ok,
                "pip is missing in the virtualenv {}: install pip for python3 (Debian: apt-get install python3-pip python3-venv)",
                fresh.display()
            );
            run_setup(
                StdCommand::new(fresh.join("bin/python"))
                    .args(["-m", "pip", "install", "--quiet", "-r"])
                    .arg(&requirements_path),
                "installing examples/python/requirements.txt from PyPI",
            );
            std::fs::write(stamp(&fresh), &requirements).expect("write the requirements stamp");
            let _ = std::fs::remove_dir_all(&venv);
            std::fs::rename(&fresh, &venv).expect("move the virtualenv into place");
        }
        let python = venv.join("bin/python");
        let stubs = tmp.join(format!("python-worker-stubs.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&stubs);
        std::fs::create_dir_all(&stubs).expect("create the stubs folder");
        run_setup(
            StdCommand::new(&python)
                .current_dir(manifest_dir())
                .args(["-m", "grpc_tools.protoc", "-I", "proto"])
                .arg(format!("--python_out={}", stubs.display()))
                .arg(format!("--grpc_python_out={}", stubs.display()))
                .arg("proto/intray/v1/intray.proto"),
            "generating the Python stubs with grpc_tools.protoc",
        );
        PythonEnv { python, stubs }
    })
}

/// The Python environment, made once (in a blocking task: it runs pip).
async fn setup() -> &'static PythonEnv {
    tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup")
}

/// Sends `signal` to the worker, which must then drain and exit cleanly.
async fn stop(worker: &mut tokio::process::Child, signal: Signal) {
    let pid = worker.id().expect("worker pid");
    kill(Pid::from_raw(pid as i32), signal).expect("signal the worker");
    exited_cleanly(worker).await;
}

/// Waits for the worker to exit, with status 0.
async fn exited_cleanly(worker: &mut tokio::process::Child) {
    let status = within(LONG, "the Python worker to exit", worker.wait())
        .await
        .expect("wait for the Python worker");
    assert!(status.success(), "the Python worker exited with {status}");
}

/// The job `id`, which the worker must have handed back at its stop
/// (queued again, class `worker_shutdown`).
async fn handed_back(jobs: &mut JobsClient, id: &str) -> pb::Job {
    let back = get(jobs, id).await;
    assert_eq!(state(&back), St::Queued, "handed back: {back:?}");
    assert_eq!(error_class(&back), "worker_shutdown");
    back
}

fn error_class(job: &pb::Job) -> String {
    job.error
        .as_ref()
        .map(|e| e.class.clone())
        .unwrap_or_default()
}

/// The example worker on queue `py` of `addr`, with a lease of
/// `lease_seconds`, a 1 s long poll and a 1 s shutdown grace.
fn start_worker(env: &PythonEnv, addr: &str, lease_seconds: u32) -> tokio::process::Child {
    worker_command(env, addr, lease_seconds)
        .spawn()
        .expect("start the Python worker")
}

/// As [`start_worker`], with SIGHUP ignored (`SigIgn`, as `nohup` leaves
/// it) or at its default (`SigDfl`, whatever the test runner left: a CI
/// job started with `nohup` leaves it ignored, and the worker then rightly
/// keeps on): the worker inherits that across exec.
fn start_worker_with_sighup(
    env: &PythonEnv,
    addr: &str,
    lease_seconds: u32,
    disposition: SigHandler,
) -> tokio::process::Child {
    let mut command = worker_command(env, addr, lease_seconds);
    // SAFETY: between fork and exec the child only calls sigaction, which
    // is async-signal-safe; SIG_IGN and SIG_DFL install no handler.
    unsafe {
        command.pre_exec(move || {
            nix::sys::signal::signal(Signal::SIGHUP, disposition)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    command.spawn().expect("start the Python worker")
}

fn worker_command(env: &PythonEnv, addr: &str, lease_seconds: u32) -> Command {
    let mut command = Command::new(&env.python);
    command
        .arg("-u")
        .arg(manifest_dir().join("examples/python/worker.py"))
        .args(["--addr", addr, "--tenant", TENANT])
        .args(["--queue", "py", "--worker-id", "py-worker"])
        .args(["--lease-seconds", &lease_seconds.to_string()])
        .args(["--wait-seconds", "1"])
        .args(["--grace-seconds", "1"])
        .arg("--stubs")
        .arg(&env.stubs)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// How many `WorkerService/Lease` calls the server at `addr` has answered
/// with `code`, from its RPC metrics.
async fn lease_calls(addr: std::net::SocketAddr, code: &str) -> f64 {
    worker_calls(addr, &["Lease"], code).await
}

/// `WorkerService` calls of any of `methods` answered with `code`.
async fn worker_calls(addr: std::net::SocketAddr, methods: &[&str], code: &str) -> f64 {
    let metrics = parse(&scrape(addr).await);
    methods
        .iter()
        .filter_map(|method| {
            metrics.get(&format!(
                "intray_rpc_responses_total{{method=\"/intray.v1.WorkerService/{method}\",code=\"{code}\"}}"
            ))
        })
        .sum()
}

async fn python_worker_end_to_end(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 3);

    // Success: the payload comes back.
    let echo = submit(&mut jobs, "py", "echo", json!({"doc": "hi"})).await;
    let done = wait_for_state(&mut jobs, &echo.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!({"echo": {"doc": "hi"}, "attempt": 1.0}))
    );
    assert_eq!(done.lease_owner, "");

    // A final failure with its error class.
    let fail = submit(
        &mut jobs,
        "py",
        "fail",
        json!({"error_class": "bad_input", "message": "empty doc", "retryable": false}),
    )
    .await;
    let done = wait_for_state(&mut jobs, &fail.id, St::Failed, LONG).await;
    assert_eq!(error_class(&done), "bad_input");
    assert_eq!(done.attempt, 1);

    // A retryable failure, then success.
    let flaky = submit(&mut jobs, "py", "flaky", json!({})).await;
    let done = wait_for_state(&mut jobs, &flaky.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 2);
    let events = watch_all(&mut jobs, &flaky.id, 0, LONG).await;
    let retry = events
        .iter()
        .find(|e| e.r#type == pb::JobEventType::RetryScheduled as i32)
        .unwrap_or_else(|| panic!("no RETRY_SCHEDULED in {:?}", event_types(&events)));
    let detail = retry
        .detail
        .as_ref()
        .map(|d| serde_json::to_string(d).unwrap_or_default());
    assert!(
        detail.as_deref().is_some_and(|d| d.contains("flaky")),
        "the retry records the error class: {detail:?}"
    );

    // Cancellation reaches the running job through the heartbeat thread.
    let sleep = submit(&mut jobs, "py", "sleep", json!({"seconds": 60})).await;
    wait_for_state(&mut jobs, &sleep.id, St::Running, LONG).await;
    let cancelled_at = Instant::now();
    jobs.cancel(pb::CancelJobRequest {
        id: sleep.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    wait_for_state(&mut jobs, &sleep.id, St::Cancelled, Duration::from_secs(8)).await;
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "the worker reported the cancel within a heartbeat or so (1 s), not at the 30 s grace: {:?}",
        cancelled_at.elapsed()
    );

    // A busy worker's outcome brings its next job: five jobs queued behind
    // a running one are each leased by the previous job's CompleteAndLease,
    // on their first attempt (a job the worker dropped would come back on a
    // second one, after its 3 s lease).
    let busy = submit(&mut jobs, "py", "sleep", json!({"seconds": 2})).await;
    wait_for_state(&mut jobs, &busy.id, St::Running, LONG).await;
    // Counted once the worker holds the job: its earlier reports are answered.
    let chained_before = settled_worker_calls_ok(server.http_addr, "CompleteAndLease").await;
    let mut queued = Vec::new();
    for n in 0..5 {
        queued.push(submit(&mut jobs, "py", "echo", json!({"n": n})).await.id);
    }
    wait_for_state(&mut jobs, &busy.id, St::Succeeded, LONG).await;
    for id in &queued {
        let done = wait_for_state(&mut jobs, id, St::Succeeded, LONG).await;
        assert_eq!(done.attempt, 1, "job {id} ran more than once");
    }
    let chained =
        settled_worker_calls_ok(server.http_addr, "CompleteAndLease").await - chained_before;
    assert_eq!(chained, 6.0, "one CompleteAndLease per outcome");
    assert_eq!(
        worker_calls_ok(server.http_addr, "Complete").await,
        0.0,
        "every outcome of the run went with CompleteAndLease"
    );

    // A result over the server's size limit: refused in the chained call,
    // then reported as a final failure rather than left to its lease.
    let big = "x".repeat(1024 * 1024 - 20);
    let too_big = submit(&mut jobs, "py", "echo", json!({ "doc": big })).await;
    let done = wait_for_state(&mut jobs, &too_big.id, St::Failed, LONG).await;
    assert_eq!(error_class(&done), "invalid_result");
    assert_eq!(done.attempt, 1, "reported at once, not after its lease");

    // SIGTERM: stops leasing; the job in hand is stopped after the 1 s
    // grace and handed back to run again at once; the worker exits cleanly.
    let long = submit(&mut jobs, "py", "sleep", json!({"seconds": 60})).await;
    wait_for_state(&mut jobs, &long.id, St::Running, LONG).await;
    stop(&mut worker, Signal::SIGTERM).await;
    handed_back(&mut jobs, &long.id).await;
    server.stop().await;
}

/// Heartbeats that fail for a moment (two answered `UNAVAILABLE`, through a
/// proxy) are retried within the lease, and the job keeps its lease: it
/// succeeds on its first attempt. A worker that took a failed heartbeat
/// for a lost lease would drop the job, and it would run again.
async fn python_heartbeats_ride_out_a_blip(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (addr, calls) = proxy::start(&server, TENANT, Fault::HeartbeatsUnavailable(2)).await;
    let mut worker = start_worker(env, &addr, 3);
    // Four seconds under a 3 s lease: the lease must be extended.
    let sleep = submit(&mut jobs, "py", "sleep", json!({"seconds": 4})).await;
    let done = wait_for_state(&mut jobs, &sleep.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 1, "the job kept its lease through the blip");
    let beats = calls.heartbeats();
    assert!(
        beats >= 3,
        "two failed heartbeats, then one that went through: {beats}"
    );
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// As the Rust library's test of the same name: when `CompleteAndLease`
/// brings the next job but the outcome cannot be reported (a proxy answers
/// it `UNAVAILABLE`, and every `Complete` of it after), the worker retries
/// it for a third of its 6 s lease, not the whole lease, so the next job
/// starts while its lease is young and keeps it (the reaper runs every
/// 100 ms here: held back a whole lease, it would run a second time).
async fn python_unreported_outcome_holds_the_next_job_back_a_third_of_a_lease(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let first = submit(&mut jobs, "py", "sleep", json!({"seconds": 1})).await;
    let next = submit(&mut jobs, "py", "sleep", json!({"seconds": 1})).await;
    let (addr, calls) = proxy::start(&server, TENANT, Fault::OutcomeUnavailable).await;
    let mut worker = start_worker(env, &addr, 6);
    let done = wait_for_state(&mut jobs, &next.id, St::Succeeded, LONG).await;
    // A lease that ran out would have put it back, to run a second time.
    assert_eq!(done.attempt, 1, "the next job kept its first lease");
    assert!(calls.chained() >= 1);
    // The lost outcome's job is reclaimed when its lease ends, and run again.
    let again = wait_for_state(&mut jobs, &first.id, St::Succeeded, LONG).await;
    assert_eq!(again.attempt, 2);
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// A heartbeat that is never answered (through a proxy) gives up when the
/// 3 s lease would end: the job in hand stops then, and the one-job worker
/// leases the job's second attempt right after the reaper (every 100 ms)
/// reclaims it. With a call timeout of 10 s the first attempt ran on to
/// about 11 s.
async fn python_a_hung_heartbeat_stops_the_job_within_its_lease(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (addr, calls) = proxy::start(&server, TENANT, Fault::HeartbeatsHang).await;
    let mut worker = start_worker(env, &addr, 3);
    let sleep = submit(&mut jobs, "py", "sleep", json!({"seconds": 60})).await;
    wait_for_state(&mut jobs, &sleep.id, St::Running, LONG).await;
    let leased = Instant::now();
    let again = within(LONG, "the second attempt", async {
        loop {
            let job = get(&mut jobs, &sleep.id).await;
            if job.attempt == 2 && state(&job) == St::Running {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let took = leased.elapsed();
    assert!(
        took <= Duration::from_millis(3000 + 2000),
        "the first attempt held the worker {took:?}, past its 3 s lease: {again:?}"
    );
    assert!(calls.heartbeats() >= 1, "a heartbeat was sent and hung");
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// A job that succeeds after the shutdown grace ran out (a blocking call
/// that does not look at the cancel flag) keeps its success: the work is
/// done, and reporting it as `worker_shutdown` would run it again.
async fn python_a_success_after_the_grace_stands(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 6);
    // 3 s of work against the worker's 1 s grace.
    let busy = submit(&mut jobs, "py", "busy", json!({"seconds": 3})).await;
    wait_for_state(&mut jobs, &busy.id, St::Running, LONG).await;
    stop(&mut worker, Signal::SIGTERM).await;
    let done = get(&mut jobs, &busy.id).await;
    assert_eq!(state(&done), St::Succeeded, "the success stands: {done:?}");
    assert_eq!(done.attempt, 1);
    server.stop().await;
}

/// No payload may end the worker. A failure whose class and message are
/// not strings raised a `TypeError` while its outcome was built, which
/// ended the process, and the job then ended every worker that leased it
/// until its attempts ran out. Now the class goes as text (characters the
/// server refuses in a class as `_`), a handler that raises on its payload
/// fails as `handler_exception`, and the same worker runs the next job.
async fn python_a_payload_cannot_end_the_worker(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 3);

    let numeric = submit(
        &mut jobs,
        "py",
        "fail",
        json!({"error_class": 5, "message": {"why": [1]}, "retryable": false}),
    )
    .await;
    let done = wait_for_state(&mut jobs, &numeric.id, St::Failed, LONG).await;
    // The 5 crosses as a double; the worker gives the handler a whole
    // number back as an int (str() of the double would write 5.0).
    assert_eq!(error_class(&done), "5");
    let message = done.error.as_ref().map(|e| e.message.clone());
    assert!(
        message.as_deref().is_some_and(|m| m.contains("'why': [1]")),
        "the message as text: {message:?}"
    );
    assert_eq!(done.attempt, 1);

    let spaced = submit(
        &mut jobs,
        "py",
        "fail",
        json!({"error_class": "not a class!", "retryable": false}),
    )
    .await;
    let done = wait_for_state(&mut jobs, &spaced.id, St::Failed, LONG).await;
    assert_eq!(error_class(&done), "not_a_class_");

    // `payload.get` on a string raises: one attempt, so that it fails now.
    let unreadable = submit_with(
        &mut jobs,
        pb::SubmitRequest {
            max_attempts: Some(1),
            ..submit_req("py", "fail", json!("not an object"))
        },
    )
    .await;
    let done = wait_for_state(&mut jobs, &unreadable.id, St::Failed, LONG).await;
    assert_eq!(error_class(&done), "handler_exception");

    let next = submit(&mut jobs, "py", "echo", json!({"after": "the failures"})).await;
    let done = wait_for_state(&mut jobs, &next.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 1);
    assert!(
        worker.try_wait().expect("poll the Python worker").is_none(),
        "the Python worker still runs"
    );
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// A payload within the server's 1 MiB of JSON can be five times that as
/// protobuf (`google.protobuf.Value` spends 11 bytes on a `0,`): 460,000
/// zeros are 920 kB of JSON and over 5 MB in the `Lease` answer. With
/// grpcio's default 4 MiB receive limit the worker refused the answer
/// after the server had handed the job over: the job was never run, and
/// came back at each lease's end to fail so again.
async fn python_a_payload_large_as_protobuf_is_run(backend: Backend) {
    let env = setup().await;
    let payload = json!({ "zeros": vec![0; 460_000] });
    let as_json = serde_json::to_vec(&payload).expect("JSON").len();
    assert!(as_json < 1024 * 1024, "within the payload limit: {as_json}");
    let as_protobuf = prost::Message::encoded_len(&json_to_value(payload.clone()));
    assert!(
        as_protobuf > 4 * 1024 * 1024,
        "past grpcio's default limit: {as_protobuf}"
    );
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    // Seconds of JSON conversion in Python: a lease that is not tight.
    let mut worker = start_worker(env, &server.addr.to_string(), 10);
    let big = submit(&mut jobs, "py", "echo", payload).await;
    // Its events, not Get: each Get would carry the 5 MB payload.
    let events = watch_all(&mut jobs, &big.id, 0, LONG).await;
    assert_eq!(
        events.last().map(event_type),
        Some(pb::JobEventType::Succeeded),
        "{:?}",
        event_types(&events)
    );
    let done = get(&mut jobs, &big.id).await;
    assert_eq!(done.attempt, 1, "run on its first lease");
    let echoed = done
        .result
        .as_ref()
        .map(value_to_json)
        .and_then(|r| r["echo"]["zeros"].as_array().map(Vec::len));
    assert_eq!(echoed, Some(460_000));
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// A server allowing each caller `per_second` calls, one at a time.
async fn rate_limited(backend: Backend, per_second: f64) -> TestServer {
    TestServer::start_with(backend, |s| {
        s.rate_limit = Some(RateLimit {
            per_second,
            burst: 1,
        });
    })
    .await
}

/// Some calls were refused, and each refusal was waited out: at most two
/// more refused than answered (retrying at once, several times as many).
fn waited_out(answered: f64, refused: f64) {
    assert!(
        refused >= 1.0,
        "the rate limit was reached: {refused} refused"
    );
    assert!(
        refused <= answered + 2.0,
        "{refused} refused to {answered} answered: the retries did not wait for the server"
    );
}

/// A server that limits the worker's rate answers `RESOURCE_EXHAUSTED`
/// with a `RetryInfo` saying when the next call will pass, and the worker
/// waits that out rather than its own backoff, from 0.1 s. At one call
/// each 2 s (burst 1) against a 1 s long poll, an answered `Lease` is
/// followed by about one refused; ignoring the delay, by four or five (15
/// refused to 4 answered in 8 s, by hand).
async fn python_lease_waits_out_the_servers_retry_info(backend: Backend) {
    let env = setup().await;
    let server = rate_limited(backend, 0.5).await;
    let mut worker = start_worker(env, &server.addr.to_string(), 3);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let answered = lease_calls(server.http_addr, "OK").await;
    let refused = lease_calls(server.http_addr, "RESOURCE_EXHAUSTED").await;
    assert!(answered >= 2.0, "the worker leased on: {answered} answered");
    waited_out(answered, refused);
    assert!(
        worker.try_wait().expect("poll the Python worker").is_none(),
        "the Python worker still runs"
    );
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// `Heartbeat` and the outcome's call, refused by the rate limit, are sent
/// again once the server's `RetryInfo` says, not at once: one token every
/// four seconds against a heartbeat every two, so some are refused, and
/// the job still ends with its outcome and on its first attempt.
async fn python_heartbeat_and_outcome_wait_out_the_servers_retry_info(backend: Backend) {
    let env = setup().await;
    let server = rate_limited(backend, 0.25).await;
    let mut jobs = server.jobs_client(TENANT);
    // Before the worker starts, so that the submit has the bucket's token.
    let job = submit(&mut jobs, "py", "sleep", json!({"seconds": 7})).await;
    let mut worker = start_worker(env, &server.addr.to_string(), 6);
    // Watched on /metrics, which the limit leaves alone: the test's own
    // Get would take the tenant's tokens.
    let outcomes = ["Complete", "CompleteAndLease"];
    within(
        Duration::from_secs(40),
        "the job's outcome to be taken",
        async {
            while worker_calls(server.http_addr, &outcomes, "OK").await < 1.0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        },
    )
    .await;
    let methods = ["Heartbeat", "Complete", "CompleteAndLease"];
    let answered = worker_calls(server.http_addr, &methods, "OK").await;
    let refused = worker_calls(server.http_addr, &methods, "RESOURCE_EXHAUSTED").await;
    worker.kill().await.expect("stop the Python worker");
    // A token for the Get.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let done = get(&mut jobs, &job.id).await;
    assert_eq!(done.state(), St::Succeeded, "{done:?}");
    assert_eq!(done.attempt, 1, "the lease held: {done:?}");
    waited_out(answered, refused);
    server.stop().await;
}

/// A closed terminal (SIGHUP) drains the worker as SIGTERM does: by
/// default it ended the worker mid-job, and the job waited out its lease.
async fn python_sighup_drains(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker_with_sighup(env, &server.addr.to_string(), 6, SigHandler::SigDfl);
    let long = submit(&mut jobs, "py", "sleep", json!({"seconds": 60})).await;
    wait_for_state(&mut jobs, &long.id, St::Running, LONG).await;
    stop(&mut worker, Signal::SIGHUP).await;
    handed_back(&mut jobs, &long.id).await;
    server.stop().await;
}

/// Started with SIGHUP ignored (`nohup`), a closed terminal stops nothing:
/// the worker goes on leasing, as its starter asked.
async fn python_started_under_nohup_keeps_running_on_sighup(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker_with_sighup(env, &server.addr.to_string(), 3, SigHandler::SigIgn);
    let first = submit(&mut jobs, "py", "echo", json!({"n": 1})).await;
    wait_for_state(&mut jobs, &first.id, St::Succeeded, LONG).await;
    let pid = worker.id().expect("worker pid");
    kill(Pid::from_raw(pid as i32), Signal::SIGHUP).expect("signal the worker");
    // Time for a drain to end the parked long poll, were one started.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = submit(&mut jobs, "py", "echo", json!({"n": 2})).await;
    wait_for_state(&mut jobs, &after.id, St::Succeeded, LONG).await;
    assert!(
        worker.try_wait().expect("poll the Python worker").is_none(),
        "the Python worker still runs"
    );
    worker.kill().await.expect("stop the Python worker");
    server.stop().await;
}

/// Told once to stop, the worker gives the job in hand its grace (1 s),
/// tells it to stop, and leaves a handler deaf to that behind 5 s later:
/// the 30 s blocking job is handed back as `worker_shutdown` and the
/// worker exits. It used to wait for the handler's end.
async fn python_a_deaf_handler_is_left_behind_after_the_grace(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 6);
    let busy = submit(&mut jobs, "py", "busy", json!({"seconds": 30})).await;
    wait_for_state(&mut jobs, &busy.id, St::Running, LONG).await;
    let told = Instant::now();
    let pid = Pid::from_raw(worker.id().expect("worker pid") as i32);
    kill(pid, Signal::SIGTERM).expect("signal the worker");
    exited_cleanly(&mut worker).await;
    assert!(
        told.elapsed() < Duration::from_secs(15),
        "exited {:?} after the SIGTERM",
        told.elapsed()
    );
    assert_eq!(handed_back(&mut jobs, &busy.id).await.attempt, 1);
    server.stop().await;
}

/// Told twice to stop, the worker does not wait for the job in hand: a
/// 30 s blocking job, deaf to its cancel flag, is handed back as
/// `worker_shutdown` at the second SIGTERM and the worker exits. The
/// second signal was ignored: the job ran on to its end, past the grace.
async fn python_told_twice_to_stop_hands_the_job_back_at_once(backend: Backend) {
    let env = setup().await;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 6);
    let busy = submit(&mut jobs, "py", "busy", json!({"seconds": 30})).await;
    wait_for_state(&mut jobs, &busy.id, St::Running, LONG).await;
    let pid = Pid::from_raw(worker.id().expect("worker pid") as i32);
    kill(pid, Signal::SIGTERM).expect("signal the worker");
    tokio::time::sleep(Duration::from_millis(300)).await;
    kill(pid, Signal::SIGTERM).expect("signal the worker again");
    let told_again = Instant::now();
    exited_cleanly(&mut worker).await;
    assert!(
        told_again.elapsed() < Duration::from_secs(5),
        "exited {:?} after the second SIGTERM",
        told_again.elapsed()
    );
    assert_eq!(handed_back(&mut jobs, &busy.id).await.attempt, 1);
    server.stop().await;
}
