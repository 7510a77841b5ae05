//! `intray work`: a worker that runs a command per job, so any program in any
//! language can be a worker without a client library.

mod child;
mod guard;

use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use child::CommandSpec;
use guard::Guard;
pub use guard::{GuardArgs, run as guard};

use super::args::{ClientOpts, parse_duration};
use super::error::ClientError;
use crate::worker::{Worker, WorkerError};

/// Arguments of `intray work`.
#[derive(Args, Clone, Debug)]
pub struct WorkArgs {
    /// Queue to lease jobs from; repeat for several.
    #[arg(long = "queue", value_name = "QUEUE", required = true)]
    pub queues: Vec<String>,

    /// Only jobs of this kind; repeat for several (default: any kind).
    #[arg(long = "kind", value_name = "KIND")]
    pub kinds: Vec<String>,

    /// Commands run at once, 1..=1000.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub concurrency: usize,

    /// Name shown in `intray stats` and job events (default hostname-pid).
    #[arg(long, value_name = "ID")]
    pub worker_id: Option<String>,

    /// Lease asked for; heartbeats extend it every third of it while the command runs.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// On SIGINT, SIGTERM or SIGHUP, how long running commands may take to finish before they are stopped.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub grace: Duration,

    /// How long a stopped command has between SIGTERM and SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub kill_after: Duration,

    /// Largest result in bytes (stdout, and its JSON form); larger is a result_too_large failure.
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024)]
    pub max_result_bytes: usize,

    /// The command to run for each job, after `--`: the payload JSON is on
    /// its stdin; INTRAY_JOB_ID, INTRAY_ATTEMPT, INTRAY_KIND, INTRAY_QUEUE,
    /// INTRAY_MAX_ATTEMPTS and TRACEPARENT (when the job has one) in its
    /// environment, and not the worker's INTRAY_TOKEN, INTRAY_CLIENT_CERT or
    /// INTRAY_CLIENT_KEY; its stdout (JSON, else a string) is the result; exit 0
    /// succeeds, 75 is a retryable failure, death by SIGTERM, SIGINT or
    /// SIGHUP from outside is retried at once while attempts remain,
    /// anything else a final failure
    /// with the tail of stderr as the message.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Runs the worker until SIGINT, SIGTERM or SIGHUP, then drains.
pub async fn run(opts: &ClientOpts, args: WorkArgs) -> Result<(), ClientError> {
    crate::telemetry::init_logging();
    guard_credentials();
    let mut command = args.command.into_iter();
    let program = command
        .next()
        .ok_or_else(|| ClientError::BadArgument("give the command to run after --".into()))?;
    child::check_program(&program).map_err(ClientError::BadArgument)?;
    let guard = match Guard::start(args.kill_after) {
        Ok(guard) => Some(Arc::new(guard)),
        Err(err) => {
            tracing::warn!(error = %err, "cannot start the work guard: commands will outlive a worker killed by SIGKILL");
            None
        }
    };
    let spec = Arc::new(CommandSpec {
        program,
        args: command.collect(),
        kill_after: args.kill_after,
        max_result_bytes: args.max_result_bytes,
        guard: guard.clone(),
    });
    // The shared client options: address, TLS, tenant and token.
    let (_, endpoint) = super::commands::endpoint(opts)?;
    let mut builder = Worker::builder(&opts.addr)
        .endpoint(endpoint)
        .kinds(args.kinds)
        .concurrency(args.concurrency)
        .lease_duration(args.lease_duration)
        .grace(args.grace)
        // Room for SIGTERM, the wait and SIGKILL before the worker gives up.
        .cancel_timeout(args.kill_after + Duration::from_secs(1))
        .default_handler(move |job, ctx| {
            let spec = spec.clone();
            async move { spec.run(job, ctx).await }
        });
    for queue in args.queues {
        builder = builder.queue(queue);
    }
    if let Some(tenant) = &opts.tenant {
        builder = builder.tenant(tenant);
    }
    if let Some(token) = opts
        .token
        .as_deref()
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        builder = builder.auth_token(token);
    }
    if let Some(id) = args.worker_id {
        builder = builder.worker_id(id);
    }
    let worker = builder.build().map_err(worker_error)?;
    let (first, second) = stop_signals();
    let ran = worker.run_until(first, second).await.map_err(worker_error);
    if let Some(guard) = guard {
        // The guard exits at once with nothing listed, but its wait is a
        // blocking one and must not hold a runtime thread.
        let finished = tokio::task::spawn_blocking(move || guard.finish()).await;
        if let Err(err) = finished {
            tracing::warn!(error = %err, "cannot wait for the work guard");
        }
    }
    ran
}

fn worker_error(error: WorkerError) -> ClientError {
    match error {
        WorkerError::Config(message) => ClientError::BadArgument(message),
        WorkerError::Refused(status) => ClientError::Status(status),
    }
}

/// Two futures: the first completes on the first SIGINT, SIGTERM or SIGHUP
/// (drain: no more leases, running commands get the grace period), the
/// second on the next one (stop the running commands now). SIGHUP too: its
/// default action would end the worker at once when its terminal closes,
/// while its commands, in process groups of their own, run on unwatched.
fn stop_signals() -> (impl Future<Output = ()>, impl Future<Output = ()>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = tokio::sync::oneshot::channel::<()>();
    // Registered now, before any command runs: without a handler the
    // default action (exit) would apply, leaving the commands behind.
    let streams = signal(SignalKind::interrupt()).and_then(|interrupt| {
        let terminate = signal(SignalKind::terminate())?;
        // Started under `nohup`, a closed terminal must not stop it.
        let hangup = if hangup_ignored() {
            None
        } else {
            Some(signal(SignalKind::hangup())?)
        };
        Ok((interrupt, terminate, hangup))
    });
    match streams {
        Ok((mut interrupt, mut terminate, mut hangup)) => {
            tokio::spawn(async move {
                for (tx, what) in [
                    (
                        first_tx,
                        "shutting down: no more leases, draining running commands",
                    ),
                    (second_tx, "told again: stopping running commands now"),
                ] {
                    let hungup = async {
                        match hangup.as_mut() {
                            Some(hangup) => hangup.recv().await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                        _ = hungup => {}
                    }
                    tracing::info!("{what}");
                    let _ = tx.send(());
                }
            });
        }
        Err(err) => tracing::warn!(error = %err, "cannot listen for SIGINT, SIGTERM and SIGHUP"),
    }
    // A sender dropped unsent (no handler) means no signal will come.
    let wait = |rx: tokio::sync::oneshot::Receiver<()>| async move {
        if rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    (wait(first_rx), wait(second_rx))
}

/// Whether whoever started the worker left SIGHUP ignored (`nohup`).
/// Makes this process undumpable, so that processes of the same user (its
/// commands among them) can no longer read its environment or memory
/// (`/proc/PID/environ`, ptrace): the worker's token is there, and keeping
/// it out of the commands' own environment alone left it one `cat` away.
/// A token given with `--token` still shows in `/proc/PID/cmdline`.
fn guard_credentials() {
    if let Err(err) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(error = %err, "cannot make the worker undumpable: its commands may read its token from /proc");
    }
}

fn hangup_ignored() -> bool {
    use nix::libc;
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: with a null new action, sigaction only writes the current
    // one into `old`, valid memory for a `sigaction`.
    let rc = unsafe { libc::sigaction(libc::SIGHUP, std::ptr::null(), old.as_mut_ptr()) };
    // SAFETY: zeroed, then filled in by sigaction: a valid plain C struct.
    let old = unsafe { old.assume_init() };
    rc == 0 && old.sa_sigaction == libc::SIG_IGN
}
