//! Runs one job as a child process: payload on stdin, result on stdout, the
//! exit code as the outcome, and SIGTERM then SIGKILL when the job must stop.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::guard::{Guard, Watched};
use crate::worker::{CancelReason, Job, JobContext, JobError};

/// `EX_TEMPFAIL` from sysexits.h: "try again later".
pub const EXIT_RETRYABLE: i32 = 75;
/// Signals that stop a command from outside rather than for a fault of its
/// job: a service manager stopping the worker's whole group (systemd sends
/// SIGTERM to every process of the unit at once), a closed terminal, a
/// Ctrl-C. `intray work`'s own stops are told apart by the job's cancel
/// reason, which decides the outcome before the exit does.
const INTERRUPTS: [Signal; 3] = [Signal::SIGHUP, Signal::SIGINT, Signal::SIGTERM];
/// How much of stderr ends up in a failure's message.
const STDERR_TAIL_BYTES: usize = 2048;
/// How long the pipes are read after the command exited.
const PIPE_GRACE: Duration = Duration::from_secs(1);
/// The worker's own credentials, kept from the commands: a command handles
/// producers' payloads, and must not be able to act as the worker (or as an
/// admin, when the worker runs with such a token).
const WITHHELD_ENV: [&str; 3] = ["INTRAY_TOKEN", "INTRAY_CLIENT_CERT", "INTRAY_CLIENT_KEY"];

/// The command every job runs, and its limits.
#[derive(Clone, Debug)]
pub struct CommandSpec {
    /// Program, then its arguments.
    pub program: String,
    /// Arguments after the program.
    pub args: Vec<String>,
    /// Time between SIGTERM and SIGKILL.
    pub kill_after: Duration,
    /// Largest result, in bytes of stdout and of serialised JSON.
    pub max_result_bytes: usize,
    /// Stops the running commands if the worker dies without doing so.
    pub guard: Option<Arc<Guard>>,
}

/// What the child wrote to stdout: the first `limit` bytes and the total.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    total: usize,
}

