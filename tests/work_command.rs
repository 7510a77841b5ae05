//! `intray work` (the built binary) running a small shell script against the
//! real server, on SQLite and PostgreSQL: results, exit codes, cancellation
//! killing the child, and results over the size limit.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use intray::pb::{self, JobState as St};
use nix::sys::signal::{SigHandler, Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};

common::backend_tests!(
    work_success,
    work_exit_75_is_retried,
    work_exit_1_fails_with_stderr_tail,
    work_a_command_stopped_from_outside_runs_again,
    work_drains_on_sighup,
    work_started_under_nohup_keeps_running_on_sighup,
    work_cancel_kills_the_child,
    work_result_over_the_limit_fails_clearly,
    work_with_a_command_it_cannot_find_refuses_to_start,
    work_keeps_a_result_made_on_sigterm_at_shutdown,
    work_started_with_sigchld_ignored_still_reads_exit_codes,
    work_told_twice_to_stop_stops_at_once,
    work_killed_stops_its_commands,
);

const TENANT: &str = "acme";
const LONG: Duration = Duration::from_secs(20);

/// One script for every test, switching on the job's kind.
const SCRIPT: &str = r#"#!/bin/sh
payload=$(cat)
case "$INTRAY_KIND" in
  ok)
    printf '%s' "$payload" > "$WORK_DIR/$INTRAY_JOB_ID.payload"
    printf '{"payload":%s,"job":"%s","attempt":%s,"kind":"%s","queue":"%s"}\n' \
      "$payload" "$INTRAY_JOB_ID" "$INTRAY_ATTEMPT" "$INTRAY_KIND" "$INTRAY_QUEUE" ;;
  text)
    echo "plain words" ;;
  env)
    leaked=$(tr '\0' '\n' < "/proc/$PPID/environ" 2>/dev/null | grep -c '^INTRAY_TOKEN=')
    own=$(tr '\0' '\n' < "/proc/$$/environ" 2>/dev/null | grep -c '^INTRAY_JOB_ID=')
    printf '"%s %s %s"' "${INTRAY_TOKEN-unset}${INTRAY_CLIENT_KEY-}" "${leaked:-0}" "${own:-0}" ;;
  tempfail)
    if [ "$INTRAY_ATTEMPT" = 1 ]; then echo "upstream busy, try later" >&2; exit 75; fi
    echo '"ok on retry"' ;;
  fail)
    echo "some early noise" >&2
    echo "fatal: the input is bad" >&2
    exit 1 ;;
  hang)
    echo $$ > "$WORK_DIR/$INTRAY_JOB_ID.pid"
    sleep 60 &
    echo $! > "$WORK_DIR/$INTRAY_JOB_ID.sleep"
    wait ;;
  stopped-once)
    if [ "$INTRAY_ATTEMPT" = 1 ]; then
      echo $$ > "$WORK_DIR/$INTRAY_JOB_ID.pid"
      sleep 60 &
      echo $! > "$WORK_DIR/$INTRAY_JOB_ID.sleep"
      wait
    fi
    echo '"ran again"' ;;
  big)
    head -c 2000000 /dev/zero | tr '\0' 'x' ;;
  finish-on-term)
    trap 'echo "\"finished on TERM\""; exit 0' TERM
    echo started > "$WORK_DIR/$INTRAY_JOB_ID.started"
    while :; do sleep 0.1; done ;;
  *)
    echo "unknown kind $INTRAY_KIND" >&2; exit 2 ;;
esac
"#;

/// A running `intray work` process and the folder its script writes to.
struct WorkProcess {
    child: Child,
    dir: tempfile::TempDir,
}

/// The lease, grace and kill-after of the tests' `intray work`.
const TIMINGS: [&str; 6] = [
    "--lease-duration",
    "3s",
    "--grace",
    "2s",
    "--kill-after",
    "1s",
];

impl WorkProcess {
    async fn start(server: &TestServer, extra: &[&str]) -> WorkProcess {
        Self::spawn(
            Command::new(env!("CARGO_BIN_EXE_intray")),
            server,
            &TIMINGS,
            extra,
        )
    }

