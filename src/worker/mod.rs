//! The Rust worker library: lease jobs from intray and run a handler per kind,
//! with the whole lease protocol done for you.
//!
//! ```no_run
//! use intray::worker::{Job, JobContext, JobError, Worker};
//! use serde_json::{Value, json};
//!
//! async fn summarize(job: Job, ctx: JobContext) -> Result<Value, JobError> {
//!     ctx.report_progress(0.1, "calling the model");
//!     let doc = job.payload["doc"].as_str().ok_or_else(|| JobError::fatal("bad_input", "no doc"))?;
//!     tokio::select! {
//!         () = ctx.cancelled() => Err(JobError::retryable("cancelled", "stopped")),
//!         summary = async { doc.chars().take(40).collect::<String>() } => {
//!             ctx.add_cost(2);
//!             Ok(json!({ "summary": summary }))
//!         }
//!     }
//! }
//!
//! # async fn main_() -> Result<(), intray::worker::WorkerError> {
//! let worker = Worker::builder("http://127.0.0.1:50051")
//!     .tenant("acme")
//!     .queue("default")
//!     .handler("summarize", summarize)
//!     .concurrency(8)
//!     .build()?;
//! worker.run(async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```
//!
//! What the worker does (the protocol is described in `docs/workers.md`):
//!
//! - **Leasing.** One long-polling `Lease` at a time, for as many jobs as it
//!   has free slots (`concurrency` minus running jobs, at most 100); a slot
//!   frees only once its outcome is reported.
//! - **Heartbeats** every third of the lease while a handler runs, and at
//!   once when it reports progress. `cancel_requested` in the answer, or
//!   `ABORTED` (lease lost), fires the handler's token; so does a lease no
//!   heartbeat could extend for a whole lease duration.
//! - **Outcome.** `Ok(value)` completes with the value as result, a
//!   [`JobError`] as a failure (class, message, retryable, retry_after), with
//!   the cost from [`JobContext::add_cost`]. A cancelled job is reported as a
//!   failure (the server records it as `CANCELLED`); a lost lease reports
//!   nothing. A panicking handler is a retryable `handler_panicked` failure.
//!   A result's integers beyond 2^53 go as the nearest double (a payload's
//!   numbers are doubles). A report the server cannot be reached for is
//!   retried for up to a lease from its first try, then given up (the job
//!   comes back when its lease ends).
//! - **Drain.** When the future given to [`Worker::run`] completes, no more
//!   leases are taken; running jobs get the grace period to finish, then
//!   their tokens fire and, `cancel_timeout` later, unfinished handlers are
//!   dropped. Jobs that did not succeed are handed back as retryable failures
//!   of class `worker_shutdown` with no retry delay, so another worker picks
//!   them up at once instead of waiting for the lease to expire (this uses
//!   up an attempt, as a lease expiry would, and on the last one the job
//!   fails for good). A next job that a report sent before the drain began
//!   brings back still runs, under the same grace. While the server is
//!   unreachable the drain also waits for the reports' retries, up to a
//!   lease; [`Worker::run_until`]'s force gives each one try instead.
//! - **Dropping** the future of [`Worker::run`] stops everything at once:
//!   handlers are aborted and nothing is reported, so their jobs come back
//!   only when their leases end. Let it finish to drain.
//! - **Reconnects.** The channel connects lazily and re-dials on its own;
//!   `Lease` failures other than a refusal of the worker itself back off
//!   exponentially (100 ms doubling to 30 s, with jitter). `Heartbeat` and
//!   `Complete` retry on `UNAVAILABLE` too. Every retry waits at least the
//!   delay of a `google.rpc.RetryInfo` the server sent (at most a minute),
//!   except a last try made before the lease ends, and progress reports do
//!   not hurry a failed heartbeat's retry.
//! - **Trace context.** [`JobContext::traceparent`] carries the
//!   `LeasedJob.traceparent` (empty until the server sends one).
//!
//! TLS: an `https://` address verifies the server against the system's
//! roots. For a private CA or a client certificate, pass an
//! [`Endpoint`](tonic::transport::Endpoint) configured with `tls_config` to
//! [`WorkerBuilder::endpoint`]; the builder has no TLS options of its own.

mod attempt;
mod backoff;
mod builder;
pub(crate) mod connection;
mod context;
mod error;
mod heartbeat;
mod job;
mod runner;

pub use builder::WorkerBuilder;
pub use connection::TENANT_METADATA;
pub(crate) use connection::with_keep_alive;
pub use context::{CancelReason, JobContext};
pub use error::{JobError, WorkerError};
pub use job::Job;
pub use runner::Worker;
