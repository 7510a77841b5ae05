//! Configuring a worker: where the server is, what to lease, how to run it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tonic::transport::Endpoint;

use super::connection::{self, CallMetadata};
use super::context::JobContext;
use super::error::{JobError, WorkerError};
use super::job::Job;
use super::runner::Worker;
use crate::domain::validate;

/// A handler, type-erased so handlers of different kinds share a map.
pub(crate) type BoxHandler = Arc<
    dyn Fn(Job, JobContext) -> BoxFuture<'static, Result<serde_json::Value, JobError>>
        + Send
        + Sync,
>;

/// Most jobs the server hands out per `Lease`.
pub(crate) const MAX_LEASE_BATCH: usize = 100;

/// Everything the running worker needs to know, checked by
/// [`WorkerBuilder::build`].
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub worker_id: String,
    pub queues: Vec<String>,
    /// Sent with `Lease`; empty leases any kind.
    pub kinds: Vec<String>,
    pub concurrency: usize,
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    pub poll_wait: Duration,
    pub grace: Duration,
    pub cancel_timeout: Duration,
    pub reconnect_initial: Duration,
    pub reconnect_max: Duration,
}

/// Handlers by kind, and the one for any other kind.
#[derive(Clone, Default)]
pub(crate) struct Handlers {
    by_kind: HashMap<String, BoxHandler>,
    fallback: Option<BoxHandler>,
}

impl Handlers {
    pub(crate) fn get(&self, kind: &str) -> Option<&BoxHandler> {
        self.by_kind.get(kind).or(self.fallback.as_ref())
    }
}

/// Builds a [`Worker`]; start with [`Worker::builder`].
///
/// Defaults: concurrency 1, lease 60 s, heartbeat every third of the lease,
/// long-poll 30 s, drain grace 30 s, 5 s for a cancelled handler to return,
/// reconnect backoff 100 ms doubling to 30 s, worker id `hostname-pid`.
pub struct WorkerBuilder {
    endpoint: Result<Endpoint, WorkerError>,
    token: Option<String>,
    tenant: Option<String>,
    worker_id: Option<String>,
    queues: Vec<String>,
    kinds: Vec<String>,
    handlers: Handlers,
    concurrency: usize,
    lease_duration: Duration,
    heartbeat_interval: Option<Duration>,
    poll_wait: Duration,
    grace: Duration,
    cancel_timeout: Duration,
    reconnect: (Duration, Duration),
}

impl WorkerBuilder {
    pub(crate) fn new(addr: &str) -> Self {
        WorkerBuilder {
            endpoint: connection::endpoint(addr),
            token: None,
            tenant: None,
            worker_id: None,
            queues: Vec::new(),
            kinds: Vec::new(),
            handlers: Handlers::default(),
            concurrency: 1,
            lease_duration: Duration::from_secs(60),
            heartbeat_interval: None,
            poll_wait: Duration::from_secs(30),
            grace: Duration::from_secs(30),
            cancel_timeout: Duration::from_secs(5),
            reconnect: (Duration::from_millis(100), Duration::from_secs(30)),
        }
    }

    /// Uses a ready-made endpoint instead of the address, e.g. one with
    /// `tls_config` set for a private CA or a client certificate (an
    /// `https://` address alone verifies the server against the system's
    /// roots). The worker sets its own HTTP/2 keep-alive (a PING every 20 s,
    /// 10 s to answer, idle or not), a 5 s connect timeout and `TCP_NODELAY`
    /// on it, over any set here.
    pub fn endpoint(mut self, endpoint: Endpoint) -> Self {
        self.endpoint = Ok(endpoint);
        self
    }

