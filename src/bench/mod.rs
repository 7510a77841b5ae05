//! `intray bench`: load scenarios against a running server (`--addr`) or one
//! it starts itself (`--spawn`), with every figure measured on the client
//! side and printed as a table row plus one JSON line per result.

mod conn;
mod error;
mod probe;
mod report;
mod scenarios;
mod spawn;
mod stats;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub use error::BenchError;
pub use scenarios::Scenario;

use crate::client::ClientOpts;
use report::{Printer, command_line};
use scenarios::{Ctx, SMALL_BACKLOG, Sizes};
use spawn::{Backend, Spawned};

fn duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

/// Arguments of `intray bench`.
#[derive(Args, Clone, Debug)]
#[command(after_help = "\
Every figure is measured by this client; the server and the bench share the machine. \
The global --addr, --tenant, --token and TLS options apply without --spawn.

Examples:
  intray bench --spawn --database-url postgres://postgres@127.0.0.1:5432/intray_bench
  intray bench --spawn --database-url sqlite:///tmp/bench.db --scenario submit,e2e
  intray bench --addr http://10.0.0.5:50051 --scenario dispatch --json")]
pub struct BenchArgs {
    /// Start `intray serve` (this executable) as a child process on free
    /// loopback ports and stop it at the end. DESTRUCTIVE: the PostgreSQL
    /// database named in --database-url is DROPPED and recreated first, a
    /// SQLite file deleted, so every run starts empty.
    #[arg(long, requires = "database_url")]
    pub spawn: bool,

    /// The server's database. With --spawn the database it gets (see
    /// --spawn); with --addr it is only read, to count the server's
    /// PostgreSQL connections in the watchers scenario.
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,

    /// An extra flag for the spawned `intray serve`; repeat for several
    /// (e.g. --serve-arg=--max-connections=32).
    #[arg(
        long = "serve-arg",
        value_name = "ARG",
        allow_hyphen_values = true,
        requires = "spawn"
    )]
    pub serve_args: Vec<String>,

    /// Where the spawned server's output goes (default: a file in the
    /// temporary directory). It logs at warn unless RUST_LOG is set.
    #[arg(long, value_name = "PATH", requires = "spawn")]
    pub server_log: Option<PathBuf>,

    /// Process id of the --addr server, for its memory in the watchers scenario.
    #[arg(long, value_name = "PID", conflicts_with = "spawn")]
    pub server_pid: Option<u32>,

    /// Scenarios to run, repeatable or comma-separated; default all, in the order listed here.
    #[arg(
        long = "scenario",
        value_name = "NAME",
        value_enum,
        value_delimiter = ','
    )]
    pub scenarios: Vec<Scenario>,

    /// Concurrent producers of the submit scenario, one row each.
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "1,16,32"
    )]
    pub submit_producers: Vec<usize>,

    /// Measured jobs per submit row.
    #[arg(long, value_name = "N", default_value_t = 5000)]
    pub submit_jobs: u64,

    /// Producers of e2e, e2e-batched and backlog (each on its own connection); transport
    /// runs as many callers as producers and workers together.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub producers: usize,

    /// Remote workers of e2e, e2e-batched, burn-down, backlog and watchers (each on its own connection).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub workers: usize,

    /// Measured jobs of e2e (transport makes three calls for each).
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    pub e2e_jobs: u64,

    /// Most jobs outstanding (submitted and not yet answered as completed)
    /// in e2e and e2e-chained: a producer waits for a completion before
    /// submitting more, so the queue stays this deep instead of growing
    /// through the run.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub e2e_outstanding: u64,

    /// Measured jobs of e2e-batched.
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    pub batched_jobs: u64,

    /// Most jobs outstanding in e2e-batched; at least --batch. Larger than
    /// e2e's so that every worker can hold a full lease with jobs still
    /// queued behind.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub batched_outstanding: u64,

    /// Jobs per SubmitBatch in the batched scenarios; Lease max_jobs is this, at most 100.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub batch: usize,

    /// Jobs pre-submitted (untimed) and then drained by burn-down.
    #[arg(long, value_name = "N", default_value_t = 50_000)]
    pub burn_down_jobs: u64,

    /// Measured jobs of dispatch, and of dispatch at each backlog size (over
    /// all its rounds).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub dispatch_samples: u64,

    /// Pause from the idle worker having completed a dispatch job (about to
    /// Lease again) to the next Submit.
    #[arg(long, value_name = "DURATION", default_value = "5ms", value_parser = duration)]
    pub dispatch_spacing: Duration,

    /// The large backlog of the backlog scenario (compared with 1,000). An
    /// --addr server's --queue-bound must allow it; --spawn raises the bound.
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    pub backlog_size: u64,

    /// Measured e2e jobs at each backlog size (over all its rounds); the
    /// e2e part runs behind a runnable backlog of that size, kept at that
    /// depth, and the dispatch part beside a scheduled one.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub backlog_jobs: u64,

    /// Before each scenario, and before each e2e and dispatch part of the
    /// backlog scenario's rounds: a CHECKPOINT (on PostgreSQL), then a wait of at most
    /// this long for this machine's CPU to fall under 25 % busy, so that
    /// what the work before left behind (a million rows to vacuum, WAL to
    /// write) is not measured. 0s skips both.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = duration)]
    pub settle: Duration,

    /// Concurrent WatchJob streams, one per job.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub watchers: u64,

    /// WatchJob streams per HTTP/2 connection.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub watchers_per_channel: usize,

    /// Jobs each scenario runs first, unmeasured (dispatch: at most 100); 0 for none.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub warmup: u64,
}

