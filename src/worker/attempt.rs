//! One attempt: run the handler, keep its lease alive, stop it when told,
//! and report the outcome.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

use super::backoff::Backoff;
use super::context::{CancelReason, JobContext, sendable_text};
use super::error::JobError;
use super::heartbeat;
use super::job::Job;
use super::runner::Shared;
use crate::domain::json::numbers_as_doubles;
use crate::pb;
use crate::pb::complete_request::{Failure, Outcome, Success};

/// A single `Complete` call may take this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The shortest timeout a retry of an outcome gets near its limit: shorter
/// than a call to a busy server takes, it could only fail.
const LAST_CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// What became of the handler.
enum Ended {
    Returned(Result<serde_json::Value, JobError>),
    Panicked(String),
    /// It did not return within `cancel_timeout` of its token firing.
    Abandoned,
}

/// A leased job and when the answer that leased it arrived. Its lease
/// started a round trip's half earlier; a next job that came back with an
/// outcome may wait a while after that before it starts, and its lease is
/// counted from its arrival, not from its start.
pub(crate) struct Leased {
    pub job: pb::LeasedJob,
    pub received: Instant,
}

/// Runs one leased job to its reported outcome; the slot's next job when
/// the report brought one back.
pub(crate) async fn run(shared: &Shared, leased: Leased) -> Option<Leased> {
    let Leased {
        job: leased,
        received,
    } = leased;
    let ctx = JobContext::new(
        leased.job_id.clone(),
        leased.attempt,
        leased.traceparent.clone(),
    );
    let ended = match (Job::from_leased(&leased), shared.handlers.get(&leased.kind)) {
        (Err(error), _) => Ended::Returned(Err(error)),
        (Ok(_), None) => Ended::Returned(Err(JobError::retryable(
            "no_handler",
            format!("this worker has no handler for kind {:?}", leased.kind),
        ))),
        (Ok(job), Some(handler)) => {
            // Called inside the task, so that a panic before the handler's
            // first await (in a closure's synchronous part) is caught as a
            // panic of the task, like one after it.
            let handler = Arc::clone(handler);
            let handler_ctx = ctx.clone();
            let task = tokio::spawn(async move { handler(job, handler_ctx).await });
            // Dropping a task's handle leaves the task running: if this
            // attempt is dropped (`Worker::run` dropped), the handler must
            // stop with it, not run on unsupervised and unreported while
            // its lease runs out and another worker takes the job.
            let _abort = AbortOnDrop(task.abort_handle());
            supervise(shared, &leased, received, &ctx, task).await
        }
    };
    let outcome = match (ctx.cancel_reason(), ended) {
        (Some(CancelReason::LeaseLost), _) => {
            // Another worker may hold the job now; anything sent would be
            // refused with ABORTED anyway.
            tracing::warn!(job_id = %leased.job_id, "lease lost; the outcome is dropped");
            return None;
        }
        (Some(CancelReason::CancelRequested), _) => failure(&JobError::fatal(
            "cancelled",
            "the job was cancelled while running",
        )),
        // A handler that still succeeded after the shutdown signal did the
        // work: report it rather than run the job again.
        (Some(CancelReason::Shutdown), Ended::Returned(Ok(result))) => success(result),
        (Some(CancelReason::Shutdown), _) => failure(
            &JobError::retryable(
                "worker_shutdown",
                "the worker shut down before the job finished",
            )
            .with_retry_after(Duration::ZERO),
        ),
        (None, Ended::Returned(Ok(result))) => success(result),
        (None, Ended::Returned(Err(error))) => failure(&error),
        (None, Ended::Panicked(message)) => {
            failure(&JobError::retryable("handler_panicked", message))
        }
        // Abandoned only happens after the token fired, so with a reason.
        (None, Ended::Abandoned) => failure(&JobError::retryable("handler_abandoned", "")),
    };
    complete(shared, &leased, outcome, ctx.cost_cents()).await
}