    /// As [`Self::start`], but as `nobody` when the tests run as root: root
    /// reads every process's `/proc` files, so only a worker of an ordinary
    /// user shows whether its commands can read its environment.
    async fn start_unprivileged(server: &TestServer, extra: &[&str]) -> WorkProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_intray"));
        if nix::unistd::Uid::effective().is_root() {
            let nobody = 65534;
            // SAFETY: between fork and exec the child only calls setgroups,
            // setgid and setuid, which are async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    nix::unistd::setgroups(&[])?;
                    nix::unistd::setgid(nix::unistd::Gid::from_raw(nobody))?;
                    nix::unistd::setuid(nix::unistd::Uid::from_raw(nobody))?;
                    Ok(())
                });
            }
        }
        Self::spawn(command, server, &TIMINGS, extra)
    }

    /// As [`Self::start`], with `signal` ignored (`SigIgn`, as a
    /// supervisor or `nohup` might leave it) or at its default (`SigDfl`,
    /// whatever the test runner left): `intray work` inherits that across
    /// exec.
    async fn start_with_signal(
        server: &TestServer,
        signal: Signal,
        disposition: SigHandler,
        extra: &[&str],
    ) -> WorkProcess {
        let mut command = Command::new(env!("CARGO_BIN_EXE_intray"));
        // SAFETY: between fork and exec the child only calls sigaction,
        // which is async-signal-safe; SIG_IGN and SIG_DFL install no handler.
        unsafe {
            command.pre_exec(move || {
                nix::sys::signal::signal(signal, disposition)
                    .map(drop)
                    .map_err(std::io::Error::from)
            });
        }
        Self::spawn(command, server, &TIMINGS, extra)
    }

    fn spawn(
        mut command: Command,
        server: &TestServer,
        timings: &[&str],
        extra: &[&str],
    ) -> WorkProcess {
        let dir = tempfile::tempdir().expect("temporary directory");
        // Open to a worker started as another user (start_unprivileged).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))
            .expect("open the directory");
        let script = dir.path().join("job.sh");
        std::fs::write(&script, SCRIPT).expect("write the script");
        command
            .args(["work", "--addr", &server.url(), "--tenant", TENANT])
            .args(["--queue", "shell", "--worker-id", "shell-worker"])
            .args(timings)
            .args(extra)
            .arg("--")
            .arg("sh")
            .arg(&script)
            .env("WORK_DIR", dir.path())
            // The worker's credential, which its commands must not see (an
            // open server ignores it).
            .env("INTRAY_TOKEN", "the-worker-token-0123456789")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let child = command.spawn().expect("start intray work");
        WorkProcess { child, dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The shell running `job`'s command and the `sleep` it started, once
    /// the script has written both pids.
    async fn command_pids(&self, job: &pb::Job) -> (i32, i32) {
        let shell = read_pid(&self.path(&format!("{}.pid", job.id))).await;
        let sleep = read_pid(&self.path(&format!("{}.sleep", job.id))).await;
        (shell, sleep)
    }

    /// SIGTERM, then the drain must end with exit status 0.
    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        let status = within(LONG, "intray work to exit", self.child.wait())
            .await
            .expect("wait for intray work");
        assert!(status.success(), "intray work exited with {status}");
    }
}

fn error_of(job: &pb::Job) -> (String, String) {
    job.error
        .as_ref()
        .map(|e| (e.class.clone(), e.message.clone()))
        .unwrap_or_default()
}

