//! Flags of `intray serve` and `intray migrate`, each with an `INTRAY_*`
//! environment equivalent, turned into [`Settings`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::config::{RateLimit, Settings, TlsFiles};

/// Database used when neither a flag nor an environment variable names one.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://intray.db";

fn duration(s: &str) -> Result<Duration, humantime::DurationError> {
    humantime::parse_duration(s)
}

fn queue_cap(s: &str) -> Result<(String, u32), String> {
    let (queue, cap) = s
        .split_once('=')
        .ok_or_else(|| format!("expected QUEUE=N, got {s:?}"))?;
    let queue = crate::domain::validate::queue("queue", queue).map_err(|e| e.to_string())?;
    Ok((queue, running_cap(cap)?))
}

/// A cap of running jobs: at least 1 (0 would stop the queue for good, with
/// nothing said; `PauseQueue` is how to stop one).
fn running_cap(s: &str) -> Result<u32, String> {
    match s.parse() {
        Ok(0) => Err("a cap of 0 would never run a job (pause the queue instead)".into()),
        Ok(cap) => Ok(cap),
        Err(_) => Err(format!("{s:?} is not a number of jobs")),
    }
}

/// Where the database is.
#[derive(Args, Debug, Clone)]
pub struct DatabaseArgs {
    /// Database URL: `sqlite://PATH` (created if missing) or `postgres://...`.
    /// Falls back to DATABASE_URL, then to sqlite://intray.db.
    #[arg(long, env = "INTRAY_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
}

impl DatabaseArgs {
    /// The flag, else `INTRAY_DATABASE_URL`, else `DATABASE_URL`, else the default.
    /// An empty one counts as unset at each step, as an empty
    /// `DATABASE_URL` always did.
    pub fn url(&self) -> String {
        self.database_url
            .clone()
            .filter(|v| !v.is_empty())
            .or_else(|| std::env::var("DATABASE_URL").ok().filter(|v| !v.is_empty()))
            .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned())
    }
}