    /// Sends `authorization: Bearer TOKEN` with every call.
    pub fn auth_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Acts as this tenant (`x-intray-tenant`); the server's default otherwise.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// How the worker shows in `Stats` and in job events.
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// Leases from this queue too (at least one is required).
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queues.push(queue.into());
        self
    }

    /// With a [`Self::default_handler`], leases only these kinds and the
    /// kinds that have a handler of their own (without this, any kind).
    /// Without a default handler this has no effect: the kinds with a
    /// handler are leased.
    pub fn kinds<I: IntoIterator<Item = S>, S: Into<String>>(mut self, kinds: I) -> Self {
        self.kinds.extend(kinds.into_iter().map(Into::into));
        self
    }

    /// Runs `handler` for jobs of `kind`.
    pub fn handler<F, Fut>(mut self, kind: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Job, JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<serde_json::Value, JobError>> + Send + 'static,
    {
        self.handlers.by_kind.insert(
            kind.into(),
            Arc::new(move |job, ctx| Box::pin(handler(job, ctx))),
        );
        self
    }

    /// Runs `handler` for every kind without a handler of its own, and makes
    /// the worker lease any kind (or those named with [`Self::kinds`]).
    pub fn default_handler<F, Fut>(mut self, handler: F) -> Self
    where
        F: Fn(Job, JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<serde_json::Value, JobError>> + Send + 'static,
    {
        self.handlers.fallback = Some(Arc::new(move |job, ctx| Box::pin(handler(job, ctx))));
        self
    }

    /// Jobs run at once, 1..=1000; each `Lease` asks for the free slots.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Lease length asked for, at least 1 s and at most the server's
    /// `--max-lease-duration` (1 h by default; a longer one is refused at
    /// the first `Lease`); heartbeats extend it by as much.
    pub fn lease_duration(mut self, d: Duration) -> Self {
        self.lease_duration = d;
        self
    }

    /// Heartbeat period (default a third of the lease, which survives two
    /// lost heartbeats). Set it past the lease only to test lease loss.
    pub fn heartbeat_interval(mut self, d: Duration) -> Self {
        self.heartbeat_interval = Some(d);
        self
    }

    /// How long one `Lease` call waits for work, 0..=60 s. While idle the
    /// worker calls at most once a second, whatever the wait.
    pub fn poll_wait(mut self, d: Duration) -> Self {
        self.poll_wait = d;
        self
    }

    /// On shutdown, how long running jobs may take to finish before their
    /// tokens fire.
    pub fn grace(mut self, d: Duration) -> Self {
        self.grace = d;
        self
    }

    /// After a job's token fires, how long its handler may take to return
    /// before it is aborted (dropped) and its job reported. Dropping stops a
    /// future at its next await: code that blocks a thread, or a
    /// `spawn_blocking` it started, runs on after its job was reported.
    /// For a cancelled job the wait also ends a second (or a tenth of the
    /// lease) before the lease ends, as far as the heartbeats know it, so
    /// that the report lands: the server cuts a cancelled job's lease to
    /// its `--cancel-grace`.
    pub fn cancel_timeout(mut self, d: Duration) -> Self {
        self.cancel_timeout = d;
        self
    }

    /// First and longest delay between reconnect attempts.
    pub fn reconnect_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.reconnect = (initial, max);
        self
    }

    /// Checks the settings and builds the worker; nothing connects yet.
    pub fn build(self) -> Result<Worker, WorkerError> {
        let bad = |m: &str| Err(WorkerError::Config(m.to_owned()));
        let endpoint = self.endpoint?;
        if self.queues.is_empty() {
            return bad("at least one queue is required");
        }
        if self.handlers.by_kind.is_empty() && self.handlers.fallback.is_none() {
            return bad("at least one handler is required");
        }
        if !(1..=1000).contains(&self.concurrency) {
            return bad("concurrency must be 1..=1000");
        }
        // No upper bound here: the server's --max-lease-duration (1 h by
        // default) decides, and refuses a longer one at the first Lease.
        if self.lease_duration < Duration::from_secs(1) {
            return bad("lease duration must be at least 1s");
        }
        if self.poll_wait > Duration::from_secs(60) {
            return bad("poll wait must be at most 60s");
        }
        let heartbeat_interval = self.heartbeat_interval.unwrap_or(self.lease_duration / 3);
        if heartbeat_interval.is_zero() {
            return bad("heartbeat interval must be positive");
        }
        if self.reconnect.0.is_zero() {
            return bad("reconnect backoff must be positive");
        }
        let kinds = if self.handlers.fallback.is_some() {
            let mut kinds = self.kinds;
            if !kinds.is_empty() {
                kinds.extend(self.handlers.by_kind.keys().cloned());
            }
            kinds
        } else {
            self.handlers.by_kind.keys().cloned().collect()
        };
        let mut kinds = kinds;
        kinds.sort();
        kinds.dedup();
        let worker_id = self.worker_id.unwrap_or_else(default_worker_id);
        // Refused here rather than by the server's first `Lease`, which
        // would end `run` only once it is running.
        validate::worker_id(&worker_id).map_err(|e| WorkerError::Config(e.to_string()))?;
        let metadata = CallMetadata::new(self.tenant.as_deref(), self.token.as_deref())?;
        let config = Config {
            worker_id,
            queues: self.queues,
            kinds,
            concurrency: self.concurrency,
            lease_duration: self.lease_duration,
            heartbeat_interval,
            poll_wait: self.poll_wait,
            grace: self.grace,
            cancel_timeout: self.cancel_timeout,
            reconnect_initial: self.reconnect.0,
            reconnect_max: self.reconnect.1,
        };
        Ok(Worker::new(
            connection::client(endpoint, metadata),
            config,
            self.handlers,
        ))
    }
}