async fn work_success(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start_unprivileged(&server, &["--concurrency", "2"]).await;

    let ok = submit(
        &mut jobs,
        "shell",
        "ok",
        json!({"doc": "hello", "n": [1, 2]}),
    )
    .await;
    let text = submit(&mut jobs, "shell", "text", json!(null)).await;
    let env = submit(&mut jobs, "shell", "env", json!(null)).await;

    let done = wait_for_state(&mut jobs, &ok.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!({
            "payload": {"doc": "hello", "n": [1.0, 2.0]},
            "job": ok.id,
            "attempt": 1.0,
            "kind": "ok",
            "queue": "shell",
        })),
        "stdout JSON is the result; payload on stdin, job facts in the environment"
    );
    let stdin = std::fs::read_to_string(worker.path(&format!("{}.payload", ok.id)))
        .expect("the payload the command read");
    assert_eq!(
        stdin, r#"{"doc":"hello","n":[1,2]}"#,
        "whole numbers as integers"
    );
    assert_eq!(done.lease_owner, "");
    let done = wait_for_state(&mut jobs, &text.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("plain words"))
    );
    let done = wait_for_state(&mut jobs, &env.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("unset 0 1")),
        "the worker's token is kept from its commands, and from its /proc environ \
         (which the command's own, readable, shows is not for want of /proc)"
    );
    worker.stop().await;
    server.stop().await;
}

/// A command that is not there is refused at start (exit 2), before any
/// job is leased: each job would otherwise fail with it.
async fn work_with_a_command_it_cannot_find_refuses_to_start(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "shell", "ok", json!({})).await;
    let output = within(
        LONG,
        "intray work to refuse",
        Command::new(env!("CARGO_BIN_EXE_intray"))
            .args(["work", "--addr", &server.url(), "--tenant", TENANT])
            .args(["--queue", "shell", "--", "./no-such-handler.sh"])
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("run intray work");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no-such-handler.sh"), "{stderr}");
    let job = get(&mut jobs, &job.id).await;
    assert_eq!((state(&job), job.attempt), (St::Queued, 0));
    server.stop().await;
}

async fn work_exit_75_is_retried(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;

    let mut request = submit_req("shell", "tempfail", json!({}));
    request.backoff = Some(pb::Backoff {
        initial: Some(ms(100)),
        max: Some(ms(200)),
    });
    let job = submit_with(&mut jobs, request).await;
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 2, "exit 75 was retried");
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("ok on retry"))
    );
    let events = watch_all(&mut jobs, &job.id, 0, LONG).await;
    let retry = events
        .iter()
        .find(|e| e.r#type == pb::JobEventType::RetryScheduled as i32)
        .unwrap_or_else(|| panic!("no RETRY_SCHEDULED in {:?}", event_types(&events)));
    let detail = retry
        .detail
        .as_ref()
        .map(|d| serde_json::to_string(d).unwrap_or_default());
    assert!(
        detail
            .as_deref()
            .is_some_and(|d| d.contains("command_tempfail") && d.contains("upstream busy")),
        "the retry records the class and stderr: {detail:?}"
    );
    worker.stop().await;
    server.stop().await;
}

/// A command killed by SIGTERM from outside the worker (systemd stops a
/// unit by signalling every process in it at once) is run again at once,
/// not sent to the dead set as a failure of its job.
async fn work_a_command_stopped_from_outside_runs_again(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;

    let job = submit(&mut jobs, "shell", "stopped-once", json!({})).await;
    let (shell, sleep) = worker.command_pids(&job).await;
    kill(Pid::from_raw(shell), Signal::SIGTERM).expect("SIGTERM the command");
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    let _ = kill(Pid::from_raw(sleep), Signal::SIGKILL);
    assert_eq!(done.attempt, 2, "run again after the stop");
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("ran again"))
    );
    let events = watch_all(&mut jobs, &job.id, 0, LONG).await;
    assert!(
        has_retry_mentioning(&events, "command_interrupted"),
        "a retry of class command_interrupted: {:?}",
        event_types(&events)
    );
    worker.stop().await;
    server.stop().await;
}

