//! Command-line arguments of the client commands and their value parsers.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};

use crate::pb::JobState;

/// How to reach the server and how to print; shared by every client command.
///
/// Every flag is `global`, so it may be written before or after the
/// subcommand (`intray --json get ID` and `intray get ID --json`).
///
/// `Debug` leaves the token out, so the options can be logged.
#[derive(Args, Clone)]
// As for ClientCommand: keep this doc comment out of the parent's help.
#[command(about = None, long_about = None)]
pub struct ClientOpts {
    /// gRPC address of the intray server (a bare `host:port` means plaintext `http://`).
    #[arg(
        long = "addr",
        id = "client_addr",
        env = "INTRAY_ADDR",
        default_value = "http://127.0.0.1:50051",
        value_name = "URL",
        global = true,
        help_heading = "Client options"
    )]
    pub addr: String,

    /// Tenant to act as, sent as `x-intray-tenant` request metadata (the server uses "default" when absent).
    #[arg(
        long = "tenant",
        id = "client_tenant",
        env = "INTRAY_TENANT",
        value_name = "TENANT",
        global = true,
        help_heading = "Client options"
    )]
    pub tenant: Option<String>,

    /// Bearer token sent as `authorization: Bearer TOKEN` with every call (prefer the environment variable: a flag shows in `ps`).
    #[arg(
        long = "token",
        id = "client_token",
        env = "INTRAY_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        global = true,
        help_heading = "Client options"
    )]
    pub token: Option<String>,

    /// PEM CA certificate the server's certificate must chain to, for an `https://` address.
    #[arg(
        long = "tls-ca",
        id = "client_tls_ca",
        env = "INTRAY_TLS_CA",
        value_name = "PATH",
        global = true,
        help_heading = "Client options"
    )]
    pub tls_ca: Option<PathBuf>,

    /// PEM client certificate for a server that requires one (mTLS); with `--client-key`.
    #[arg(
        long = "client-cert",
        id = "client_cert",
        env = "INTRAY_CLIENT_CERT",
        value_name = "PATH",
        requires = "client_key",
        global = true,
        help_heading = "Client options"
    )]
    pub client_cert: Option<PathBuf>,

    /// PEM key of `--client-cert`.
    #[arg(
        long = "client-key",
        id = "client_key",
        env = "INTRAY_CLIENT_KEY",
        value_name = "PATH",
        requires = "client_cert",
        global = true,
        help_heading = "Client options"
    )]
    pub client_key: Option<PathBuf>,

    /// Print the proto3 JSON mapping of the response instead of readable text.
    #[arg(
        long = "json",
        id = "client_json",
        global = true,
        help_heading = "Client options"
    )]
    pub json: bool,
}

impl std::fmt::Debug for ClientOpts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientOpts")
            .field("addr", &self.addr)
            .field("tenant", &self.tenant)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls_ca)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("json", &self.json)
            .finish()
    }
}