impl CommandSpec {
    /// Runs the command for `job` and maps its exit to an outcome.
    pub async fn run(&self, job: Job, ctx: JobContext) -> Result<Value, JobError> {
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("INTRAY_JOB_ID", &job.id)
            .env("INTRAY_ATTEMPT", job.attempt.to_string())
            .env("INTRAY_MAX_ATTEMPTS", job.max_attempts.to_string())
            .env("INTRAY_KIND", &job.kind)
            .env("INTRAY_QUEUE", &job.queue)
            // Its own process group, so a stop signal reaches whatever the
            // command started too (a shell script's children), and a Ctrl-C
            // at the terminal reaches only `intray work`, which drains.
            .process_group(0)
            .kill_on_drop(true);
        for name in WITHHELD_ENV {
            command.env_remove(name);
        }
        match ctx.traceparent() {
            Some(traceparent) => command.env("TRACEPARENT", traceparent),
            None => command.env_remove("TRACEPARENT"),
        };
        // The program was found at start (`check_program`); what fails
        // now is the moment's (too many open files, a binary being
        // replaced), not the job's, so the job gets another attempt.
        let mut child = command.spawn().map_err(|e| {
            JobError::retryable(
                "command_not_started",
                format!("cannot start {:?}: {e}", self.program),
            )
        })?;
        let pid = child.id().and_then(|id| i32::try_from(id).ok());
        let mut exit = pid.map(|pid| {
            let watched = self.guard.as_ref().map(|guard| guard.watch(pid));
            ExitWatch::spawn(pid, watched)
        });

        let payload = serde_json::to_vec(&job.payload).unwrap_or_default();
        let stdin = child.stdin.take().map(|mut stdin| {
            tokio::spawn(async move {
                // A command that does not read its input closes the pipe
                // early; that is its business, not an error.
                let _ = stdin.write_all(&payload).await;
                let _ = stdin.write_all(b"\n").await;
            })
        });
        let limit = self.max_result_bytes;
        let stop_reading = CancellationToken::new();
        let stdout = child
            .stdout
            .take()
            .map(|out| tokio::spawn(capture(out, limit, stop_reading.clone())));
        let stderr = child
            .stderr
            .take()
            .map(|err| tokio::spawn(tail(err, STDERR_TAIL_BYTES, stop_reading.clone())));

        let status = tokio::select! {
            status = reap_after_group(&mut child, &mut exit) => status,
            () = ctx.cancelled() => {
                let status = self.terminate(&mut child, &mut exit).await;
                tracing::info!(job_id = %job.id, ?status, reason = ?ctx.cancel_reason(), "command stopped");
                // A command that finished its work on SIGTERM at shutdown
                // (exit 0) has its result read and reported like any
                // other: the worker keeps a success after the shutdown
                // signal rather than running the job again.
                let finished = ctx.cancel_reason() == Some(CancelReason::Shutdown)
                    && status.is_some_and(|s| s.success());
                if !finished {
                    stop_reading.cancel();
                    if let Some(task) = &stdin {
                        task.abort();
                    }
                    return Err(JobError::retryable("command_stopped", format!("stopped: {:?}", ctx.cancel_reason())));
                }
                status.ok_or_else(|| std::io::Error::other("the command's status was lost"))
            }
        };
        if let Some(task) = stdin {
            task.abort();
        }
        let status = status.map_err(|e| {
            JobError::retryable(
                "command_wait_failed",
                format!("cannot wait for the command: {e}"),
            )
        })?;
        let reads = async {
            let captured = match stdout {
                Some(task) => task.await.unwrap_or_default(),
                None => Captured::default(),
            };
            let stderr = match stderr {
                Some(task) => task.await.unwrap_or_default(),
                None => String::new(),
            };
            (captured, stderr)
        };
        tokio::pin!(reads);
        // A descendant that left the command's group (a daemon) can hold the
        // pipes open long after the command exited, and with them the job:
        // what was written by then is read, the rest is not waited for.
        let (captured, stderr) = match tokio::time::timeout(PIPE_GRACE, &mut reads).await {
            Ok(read) => read,
            Err(_) => {
                tracing::warn!(job_id = %job.id, "the command's pipes stayed open after it exited; reading stopped");
                stop_reading.cancel();
                reads.await
            }
        };
        outcome(status, captured, &stderr, limit)
    }

    /// SIGTERM to the command's process group, SIGKILL after `kill_after`.
    async fn terminate(
        &self,
        child: &mut Child,
        exit: &mut Option<ExitWatch>,
    ) -> Option<ExitStatus> {
        let Some(watch) = exit else {
            // Already reaped: nothing left to signal.
            return child.wait().await.ok();
        };
        let group = watch.group;
        let _ = killpg(group, Signal::SIGTERM);
        match tokio::time::timeout(self.kill_after, watch.exited()).await {
            Ok(true) => {}
            Err(_) => {
                let _ = killpg(group, Signal::SIGKILL);
            }
            // The wait failed, so the exit cannot be known without reaping:
            // the command gets its time to exit, then the group is killed.
            Ok(false) => {
                let status = match tokio::time::timeout(self.kill_after, child.wait()).await {
                    Ok(status) => status.ok(),
                    Err(_) => {
                        let _ = killpg(group, Signal::SIGKILL);
                        child.wait().await.ok()
                    }
                };
                let _ = killpg(group, Signal::SIGKILL);
                return status;
            }
        }
        reap_after_group(child, exit).await.ok()
    }
}

/// Knows when a command has exited without reaping it: one thread of the
/// blocking pool per running command waits for that (`waitid` with
/// `WNOWAIT`). While the command is unreaped its pid, which is its process
/// group's id, cannot be given to another process, so signalling the group
/// until then cannot reach an unrelated one.
struct ExitWatch {
    group: Pid,
    /// `Some(true)` once the command exited, `Some(false)` if the wait
    /// failed; closed if the wait never ran (the runtime shutting down).
    state: watch::Receiver<Option<bool>>,
    /// The group on the guard's list, taken off once the group is killed
    /// and before the command is reaped: afterwards its id may be another
    /// process's.
    watched: Option<Watched>,
}