/// The longest `--retention`: keeping jobs "forever" is a retention this
/// long, and the database's cut-off must stay a valid time.
const MAX_RETENTION: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// `intray serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address of the gRPC API.
    #[arg(long, env = "INTRAY_GRPC_ADDR", default_value = "0.0.0.0:50051")]
    pub grpc_addr: SocketAddr,

    #[command(flatten)]
    pub database: DatabaseArgs,

    /// PostgreSQL connections per replica (at least 3): half for the hot
    /// path (claims, hand-offs, completions, notifications to the other
    /// replicas), the rest for everything else, one of which listens for
    /// the other replicas' notifications.
    #[arg(long, env = "INTRAY_MAX_CONNECTIONS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(3..))]
    pub max_connections: u32,

    /// Shared transactions that the coalescer of Lease and Complete calls
    /// may run at once. Concurrent unary calls queue up behind them and go
    /// into the next shared transaction; 1 gives the largest batches, more
    /// overlaps commits (only for batches of 32 jobs or more: a smaller one
    /// waits for the running transaction). Each takes a pool connection.
    #[arg(long, env = "INTRAY_COALESCE_IN_FLIGHT", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub coalesce_in_flight: u16,

    /// The same for the Submit coalescer. One at a time by default: a
    /// submit is one autocommitted statement, and twice the batch in one
    /// statement beat two overlapping ones (docs/performance-log.md).
    #[arg(long, env = "INTRAY_SUBMIT_IN_FLIGHT", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub submit_in_flight: u16,

    /// How often the reaper reclaims expired leases and expires jobs past their deadline.
    #[arg(long, env = "INTRAY_REAPER_INTERVAL", default_value = "5s", value_parser = duration)]
    pub reaper_interval: Duration,

    /// Lease length when a worker does not ask for one.
    #[arg(long, env = "INTRAY_LEASE_DURATION", default_value = "60s", value_parser = duration)]
    pub lease_duration: Duration,

    /// Longest lease a worker may ask for.
    #[arg(long, env = "INTRAY_MAX_LEASE_DURATION", default_value = "1h", value_parser = duration)]
    pub max_lease_duration: Duration,

    /// Attempts per job when the submitter does not say (1..=100).
    #[arg(long, env = "INTRAY_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,

    /// Backoff base when the submitter does not say.
    #[arg(long, env = "INTRAY_BACKOFF_INITIAL", default_value = "5s", value_parser = duration)]
    pub backoff_initial: Duration,

    /// Backoff cap when the submitter does not say.
    #[arg(long, env = "INTRAY_BACKOFF_MAX", default_value = "5m", value_parser = duration)]
    pub backoff_max: Duration,

    /// Largest payload or result, in bytes of JSON.
    #[arg(long, env = "INTRAY_MAX_PAYLOAD_BYTES", default_value_t = 1024 * 1024)]
    pub max_payload_bytes: usize,

    /// How long a running job may ignore a cancel before it is cancelled anyway.
    #[arg(long, env = "INTRAY_CANCEL_GRACE", default_value = "30s", value_parser = duration)]
    pub cancel_grace: Duration,

    /// How often waiting Lease calls re-read the database without a notification.
    #[arg(long, env = "INTRAY_FALLBACK_POLL", default_value = "1s", value_parser = duration)]
    pub fallback_poll: Duration,

    /// How often open WatchJob streams re-read the database without a notification.
    #[arg(long, env = "INTRAY_WATCH_FALLBACK_POLL", default_value = "30s", value_parser = duration)]
    pub watch_fallback_poll: Duration,

    /// Finished jobs older than this are deleted with their events.
    #[arg(long, env = "INTRAY_RETENTION", default_value = "7days", value_parser = duration)]
    pub retention: Duration,

    /// Most queued jobs per tenant and queue; Submit beyond it gets RESOURCE_EXHAUSTED.
    #[arg(long, env = "INTRAY_QUEUE_BOUND", default_value_t = 1_000_000)]
    pub queue_bound: u64,

    /// Most running jobs of one tenant in one queue; no cap when unset.
    #[arg(long, env = "INTRAY_MAX_RUNNING_PER_TENANT", value_parser = running_cap)]
    pub max_running_per_tenant: Option<u32>,

    /// Per-queue override of --max-running-per-tenant, as QUEUE=N; repeat or separate with commas.
    #[arg(
        long,
        env = "INTRAY_QUEUE_MAX_RUNNING_PER_TENANT",
        value_name = "QUEUE=N",
        value_delimiter = ',',
        value_parser = queue_cap
    )]
    pub queue_max_running_per_tenant: Vec<(String, u32)>,

    /// On SIGTERM/SIGINT, how long in-flight calls may run on before they are dropped.
    #[arg(long, env = "INTRAY_SHUTDOWN_GRACE", default_value = "20s", value_parser = duration)]
    pub shutdown_grace: Duration,

    /// On SIGTERM/SIGINT, how long to go on serving with health NOT_SERVING before taking no more calls (for a load balancer to stop sending any).
    #[arg(long, env = "INTRAY_SHUTDOWN_DELAY", default_value = "0s", value_parser = duration)]
    pub shutdown_delay: Duration,

    /// Consecutive transient failures of a queue's kind that open its circuit breaker; 0 disables breakers.
    #[arg(long, env = "INTRAY_BREAKER_THRESHOLD", default_value_t = 5)]
    pub breaker_threshold: u32,

    /// Shortest time an open breaker stops leasing its kind (a larger retry_after reported wins).
    #[arg(long, env = "INTRAY_BREAKER_COOLDOWN", default_value = "30s", value_parser = duration)]
    pub breaker_cooldown: Duration,

    /// Error classes that count against a breaker.
    #[arg(
        long,
        env = "INTRAY_BREAKER_CLASSES",
        value_delimiter = ',',
        default_value = "rate_limited,provider_unavailable,timeout"
    )]
    pub breaker_classes: Vec<String>,

    /// Token file: one `TOKEN TENANT ROLES` line per token (README,
    /// "Security"). Without it the server runs in open development mode.
    #[arg(long, env = "INTRAY_AUTH_FILE", value_name = "PATH")]
    pub auth_file: Option<PathBuf>,

    /// How often the token file, the TLS files and the webhooks file are checked for changes (SIGHUP reloads at once).
    #[arg(long, env = "INTRAY_RELOAD_INTERVAL", default_value = "5s", value_parser = duration)]
    pub reload_interval: Duration,

    /// PEM certificate chain for TLS on the gRPC and HTTP ports (with --tls-key). Plaintext without it.
    #[arg(
        long,
        env = "INTRAY_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(
        long,
        env = "INTRAY_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificates: clients must present a certificate they signed (mTLS).
    #[arg(
        long,
        env = "INTRAY_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,

    /// Longest a call may take (a Lease gets its longest wait, 60s, on top).
    #[arg(long, env = "INTRAY_RPC_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub rpc_timeout: Duration,

    /// Most calls served at once; more wait for a slot within their timeout.
    #[arg(long, env = "INTRAY_CONCURRENCY_LIMIT", default_value_t = 1024)]
    pub concurrency_limit: usize,

    /// Calls per second per token (per tenant without authentication); 0 is unlimited.
    #[arg(long, env = "INTRAY_RATE_LIMIT", default_value_t = 0.0)]
    pub rate_limit: f64,

    /// Calls a token may make at once after a quiet spell; default twice --rate-limit.
    #[arg(long, env = "INTRAY_RATE_LIMIT_BURST")]
    pub rate_limit_burst: Option<u32>,

    /// HTTP/2 PING interval: keeps idle long-poll connections open through load balancers.
    #[arg(long, env = "INTRAY_HTTP2_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = duration)]
    pub http2_keepalive_interval: Duration,

    /// How long a PING may go unanswered before the connection is closed.
    #[arg(long, env = "INTRAY_HTTP2_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub http2_keepalive_timeout: Duration,

    /// Address of the HTTP port: JSON API (/api/v1), dashboard (/), GET /metrics.
    #[arg(long, env = "INTRAY_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,

    /// Host names the HTTP port answers to besides IP addresses and localhost
    /// (`*.example.com` for names under it, `*` for all). Default: all with
    /// --auth-file, none without (DNS rebinding).
    #[arg(
        long,
        env = "INTRAY_HTTP_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "NAMES"
    )]
    pub http_allowed_hosts: Option<Vec<String>>,

    /// How long an HTTP client has to send a request's headers; a client
    /// that stalls is disconnected.
    #[arg(long, env = "INTRAY_HTTP_HEADER_TIMEOUT", default_value = "20s", value_parser = duration)]
    pub http_header_timeout: Duration,

    /// How long an HTTP client has to send a request's body once its
    /// headers are in; a body that does not arrive in time is answered 408.
    #[arg(long, env = "INTRAY_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub http_body_timeout: Duration,

    /// Log lines as `text` or `json` (filtered by RUST_LOG).
    #[arg(long, env = "INTRAY_LOG_FORMAT", default_value = "text")]
    pub log_format: crate::telemetry::LogFormat,

    /// An attempt running longer than this logs a warning with its duration.
    #[arg(long, env = "INTRAY_SLOW_ATTEMPT", default_value = "8s", value_parser = duration)]
    pub slow_attempt: Duration,

    /// How often the queue gauges of /metrics are read from the database.
    #[arg(long, env = "INTRAY_METRICS_REFRESH", default_value = "15s", value_parser = duration)]
    pub metrics_refresh: Duration,

    /// JSON file with the webhook secrets per tenant, the callback
    /// allow-list and the ingress sources (README, "Webhooks").
    #[arg(long, env = "INTRAY_WEBHOOKS_FILE", value_name = "PATH")]
    pub webhooks_file: Option<PathBuf>,

    /// Longest a completion callback request may take.
    #[arg(long, env = "INTRAY_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub webhook_timeout: Duration,

    /// How long a completion callback is retried before it is marked failed.
    #[arg(long, env = "INTRAY_WEBHOOK_RETRY_WINDOW", default_value = "24h", value_parser = duration)]
    pub webhook_retry_window: Duration,

    /// Base of the callback retry backoff (exponential, full jitter).
    #[arg(long, env = "INTRAY_WEBHOOK_BACKOFF_INITIAL", default_value = "1s", value_parser = duration)]
    pub webhook_backoff_initial: Duration,

    /// Cap of the callback retry backoff.
    #[arg(long, env = "INTRAY_WEBHOOK_BACKOFF_MAX", default_value = "1h", value_parser = duration)]
    pub webhook_backoff_max: Duration,

    /// Most callback attempts one replica has in flight at one receiver
    /// (host:port), out of its 32: receivers that never answer hold no
    /// more slots than this each.
    #[arg(long, env = "INTRAY_WEBHOOK_RECEIVER_LIMIT", default_value_t = 8)]
    pub webhook_receiver_limit: usize,

    /// PEM CA certificates for https callbacks (default: SSL_CERT_FILE, else
    /// /etc/ssl/certs/ca-certificates.crt).
    #[arg(long, env = "INTRAY_WEBHOOK_CA_FILE", value_name = "PATH")]
    pub webhook_ca_file: Option<PathBuf>,

    /// Largest body accepted by POST /hooks/{source}.
    #[arg(long, env = "INTRAY_WEBHOOK_MAX_BODY_BYTES", default_value_t = 256 * 1024)]
    pub webhook_max_body_bytes: usize,
}