/// The client commands: talk to a running intray server over gRPC.
#[derive(Subcommand, Clone, Debug)]
// Without this, clap would use the doc comment above as the about text of
// whatever command this enum is flattened into.
#[command(about = None, long_about = None)]
pub enum ClientCommand {
    /// Submit a job and print it.
    ///
    /// Prints the stored job and whether it was created, or whether an
    /// earlier job with the same idempotency key was returned instead.
    #[command(
        after_help = "Example:\n  intray submit --queue default --kind summarize \
                            --payload '{\"doc\":\"...\"}' --timeout 10m --label team=search"
    )]
    // Boxed: the submit options are most of the enum's size, and a caller's
    // own command enum that embeds this one would trip clippy's
    // large_enum_variant otherwise.
    Submit(Box<SubmitArgs>),
    /// Print one job.
    Get(GetArgs),
    /// Cancel a job: a queued job at once, a running one once its worker stops.
    Cancel(CancelArgs),
    /// Print a job's events as they happen, until the job reaches a terminal state.
    ///
    /// Prints the history first (after `--after`), then live events, one line
    /// each (one JSON object per line with `--json`); reconnects on its own if
    /// the server becomes unavailable or the connection drops, without
    /// missing or repeating events. Exits 0 when the job succeeded and 3 when
    /// it ended otherwise (failed, cancelled, expired).
    Watch(WatchArgs),
    /// List jobs, newest first.
    ///
    /// The dead set is `--state failed`.
    List(ListArgs),
    /// Put failed, cancelled or expired jobs back in their queue with a fresh attempt budget.
    ///
    /// Either one job by ID, or every job of a queue matching the filters
    /// (failed jobs unless `--state` says otherwise).
    #[command(
        after_help = "Examples:\n  intray retry 0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d\n  \
                            intray retry --queue default --error-class rate_limited --dry-run"
    )]
    Retry(RetryArgs),
    /// Print job counts per queue and the workers seen in the last five minutes.
    Stats(StatsArgs),
    /// Run a command for each job of a queue: a worker in any language.
    ///
    /// The payload JSON is on the command's stdin, its stdout is the result,
    /// exit 0 succeeds, 75 is a retryable failure and any other code a final
    /// one. Runs until SIGINT, SIGTERM or SIGHUP, then drains.
    #[command(
        after_help = "Example:\n  intray work --queue default --kind resize --concurrency 4 -- ./resize.sh"
    )]
    Work(super::work::WorkArgs),
}

/// Arguments of `intray submit`.
#[derive(Args, Clone, Debug)]
pub struct SubmitArgs {
    /// Queue the job waits in (1..=128 characters of [A-Za-z0-9_.:-]).
    #[arg(long, value_name = "QUEUE")]
    pub queue: String,

    /// What the worker should do (1..=128 characters of [A-Za-z0-9_.:/-]).
    #[arg(long, value_name = "KIND")]
    pub kind: String,

    /// Job input as JSON text (any JSON value, within the server's --max-payload-bytes, 1 MiB by default); none when omitted.
    #[arg(long, value_name = "JSON", conflicts_with = "payload_file")]
    pub payload: Option<String>,

    /// Read the JSON payload from a file, or from standard input with `-`.
    #[arg(long, value_name = "PATH")]
    pub payload_file: Option<PathBuf>,

    /// Key that makes the submit safe to repeat: the same key and input return the original job.
    ///
    /// `--delay` and `--timeout` become absolute times when the command
    /// runs, so a repeat with them is different input (ALREADY_EXISTS); use
    /// `--run-at` and `--deadline` for submits that must be repeatable.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,

    /// Priority, -1000..=1000; larger runs first.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub priority: Option<i32>,

    /// Do not run before this time (RFC 3339, e.g. 2030-01-02T03:04:05Z).
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "delay")]
    pub run_at: Option<DateTime<Utc>>,

    /// Do not run before this long from now (e.g. 30s, 5m, 1h).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub delay: Option<Duration>,

    /// Expire the job if it has not finished by this time (RFC 3339).
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "timeout")]
    pub deadline: Option<DateTime<Utc>>,

    /// Expire the job if it has not finished this long from now (e.g. 10m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,

    /// Attempts before the job fails for good, 1..=100 (server default 3).
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,

    /// Base delay of the exponential backoff between attempts (server default 5s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub backoff_initial: Option<Duration>,

    /// Cap on the backoff delay (server default 5m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub backoff_max: Option<Duration>,

    /// Label the job with KEY=VALUE; repeat for several labels.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,

    /// http(s) URL stored with the job for completion callbacks.
    #[arg(long, value_name = "URL")]
    pub callback_url: Option<String>,

    /// Spend limit in cents over all attempts: once reported costs reach it, a failure is final.
    #[arg(long, value_name = "CENTS")]
    pub max_cost_cents: Option<i64>,
}