/// Aborts a handler's task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Waits for the handler while heartbeating; fires its token on shutdown
/// after the grace period, and gives up on it `cancel_timeout` after the
/// token fired.
async fn supervise(
    shared: &Shared,
    leased: &pb::LeasedJob,
    received: Instant,
    ctx: &JobContext,
    mut task: tokio::task::JoinHandle<Result<serde_json::Value, JobError>>,
) -> Ended {
    let keep_alive = heartbeat::keep_alive(shared, leased, received, ctx);
    tokio::pin!(keep_alive);
    let mut heartbeating = true;
    let mut give_up_at: Option<Instant> = None;
    loop {
        if ctx.is_cancelled() && give_up_at.is_none() {
            give_up_at = Some(give_up_time(
                ctx,
                shared.config.cancel_timeout,
                shared.config.lease_duration,
            ));
        }
        let give_up = async {
            match give_up_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            joined = &mut task => return match joined {
                Ok(result) => Ended::Returned(result),
                Err(e) if e.is_panic() => Ended::Panicked(panic_message(e.into_panic())),
                Err(_) => Ended::Abandoned,
            },
            () = &mut keep_alive, if heartbeating => heartbeating = false,
            // A cancel request fires the token inside the heartbeats, which
            // go on: this starts the clock on the handler.
            () = ctx.cancelled(), if give_up_at.is_none() => {}
            () = shared.hard_stop.cancelled(), if !ctx.is_cancelled() => {
                ctx.cancel(CancelReason::Shutdown);
            }
            () = give_up => {
                tracing::warn!(job_id = %leased.job_id, "handler did not stop after its token fired; aborting it");
                task.abort();
                return Ended::Abandoned;
            }
        }
    }
}

/// When to give up on a handler whose token fired now: `cancel_timeout`
/// later, and for a cancelled job no later than leaves its report time to
/// land within the lease. After a cancel heartbeats no longer extend it,
/// so with a short lease the timeout alone would report to a lease already
/// ended, and the job would end without its report (its cost). A shutdown
/// keeps heartbeating, so its lease does not bound the wait.
fn give_up_time(ctx: &JobContext, cancel_timeout: Duration, lease: Duration) -> Instant {
    let by_timeout = Instant::now() + cancel_timeout;
    let by_lease = ctx
        .held_until()
        .filter(|_| ctx.cancel_reason() == Some(CancelReason::CancelRequested))
        .map(|held| {
            held.checked_sub(REPORT_TIME.min(lease / 10))
                .unwrap_or(held)
        });
    by_lease.map_or(by_timeout, |by_lease| by_timeout.min(by_lease))
}

/// What a report is given to land before a lease ends (a tenth of the
/// lease when that is shorter).
const REPORT_TIME: Duration = Duration::from_secs(1);

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    format!("the handler panicked: {text}")
}

fn success(mut result: serde_json::Value) -> Outcome {
    // An integer past 2^53 (an id, say) would be refused whole, failing
    // finished work for good; it goes as the nearest double.
    numbers_as_doubles(&mut result);
    match serde_json::from_value::<pbjson_types::Value>(result) {
        Ok(value) => Outcome::Success(Success {
            result: Some(value),
        }),
        Err(e) => failure(&JobError::fatal(
            "invalid_result",
            format!("the result cannot be sent: {e}"),
        )),
    }
}

/// What the server takes in a failure (`domain::validate`): one outside
/// these limits would be refused, and its job would wait out its lease.
const MAX_CLASS: usize = 128;
const MAX_MESSAGE: usize = 16 * 1024;
const MAX_RETRY_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// A handler's failure as the server takes it. A class, message or delay
/// outside the server's limits is a handler bug (or an upstream error
/// copied in whole) that should not cost the job its outcome: the class's
/// other characters become `_`, NUL (which PostgreSQL cannot store) is
/// dropped from the message, and each is cut at its limit.
fn failure(error: &JobError) -> Outcome {
    let mut class: String = error
        .class
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.:-/".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(MAX_CLASS)
        .collect();
    if class.is_empty() {
        class = "error".into();
    }
    let message = sendable_text(&error.message, MAX_MESSAGE);
    Outcome::Failure(Failure {
        error_class: class,
        message,
        retryable: Some(error.retryable),
        retry_after: error.retry_after.map(|d| d.min(MAX_RETRY_AFTER).into()),
    })
}