impl BenchArgs {
    fn sizes(&self) -> Result<Sizes, BenchError> {
        let positive = [
            ("--submit-jobs", self.submit_jobs),
            ("--producers", self.producers as u64),
            ("--workers", self.workers as u64),
            ("--e2e-jobs", self.e2e_jobs),
            ("--e2e-outstanding", self.e2e_outstanding),
            ("--batched-jobs", self.batched_jobs),
            ("--batch", self.batch as u64),
            ("--burn-down-jobs", self.burn_down_jobs),
            ("--dispatch-samples", self.dispatch_samples),
            ("--backlog-jobs", self.backlog_jobs),
            ("--watchers", self.watchers),
            ("--watchers-per-channel", self.watchers_per_channel as u64),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(BenchError::BadArgument(format!(
                "{flag} must be at least 1"
            )));
        }
        if self.submit_producers.contains(&0) {
            return Err(BenchError::BadArgument(
                "--submit-producers must be at least 1".into(),
            ));
        }
        if self.batch > 1000 {
            return Err(BenchError::BadArgument(
                "--batch is at most 1000 (the SubmitBatch limit)".into(),
            ));
        }
        if self.batched_outstanding < self.batch as u64 {
            return Err(BenchError::BadArgument(format!(
                "--batched-outstanding must be at least --batch ({}): a SubmitBatch needs room for all its jobs",
                self.batch
            )));
        }
        if self.backlog_size < SMALL_BACKLOG {
            return Err(BenchError::BadArgument(format!(
                "--backlog-size must be at least {SMALL_BACKLOG}, the size it is compared with"
            )));
        }
        Ok(Sizes {
            submit_producers: self.submit_producers.clone(),
            submit_jobs: self.submit_jobs,
            producers: self.producers,
            workers: self.workers,
            e2e_jobs: self.e2e_jobs,
            e2e_outstanding: self.e2e_outstanding,
            batched_jobs: self.batched_jobs,
            batched_outstanding: self.batched_outstanding,
            batch: self.batch,
            burn_down_jobs: self.burn_down_jobs,
            dispatch_samples: self.dispatch_samples,
            dispatch_spacing: self.dispatch_spacing,
            backlog_size: self.backlog_size,
            backlog_jobs: self.backlog_jobs,
            settle: self.settle,
            watchers: self.watchers,
            watchers_per_channel: self.watchers_per_channel,
            warmup: self.warmup,
        })
    }