/// Arguments of `intray get`.
#[derive(Args, Clone, Debug)]
pub struct GetArgs {
    /// Job id (UUID).
    #[arg(value_name = "ID", value_parser = parse_job_id)]
    pub id: String,

    /// Also print the job's event history as a timeline (times, durations
    /// between events, attempts, workers, errors).
    #[arg(long)]
    pub events: bool,
}

/// Arguments of `intray cancel`.
#[derive(Args, Clone, Debug)]
pub struct CancelArgs {
    /// Job id (UUID).
    #[arg(value_name = "ID", value_parser = parse_job_id)]
    pub id: String,

    /// Why the job is cancelled; recorded in its event log.
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
}

/// Arguments of `intray watch`.
#[derive(Args, Clone, Debug)]
pub struct WatchArgs {
    /// Job id (UUID).
    #[arg(value_name = "ID", value_parser = parse_job_id)]
    pub id: String,

    /// Only print events with a larger sequence number (0 prints the whole history).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub after: u64,
}

/// Arguments of `intray list`.
#[derive(Args, Clone, Debug)]
pub struct ListArgs {
    /// Only jobs of this queue.
    #[arg(long, value_name = "QUEUE")]
    pub queue: Option<String>,

    /// Only jobs of this kind.
    #[arg(long, value_name = "KIND")]
    pub kind: Option<String>,

    /// Only jobs in these states; repeat or separate with commas.
    #[arg(
        long = "state",
        value_name = "STATE",
        value_enum,
        value_delimiter = ',',
        ignore_case = true
    )]
    pub states: Vec<StateArg>,

    /// Only jobs whose last error has this class (e.g. rate_limited).
    #[arg(long, value_name = "CLASS")]
    pub error_class: Option<String>,

    /// Only jobs carrying this label; repeat to require several.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,

    /// Jobs per page, 1..=1000 (server default 50).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,

    /// Start at this page (the token printed after the previous page).
    #[arg(long, value_name = "TOKEN")]
    pub page_token: Option<String>,

    /// Follow the pages to the end and print every matching job.
    #[arg(long)]
    pub all: bool,
}

/// Arguments of `intray retry`.
#[derive(Args, Clone, Debug)]
pub struct RetryArgs {
    /// Retry this one job (UUID); or leave it out and select jobs with --queue.
    #[arg(
        value_name = "ID",
        value_parser = parse_job_id,
        conflicts_with_all = ["queue", "kind", "error_class", "states", "limit"]
    )]
    pub id: Option<String>,

    /// Retry the jobs of this queue (required without ID).
    #[arg(long, value_name = "QUEUE", required_unless_present = "id")]
    pub queue: Option<String>,

    /// Only jobs of this kind.
    #[arg(long, value_name = "KIND")]
    pub kind: Option<String>,

    /// Only jobs whose last error has this class.
    #[arg(long, value_name = "CLASS")]
    pub error_class: Option<String>,

    /// Only jobs in these states; repeat or separate with commas (server default failed).
    #[arg(
        long = "state",
        value_name = "STATE",
        value_enum,
        value_delimiter = ',',
        ignore_case = true
    )]
    pub states: Vec<RetryStateArg>,

    /// Only count the jobs that would be retried; change nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Retry at most this many jobs, 1..=10000 (server default 1000).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
}

/// Arguments of `intray stats`.
#[derive(Args, Clone, Debug)]
pub struct StatsArgs {
    /// Only this queue (default: every queue of the tenant).
    #[arg(long, value_name = "QUEUE")]
    pub queue: Option<String>,
}

/// A job state as written on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// Waiting to be leased.
    Queued,
    /// Leased by a worker.
    Running,
    /// Finished successfully.
    Succeeded,
    /// Failed for good: the dead set.
    #[value(alias = "dead")]
    Failed,
    /// Cancelled.
    Cancelled,
    /// Deadline passed before the job could finish.
    Expired,
}

