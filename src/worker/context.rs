//! What a handler gets besides the job: cancellation, progress and cost.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why a handler's cancellation token fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelReason {
    /// Someone cancelled the job; whatever the handler returns is discarded.
    CancelRequested,
    /// The lease is gone (expired and reclaimed, or the job ended), or no
    /// heartbeat reached the server for a whole lease (it was unreachable):
    /// another worker may already run the job, so stop and write nothing
    /// more. Whatever the handler returns is dropped, a success too.
    LeaseLost,
    /// The worker is stopping: the drain's grace period has passed, the
    /// forced stop of [`Worker::run_until`](super::Worker::run_until) came,
    /// or the server refused the worker itself (see [`Worker::run`](super::Worker::run)).
    Shutdown,
}

/// The handler's view of its attempt. Cheap to clone.
///
/// Handlers doing long work should select on [`JobContext::cancelled`] (or
/// hand [`JobContext::cancellation_token`] to their HTTP client) and return
/// soon after it fires; the worker completes the attempt accordingly.
#[derive(Clone, Debug)]
pub struct JobContext {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    job_id: String,
    attempt: u32,
    traceparent: String,
    token: CancellationToken,
    reason: OnceLock<CancelReason>,
    /// Latest progress not yet sent; only the newest matters.
    progress: Mutex<Option<(f64, String)>>,
    /// Wakes the heartbeat loop so progress is sent now, not a third of a
    /// lease later.
    progress_reported: Notify,
    cost_cents: AtomicI64,
    /// Until when the lease is surely held, by this worker's clock: from
    /// the last heartbeat the server extended it at. None before the
    /// first estimate.
    held_until: Mutex<Option<Instant>>,
}

impl JobContext {
    pub(crate) fn new(job_id: String, attempt: u32, traceparent: String) -> Self {
        JobContext {
            inner: Arc::new(Inner {
                job_id,
                attempt,
                traceparent,
                token: CancellationToken::new(),
                reason: OnceLock::new(),
                progress: Mutex::new(None),
                progress_reported: Notify::new(),
                cost_cents: AtomicI64::new(0),
                held_until: Mutex::new(None),
            }),
        }
    }

    /// The job's id.
    pub fn job_id(&self) -> &str {
        &self.inner.job_id
    }