    /// The scenarios to run, each once, in their fixed order.
    fn selected(&self) -> Vec<Scenario> {
        let mut selected = if self.scenarios.is_empty() {
            <Scenario as clap::ValueEnum>::value_variants().to_vec()
        } else {
            self.scenarios.clone()
        };
        selected.sort();
        selected.dedup();
        selected
    }
}

/// Runs the benchmark; `opts` are the CLI's global client options
/// (`--json` prints only the JSON lines).
pub async fn run(opts: ClientOpts, args: BenchArgs) -> Result<(), BenchError> {
    let sizes = args.sizes()?;
    let scenarios = args.selected();
    let command = command_line(&std::env::args().collect::<Vec<_>>());
    let backend = args.database_url.as_deref().and_then(Backend::of);
    if args.database_url.is_some() && backend.is_none() {
        return Err(BenchError::BadArgument(
            "--database-url must start with postgres:// or sqlite:".into(),
        ));
    }
    let mut opts = opts;
    let spawned = match (&args.database_url, args.spawn) {
        (Some(url), true) => {
            spawn::reset_database(url).await?;
            let log = args.server_log.clone().unwrap_or_else(|| {
                std::env::temp_dir().join(format!("intray-bench-server-{}.log", std::process::id()))
            });
            let mut serve_args = vec![
                // The backlog scenario queues --backlog-size jobs on top of the rest.
                "--queue-bound".to_owned(),
                (args.backlog_size + 1_000_000).to_string(),
                "--shutdown-grace".to_owned(),
                "2s".to_owned(),
            ];
            serve_args.extend(args.serve_args.iter().cloned());
            let server = Spawned::start(url, &serve_args, &log).await?;
            opts.addr = server.addr().to_owned();
            // The child serves plaintext without tokens.
            opts.tls_ca = None;
            opts.client_cert = None;
            opts.client_key = None;
            Some(server)
        }
        _ => None,
    };
    let result = run_scenarios(&opts, &args, sizes, &scenarios, &command, spawned.as_ref()).await;
    if let Some(server) = spawned {
        let log = server.log().to_owned();
        let stopped = server.stop().await;
        if result.is_err() {
            eprintln!("bench: the spawned server's log is {}", log.display());
        }
        result?;
        stopped?;
        return Ok(());
    }
    result
}

async fn run_scenarios(
    opts: &ClientOpts,
    args: &BenchArgs,
    sizes: Sizes,
    scenarios: &[Scenario],
    command: &str,
    spawned: Option<&Spawned>,
) -> Result<(), BenchError> {
    let conn = conn::Conn::new(opts)?;
    let backend = args
        .database_url
        .as_deref()
        .and_then(Backend::of)
        .map_or("unknown", Backend::name);
    let target = if spawned.is_some() { "spawned" } else { "addr" };
    let mut printer = Printer::new(io::stdout(), opts.json, backend, target, command);
    printer.comment(&format!("command: {command}"))?;
    match spawned {
        Some(server) => printer.comment(&format!(
            "server: spawned intray serve (pid {}) at {} on a fresh {backend} database; log {}",
            server.pid(),
            server.addr(),
            server.log().display()
        ))?,
        None => printer.comment(&format!("server: {} ({backend} backend)", conn.addr()))?,
    }
    printer.comment(&format!("load average at start: {}", loadavg()))?;
    let ctx = Ctx {
        conn,
        sizes,
        run_id: format!("{:08x}", rand::random::<u32>()),
        server_pid: spawned.map(Spawned::pid).or(args.server_pid),
        database_url: args.database_url.clone(),
    };
    for &scenario in scenarios {
        scenarios::run(scenario, &ctx, &mut |report| Ok(printer.emit(&report)?)).await?;
    }
    printer.comment(&format!("load average at end: {}", loadavg()))?;
    Ok(())
}

/// The first three fields of `/proc/loadavg`, or "unknown".
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