impl From<StateArg> for JobState {
    fn from(state: StateArg) -> Self {
        match state {
            StateArg::Queued => JobState::Queued,
            StateArg::Running => JobState::Running,
            StateArg::Succeeded => JobState::Succeeded,
            StateArg::Failed => JobState::Failed,
            StateArg::Cancelled => JobState::Cancelled,
            StateArg::Expired => JobState::Expired,
        }
    }
}

/// A state a retry can take jobs out of, as written on the command line.
///
/// Its own type so `--help` lists only these and a `retry --state running`
/// fails before any request is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RetryStateArg {
    /// Failed for good: the dead set.
    #[value(alias = "dead")]
    Failed,
    /// Cancelled.
    Cancelled,
    /// Deadline passed before the job could finish.
    Expired,
}

impl From<RetryStateArg> for JobState {
    fn from(state: RetryStateArg) -> Self {
        match state {
            RetryStateArg::Failed => JobState::Failed,
            RetryStateArg::Cancelled => JobState::Cancelled,
            RetryStateArg::Expired => JobState::Expired,
        }
    }
}

/// Parses `KEY=VALUE`, splitting at the first `=` so values may contain `=`.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))?;
    if key.is_empty() {
        return Err(format!("label key is empty in {s:?}"));
    }
    Ok((key.to_owned(), value.to_owned()))
}

/// Parses a duration written like `500ms`, `30s`, `5m` or `1h 30m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{e} (write a duration like 500ms, 30s, 5m or 1h)"))
}

/// Parses an RFC 3339 timestamp in any offset.
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s.trim())
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{e} (write an RFC 3339 time like 2030-01-02T03:04:05Z)"))
}