/// `hostname-pid`: unique per process on a host, readable in `Stats`.
fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok());
    worker_id_of(host.as_deref(), std::process::id())
}

/// `host-pid`, within the server's 1..=128 characters: the host is cut,
/// the pid, which makes the id unique on its host, is kept whole.
fn worker_id_of(host: Option<&str>, pid: u32) -> String {
    let host = host
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .unwrap_or("worker");
    let pid = format!("-{pid}");
    let host: String = host.chars().take(128 - pid.len()).collect();
    host + &pid
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ok(_: Job, _: JobContext) -> Result<serde_json::Value, JobError> {
        Ok(serde_json::Value::Null)
    }

    fn config(b: WorkerBuilder) -> Result<Config, WorkerError> {
        b.build().map(|w| w.config().clone())
    }

    #[test]
    fn the_default_worker_id_keeps_its_pid_within_128_characters() {
        assert_eq!(worker_id_of(Some(" box\n"), 42), "box-42");
        assert_eq!(worker_id_of(None, 7), "worker-7");
        assert_eq!(worker_id_of(Some(""), 7), "worker-7");
        // Cut by characters, not bytes (a cut inside one panicked).
        let long = worker_id_of(Some(&"\u{e9}".repeat(200)), 4_194_304);
        assert_eq!(long.chars().count(), 128);
        assert!(long.ends_with("-4194304"), "{long}");
    }

    #[tokio::test]
    async fn a_worker_id_the_server_would_refuse_is_refused_at_build() {
        let base = || Worker::builder("localhost:1").queue("q").handler("k", ok);
        assert!(matches!(
            base().worker_id("").build(),
            Err(WorkerError::Config(m)) if m.contains("worker_id")
        ));
        assert!(base().worker_id("x".repeat(129)).build().is_err());
        assert!(base().worker_id("\u{e9}".repeat(128)).build().is_ok());
        assert!(base().build().is_ok(), "the default id is valid");
    }

    #[tokio::test]
    async fn kinds_follow_handlers_unless_a_default_handler_leases_any() {
        let base = || Worker::builder("localhost:1").queue("q");
        let c = config(base().handler("b", ok).handler("a", ok));
        assert_eq!(c.map(|c| c.kinds).ok(), Some(vec!["a".into(), "b".into()]));
        let c = config(base().handler("a", ok).default_handler(ok));
        assert_eq!(c.map(|c| c.kinds).ok(), Some(vec![]));
        let c = config(base().handler("a", ok).default_handler(ok).kinds(["x"]));
        assert_eq!(c.map(|c| c.kinds).ok(), Some(vec!["a".into(), "x".into()]));
    }

    #[tokio::test]
    async fn heartbeat_defaults_to_a_third_of_the_lease() {
        let c = config(
            Worker::builder("localhost:1")
                .queue("q")
                .handler("a", ok)
                .lease_duration(Duration::from_secs(30)),
        );
        assert_eq!(
            c.map(|c| c.heartbeat_interval).ok(),
            Some(Duration::from_secs(10))
        );
    }

    #[tokio::test]
    async fn bad_settings_are_refused() {
        let base = || Worker::builder("localhost:1").queue("q").handler("a", ok);
        assert!(
            Worker::builder("localhost:1")
                .handler("a", ok)
                .build()
                .is_err()
        );
        assert!(Worker::builder("localhost:1").queue("q").build().is_err());
        assert!(base().concurrency(0).build().is_err());
        assert!(
            base()
                .lease_duration(Duration::from_millis(10))
                .build()
                .is_err()
        );
        assert!(base().poll_wait(Duration::from_secs(61)).build().is_err());
        assert!(base().tenant("ä").build().is_err());
        assert!(
            Worker::builder("bad uri")
                .queue("q")
                .handler("a", ok)
                .build()
                .is_err()
        );
        assert!(base().build().is_ok());
    }
}
