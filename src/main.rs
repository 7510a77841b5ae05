//! The `intray` binary: parses the command line and calls into the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use intray::cli::{DatabaseArgs, ServeArgs};
use intray::client::{ClientCommand, ClientOpts};

// glibc's malloc took an eighth of the server's CPU under load (perf: its
// arenas contend between tokio's worker threads); mimalloc's thread-local
// heaps do not.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// intray: a durable job service for slow, failure-prone work, over gRPC.
///
/// `intray serve` runs the server (an embedded SQLite file by default,
/// PostgreSQL with --database-url postgres://...). The other commands are a
/// client for a running server.
#[derive(Parser)]
#[command(name = "intray", version, about, long_about)]
struct Cli {
    #[command(flatten)]
    client: ClientOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Started by `intray work` itself: stops its commands if it dies.
    #[command(name = "work-guard", hide = true)]
    WorkGuard(intray::client::GuardArgs),
    #[command(flatten)]
    OnRuntime(OnRuntime),
}

/// The commands that run inside a tokio runtime.
#[derive(Subcommand)]
enum OnRuntime {
    /// Run the server: gRPC API, reaper, migrations on start.
    // Boxed: the serve flags are many times larger than any other command's.
    Serve(Box<ServeArgs>),
    /// Apply the database migrations and exit.
    Migrate(DatabaseArgs),
    /// Measure a server: submit, e2e, e2e-batched, burn-down, dispatch, backlog, watchers, transport.
    ///
    /// Against --addr, or a server it starts itself with --spawn (which
    /// DROPS and recreates the database first). Prints a table row and one
    /// JSON line per result, with the command line that produced it.
    // Boxed like serve: many flags.
    Bench(Box<intray::bench::BenchArgs>),
    #[command(flatten)]
    Client(ClientCommand),
}

/// Threads of the blocking pool, started only when needed: `intray work`
/// keeps one per running command (up to 1000, `--concurrency`) waiting for
/// it to exit, above tokio's default of 512.
const BLOCKING_THREADS: usize = 1000 + 512;

fn main() -> ExitCode {
    reset_sigchld();
    let cli = Cli::parse();
    // The guard only reads a pipe and sends signals: no runtime, and no
    // threads of one, in a process that may outlive its worker for long.
    let command = match cli.command {
        Command::WorkGuard(args) => {
            intray::client::work_guard(&args);
            return ExitCode::SUCCESS;
        }
        Command::OnRuntime(command) => command,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(BLOCKING_THREADS)
        .build();
    match runtime {
        Ok(runtime) => runtime.block_on(run(cli.client, command)),
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Gives SIGCHLD its default disposition back. A parent may start us with
/// it ignored, and that is inherited across exec: the kernel then reaps
/// every child by itself, so `intray work` would lose each command's exit
/// status (the job failed for the wrong reason) and could signal a process
/// group whose id had already been reused; `bench --spawn` would lose its
/// server's.
fn reset_sigchld() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: SIG_DFL installs no handler, so no code runs in a signal
    // context, and no other thread exists yet to change the disposition
    // at the same time.
    if let Err(err) = unsafe { signal(Signal::SIGCHLD, SigHandler::SigDfl) } {
        eprintln!("warning: cannot reset SIGCHLD to its default: {err}");
    }
}

async fn run(client: ClientOpts, command: OnRuntime) -> ExitCode {
    match command {
        OnRuntime::Serve(args) => serve(*args).await,
        OnRuntime::Migrate(db) => {
            intray::telemetry::init_logging();
            let url = db.url();
            match intray::store::migrate(&url, true).await {
                Ok(()) => {
                    tracing::info!("migrations applied");
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("error: {}", intray::report::with_causes(&err));
                    ExitCode::FAILURE
                }
            }
        }
        OnRuntime::Bench(args) => match intray::bench::run(client, *args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::from(err.exit_code())
            }
        },
        OnRuntime::Client(cmd) => match intray::client::run(client, cmd).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(1))
            }
        },
    }
}

async fn serve(args: ServeArgs) -> ExitCode {
    // Built inside the runtime: the OTLP exporter's channel needs it.
    let (tracing_pipeline, tracing_warnings) = match intray::telemetry::Tracing::from_env() {
        Ok(built) => built,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    intray::telemetry::init(args.log_format, &tracing_pipeline);
    for warning in tracing_warnings {
        tracing::warn!("{warning}");
    }
    let mut settings = match args.settings() {
        Ok(settings) => settings,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    // The files and flags the database does not need, before it is
    // touched: a typo must not leave a migrated database behind.
    if let Err(err) = intray::server::preflight(&settings) {
        eprintln!("error: {}", intray::report::with_causes(&err));
        let code = match err {
            intray::server::ServerError::Settings(_) => 2,
            _ => 1,
        };
        return ExitCode::from(code);
    }
    // Migrations first, then the ports: an open port (the chart's startup
    // probe) then says the schema is current, and a long migration is not
    // taken for a server that hangs. `run_with` finds nothing left to apply.
    if let Err(err) = intray::store::migrate(&settings.database_url, false).await {
        eprintln!("error: {}", intray::report::with_causes(&err));
        return ExitCode::FAILURE;
    }
    let listener = match tokio::net::TcpListener::bind(args.grpc_addr).await {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("error: cannot listen on {}: {err}", args.grpc_addr);
            return ExitCode::FAILURE;
        }
    };
    let http = match tokio::net::TcpListener::bind(args.http_addr).await {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("error: cannot listen on {}: {err}", args.http_addr);
            return ExitCode::FAILURE;
        }
    };
    settings.tracing = tracing_pipeline.clone();
    tracing::info!(
        grpc_addr = %args.grpc_addr, http_addr = %args.http_addr,
        database = %intray::report::redacted_url(&settings.database_url),
        otlp = tracing_pipeline.tracer().is_some(), "intray serving"
    );
    keep_serving_on_sighup();
    let served = intray::server::run_with(settings, listener, Some(http), shutdown_signal()).await;
    // Spans of attempts that ended during the drain are exported now.
    tracing_pipeline.shutdown().await;
    match served {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {}", intray::report::with_causes(&err));
            ExitCode::FAILURE
        }
    }
}

/// Keeps SIGHUP from ending the server. Its default action terminates the
/// process, and what reloads on it (the tokens, webhooks and TLS files)
/// listens only when such a file is configured: without one, a process
/// manager's "reload" would have stopped the server with no drain.
fn keep_serving_on_sighup() {
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hangup) => {
            tokio::spawn(async move {
                while hangup.recv().await.is_some() {
                    tracing::debug!(
                        "SIGHUP (the watchers of reloadable files, if any, reload them)"
                    );
                }
            });
        }
        Err(err) => {
            tracing::warn!(error = %err, "cannot listen for SIGHUP; it would stop the server")
        }
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}