/// A closed terminal (SIGHUP) drains the worker as SIGTERM does: by
/// default it ended the worker at once, and its commands, in process
/// groups of their own, ran on with nobody watching them.
async fn work_drains_on_sighup(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    // At its default whatever the test runs under (a CI job started with
    // `nohup` leaves it ignored, and the worker then rightly keeps on).
    let mut worker =
        WorkProcess::start_with_signal(&server, Signal::SIGHUP, SigHandler::SigDfl, &[]).await;

    let job = submit(&mut jobs, "shell", "hang", json!({})).await;
    let (shell, sleep) = worker.command_pids(&job).await;
    let pid = worker.child.id().expect("intray work runs");
    kill(Pid::from_raw(pid as i32), Signal::SIGHUP).expect("SIGHUP intray work");
    let status = within(LONG, "intray work to drain", worker.child.wait())
        .await
        .expect("wait for intray work");
    assert!(status.success(), "intray work exited with {status}");
    assert!(
        process_gone(shell) && process_gone(sleep),
        "the command was stopped before the worker left"
    );
    let back = get(&mut jobs, &job.id).await;
    assert_eq!(
        error_of(&back).0,
        "worker_shutdown",
        "handed back for another worker"
    );
    server.stop().await;
}

/// Started with SIGHUP ignored (`nohup`), a closed terminal stops nothing:
/// the worker goes on leasing, as its starter asked.
async fn work_started_under_nohup_keeps_running_on_sighup(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker =
        WorkProcess::start_with_signal(&server, Signal::SIGHUP, SigHandler::SigIgn, &[]).await;
    let pid = worker.child.id().expect("intray work runs");
    let first = submit(&mut jobs, "shell", "text", json!(null)).await;
    wait_for_state(&mut jobs, &first.id, St::Succeeded, LONG).await;
    kill(Pid::from_raw(pid as i32), Signal::SIGHUP).expect("SIGHUP intray work");
    // Time for a drain to end a parked lease, were one started.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = submit(&mut jobs, "shell", "text", json!(null)).await;
    wait_for_state(&mut jobs, &after.id, St::Succeeded, LONG).await;
    assert!(
        worker.child.try_wait().expect("poll intray work").is_none(),
        "intray work still runs"
    );
    worker.stop().await;
    server.stop().await;
}

async fn work_exit_1_fails_with_stderr_tail(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;

    let job = submit(&mut jobs, "shell", "fail", json!({})).await;
    let done = wait_for_state(&mut jobs, &job.id, St::Failed, LONG).await;
    assert_eq!(
        done.attempt, 1,
        "any exit code other than 0 and 75 is final"
    );
    let (class, message) = error_of(&done);
    assert_eq!(class, "command_failed");
    assert!(message.starts_with("exit code 1: "), "{message:?}");
    assert!(
        message.ends_with("fatal: the input is bad"),
        "stderr's tail: {message:?}"
    );
    worker.stop().await;
    server.stop().await;
}

/// Started with SIGCHLD ignored (some supervisors do that), `intray work`
/// still learns each command's exit status: the kernel would otherwise
/// reap its commands by itself, and every exit would be lost.
async fn work_started_with_sigchld_ignored_still_reads_exit_codes(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker =
        WorkProcess::start_with_signal(&server, Signal::SIGCHLD, SigHandler::SigIgn, &[]).await;

    let ok = submit(&mut jobs, "shell", "text", json!(null)).await;
    let failed = submit(&mut jobs, "shell", "fail", json!({})).await;
    let done = wait_for_state(&mut jobs, &ok.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("plain words"))
    );
    // A lost status fails the attempt as retryable (command_wait_failed).
    assert_eq!(done.attempt, 1, "the first attempt's exit was read");
    let done = wait_for_state(&mut jobs, &failed.id, St::Failed, LONG).await;
    assert_eq!(done.attempt, 1);
    let (class, message) = error_of(&done);
    assert_eq!(class, "command_failed");
    assert!(message.starts_with("exit code 1: "), "{message:?}");
    worker.stop().await;
    server.stop().await;
}