impl ExitWatch {
    fn spawn(pid: i32, watched: Option<Watched>) -> ExitWatch {
        let (tell, state) = watch::channel(None);
        tokio::task::spawn_blocking(move || {
            let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
            let exited = loop {
                match waitid(Id::Pid(Pid::from_raw(pid)), flags) {
                    // ECHILD: already reaped, so it has exited.
                    Ok(_) | Err(Errno::ECHILD) => break true,
                    Err(Errno::EINTR) => {}
                    Err(err) => {
                        tracing::warn!(error = %err, pid, "cannot wait for the command without reaping it");
                        break false;
                    }
                }
            };
            let _ = tell.send(Some(exited));
        });
        ExitWatch {
            group: Pid::from_raw(pid),
            state,
            watched,
        }
    }

    /// Whether the command exited (it waits for that) and is still
    /// unreaped; `false` when that cannot be known.
    async fn exited(&mut self) -> bool {
        matches!(
            self.state.wait_for(Option::is_some).await.map(|s| *s),
            Ok(Some(true))
        )
    }
}

/// Waits for the command to exit, then SIGKILLs what is left of its process
/// group (whatever it started would hold the pipes open and outlive the
/// job, or ignored a SIGTERM), then reaps it. The group is signalled before
/// the command is reaped (see [`ExitWatch`]); only when that wait failed is
/// it signalled after.
async fn reap_after_group(
    child: &mut Child,
    exit: &mut Option<ExitWatch>,
) -> std::io::Result<ExitStatus> {
    let Some(watch) = exit else {
        return child.wait().await;
    };
    if watch.exited().await {
        let _ = killpg(watch.group, Signal::SIGKILL);
        watch.watched.take();
        return child.wait().await;
    }
    let status = child.wait().await;
    let _ = killpg(watch.group, Signal::SIGKILL);
    status
}

/// Checks that `program` names an executable file, as a path or through
/// `PATH` the way the spawn will look it up: a typo would otherwise fail
/// every job leased, each on its first attempt.
pub fn check_program(program: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &std::path::Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = if program.contains('/') {
        executable(std::path::Path::new(program))
    } else {
        std::env::var_os("PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|dir| executable(&dir.join(program)))
        })
    };
    if found {
        Ok(())
    } else {
        Err(format!(
            "cannot run {program:?}: no executable file of that name{}",
            if program.contains('/') {
                ""
            } else {
                " on PATH"
            }
        ))
    }
}

/// Reads everything, keeping the first `limit + 1` bytes (one more than
/// allowed, to tell "exactly the limit" from "over it"); reading on past the
/// limit keeps a chatty command from blocking on a full pipe.
async fn capture(
    mut out: impl AsyncRead + Unpin,
    limit: usize,
    stop: CancellationToken,
) -> Captured {
    let mut bytes = Vec::new();
    let mut total = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = out.read(&mut buf) => read,
            () = stop.cancelled() => break,
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total = total.saturating_add(n);
                let room = (limit + 1).saturating_sub(bytes.len());
                bytes.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    Captured { bytes, total }
}

/// The last `keep` bytes of a stream, as text.
async fn tail(mut err: impl AsyncRead + Unpin, keep: usize, stop: CancellationToken) -> String {
    let mut kept: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let read = tokio::select! {
            read = err.read(&mut buf) => read,
            () = stop.cancelled() => break,
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > keep {
                    kept.drain(..kept.len() - keep);
                }
            }
        }
    }
    String::from_utf8_lossy(&kept).trim().to_owned()
}