/// Checks that a job id is a UUID and writes it in the canonical lowercase
/// hyphenated form the server stores, so `ABC...` and braces still match.
pub fn parse_job_id(s: &str) -> Result<String, String> {
    uuid::Uuid::parse_str(s.trim())
        .map(|id| id.hyphenated().to_string())
        .map_err(|e| format!("not a job id (UUID): {e}"))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    /// The wiring main.rs uses: client options at the top level, client
    /// commands flattened next to the server's own commands.
    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        client: ClientOpts,
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Subcommand, Debug)]
    enum Command {
        /// Stand-in for the server command.
        Serve,
        #[command(flatten)]
        Client(ClientCommand),
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("intray").chain(args.iter().copied()))
    }

    fn client_command(args: &[&str]) -> ClientCommand {
        match parse(args).map(|cli| cli.command) {
            Ok(Command::Client(cmd)) => cmd,
            other => panic!("{args:?} did not parse as a client command: {other:?}"),
        }
    }

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_command_and_flag_has_help() {
        let cli = Cli::command();
        for command in cli.get_subcommands().filter(|c| c.get_name() != "serve") {
            assert!(
                command.get_about().is_some(),
                "{} has no help",
                command.get_name()
            );
            for arg in command.get_arguments() {
                let generated = ["help", "version"].contains(&arg.get_id().as_str());
                assert!(
                    generated || arg.get_help().is_some(),
                    "{} {} has no help",
                    command.get_name(),
                    arg.get_id()
                );
            }
        }
    }

    #[test]
    fn labels_split_at_first_equals() {
        assert_eq!(parse_label("a=b"), Ok(("a".into(), "b".into())));
        assert_eq!(parse_label("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert_eq!(parse_label("team="), Ok(("team".into(), String::new())));
        assert!(parse_label("novalue").is_err());
        assert!(parse_label("=v").is_err());
    }

    #[test]
    fn durations_use_humantime_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn times_are_rfc3339_in_any_offset() {
        let t = parse_time("2030-01-02T04:04:05+01:00");
        assert_eq!(
            t.map(|t| t.to_rfc3339()),
            Ok("2030-01-02T03:04:05+00:00".into())
        );
        assert!(parse_time("2030-01-02 03:04").is_err());
    }

    #[test]
    fn job_ids_are_canonical_uuids() {
        assert_eq!(
            parse_job_id("0190C3C6-7F7E-7C8A-9D3E-2A6F0E1B4C5D"),
            Ok("0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d".into())
        );
        assert!(parse_job_id("42").is_err());
    }

    #[test]
    fn states_accept_names_aliases_commas_and_any_case() {
        let ListArgs { states, .. } = match client_command(&[
            "list",
            "--state",
            "failed,Expired",
            "--state",
            "dead",
            "--state",
            "QUEUED",
        ]) {
            ClientCommand::List(args) => args,
            other => panic!("unexpected {other:?}"),
        };
        let states: Vec<JobState> = states.into_iter().map(JobState::from).collect();
        assert_eq!(
            states,
            [
                JobState::Failed,
                JobState::Expired,
                JobState::Failed,
                JobState::Queued
            ]
        );
        assert!(parse(&["list", "--state", "done"]).is_err());
    }

    #[test]
    fn global_options_go_before_or_after_the_command() {
        let cli = parse(&["--json", "get", "0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d"]);
        assert!(cli.is_ok_and(|cli| cli.client.json));
        let cli = parse(&[
            "get",
            "0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d",
            "--json",
            "--addr",
            "localhost:1",
            "--tenant",
            "acme",
        ]);
        let Ok(cli) = cli else { panic!("{cli:?}") };
        assert!(cli.client.json);
        assert_eq!(cli.client.addr, "localhost:1");
        assert_eq!(cli.client.tenant.as_deref(), Some("acme"));
    }

    #[test]
    fn submit_takes_every_option() {
        let cmd = client_command(&[
            "submit",
            "--queue",
            "q",
            "--kind",
            "k",
            "--payload",
            "{}",
            "--priority",
            "-5",
            "--delay",
            "30s",
            "--timeout",
            "10m",
            "--max-attempts",
            "4",
            "--backoff-initial",
            "1s",
            "--backoff-max",
            "1m",
            "--label",
            "a=1",
            "--label",
            "b=2",
            "--idempotency-key",
            "key",
            "--callback-url",
            "https://example.com/cb",
        ]);
        let ClientCommand::Submit(args) = cmd else {
            panic!("unexpected {cmd:?}")
        };
        assert_eq!(args.priority, Some(-5));
        assert_eq!(args.delay, Some(Duration::from_secs(30)));
        assert_eq!(args.timeout, Some(Duration::from_secs(600)));
        assert_eq!(args.labels.len(), 2);
    }

    #[test]
    fn submit_rejects_conflicting_options() {
        let base = ["submit", "--queue", "q", "--kind", "k"];
        let with = |extra: &[&str]| {
            let args: Vec<&str> = base.iter().chain(extra).copied().collect();
            parse(&args).map(|_| ())
        };
        assert!(with(&[]).is_ok());
        assert!(with(&["--payload", "1", "--payload-file", "-"]).is_err());
        assert!(with(&["--run-at", "2030-01-01T00:00:00Z", "--delay", "1s"]).is_err());
        assert!(with(&["--deadline", "2030-01-01T00:00:00Z", "--timeout", "1s"]).is_err());
        assert!(parse(&["submit", "--queue", "q"]).is_err());
    }

    #[test]
    fn retry_takes_an_id_or_a_queue() {
        let id = "0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d";
        assert!(parse(&["retry", id]).is_ok());
        assert!(parse(&["retry", "--queue", "q", "--state", "expired", "--dry-run"]).is_ok());
        assert!(parse(&["retry", id, "--dry-run"]).is_ok());
        assert!(parse(&["retry"]).is_err());
        assert!(parse(&["retry", id, "--queue", "q"]).is_err());
        assert!(parse(&["retry", "--queue", "q", "--state", "running"]).is_err());
    }
}
