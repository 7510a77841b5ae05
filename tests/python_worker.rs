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
//! heartbeat that hangs must not keep a job running past its lease.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command as StdCommand, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::proxy::{self, Fault};
use common::*;
use intray::pb::{self, JobState as St};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::Command;

common::backend_tests!(
    python_worker_end_to_end,
    python_heartbeats_ride_out_a_blip,
    python_unreported_outcome_holds_the_next_job_back_a_third_of_a_lease,
    python_a_hung_heartbeat_stops_the_job_within_its_lease,
    python_a_success_after_the_grace_stands,
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

fn error_class(job: &pb::Job) -> String {
    job.error
        .as_ref()
        .map(|e| e.class.clone())
        .unwrap_or_default()
}

/// The example worker on queue `py` of `addr`, with a lease of
/// `lease_seconds`, a 1 s long poll and a 1 s shutdown grace.
fn start_worker(env: &PythonEnv, addr: &str, lease_seconds: u32) -> tokio::process::Child {
    Command::new(&env.python)
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
        .kill_on_drop(true)
        .spawn()
        .expect("start the Python worker")
}

async fn python_worker_end_to_end(backend: Backend) {
    let env = tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup");
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
    let pid = worker.id().expect("worker pid");
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).expect("signal the worker");
    let status = within(LONG, "the Python worker to exit", worker.wait())
        .await
        .expect("wait for the Python worker");
    assert!(status.success(), "the Python worker exited with {status}");
    let back = get(&mut jobs, &long.id).await;
    assert_eq!(state(&back), St::Queued, "handed back: {back:?}");
    assert_eq!(error_class(&back), "worker_shutdown");
    server.stop().await;
}

/// Heartbeats that fail for a moment (two answered `UNAVAILABLE`, through a
/// proxy) are retried within the lease, and the job keeps its lease: it
/// succeeds on its first attempt. A worker that took a failed heartbeat
/// for a lost lease would drop the job, and it would run again.
async fn python_heartbeats_ride_out_a_blip(backend: Backend) {
    let env = tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup");
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
    let env = tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup");
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
    let env = tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup");
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
    let env = tokio::task::spawn_blocking(python_env)
        .await
        .expect("Python setup");
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = start_worker(env, &server.addr.to_string(), 6);
    // 3 s of work against the worker's 1 s grace.
    let busy = submit(&mut jobs, "py", "busy", json!({"seconds": 3})).await;
    wait_for_state(&mut jobs, &busy.id, St::Running, LONG).await;
    let pid = worker.id().expect("worker pid");
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).expect("signal the worker");
    let status = within(LONG, "the Python worker to exit", worker.wait())
        .await
        .expect("wait for the Python worker");
    assert!(status.success(), "the Python worker exited with {status}");
    let done = get(&mut jobs, &busy.id).await;
    assert_eq!(state(&done), St::Succeeded, "the success stands: {done:?}");
    assert_eq!(done.attempt, 1);
    server.stop().await;
}