/// Exit 0: stdout is the result (JSON, else a string); 75: retryable
/// failure; death by an interrupt (or a shell's 128 + its number): a
/// retryable failure to run again at once; anything else, or another
/// signal: final failure with stderr's tail.
fn outcome(
    status: ExitStatus,
    stdout: Captured,
    stderr: &str,
    limit: usize,
) -> Result<Value, JobError> {
    let detail = |what: String| {
        if stderr.is_empty() {
            what
        } else {
            format!("{what}: {stderr}")
        }
    };
    let interrupted = status
        .signal()
        .or_else(|| status.code().map(|code| code - 128))
        .and_then(|number| Signal::try_from(number).ok())
        .filter(|signal| INTERRUPTS.contains(signal));
    if let Some(signal) = interrupted {
        return Err(JobError::retryable(
            "command_interrupted",
            detail(format!("stopped by {signal} from outside the worker")),
        )
        .with_retry_after(Duration::ZERO));
    }
    match status.code() {
        Some(0) => {
            if stdout.total > limit {
                return Err(too_large(stdout.total, limit));
            }
            let value = result_value(&stdout.bytes);
            let size = serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0);
            if size > limit {
                return Err(too_large(size, limit));
            }
            Ok(value)
        }
        Some(EXIT_RETRYABLE) => Err(JobError::retryable(
            "command_tempfail",
            detail(format!("exit code {EXIT_RETRYABLE}")),
        )),
        Some(code) => Err(JobError::fatal(
            "command_failed",
            detail(format!("exit code {code}")),
        )),
        None => Err(JobError::fatal(
            "command_failed",
            detail(format!(
                "killed by signal {}",
                status.signal().unwrap_or_default()
            )),
        )),
    }
}

fn too_large(bytes: usize, limit: usize) -> JobError {
    JobError::fatal(
        "result_too_large",
        format!("the command wrote a result of {bytes} bytes; the limit is {limit} bytes"),
    )
}