/// Sends the outcome; retries while the server is unavailable, for up to a
/// lease (after that the lease is likely gone), or a third of one once a
/// next job has come back, whose lease is running meanwhile. A success the
/// server refuses as invalid (a result over the size limit) is reported as
/// a final failure of class `invalid_result`, and a refused failure as one
/// of class `invalid_failure`, so the job does not wait out its lease; a
/// refused cost is dropped rather than the outcome.
///
/// Unless the worker is draining, the first report is a `CompleteAndLease`
/// that claims the slot's next job in the same transaction; that job is
/// returned whatever became of the outcome. Later tries go alone, so a slot
/// never gets two. A `CompleteAndLease` refused as a whole (its claim) says
/// nothing about the outcome: it is sent again alone, as it was.
async fn complete(
    shared: &Shared,
    leased: &pb::LeasedJob,
    outcome: Outcome,
    mut cost_cents: i64,
) -> Option<Leased> {
    let mut give_up = Instant::now() + shared.config.lease_duration;
    let mut retry = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut outcome = outcome;
    let mut chain = shared.may_chain();
    let mut next = None;
    // Whether the outcome was already replaced after a refusal: the
    // replacement is not replaced again.
    let mut replaced = false;
    // Whether a try went unanswered: the server may have applied it.
    let mut unanswered = false;
    loop {
        let item = pb::CompleteRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            outcome: Some(outcome.clone()),
            cost_cents,
        };
        let chained = std::mem::take(&mut chain);
        let reported = if chained {
            complete_and_lease(shared, item)
                .await
                .map(|(refused, job)| {
                    let received = Instant::now();
                    if job.is_some() {
                        // The next job's lease runs from now, and its first
                        // heartbeat comes a third of a lease after it starts:
                        // retries of this outcome may hold it back a third.
                        give_up = give_up.min(received + shared.config.lease_duration / 3);
                    }
                    next = job.map(|job| Leased { job, received });
                    refused
                })
        } else {
            let mut request = tonic::Request::new(item);
            // A hung call must not hold a next job back past the limit, nor
            // a worker told to stop now.
            let left = give_up.saturating_duration_since(Instant::now());
            request.set_timeout(if shared.forced.is_cancelled() {
                LAST_CALL_TIMEOUT
            } else {
                left.clamp(LAST_CALL_TIMEOUT, CALL_TIMEOUT)
            });
            let mut client = shared.client.clone();
            client.complete(request).await.map(|_| None)
        };
        let status = match reported {
            Ok(None) => {
                tracing::debug!(job_id = %leased.job_id, "outcome reported");
                return next;
            }
            Ok(Some(refused)) => refused,
            Err(status) if chained && status.code() == Code::Unimplemented => {
                tracing::info!("the server has no CompleteAndLease; outcomes go alone");
                shared.stop_chaining();
                continue;
            }
            // A refusal of the whole call is one of its claim (the outcomes'
            // are per item): the outcome goes alone, as it was. A claim
            // refused as invalid would be refused again, so later outcomes
            // go alone too; another refusal (a token being rotated, say)
            // says nothing of the next call's.
            Err(status) if chained && !transient(status.code()) => {
                if status.code() == Code::InvalidArgument {
                    tracing::warn!(
                        message = status.message(),
                        "the server refused the claim sent with an outcome; outcomes go alone"
                    );
                    shared.stop_chaining();
                } else {
                    tracing::warn!(code = ?status.code(), message = status.message(), "the server refused a CompleteAndLease; this outcome goes alone");
                }
                continue;
            }
            Err(status) => status,
        };
        match status.code() {
            Code::Aborted | Code::NotFound if unanswered => {
                tracing::warn!(job_id = %leased.job_id, message = status.message(), "lease ended: an earlier try whose answer was lost applied the outcome, or the lease was lost before it");
                return next;
            }
            Code::Aborted | Code::NotFound => {
                tracing::warn!(job_id = %leased.job_id, message = status.message(), "lease lost before the outcome was reported; it is dropped");
                return next;
            }
            // The cost is not worth the outcome.
            Code::InvalidArgument if cost_cents != 0 && names_cost(&status) => {
                tracing::warn!(job_id = %leased.job_id, cost_cents, message = status.message(), "the server refused the cost; the outcome goes without it");
                cost_cents = 0;
            }
            Code::InvalidArgument if !replaced => {
                tracing::warn!(job_id = %leased.job_id, message = status.message(), "the server refused the outcome");
                replaced = true;
                outcome = match outcome {
                    Outcome::Success(_) => failure(&JobError::fatal(
                        "invalid_result",
                        format!("the server refused the result: {}", status.message()),
                    )),
                    Outcome::Failure(refused) => failure(&JobError {
                        class: "invalid_failure".into(),
                        message: format!("the server refused the failure: {}", status.message()),
                        retryable: refused.retryable.unwrap_or(true),
                        retry_after: None,
                    }),
                };
            }
            code if transient(code)
                && Instant::now() < give_up
                && !shared.forced.is_cancelled() =>
            {
                // The last try comes at the limit, not a backoff past it.
                unanswered |= !matches!(code, Code::ResourceExhausted);
                let delay = retry
                    .next_delay_after(&status)
                    .min(give_up.saturating_duration_since(Instant::now()));
                tracing::warn!(job_id = %leased.job_id, code = ?status.code(), message = status.message(), retry_in = ?delay, "complete failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    // Told to stop now: the try after it is the last.
                    () = shared.forced.cancelled() => give_up = Instant::now(),
                }
            }
            _ => {
                tracing::error!(job_id = %leased.job_id, code = ?status.code(), message = status.message(), "could not report the outcome; the lease will expire and the job run again");
                return next;
            }
        }
    }
}

