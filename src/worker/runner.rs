//! The lease loop: ask for as many jobs as there are free slots, hand each to
//! an attempt, back off while the server is away, and drain on shutdown.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use super::attempt;
use super::backoff::Backoff;
use super::builder::{Config, Handlers, MAX_LEASE_BATCH, WorkerBuilder};
use super::connection::Client;
use super::error::WorkerError;
use crate::pb;

/// Extra time past the long-poll wait before a `Lease` call counts as lost.
const LEASE_CALL_SLACK: Duration = Duration::from_secs(10);

/// Least time between the starts of two `Lease` calls that came back empty.
const MIN_IDLE_POLL: Duration = Duration::from_secs(1);

/// A configured worker; [`Worker::run`] runs it until shutdown.
pub struct Worker {
    shared: Arc<Shared>,
}

/// What the lease loop and every attempt share.
pub(crate) struct Shared {
    pub client: Client,
    pub config: Config,
    pub handlers: Handlers,
    /// Fired when the drain grace period is over: running handlers must stop.
    pub hard_stop: CancellationToken,
    /// Fired when the stop must not wait (a second signal): the hard stop
    /// comes at once, and an outcome gets one try, no retries.
    pub forced: CancellationToken,
    /// Fired when the worker stops leasing: attempts stop asking for their
    /// next job with their outcome.
    pub draining: CancellationToken,
    /// Whether the server has `CompleteAndLease` (until it answers
    /// `UNIMPLEMENTED`).
    pub chaining: AtomicBool,
}

impl Shared {
    /// Whether a finished attempt should ask for its slot's next job with
    /// its outcome.
    pub fn may_chain(&self) -> bool {
        !self.draining.is_cancelled() && self.chaining.load(Ordering::Relaxed)
    }

    /// The server does not know `CompleteAndLease`: outcomes go alone.
    pub fn stop_chaining(&self) {
        self.chaining.store(false, Ordering::Relaxed);
    }

    /// The claim sent with an attempt's outcome: one job for the slot it
    /// frees, without a long-poll (an idle slot goes back to the lease
    /// loop, which the shutdown signal can cut short).
    pub fn next_job_request(&self) -> pb::LeaseRequest {
        pb::LeaseRequest {
            wait: Some(Duration::ZERO.into()),
            ..lease_request(&self.config, 1)
        }
    }
}

impl Worker {
    /// Starts building a worker for the server at `addr` (`host:port` or a
    /// `http://` / `https://` URI).
    pub fn builder(addr: &str) -> WorkerBuilder {
        WorkerBuilder::new(addr)
    }

    pub(crate) fn new(client: Client, config: Config, handlers: Handlers) -> Self {
        Worker {
            shared: Arc::new(Shared {
                client,
                config,
                handlers,
                hard_stop: CancellationToken::new(),
                forced: CancellationToken::new(),
                draining: CancellationToken::new(),
                chaining: AtomicBool::new(true),
            }),
        }
    }

    #[cfg(test)]
    pub(crate) fn config(&self) -> &Config {
        &self.shared.config
    }

    /// The worker id sent with `Lease`.
    pub fn worker_id(&self) -> &str {
        &self.shared.config.worker_id
    }

