//! What a handler returns when an attempt fails, and why a worker stops.

use std::time::Duration;

/// A failed attempt, as a handler reports it.
///
/// The server requeues a retryable failure while attempts remain (after
/// `retry_after`, or the job's backoff when unset) and moves anything else to
/// the dead set. `class` is what operators filter and bulk-retry by, so keep
/// it short, stable and machine-readable (`rate_limited`, `bad_input`).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct JobError {
    /// Machine-readable kind of failure, 1..=128 characters of
    /// `[A-Za-z0-9_.:/-]` (others are sent as `_`, and a longer class is cut).
    pub class: String,
    /// Human-readable detail, up to 16,384 characters (cut beyond that).
    pub message: String,
    /// Whether another attempt may succeed.
    pub retryable: bool,
    /// Run the next attempt no sooner than this (overrides the backoff).
    pub retry_after: Option<Duration>,
}

impl JobError {
    /// A failure another attempt may fix (a timeout, a 429, a 503).
    pub fn retryable(class: impl Into<String>, message: impl Into<String>) -> Self {
        JobError {
            class: class.into(),
            message: message.into(),
            retryable: true,
            retry_after: None,
        }
    }

    /// A failure no retry can fix (bad input, a bug): the job goes straight
    /// to the dead set.
    pub fn fatal(class: impl Into<String>, message: impl Into<String>) -> Self {
        JobError {
            retryable: false,
            ..JobError::retryable(class, message)
        }
    }

    /// Asks for the next attempt after `delay` rather than the backoff, e.g.
    /// what a provider's `Retry-After` header said.
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }
}

/// Why [`Worker::run`](super::Worker::run) returned an error, or a builder
/// refused its settings.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A setting is missing or out of range.
    #[error("invalid worker setting: {0}")]
    Config(String),

    /// The server refused the worker itself (bad credentials, an invalid
    /// lease request): retrying cannot help, so the worker stops.
    // Boxed because a Status is a few hundred bytes.
    #[error("the server refused the worker: {0}")]
    Refused(Box<tonic::Status>),
}