    /// The attempt number, from 1.
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }

    /// The W3C `traceparent` of the attempt, to continue the producer's
    /// trace; `None` while the server sends none.
    pub fn traceparent(&self) -> Option<&str> {
        Some(self.inner.traceparent.as_str()).filter(|t| !t.is_empty())
    }

    /// A token fired when the handler must stop: see [`CancelReason`].
    pub fn cancellation_token(&self) -> CancellationToken {
        self.inner.token.clone()
    }

    /// Completes once the handler must stop.
    pub async fn cancelled(&self) {
        self.inner.token.cancelled().await;
    }

    /// Whether the handler must stop.
    pub fn is_cancelled(&self) -> bool {
        self.inner.token.is_cancelled()
    }

    /// Why the token fired, once it has.
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        self.inner.reason.get().copied()
    }

    /// Reports progress (clamped to 0..=1) with a short message; it is sent
    /// with a heartbeat soon and shows on the job and in its events. Reports
    /// closer than 200 ms share one heartbeat (the latest wins), and after a
    /// failed heartbeat none is sent before its retry is due.
    pub fn report_progress(&self, fraction: f64, message: impl Into<String>) {
        let fraction = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        // A message the server refuses would get every heartbeat refused
        // with it, and the lease lost.
        let message = sendable_text(&message.into(), MAX_PROGRESS_MESSAGE);
        *self
            .inner
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((fraction, message));
        self.inner.progress_reported.notify_one();
    }

    /// Adds to the attempt's cost, reported with its outcome (the server
    /// sums it over attempts). A negative amount takes back part of what
    /// was added; the sum saturates rather than wraps, and is reported as
    /// 0 while it is below 0 (the server refuses a negative cost, and the
    /// outcome with it).
    pub fn add_cost(&self, cents: i64) {
        // The closure always returns Some, so this never fails.
        let _ = self
            .inner
            .cost_cents
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sum| {
                Some(sum.saturating_add(cents))
            });
    }

    /// The cost reported so far in this attempt: never below 0.
    pub fn cost_cents(&self) -> i64 {
        self.inner.cost_cents.load(Ordering::Relaxed).max(0)
    }

    /// Fires the token; the first reason given is the one kept.
    pub(crate) fn cancel(&self, reason: CancelReason) {
        let _ = self.inner.reason.set(reason);
        self.inner.token.cancel();
    }

    pub(crate) fn take_progress(&self) -> Option<(f64, String)> {
        self.inner
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Puts back the progress a failed heartbeat carried, unless the
    /// handler reported newer progress since; the retry carries it.
    pub(crate) fn restore_progress(&self, progress: (f64, String)) {
        self.inner
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(progress);
    }

    pub(crate) async fn progress_reported(&self) {
        self.inner.progress_reported.notified().await;
    }

    /// Notes until when the lease is surely held (the heartbeats' view).
    pub(crate) fn set_held_until(&self, at: Instant) {
        *self
            .inner
            .held_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(at);
    }

    /// Until when the lease is surely held, once the heartbeats know.
    pub(crate) fn held_until(&self) -> Option<Instant> {
        *self
            .inner
            .held_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// The longest progress message the server takes, in characters.
const MAX_PROGRESS_MESSAGE: usize = 1024;

/// `text` as the server takes free text: without NUL (which PostgreSQL
/// cannot store, so the server refuses it) and cut at `max` characters.
pub(super) fn sendable_text(text: &str, max: usize) -> String {
    text.chars().filter(|c| *c != '\0').take(max).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_cancel_reason_wins() {
        let ctx = JobContext::new("j".into(), 1, String::new());
        assert!(!ctx.is_cancelled());
        assert_eq!(ctx.cancel_reason(), None);
        ctx.cancel(CancelReason::CancelRequested);
        ctx.cancel(CancelReason::Shutdown);
        assert!(ctx.cancellation_token().is_cancelled());
        assert_eq!(ctx.cancel_reason(), Some(CancelReason::CancelRequested));
    }

    #[test]
    fn progress_is_clamped_and_only_the_latest_is_sent() {
        let ctx = JobContext::new("j".into(), 1, String::new());
        ctx.report_progress(0.2, "a");
        ctx.report_progress(7.0, "b");
        assert_eq!(ctx.take_progress(), Some((1.0, "b".into())));
        assert_eq!(ctx.take_progress(), None);
        ctx.report_progress(f64::NAN, "x".repeat(2000));
        let (p, m) = ctx.take_progress().unwrap_or_default();
        assert_eq!((p, m.len()), (0.0, 1024));
        ctx.report_progress(0.1, "a\0b");
        assert_eq!(ctx.take_progress(), Some((0.1, "ab".into())));
    }

    #[test]
    fn cost_adds_up_and_empty_traceparent_is_none() {
        let ctx = JobContext::new("j".into(), 2, String::new());
        ctx.add_cost(3);
        ctx.add_cost(4);
        assert_eq!(ctx.cost_cents(), 7);
        ctx.add_cost(-10);
        assert_eq!(ctx.cost_cents(), 0, "a negative sum is reported as 0");
        ctx.add_cost(5);
        assert_eq!(ctx.cost_cents(), 2);
        ctx.add_cost(i64::MAX);
        ctx.add_cost(i64::MAX);
        assert_eq!(ctx.cost_cents(), i64::MAX, "the sum saturates");
        assert_eq!(ctx.traceparent(), None);
        let ctx = JobContext::new("j".into(), 2, "00-ab-cd-01".into());
        assert_eq!(ctx.traceparent(), Some("00-ab-cd-01"));
    }
}