/// Whether the process is gone (a zombie nobody reaped counts as gone).
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// Waits up to `limit` for every process of `pids` to be gone.
async fn all_gone(pids: &[i32], limit: Duration) {
    within(limit, "the command's processes to die", async {
        while !pids.iter().all(|&pid| process_gone(pid)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

async fn read_pid(path: &Path) -> i32 {
    within(LONG, "the script writing its pid", async {
        loop {
            if let Ok(text) = std::fs::read_to_string(path)
                && let Ok(pid) = text.trim().parse::<i32>()
            {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

async fn work_cancel_kills_the_child(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;

    let job = submit(&mut jobs, "shell", "hang", json!({})).await;
    let (shell, sleep) = worker.command_pids(&job).await;
    assert!(
        !process_gone(shell) && !process_gone(sleep),
        "the command runs"
    );

    let cancelled_at = Instant::now();
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    // Well before the server's 30 s cancel grace: the worker reported back.
    wait_for_state(&mut jobs, &job.id, St::Cancelled, Duration::from_secs(8)).await;
    all_gone(&[shell, sleep], Duration::from_secs(5)).await;
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(6),
        "one heartbeat (1 s) plus SIGTERM, took {:?}",
        cancelled_at.elapsed()
    );
    worker.stop().await;
    server.stop().await;
}

/// SIGKILL leaves `intray work` no time to stop its commands, which run in
/// process groups of their own: its guard process stops them.
async fn work_killed_stops_its_commands(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut worker = WorkProcess::start(&server, &[]).await;

    let job = submit(&mut jobs, "shell", "hang", json!({})).await;
    let (shell, sleep) = worker.command_pids(&job).await;
    let pid = worker.child.id().expect("the worker runs") as i32;
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the worker");
    let _ = worker.child.wait().await;
    all_gone(&[shell, sleep], Duration::from_secs(10)).await;
    server.stop().await;
}

async fn work_result_over_the_limit_fails_clearly(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;

    let job = submit(&mut jobs, "shell", "big", json!({})).await;
    let done = wait_for_state(&mut jobs, &job.id, St::Failed, LONG).await;
    assert_eq!(done.attempt, 1, "a result too large is final");
    let (class, message) = error_of(&done);
    assert_eq!(class, "result_too_large");
    assert!(
        message.contains("2000000 bytes") && message.contains("1048576"),
        "the message gives the size and the limit: {message:?}"
    );
    worker.stop().await;
    server.stop().await;
}

/// A command still running when the shutdown grace ends gets SIGTERM; one
/// that finishes its work then and exits 0 has its result kept, rather
/// than its job run again as `worker_shutdown`.
async fn work_keeps_a_result_made_on_sigterm_at_shutdown(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = WorkProcess::start(&server, &[]).await;
    let job = submit(&mut jobs, "shell", "finish-on-term", json!({})).await;
    let started = worker.path(&format!("{}.started", job.id));
    within(LONG, "the command to start", async {
        while !started.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    worker.stop().await;
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!("finished on TERM"))
    );
    assert_eq!(done.attempt, 1);
    server.stop().await;
}

/// A second SIGTERM during the drain stops the running command at once and
/// gives its outcome one try: with the server gone, the first alone waited
/// out the 20 s grace and then retried the outcome for a whole lease
/// (30 s). Told twice, `intray work` exits within seconds.
async fn work_told_twice_to_stop_stops_at_once(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let timings = [
        "--lease-duration",
        "30s",
        "--grace",
        "20s",
        "--kill-after",
        "1s",
    ];
    let intray = Command::new(env!("CARGO_BIN_EXE_intray"));
    let mut worker = WorkProcess::spawn(intray, &server, &timings, &[]);
    let job = submit(&mut jobs, "shell", "hang", json!({})).await;
    let pid_file = worker.path(&format!("{}.pid", job.id));
    within(LONG, "the command to start", async {
        while !pid_file.exists() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let command = read_pid(&pid_file).await;
    server.stop().await;
    let pid = Pid::from_raw(worker.child.id().expect("intray work runs") as i32);
    kill(pid, Signal::SIGTERM).expect("the first SIGTERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let told_again = Instant::now();
    kill(pid, Signal::SIGTERM).expect("the second SIGTERM");
    within(
        Duration::from_secs(8),
        "intray work to exit when told twice",
        worker.child.wait(),
    )
    .await
    .expect("wait for intray work");
    assert!(
        told_again.elapsed() < Duration::from_secs(8),
        "{:?}",
        told_again.elapsed()
    );
    assert!(process_gone(command), "the command was stopped");
}
