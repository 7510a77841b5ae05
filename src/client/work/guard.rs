//! Stops `intray work`'s commands when the worker itself dies at once
//! (SIGKILL, the OOM killer, a crash), which leaves it no time to stop them.
//!
//! Each command runs in a process group of its own, so nothing of the
//! worker's reaches it when the worker dies: it would run on, holding its
//! job's side effects, while the job's lease expires and the job runs again
//! elsewhere. A guard process, started by the worker with a pipe as its
//! stdin, is told each command's group as it starts (`+GROUP`) and once
//! the group is killed, before the command is reaped (`-GROUP`). The pipe
//! closes when the worker exits, however it
//! exits; then the guard sends SIGTERM to every group still listed, and
//! SIGKILL to those left after the worker's `--kill-after`. After a clean
//! stop the list is empty and the guard just exits.
//!
//! The guard is the same binary (`/proc/self/exe work-guard`), in a process
//! group of its own so that a Ctrl-C or a signal to the worker's group does
//! not take it away with the worker, and with an empty environment: it
//! holds none of the worker's credentials.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::super::args::parse_duration;

/// How often the guard looks whether the groups it stopped are gone.
const POLL: Duration = Duration::from_millis(50);

/// Arguments of the hidden `intray work-guard`.
#[derive(Args, Clone, Debug)]
pub struct GuardArgs {
    /// Time between SIGTERM and SIGKILL.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub kill_after: Duration,
}

/// The worker's end of its guard.
#[derive(Debug)]
pub struct Guard {
    pipe: Mutex<Option<ChildStdin>>,
    process: Mutex<Child>,
}

impl Guard {
    /// Starts the guard process.
    pub fn start(kill_after: Duration) -> std::io::Result<Guard> {
        let mut process = std::process::Command::new("/proc/self/exe")
            .arg("work-guard")
            .arg("--kill-after")
            .arg(format!("{}ms", kill_after.as_millis()))
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()?;
        let pipe = process.stdin.take();
        Ok(Guard {
            pipe: Mutex::new(pipe),
            process: Mutex::new(process),
        })
    }

    /// Lists `group` until the returned value is dropped, which must come
    /// before the command is reaped: afterwards its id may be given to
    /// another process, which the guard must never signal.
    pub fn watch(self: &Arc<Self>, group: i32) -> Watched {
        self.tell(&format!("+{group}\n"));
        Watched {
            guard: Arc::clone(self),
            group,
        }
    }

    fn tell(&self, line: &str) {
        let mut pipe = self.pipe.lock().unwrap_or_else(|e| e.into_inner());
        // A few bytes into a pipe the guard keeps reading: this does not
        // wait. A guard gone (killed on its own) is said once, and its
        // protection is lost until the worker restarts.
        if let Some(writer) = pipe.as_mut()
            && let Err(err) = writer.write_all(line.as_bytes())
        {
            tracing::warn!(error = %err, "the work guard is gone: commands will outlive a worker killed by SIGKILL");
            *pipe = None;
        }
    }

    /// Closes the pipe and waits for the guard, which then finds nothing
    /// listed (every command was reaped) and exits.
    pub fn finish(&self) {
        self.pipe.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(err) = process.wait() {
            tracing::warn!(error = %err, "cannot wait for the work guard");
        }
    }
}

/// A command's group listed by the guard; dropping it takes it off.
pub struct Watched {
    guard: Arc<Guard>,
    group: i32,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.guard.tell(&format!("-{}\n", self.group));
    }
}

/// The guard: reads the groups until the pipe closes, then stops those left.
pub fn run(args: &GuardArgs) {
    ignore_stop_signals();
    let groups = listed(std::io::stdin().lock());
    if groups.is_empty() {
        return;
    }
    let running = groups.len();
    stop(groups, args.kill_after);
    // Said after the stop, and never allowed to fail: the worker's stderr
    // may have died with it (`intray work 2>&1 | tee log`, killed as a
    // job), and a failed write must not cost the commands their stop.
    let _ = writeln!(
        std::io::stderr(),
        "intray work-guard: the worker ended with {running} command(s) running; stopped them (SIGTERM, SIGKILL after {:?})",
        args.kill_after
    );
}

/// SIGTERM, SIGINT and SIGHUP reach the guard with its worker (systemd
/// signals the whole unit, a closed terminal its session), but the guard's
/// job is to outlive the worker: only the pipe's end stops it, and
/// SIGKILL.
fn ignore_stop_signals() {
    use nix::sys::signal::{SigHandler, signal};
    for stop in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        // SAFETY: SIG_IGN installs no handler, so no code runs in a
        // signal context.
        let _ = unsafe { signal(stop, SigHandler::SigIgn) };
    }
}

/// The groups listed and not taken off when `input` ends (or fails).
fn listed(input: impl BufRead) -> HashSet<i32> {
    let mut groups = HashSet::new();
    for line in input.lines() {
        let Ok(line) = line else { break };
        // A group id is above 1: 0 and 1 would signal the guard's own
        // group or every process.
        if let Some(Ok(group)) = line.strip_prefix('+').map(str::parse::<i32>) {
            if group > 1 {
                groups.insert(group);
            }
        } else if let Some(Ok(group)) = line.strip_prefix('-').map(str::parse::<i32>) {
            groups.remove(&group);
        }
    }
    groups
}

/// SIGTERM to each group, then SIGKILL to those still there after
/// `kill_after`. The commands are not the guard's children: whether a group
/// is gone is asked with signal 0, and a group once gone is never signalled
/// again, since its id may be reused.
fn stop(mut groups: HashSet<i32>, kill_after: Duration) {
    let alive = |group: &i32| killpg(Pid::from_raw(*group), None) != Err(Errno::ESRCH);
    for &group in &groups {
        let _ = killpg(Pid::from_raw(group), Signal::SIGTERM);
    }
    let until = Instant::now() + kill_after;
    loop {
        groups.retain(alive);
        if groups.is_empty() || Instant::now() >= until {
            break;
        }
        std::thread::sleep(POLL);
    }
    for group in groups {
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_taken_off_are_not_stopped() {
        let input = "+100\n+200\n-100\n+300\n";
        assert_eq!(listed(input.as_bytes()), HashSet::from([200, 300]));
    }

    #[test]
    fn lines_that_name_no_group_are_ignored() {
        let input = "+0\n+1\n+-5\n+abc\n\n200\n\u{e9}9\n+400\n+500";
        assert_eq!(listed(input.as_bytes()), HashSet::from([400, 500]));
    }
}