/// JSON when stdout parses as JSON, else the text as a JSON string; nothing
/// at all is `null`.
fn result_value(bytes: &[u8]) -> Value {
    let text = String::from_utf8_lossy(bytes);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(trimmed)
        .unwrap_or_else(|_| Value::String(text.strip_suffix('\n').unwrap_or(&text).to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    fn out(text: &str) -> Captured {
        Captured {
            bytes: text.as_bytes().to_vec(),
            total: text.len(),
        }
    }

    #[test]
    fn programs_are_found_as_the_spawn_finds_them() {
        assert!(check_program("sh").is_ok());
        assert!(check_program("/bin/sh").is_ok());
        assert!(check_program("no-such-program-here").is_err());
        assert!(check_program("./no/such/script.sh").is_err());
        let dir = tempfile::tempdir().expect("dir");
        let plain = dir.path().join("script.sh");
        std::fs::write(&plain, "echo hi").expect("write");
        let plain = plain.to_string_lossy().into_owned();
        assert!(check_program(&plain).is_err(), "not executable");
        assert!(check_program("/bin").is_err(), "a directory");
    }

    /// The command's group is signalled while the command is a zombie, so
    /// its pid (the group's id) cannot have gone to another process: a
    /// member it left behind is killed, and the command is reaped after.
    #[tokio::test]
    async fn the_group_is_killed_before_the_command_is_reaped() {
        let dir = tempfile::tempdir().expect("dir");
        let marker = dir.path().join("member");
        let script = format!("(sleep 1; touch {}) & exit 3", marker.display());
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .process_group(0)
            .spawn()
            .expect("spawn");
        let leader = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .expect("running");
        let mut exit = Some(ExitWatch::spawn(leader, None));
        assert!(exit.as_mut().expect("watch").exited().await, "exited");
        let stat = std::fs::read_to_string(format!("/proc/{leader}/stat")).expect("still listed");
        let state = stat
            .rsplit(") ")
            .next()
            .and_then(|rest| rest.chars().next());
        assert_eq!(state, Some('Z'), "exited but not reaped: {stat}");
        let status = reap_after_group(&mut child, &mut exit)
            .await
            .expect("reaped");
        assert_eq!(status.code(), Some(3));
        assert!(
            std::fs::metadata(format!("/proc/{leader}")).is_err(),
            "reaped"
        );
        // The member was in the group: killed, it never touches the file.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!marker.exists(), "the group's member outlived the command");
    }

    #[test]
    fn stdout_is_json_or_a_string() {
        assert_eq!(result_value(b"{\"a\": 1}\n"), serde_json::json!({"a": 1}));
        assert_eq!(result_value(b"hello\n"), Value::String("hello".into()));
        assert_eq!(result_value(b"  \n"), Value::Null);
    }

    #[test]
    fn exit_codes_map_to_outcomes() {
        assert_eq!(
            outcome(exit(0), out("7"), "", 100),
            Ok(serde_json::json!(7))
        );
        let e = outcome(exit(75), out(""), "busy", 100).err();
        assert!(e.is_some_and(|e| e.retryable
            && e.class == "command_tempfail"
            && e.message == "exit code 75: busy"));
        let e = outcome(exit(1), out(""), "boom", 100).err();
        assert!(e.is_some_and(|e| !e.retryable && e.message == "exit code 1: boom"));
        let e = outcome(ExitStatus::from_raw(9), out(""), "", 100).err();
        assert!(e.is_some_and(|e| !e.retryable && e.message == "killed by signal 9"));
    }

    /// A command stopped from outside (SIGTERM to a service's whole group,
    /// a closed terminal) is run again, not sent to the dead set; a shell
    /// reports such a death as 128 plus the signal's number.
    #[test]
    fn an_interrupted_command_is_retried_at_once() {
        for status in [
            ExitStatus::from_raw(15),
            ExitStatus::from_raw(2),
            ExitStatus::from_raw(1),
            exit(143),
            exit(130),
        ] {
            let e = outcome(status, out(""), "", 100).err();
            assert!(
                e.as_ref().is_some_and(|e| e.retryable
                    && e.class == "command_interrupted"
                    && e.retry_after == Some(Duration::ZERO)),
                "{status:?}: {e:?}"
            );
        }
        let e = outcome(exit(137), out(""), "", 100).err();
        assert!(e.is_some_and(|e| !e.retryable), "SIGKILL's 137 stays final");
    }

    #[test]
    fn results_over_the_limit_fail_clearly() {
        let big = Captured {
            bytes: vec![b'x'; 11],
            total: 5000,
        };
        let e = outcome(exit(0), big, "", 10).err();
        assert!(e.is_some_and(|e| e.class == "result_too_large"
            && !e.retryable
            && e.message.contains("5000 bytes")));
        // Fits as bytes, but not once escaped as a JSON string.
        let e = outcome(exit(0), out("\"\"\"\"\"\"\""), "", 8).err();
        assert!(e.is_some_and(|e| e.class == "result_too_large"));
    }

    #[tokio::test]
    async fn capture_keeps_one_byte_past_the_limit_and_counts_all() {
        let data = vec![1u8; 100_000];
        let c = capture(&data[..], 10, CancellationToken::new()).await;
        assert_eq!((c.bytes.len(), c.total), (11, 100_000));
        let t = tail(&b"abcdefghij"[..], 4, CancellationToken::new()).await;
        assert_eq!(t, "ghij");
    }

    #[tokio::test]
    async fn reading_a_pipe_held_open_stops_with_what_came() {
        let (mut held, read_end) = tokio::io::duplex(1024);
        held.write_all(b"partial").await.expect("write");
        let stop = CancellationToken::new();
        let reading = tokio::spawn(capture(read_end, 100, stop.clone()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!reading.is_finished(), "the writer is still open");
        stop.cancel();
        let c = reading.await.expect("joined");
        assert_eq!(c.bytes, b"partial");
        drop(held);
    }
}