    /// Leases and runs jobs until `shutdown` completes, then drains: no more
    /// leases, running jobs get the grace period to finish; after it their
    /// tokens fire ([`CancelReason::Shutdown`](super::CancelReason::Shutdown))
    /// and whatever has not succeeded is handed back as a retryable failure
    /// of class `worker_shutdown`, to run again at once elsewhere while it
    /// has attempts left.
    ///
    /// Not cancel-safe: dropping the future (in a `select!` that another
    /// branch wins, under a timeout) aborts the running handlers and
    /// reports nothing, so their jobs run again only when their leases end.
    ///
    /// Returns an error only when the server refuses the worker itself
    /// (`INVALID_ARGUMENT`, `UNAUTHENTICATED`, `PERMISSION_DENIED`,
    /// `UNIMPLEMENTED` on `Lease`), after draining the running jobs; an
    /// unreachable or unavailable server is retried with backoff forever.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), WorkerError> {
        self.run_until(shutdown, std::future::pending()).await
    }

    /// [`Worker::run`], with a second stop: when `force` completes during
    /// the drain (a second Ctrl-C, say), the running jobs are stopped at
    /// once instead of at the end of the grace period, and each outcome
    /// gets one try (an outcome not reported leaves its job to come back
    /// when its lease ends).
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
        force: impl Future<Output = ()>,
    ) -> Result<(), WorkerError> {
        let shared = self.shared;
        let slots = Arc::new(Semaphore::new(shared.config.concurrency));
        let mut attempts = JoinSet::new();
        let mut reconnect =
            Backoff::new(shared.config.reconnect_initial, shared.config.reconnect_max);
        tokio::pin!(shutdown);
        tracing::info!(
            worker_id = %shared.config.worker_id,
            queues = ?shared.config.queues,
            kinds = ?shared.config.kinds,
            concurrency = shared.config.concurrency,
            "worker started"
        );
        let outcome = loop {
            // Forget finished attempts so the set does not grow forever.
            while attempts.try_join_next().is_some() {}
            let first = tokio::select! {
                permit = slots.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break Ok(()),
                },
                () = &mut shutdown => break Ok(()),
            };
            let mut permits = vec![first];
            while permits.len() < MAX_LEASE_BATCH {
                match slots.clone().try_acquire_owned() {
                    Ok(permit) => permits.push(permit),
                    Err(_) => break,
                }
            }
            let asked = Instant::now();
            let response = tokio::select! {
                response = lease(&shared, permits.len()) => response,
                // Dropping the call resets its stream; the server drops its
                // waiting handler and gives back any job it had just been
                // handed.
                () = &mut shutdown => break Ok(()),
            };
            match response {
                Ok(jobs) if jobs.is_empty() => {
                    reconnect.reset();
                    // A short `poll_wait` (0 is allowed) must not turn an idle
                    // worker into a tight loop of calls.
                    drop(permits);
                    tokio::select! {
                        () = tokio::time::sleep_until(asked + MIN_IDLE_POLL) => {}
                        () = &mut shutdown => break Ok(()),
                    }
                }
                Ok(jobs) => {
                    reconnect.reset();
                    let received = Instant::now();
                    for (job, permit) in jobs.into_iter().zip(permits.drain(..)) {
                        let leased = attempt::Leased { job, received };
                        attempts.spawn(run_one(shared.clone(), leased, permit));
                    }
                }
                Err(status) if refuses_worker(status.code()) => {
                    tracing::error!(code = ?status.code(), message = status.message(), "the server refused the worker");
                    break Err(WorkerError::Refused(Box::new(status)));
                }
                Err(status) => {
                    let delay = reconnect.next_delay_after(&status);
                    tracing::warn!(
                        code = ?status.code(),
                        message = status.message(),
                        failures = reconnect.failures(),
                        retry_in = ?delay,
                        "lease failed; retrying"
                    );
                    drop(permits);
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = &mut shutdown => break Ok(()),
                    }
                }
            }
        };
        shared.draining.cancel();
        drain(&shared, &mut attempts, force).await;
        outcome
    }
}

/// What this worker leases, `max_jobs` at a time, long-polling.
fn lease_request(config: &Config, max_jobs: usize) -> pb::LeaseRequest {
    pb::LeaseRequest {
        worker_id: config.worker_id.clone(),
        queues: config.queues.clone(),
        kinds: config.kinds.clone(),
        max_jobs: Some(u32::try_from(max_jobs).unwrap_or(1)),
        lease_duration: Some(config.lease_duration.into()),
        wait: Some(config.poll_wait.into()),
        all_tenants: false,
    }
}

/// One `Lease` call for up to `max_jobs`, long-polling.
async fn lease(shared: &Shared, max_jobs: usize) -> Result<Vec<pb::LeasedJob>, tonic::Status> {
    let config = &shared.config;
    let mut request = tonic::Request::new(lease_request(config, max_jobs));
    request.set_timeout(config.poll_wait + LEASE_CALL_SLACK);
    let mut client = shared.client.clone();
    Ok(client.lease(request).await?.into_inner().jobs)
}

/// Statuses on `Lease` that no retry can fix: the worker is misconfigured.
fn refuses_worker(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::Unauthenticated
            | Code::PermissionDenied
            | Code::Unimplemented
    )
}

/// Runs a leased job, then each next job its outcome's report brought
/// back, in the same slot.
async fn run_one(shared: Arc<Shared>, leased: attempt::Leased, permit: OwnedSemaphorePermit) {
    let mut next = Some(leased);
    while let Some(leased) = next {
        next = attempt::run(&shared, leased).await;
    }
    // The slot frees only once the outcome is reported and no next job came
    // with it, so the worker never holds more leases than its concurrency.
    drop(permit);
}

/// Waits for running attempts; after the grace period, or at once when
/// `force` completes, tells them to stop.
async fn drain(shared: &Shared, attempts: &mut JoinSet<()>, force: impl Future<Output = ()>) {
    while attempts.try_join_next().is_some() {}
    if attempts.is_empty() {
        tracing::info!("worker stopped");
        return;
    }
    tracing::info!(running = attempts.len(), grace = ?shared.config.grace, "draining");
    tokio::pin!(force);
    let grace_over = tokio::time::sleep(shared.config.grace);
    tokio::pin!(grace_over);
    loop {
        tokio::select! {
            joined = attempts.join_next() => if joined.is_none() { break },
            () = &mut grace_over, if !shared.hard_stop.is_cancelled() => {
                tracing::warn!(running = attempts.len(), "grace period over; stopping running jobs");
                shared.hard_stop.cancel();
            }
            () = &mut force, if !shared.forced.is_cancelled() => {
                tracing::warn!(running = attempts.len(), "told again to stop; stopping running jobs now");
                shared.forced.cancel();
                shared.hard_stop.cancel();
            }
        }
    }
    tracing::info!("worker stopped");
}