/// One `CompleteAndLease` of `item`: the item's refusal as a status (none
/// when its outcome was applied), and the next job it claimed.
async fn complete_and_lease(
    shared: &Shared,
    item: pb::CompleteRequest,
) -> Result<(Option<tonic::Status>, Option<pb::LeasedJob>), tonic::Status> {
    use pb::complete_batch_result::Result as Item;
    let mut request = tonic::Request::new(pb::CompleteAndLeaseRequest {
        items: vec![item],
        lease: Some(shared.next_job_request()),
    });
    request.set_timeout(CALL_TIMEOUT);
    let mut client = shared.client.clone();
    let answer = client.complete_and_lease(request).await?.into_inner();
    let refused = match answer.results.into_iter().next().and_then(|r| r.result) {
        Some(Item::Job(_)) => None,
        Some(Item::Error(e)) => Some(item_status(e)),
        None => Some(tonic::Status::internal(
            "CompleteAndLease answered no result",
        )),
    };
    Ok((refused, answer.jobs.into_iter().next()))
}

/// Whether a call that failed with `code` may get through when tried again.
fn transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::DeadlineExceeded
            | Code::Internal
            | Code::ResourceExhausted
            | Code::Cancelled
    )
}

/// An item's refusal as the status a plain `Complete` would have got,
/// naming the refused field the same way.
fn item_status(error: pb::ItemError) -> tonic::Status {
    let code = Code::from(error.code);
    if error.field.is_empty() {
        return tonic::Status::new(code, error.message);
    }
    let details = ErrorDetails::with_bad_request_violation(error.field, error.message.clone());
    tonic::Status::with_error_details(code, error.message, details)
}

/// Whether a refusal names the outcome's cost (`cost_cents`, or an item's
/// `items[0].cost_cents`).
fn names_cost(status: &tonic::Status) -> bool {
    status.get_error_details().bad_request().is_some_and(|b| {
        b.field_violations
            .iter()
            .any(|v| v.field == "cost_cents" || v.field.ends_with(".cost_cents"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(error: JobError) -> Failure {
        match failure(&error) {
            Outcome::Failure(f) => f,
            Outcome::Success(_) => panic!("a failure"),
        }
    }

    #[test]
    fn refusals_of_the_cost_are_told_apart() {
        let item = |field: &str| pb::ItemError {
            code: Code::InvalidArgument as i32,
            message: "must not be negative".into(),
            field: field.into(),
            retry_delay: None,
        };
        assert!(names_cost(&item_status(item("items[0].cost_cents"))));
        assert!(names_cost(&item_status(item("cost_cents"))));
        assert!(!names_cost(&item_status(item("success.result"))));
        assert!(!names_cost(&item_status(item(""))));
        assert!(!names_cost(&tonic::Status::invalid_argument("cost_cents")));
    }

    #[test]
    fn failures_are_cut_to_what_the_server_takes() {
        let f = sent(JobError::retryable(" rate limited (429) ", "x\0y"));
        assert_eq!(f.error_class, "rate_limited__429_");
        assert_eq!(f.message, "xy");
        assert_eq!(sent(JobError::fatal("é/ok", "")).error_class, "_/ok");
        assert_eq!(sent(JobError::fatal("  ", "")).error_class, "error");
        let long = sent(JobError::fatal("c".repeat(300), "é".repeat(20_000)));
        assert_eq!(long.error_class.len(), MAX_CLASS);
        assert_eq!(long.message.chars().count(), MAX_MESSAGE);
        let late = sent(
            JobError::retryable("busy", "").with_retry_after(Duration::from_secs(30 * 24 * 3600)),
        );
        assert_eq!(late.retry_after, Some(MAX_RETRY_AFTER.into()));
    }

    #[test]
    fn the_failures_sent_pass_the_servers_validation() {
        use crate::domain::validate::{self, Limits, OutcomeInput};
        let limits = Limits {
            default_max_attempts: 3,
            default_backoff: crate::domain::Backoff::try_new(
                Duration::from_secs(1),
                Duration::from_secs(60),
            )
            .expect("backoff"),
            max_payload_bytes: 1024,
            default_lease: Duration::from_secs(60),
            max_lease: Duration::from_secs(3600),
        };
        let long = "x".repeat(500);
        for class in ["rate limited", "a\u{0}b", "日本", long.as_str(), ""] {
            let f = sent(JobError::fatal(class, format!("{class}\0{long}")));
            let checked = validate::complete(
                &uuid::Uuid::nil().to_string(),
                "t",
                Some(OutcomeInput::Failure {
                    error_class: f.error_class.clone(),
                    message: f.message,
                    retryable: f.retryable,
                    retry_after: None,
                }),
                0,
                &limits,
            );
            assert!(
                checked.is_ok(),
                "{class:?} sent as {:?}: {checked:?}",
                f.error_class
            );
        }
    }
}