impl ServeArgs {
    /// The lease lengths within what `Lease` accepts: a default below the
    /// shortest lease would have every `Lease` that leaves its length
    /// unset refused.
    fn check_leases(&self) -> Result<(), String> {
        let min = crate::domain::validate::MIN_LEASE;
        let shortest = humantime::format_duration(min);
        if self.max_lease_duration < min {
            return Err(format!("--max-lease-duration must be at least {shortest}"));
        }
        if self.lease_duration < min {
            return Err(format!("--lease-duration must be at least {shortest}"));
        }
        if self.lease_duration > self.max_lease_duration {
            return Err("--lease-duration must not exceed --max-lease-duration".into());
        }
        Ok(())
    }

    /// The settings these flags describe.
    pub fn settings(&self) -> Result<Settings, String> {
        if !(1..=100).contains(&self.max_attempts) {
            return Err("--max-attempts must be between 1 and 100".into());
        }
        self.check_leases()?;
        // Before any migration: `Context::new` would refuse it only after.
        crate::domain::Backoff::try_new(self.backoff_initial, self.backoff_max)
            .map_err(|e| format!("--backoff-{e}"))?;
        if self.reaper_interval.is_zero()
            || self.fallback_poll.is_zero()
            || self.watch_fallback_poll.is_zero()
        {
            return Err(
                "--reaper-interval, --fallback-poll and --watch-fallback-poll must be above zero"
                    .into(),
            );
        }
        if self.rpc_timeout.is_zero() || self.reload_interval.is_zero() {
            return Err("--rpc-timeout and --reload-interval must be above zero".into());
        }
        // A PING every instant, or one never given time to be answered,
        // would close every idle connection (a parked Lease, a watch).
        if self.http2_keepalive_interval.is_zero() || self.http2_keepalive_timeout.is_zero() {
            return Err(
                "--http2-keepalive-interval and --http2-keepalive-timeout must be above zero"
                    .into(),
            );
        }
        if self.concurrency_limit == 0 {
            return Err("--concurrency-limit must be at least 1".into());
        }
        if !self.rate_limit.is_finite() || self.rate_limit < 0.0 {
            return Err("--rate-limit must be 0 (unlimited) or a positive number".into());
        }
        if self.rate_limit_burst == Some(0) {
            return Err("--rate-limit-burst must be at least 1".into());
        }
        // PostgreSQL computes the cut-off as a timestamp, which ends 4713 BC.
        if self.retention > MAX_RETENTION {
            return Err("--retention must be at most 1000 years".into());
        }
        let mut s = Settings::new(self.database.url());
        s.max_connections = self.max_connections;
        s.coalesce_in_flight = usize::from(self.coalesce_in_flight);
        s.submit_in_flight = usize::from(self.submit_in_flight);
        s.reaper_interval = self.reaper_interval;
        s.default_lease = self.lease_duration;
        s.max_lease = self.max_lease_duration;
        s.default_max_attempts = self.max_attempts;
        s.backoff_initial = self.backoff_initial;
        s.backoff_max = self.backoff_max;
        s.max_payload_bytes = self.max_payload_bytes;
        s.cancel_grace = self.cancel_grace;
        s.fallback_poll = self.fallback_poll;
        s.watch_fallback_poll = self.watch_fallback_poll;
        s.retention = self.retention;
        s.queue_bound = self.queue_bound;
        s.max_running_per_tenant = self.max_running_per_tenant;
        s.shutdown_grace = self.shutdown_grace;
        s.shutdown_delay = self.shutdown_delay;
        s.breaker = crate::domain::breaker::BreakerPolicy {
            threshold: self.breaker_threshold,
            cooldown: self.breaker_cooldown,
            transient_classes: self.breaker_classes.clone(),
        };
        s.queue_max_running_per_tenant =
            self.queue_max_running_per_tenant.iter().cloned().collect();
        s.auth_file = self.auth_file.clone();
        s.http_allowed_hosts = self.http_allowed_hosts.clone();
        s.http_read_timeouts = crate::config::HttpReadTimeouts {
            header: self.http_header_timeout,
            body: self.http_body_timeout,
        };
        s.reload_interval = self.reload_interval;
        s.tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        };
        s.rpc_timeout = self.rpc_timeout;
        s.concurrency_limit = self.concurrency_limit;
        s.rate_limit = (self.rate_limit > 0.0).then(|| RateLimit {
            per_second: self.rate_limit,
            // Twice the rate, at least one call: a client may catch up
            // after a pause without being refused.
            burst: self.rate_limit_burst.unwrap_or_else(|| {
                (self.rate_limit * 2.0)
                    .ceil()
                    .clamp(1.0, f64::from(u32::MAX)) as u32
            }),
        });
        s.http2_keepalive_interval = self.http2_keepalive_interval;
        s.http2_keepalive_timeout = self.http2_keepalive_timeout;
        if self.metrics_refresh.is_zero() {
            return Err("--metrics-refresh must be above zero".into());
        }
        s.slow_attempt = self.slow_attempt;
        s.metrics_refresh = self.metrics_refresh;
        if self.webhook_timeout.is_zero() || self.webhook_retry_window.is_zero() {
            return Err("--webhook-timeout and --webhook-retry-window must be above zero".into());
        }
        s.webhooks.timeout = self.webhook_timeout;
        s.webhooks.retry_window = self.webhook_retry_window;
        s.webhooks.backoff =
            crate::domain::Backoff::try_new(self.webhook_backoff_initial, self.webhook_backoff_max)
                .map_err(|e| format!("--webhook-backoff-{e}"))?;
        let slots = crate::engine::webhooks::IN_FLIGHT;
        if !(1..=slots).contains(&self.webhook_receiver_limit) {
            return Err(format!(
                "--webhook-receiver-limit must be between 1 and {slots}"
            ));
        }
        s.webhooks.per_receiver = self.webhook_receiver_limit;
        s.webhooks.max_body_bytes = self.webhook_max_body_bytes;
        s.webhooks.ca_file = self.webhook_ca_file.clone();
        if let Some(path) = &self.webhooks_file {
            s.webhooks.keys =
                crate::config::webhooks::WebhookKeys::from_file(path).map_err(|e| e.to_string())?;
            s.webhooks.file = Some(path.clone());
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[test]
    fn max_connections_leaves_each_pool_a_usable_connection() {
        let parse = |n: &str| Serve::try_parse_from(["serve", "--max-connections", n]);
        assert!(
            parse("2").is_err(),
            "one pool connection would be the listener's"
        );
        assert_eq!(parse("3").map(|s| s.args.max_connections).ok(), Some(3));
    }

    #[test]
    fn a_running_cap_of_zero_is_refused() {
        let parse = |args: &[&str]| Serve::try_parse_from([&["serve"], args].concat());
        assert!(parse(&["--max-running-per-tenant", "0"]).is_err());
        assert!(parse(&["--queue-max-running-per-tenant", "gpu=0"]).is_err());
        let serve = parse(&[
            "--max-running-per-tenant",
            "1",
            "--queue-max-running-per-tenant",
            "gpu=2",
        ])
        .expect("caps of 1 and 2");
        assert_eq!(serve.args.max_running_per_tenant, Some(1));
        assert_eq!(
            serve.args.queue_max_running_per_tenant,
            [("gpu".to_owned(), 2)]
        );
    }

    /// The settings of `serve` with `args`, or the refusal.
    fn settings_of(args: &[&str]) -> Result<Settings, String> {
        Serve::try_parse_from([&["serve"], args].concat())
            .map_err(|e| e.to_string())
            .and_then(|s| s.args.settings())
    }

    #[test]
    fn a_lease_shorter_than_lease_accepts_is_refused() {
        for (flag, value) in [
            ("--lease-duration", "500ms"),
            ("--lease-duration", "0s"),
            ("--max-lease-duration", "500ms"),
        ] {
            let refused = settings_of(&[flag, value]).expect_err(value);
            assert!(refused.starts_with(flag), "{flag} {value}: {refused}");
        }
        let settings = settings_of(&["--lease-duration", "1s", "--max-lease-duration", "1s"])
            .expect("the shortest lease");
        assert_eq!(settings.default_lease, Duration::from_secs(1));
    }

    #[test]
    fn keepalives_of_zero_are_refused() {
        for flag in ["--http2-keepalive-interval", "--http2-keepalive-timeout"] {
            let refused = settings_of(&[flag, "0s"]).expect_err(flag);
            assert!(refused.contains(flag), "{refused}");
        }
        assert!(settings_of(&["--http2-keepalive-timeout", "1s"]).is_ok());
    }

    #[test]
    fn an_empty_database_url_is_unset() {
        let empty = DatabaseArgs {
            database_url: Some(String::new()),
        };
        // DATABASE_URL's, or the default: never the empty one.
        assert!(!empty.url().is_empty());
    }

    #[test]
    fn a_bad_default_backoff_is_refused_before_serving() {
        let refused = settings_of(&["--backoff-initial", "0s"]).expect_err("a zero base");
        assert!(refused.contains("--backoff-initial"), "{refused}");
        let refused = settings_of(&["--backoff-initial", "10s", "--backoff-max", "5s"])
            .expect_err("a cap below the base");
        assert!(refused.contains("--backoff-max"), "{refused}");
        assert!(settings_of(&["--backoff-initial", "10s", "--backoff-max", "10s"]).is_ok());
    }

    #[test]
    fn retention_keeps_the_cut_off_a_valid_time() {
        let settings = |retention: &str| {
            Serve::try_parse_from(["serve", "--retention", retention])
                .map_err(|e| e.to_string())
                .and_then(|s| s.args.settings())
                .map(|s| s.retention)
        };
        assert!(settings("100years").is_ok());
        let refused = settings("10000years").expect_err("past 4713 BC");
        assert!(refused.contains("--retention"), "{refused}");
    }
}
