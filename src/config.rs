//! Typed server settings with the defaults of SPEC section 3.

pub mod webhook_source;
pub mod webhooks;

use std::path::PathBuf;
use std::time::Duration;

/// How long the HTTP port waits for a request, in two parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpReadTimeouts {
    /// For its headers, from the connection (or the request before it).
    pub header: Duration,
    /// For its body, from its headers.
    pub body: Duration,
}

impl Default for HttpReadTimeouts {
    fn default() -> Self {
        HttpReadTimeouts {
            header: Duration::from_secs(20),
            body: Duration::from_secs(30),
        }
    }
}

/// Everything `intray serve` can be told, in the shape the server uses.
///
/// `Settings::new` gives the documented defaults; the CLI overrides them from
/// flags and `INTRAY_*` variables, tests from code.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `sqlite://path` (created if missing) or `postgres://...`.
    pub database_url: String,
    /// PostgreSQL connections per replica, split between the hot path's
    /// pool and the other one (see `PgStore::open`); at least 3, or the
    /// pools are given 1 and 2 anyway.
    pub max_connections: u32,
    /// Shared transactions the coalescer of lease and complete calls may
    /// run at once.
    pub coalesce_in_flight: usize,
    /// Shared transactions the submit coalescer may run at once.
    pub submit_in_flight: usize,
    /// How often the reaper looks for expired leases, cancel grace and deadlines.
    pub reaper_interval: Duration,
    /// Lease length when a worker does not ask for one.
    pub default_lease: Duration,
    /// Longest lease a worker may ask for.
    pub max_lease: Duration,
    /// Attempts when a submitter does not say.
    pub default_max_attempts: u32,
    /// Backoff base when a submitter does not say.
    pub backoff_initial: Duration,
    /// Backoff cap when a submitter does not say.
    pub backoff_max: Duration,
    /// Largest payload or result, serialised as JSON.
    pub max_payload_bytes: usize,
    /// How long a running job may ignore a cancel before it is cancelled anyway.
    pub cancel_grace: Duration,
    /// How often a waiting `Lease` re-reads the database even without a
    /// notification, so a lost one costs latency and never a job (and a
    /// retry that comes due is found).
    pub fallback_poll: Duration,
    /// The same for an open `WatchJob` stream. Longer: every open stream
    /// re-reads on it, and a stream's events are always notified (a lost
    /// `LISTEN` connection wakes every stream), so it is only a safety net.
    pub watch_fallback_poll: Duration,
    /// Finished jobs older than this are deleted with their events.
    pub retention: Duration,
    /// Most queued jobs per tenant and queue; `Submit` beyond it is refused.
    pub queue_bound: u64,
    /// Most running jobs of one tenant in one queue (`None`: no cap).
    pub max_running_per_tenant: Option<u32>,
    /// Per-queue overrides of `max_running_per_tenant`.
    pub queue_max_running_per_tenant: std::collections::BTreeMap<String, u32>,
    /// How long in-flight calls may run on after shutdown starts.
    pub shutdown_grace: Duration,
    /// How long the server goes on serving after the shutdown signal, its
    /// health already `NOT_SERVING`, before it stops taking calls: the time
    /// a load balancer (a Kubernetes Service) needs to stop sending it any.
    pub shutdown_delay: Duration,
    /// When circuit breakers open (threshold 0: never).
    pub breaker: crate::domain::breaker::BreakerPolicy,
    /// Token file (see `auth::file`); `None` is open development mode.
    pub auth_file: Option<PathBuf>,
    /// Host names the HTTP port answers to besides IP addresses and
    /// `localhost` (see `http::AllowedHosts`); `None`: every name with a
    /// token file, none without.
    pub http_allowed_hosts: Option<Vec<String>>,
    /// How long an HTTP client has to send a request's headers, and then
    /// its body: a client that stalls is cut off then.
    pub http_read_timeouts: HttpReadTimeouts,
    /// How often the token file and TLS files are checked for changes.
    pub reload_interval: Duration,
    /// TLS on the gRPC and HTTP ports; `None` is plaintext.
    pub tls: Option<TlsFiles>,
    /// Longest a call may take; a `Lease` gets its longest wait on top.
    pub rpc_timeout: Duration,
    /// Most calls served at once; further calls wait for a slot (within
    /// their timeout). A waiting `Lease` holds a slot, a `WatchJob` stream
    /// does not.
    pub concurrency_limit: usize,
    /// Per-caller rate limit; `None` is unlimited.
    pub rate_limit: Option<RateLimit>,
    /// HTTP/2 PING interval on idle connections: keeps load balancers from
    /// closing connections that only carry a long-poll or a quiet stream.
    pub http2_keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is closed.
    pub http2_keepalive_timeout: Duration,
    /// The OTLP trace pipeline (a handle, not a flag: built from the
    /// `OTEL_*` variables by the binary, by tests from code). Off by default.
    pub tracing: crate::telemetry::Tracing,
    /// An attempt running longer than this logs a warning.
    pub slow_attempt: Duration,
    /// How often the database gauges of `/metrics` are refreshed.
    pub metrics_refresh: Duration,
    /// Completion callbacks and the webhook ingress.
    pub webhooks: webhooks::WebhookSettings,
}

/// Certificate files of the gRPC port. Reloaded when they change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificates; when set, clients must present a certificate
    /// signed by one of them (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// How fast each caller (token, or tenant without authentication) may call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Sustained calls per second.
    pub per_second: f64,
    /// Calls that may be made at once after a quiet spell.
    pub burst: u32,
}

impl Settings {
    /// The defaults of SPEC section 3 for the given database.
    pub fn new(database_url: impl Into<String>) -> Self {
        Settings {
            database_url: database_url.into(),
            max_connections: 16,
            coalesce_in_flight: 2,
            submit_in_flight: 1,
            reaper_interval: Duration::from_secs(5),
            default_lease: Duration::from_secs(60),
            max_lease: Duration::from_secs(3600),
            default_max_attempts: 3,
            backoff_initial: Duration::from_secs(5),
            backoff_max: Duration::from_secs(300),
            max_payload_bytes: 1024 * 1024,
            cancel_grace: Duration::from_secs(30),
            fallback_poll: Duration::from_secs(1),
            watch_fallback_poll: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            queue_bound: 1_000_000,
            max_running_per_tenant: None,
            queue_max_running_per_tenant: std::collections::BTreeMap::new(),
            shutdown_grace: Duration::from_secs(20),
            shutdown_delay: Duration::ZERO,
            breaker: crate::domain::breaker::BreakerPolicy {
                threshold: 5,
                cooldown: Duration::from_secs(30),
                transient_classes: ["rate_limited", "provider_unavailable", "timeout"]
                    .map(String::from)
                    .to_vec(),
            },
            auth_file: None,
            http_allowed_hosts: None,
            http_read_timeouts: HttpReadTimeouts::default(),
            reload_interval: Duration::from_secs(5),
            tls: None,
            rpc_timeout: Duration::from_secs(30),
            concurrency_limit: 1024,
            rate_limit: None,
            http2_keepalive_interval: Duration::from_secs(30),
            http2_keepalive_timeout: Duration::from_secs(10),
            tracing: crate::telemetry::Tracing::off(),
            slow_attempt: Duration::from_secs(8),
            metrics_refresh: Duration::from_secs(15),
            webhooks: webhooks::WebhookSettings::default(),
        }
    }
}
