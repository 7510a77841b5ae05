//! The state machine of SPEC section 2 for the transitions that need a
//! decision: complete, cancel, replay and the reaper's. Each one mutates a
//! snapshot of the job and returns the one event it records; the store
//! writes both in one transaction. (Submit, lease and heartbeat are single
//! set-based statements in the store, because they are the hot path and need
//! no decision beyond their SQL `WHERE`.)

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::{EventType, Job, JobError, JobEvent, JobState, Outcome};

/// Why a transition was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The caller's lease token is not the job's current one.
    #[error("lease lost: the job is no longer held with this lease token")]
    LeaseLost,
    /// The job's state does not allow this transition.
    #[error("{0}")]
    Illegal(String),
}

/// Error class recorded when the last attempt's lease expired.
pub const LEASE_EXPIRED_CLASS: &str = "lease_expired";

/// Error class recorded when a failure finds the job's spend limit reached.
pub const BUDGET_EXHAUSTED_CLASS: &str = "budget_exhausted";

/// A delay added to `now`, in whole milliseconds: the time it gives is then
/// one both stores keep exactly (SQLite in milliseconds, PostgreSQL in
/// microseconds), and the job a call answers shows the time that was
/// stored. A jittered backoff has nanoseconds.
fn chrono_delay(d: Duration) -> chrono::Duration {
    i64::try_from(d.as_millis())
        .ok()
        .and_then(chrono::Duration::try_milliseconds)
        .unwrap_or(chrono::Duration::MAX)
}

/// Bumps the job's sequence and `updated_at` (which never goes back) and
/// builds the event describing the job as it now is.
fn record(
    job: &mut Job,
    now: DateTime<Utc>,
    kind: EventType,
    worker_id: Option<String>,
    detail: Option<Value>,
) -> JobEvent {
    job.event_seq += 1;
    job.updated_at = job.updated_at.max(now);
    JobEvent {
        job_id: job.id,
        sequence: job.event_seq,
        kind,
        state: job.state,
        attempt: job.attempt,
        worker_id,
        at: job.updated_at,
        detail,
    }
}

/// Drops the lease and returns who held it.
fn release(job: &mut Job) -> Option<String> {
    job.lease_token = None;
    job.lease_expires_at = None;
    job.lease_owner.take()
}

fn finish(job: &mut Job, state: JobState, now: DateTime<Utc>) {
    job.state = state;
    job.finished_at = Some(now);
}

fn error_detail(error: &JobError) -> Value {
    json!({"class": error.class, "message": error.message})
}

/// A worker reports the outcome of the attempt it holds under `token`.
///
/// Anything but the current token of a running job is `LeaseLost`, so a
/// reclaimed job's late outcome is never written; so is a token whose
/// cancel grace has passed (the lease is revoked then, SPEC section 2, even
/// before the reaper has ended the job). A job whose cancel was requested
/// ends `Cancelled` and its outcome is discarded.
pub fn complete(
    job: &mut Job,
    token: &str,
    outcome: Outcome,
    cost_cents: i64,
    now: DateTime<Utc>,
    jitter: f64,
) -> Result<JobEvent, TransitionError> {
    let revoked = job.cancel_requested && job.lease_expires_at.is_some_and(|at| at <= now);
    if job.state != JobState::Running || job.lease_token.as_deref() != Some(token) || revoked {
        return Err(TransitionError::LeaseLost);
    }
    job.cost_cents = job.cost_cents.saturating_add(cost_cents);
    let worker = release(job);
    if job.cancel_requested {
        finish(job, JobState::Cancelled, now);
        let discarded = match outcome {
            Outcome::Success { .. } => "success",
            Outcome::Failure { .. } => "failure",
        };
        let detail = json!({"reason": "cancel requested", "discarded_outcome": discarded});
        return Ok(record(job, now, EventType::Cancelled, worker, Some(detail)));
    }
    match outcome {
        Outcome::Success { result } => {
            job.result = Some(result);
            job.error = None;
            finish(job, JobState::Succeeded, now);
            let detail = json!({"cost_cents": job.cost_cents});
            Ok(record(job, now, EventType::Succeeded, worker, Some(detail)))
        }
        Outcome::Failure {
            error,
            retryable,
            retry_after,
        } => {
            let detail_error = error_detail(&error);
            job.error = Some(error);
            let reason = if !retryable {
                "not retryable"
            } else if job.attempt >= job.max_attempts {
                "attempts exhausted"
            } else if job.deadline.is_some_and(|deadline| deadline <= now) {
                "deadline passed"
            } else if job.max_cost_cents.is_some_and(|max| job.cost_cents >= max) {
                // The worker's own error stays in the event's detail.
                job.error = Some(JobError {
                    class: BUDGET_EXHAUSTED_CLASS.into(),
                    message: format!(
                        "spent {} of {} cents; not retried",
                        job.cost_cents,
                        job.max_cost_cents.unwrap_or_default()
                    ),
                });
                "budget exhausted"
            } else {
                // A retry due after the deadline is still scheduled (SPEC: only
                // a deadline already passed stops it); the reaper expires it.
                let delay = retry_after.unwrap_or_else(|| job.backoff.delay(job.attempt, jitter));
                job.state = JobState::Queued;
                job.run_at = now + chrono_delay(delay);
                let detail = json!({
                    "error": detail_error,
                    "delay_ms": u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                });
                return Ok(record(
                    job,
                    now,
                    EventType::RetryScheduled,
                    worker,
                    Some(detail),
                ));
            };
            finish(job, JobState::Failed, now);
            let detail = json!({"error": detail_error, "reason": reason});
            Ok(record(job, now, EventType::Failed, worker, Some(detail)))
        }
    }
}

/// A producer cancels a job. `Ok(None)` means nothing changed (it was
/// already cancelled, or its cancel was already requested).
///
/// A running job only gets `cancel_requested`, and its lease is cut to
/// `grace` from now so that the reaper cancels it at the latest then.
pub fn cancel(
    job: &mut Job,
    now: DateTime<Utc>,
    reason: Option<&str>,
    grace: Duration,
) -> Result<Option<JobEvent>, TransitionError> {
    let detail = reason.map(|r| json!({"reason": r}));
    match job.state {
        JobState::Queued => {
            finish(job, JobState::Cancelled, now);
            Ok(Some(record(job, now, EventType::Cancelled, None, detail)))
        }
        JobState::Running if job.cancel_requested => Ok(None),
        JobState::Running => {
            job.cancel_requested = true;
            job.cancel_requested_at = Some(now);
            let grace_end = now + chrono_delay(grace);
            job.lease_expires_at = job.lease_expires_at.map(|t| t.min(grace_end));
            let worker = job.lease_owner.clone();
            Ok(Some(record(
                job,
                now,
                EventType::CancelRequested,
                worker,
                detail,
            )))
        }
        JobState::Cancelled => Ok(None),
        state => Err(TransitionError::Illegal(format!(
            "job is {state}; only queued or running jobs can be cancelled"
        ))),
    }
}

/// `Retry`: a failed, cancelled or expired job goes back to the queue with a
/// fresh attempt budget, keeping its id and history. A deadline that has
/// already passed is dropped, since keeping it would expire the job again at
/// once.
pub fn replay(job: &mut Job, now: DateTime<Utc>) -> Result<JobEvent, TransitionError> {
    if !job.state.is_replayable() {
        return Err(TransitionError::Illegal(format!(
            "job is {}; only failed, cancelled or expired jobs can be retried",
            job.state
        )));
    }
    let from = job.state;
    job.state = JobState::Queued;
    job.attempt = 0;
    job.started_at = None;
    job.run_at = now;
    job.result = None;
    job.error = None;
    job.progress = 0.0;
    job.finished_at = None;
    job.cancel_requested = false;
    job.cancel_requested_at = None;
    release(job);
    if job.deadline.is_some_and(|d| d <= now) {
        job.deadline = None;
    }
    let detail = json!({"from": from.as_str()});
    Ok(record(job, now, EventType::Replayed, None, Some(detail)))
}

/// The reaper found a running job whose lease ran out (the worker died,
/// froze, or ignored a cancel past its grace).
pub fn lease_expired(job: &mut Job, now: DateTime<Utc>) -> JobEvent {
    let worker = release(job);
    if job.cancel_requested {
        finish(job, JobState::Cancelled, now);
        let detail = json!({"reason": "lease ended after a cancel request"});
        return record(job, now, EventType::Cancelled, worker, Some(detail));
    }
    if job.deadline.is_some_and(|d| d <= now) {
        finish(job, JobState::Expired, now);
        let detail = json!({"reason": "deadline passed while running"});
        return record(job, now, EventType::Expired, worker, Some(detail));
    }
    if job.attempt < job.max_attempts {
        job.state = JobState::Queued;
        job.run_at = now;
        return record(job, now, EventType::LeaseExpired, worker, None);
    }
    let error = JobError {
        class: LEASE_EXPIRED_CLASS.into(),
        message: "the lease of the last attempt expired".into(),
    };
    let detail = json!({"error": error_detail(&error), "reason": "attempts exhausted"});
    job.error = Some(error);
    finish(job, JobState::Failed, now);
    record(job, now, EventType::Failed, worker, Some(detail))
}

/// A job leased to a `Lease` call that went away before the job reached it
/// (its client cancelled, or its deadline passed) goes back as if it had
/// not been claimed: the attempt is given back and the job keeps its place
/// in the queue, so a job nobody ran never fails for it. Only under the
/// token it was leased with. A cancel or a deadline that came meanwhile
/// ends it as an expired lease would.
pub fn give_back(
    job: &mut Job,
    token: &str,
    now: DateTime<Utc>,
) -> Result<JobEvent, TransitionError> {
    if job.state != JobState::Running || job.lease_token.as_deref() != Some(token) {
        return Err(TransitionError::LeaseLost);
    }
    job.attempt = job.attempt.saturating_sub(1);
    if job.attempt == 0 {
        // Nobody ran it: a job with no attempt spent has not started.
        job.started_at = None;
    }
    if job.cancel_requested || job.deadline.is_some_and(|d| d <= now) {
        return Ok(lease_expired(job, now));
    }
    let worker = release(job);
    job.state = JobState::Queued;
    let detail = json!({"reason": "the Lease call went away before it got the job", "attempt_given_back": true});
    Ok(record(
        job,
        now,
        EventType::LeaseExpired,
        worker,
        Some(detail),
    ))
}

/// The reaper found a queued job past its deadline.
pub fn deadline_passed(job: &mut Job, now: DateTime<Utc>) -> JobEvent {
    finish(job, JobState::Expired, now);
    record(
        job,
        now,
        EventType::Expired,
        None,
        Some(json!({"reason": "deadline passed"})),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::fixtures::{running, t};

    fn failure(retryable: bool, retry_after: Option<Duration>) -> Outcome {
        Outcome::Failure {
            error: JobError {
                class: "rate_limited".into(),
                message: "slow down".into(),
            },
            retryable,
            retry_after,
        }
    }

    #[test]
    fn success_finishes_and_records_the_next_sequence() {
        let mut job = running(1, 3);
        let event = complete(
            &mut job,
            "tok",
            Outcome::Success { result: json!(1) },
            7,
            t(10),
            0.5,
        )
        .expect("fenced ok");
        assert_eq!(job.state, JobState::Succeeded);
        assert_eq!(job.result, Some(json!(1)));
        assert_eq!(job.cost_cents, 7);
        assert_eq!(job.lease_token, None);
        assert_eq!(job.finished_at, Some(t(10)));
        assert_eq!(event.sequence, 3);
        assert_eq!(event.kind, EventType::Succeeded);
        assert_eq!(event.worker_id.as_deref(), Some("w1"));
    }

    #[test]
    fn a_stale_token_or_a_finished_job_is_lease_lost_and_changes_nothing() {
        let mut job = running(1, 3);
        let before = job.clone();
        let err = complete(&mut job, "other", failure(true, None), 1, t(1), 0.0).unwrap_err();
        assert_eq!(err, TransitionError::LeaseLost);
        assert_eq!(job, before);

        job.state = JobState::Succeeded;
        let err = complete(&mut job, "tok", failure(true, None), 1, t(1), 0.0).unwrap_err();
        assert_eq!(err, TransitionError::LeaseLost);
    }

    #[test]
    fn a_job_given_back_is_queued_with_its_attempt_returned_and_its_place_kept() {
        let mut job = running(1, 1);
        let run_at = job.run_at;
        let event = give_back(&mut job, "tok", t(5)).expect("its own token");
        assert_eq!(
            job.state,
            JobState::Queued,
            "a job nobody ran does not fail"
        );
        assert_eq!(job.attempt, 0);
        assert_eq!(job.started_at, None, "nobody started it");
        assert_eq!(job.run_at, run_at);
        assert_eq!(job.lease_token, None);

        let mut retried = running(2, 3);
        let started = retried.started_at;
        give_back(&mut retried, "tok", t(5)).expect("its own token");
        assert_eq!(
            (retried.attempt, retried.started_at),
            (1, started),
            "its first attempt did start"
        );
        assert_eq!(event.kind, EventType::LeaseExpired);
        assert_eq!(event.worker_id.as_deref(), Some("w1"));

        let mut job = running(1, 3);
        let before = job.clone();
        assert_eq!(
            give_back(&mut job, "other", t(5)).unwrap_err(),
            TransitionError::LeaseLost
        );
        assert_eq!(job, before);

        job.cancel_requested = true;
        give_back(&mut job, "tok", t(5)).expect("its own token");
        assert_eq!(
            job.state,
            JobState::Cancelled,
            "a cancel that came meanwhile holds"
        );
    }

    #[test]
    fn retryable_failure_with_attempts_left_is_requeued_after_the_backoff() {
        let mut job = running(2, 3);
        let event = complete(&mut job, "tok", failure(true, None), 0, t(100), 0.5).expect("ok");
        assert_eq!(job.state, JobState::Queued);
        // attempt 2: window min(300 s, 5 s * 2) = 10 s, half of it with jitter 0.5
        assert_eq!(job.run_at, t(105));
        assert_eq!(event.kind, EventType::RetryScheduled);
        assert_eq!(
            job.error.as_ref().map(|e| e.class.as_str()),
            Some("rate_limited")
        );
        assert!(job.finished_at.is_none());
    }

    #[test]
    fn retry_after_overrides_the_backoff() {
        let mut job = running(1, 3);
        complete(
            &mut job,
            "tok",
            failure(true, Some(Duration::from_secs(42))),
            0,
            t(0),
            0.9,
        )
        .expect("ok");
        assert_eq!(job.run_at, t(42));
    }

    #[test]
    fn failures_that_cannot_retry_go_to_the_dead_set() {
        let mut last = running(3, 3);
        complete(&mut last, "tok", failure(true, None), 0, t(0), 0.1).expect("ok");
        assert_eq!(last.state, JobState::Failed);

        let mut final_error = running(1, 3);
        complete(&mut final_error, "tok", failure(false, None), 0, t(0), 0.1).expect("ok");
        assert_eq!(final_error.state, JobState::Failed);

        let mut past_deadline = running(1, 3);
        past_deadline.deadline = Some(t(10));
        complete(
            &mut past_deadline,
            "tok",
            failure(true, None),
            0,
            t(10),
            0.1,
        )
        .expect("ok");
        assert_eq!(past_deadline.state, JobState::Failed);
    }

    #[test]
    fn a_retry_due_after_the_deadline_is_still_scheduled() {
        let mut job = running(1, 3);
        job.deadline = Some(t(10));
        complete(
            &mut job,
            "tok",
            failure(true, Some(Duration::from_secs(20))),
            0,
            t(0),
            0.1,
        )
        .expect("ok");
        assert_eq!((job.state, job.run_at), (JobState::Queued, t(20)));
    }

    #[test]
    fn a_spent_budget_stops_retries() {
        let mut job = running(1, 5);
        job.max_cost_cents = Some(10);
        job.cost_cents = 4;
        complete(&mut job, "tok", failure(true, None), 5, t(0), 0.0).expect("ok");
        assert_eq!(job.state, JobState::Queued, "9 of 10 spent: retried");

        job.state = JobState::Running;
        job.lease_token = Some("tok".into());
        let event = complete(&mut job, "tok", failure(true, None), 1, t(1), 0.0).expect("ok");
        assert_eq!(job.state, JobState::Failed);
        assert_eq!(job.cost_cents, 10);
        assert_eq!(
            job.error.as_ref().map(|e| e.class.as_str()),
            Some(BUDGET_EXHAUSTED_CLASS)
        );
        let detail = event.detail.expect("detail");
        assert_eq!(detail["error"]["class"], "rate_limited", "{detail}");
    }

    #[test]
    fn cost_accumulates_over_attempts() {
        let mut job = running(1, 3);
        job.cost_cents = 5;
        complete(&mut job, "tok", failure(true, None), 3, t(0), 0.0).expect("ok");
        assert_eq!(job.cost_cents, 8);
    }

    #[test]
    fn outcome_after_a_cancel_request_is_discarded() {
        let mut job = running(1, 3);
        cancel(&mut job, t(1), Some("user"), Duration::from_secs(30))
            .expect("ok")
            .expect("changed");
        assert!(job.cancel_requested);
        assert_eq!(job.state, JobState::Running);
        let event = complete(
            &mut job,
            "tok",
            Outcome::Success { result: json!("x") },
            0,
            t(2),
            0.0,
        )
        .expect("ok");
        assert_eq!(job.state, JobState::Cancelled);
        assert_eq!(job.result, None);
        assert_eq!(event.kind, EventType::Cancelled);
    }

    #[test]
    fn cancel_cuts_the_lease_to_the_grace_period() {
        let mut job = running(1, 3);
        job.lease_expires_at = Some(t(3600));
        cancel(&mut job, t(0), None, Duration::from_secs(30)).expect("ok");
        assert_eq!(job.lease_expires_at, Some(t(30)));
    }

    #[test]
    fn cancel_rules() {
        let mut queued = running(0, 3);
        queued.state = JobState::Queued;
        let event = cancel(&mut queued, t(1), None, Duration::ZERO).expect("ok");
        assert_eq!(event.map(|e| e.kind), Some(EventType::Cancelled));
        assert_eq!(queued.state, JobState::Cancelled);
        // idempotent
        assert_eq!(cancel(&mut queued, t(2), None, Duration::ZERO), Ok(None));

        let mut requested = running(1, 3);
        cancel(&mut requested, t(1), None, Duration::ZERO).expect("ok");
        assert_eq!(cancel(&mut requested, t(2), None, Duration::ZERO), Ok(None));

        for state in [JobState::Succeeded, JobState::Failed, JobState::Expired] {
            let mut job = running(1, 3);
            job.state = state;
            assert!(matches!(
                cancel(&mut job, t(1), None, Duration::ZERO),
                Err(TransitionError::Illegal(_))
            ));
        }
    }

    #[test]
    fn replay_gives_a_fresh_budget_and_never_touches_succeeded_or_live_jobs() {
        let mut job = running(3, 3);
        complete(&mut job, "tok", failure(false, None), 0, t(0), 0.0).expect("ok");
        job.deadline = Some(t(1));
        let event = replay(&mut job, t(5)).expect("ok");
        assert_eq!(event.kind, EventType::Replayed);
        assert_eq!(job.state, JobState::Queued);
        assert_eq!(job.attempt, 0);
        assert_eq!(job.error, None);
        assert_eq!(job.deadline, None);
        assert_eq!(job.run_at, t(5));
        assert_eq!(job.started_at, None, "the new run has not started");

        for state in [JobState::Succeeded, JobState::Running, JobState::Queued] {
            let mut job = running(1, 3);
            job.state = state;
            assert!(matches!(
                replay(&mut job, t(1)),
                Err(TransitionError::Illegal(_))
            ));
        }
    }

    #[test]
    fn expired_lease_requeues_fails_cancels_or_expires() {
        let mut job = running(1, 3);
        let event = lease_expired(&mut job, t(61));
        assert_eq!(
            (job.state, event.kind),
            (JobState::Queued, EventType::LeaseExpired)
        );
        assert_eq!(job.lease_token, None);

        let mut last = running(3, 3);
        lease_expired(&mut last, t(61));
        assert_eq!(last.state, JobState::Failed);
        assert_eq!(
            last.error.map(|e| e.class),
            Some(LEASE_EXPIRED_CLASS.to_string())
        );

        let mut cancelled = running(1, 3);
        cancelled.cancel_requested = true;
        lease_expired(&mut cancelled, t(61));
        assert_eq!(cancelled.state, JobState::Cancelled);

        let mut late = running(1, 3);
        late.deadline = Some(t(60));
        lease_expired(&mut late, t(61));
        assert_eq!(late.state, JobState::Expired);
    }

    #[test]
    fn updated_at_never_goes_back() {
        let mut job = running(1, 3);
        job.updated_at = t(100);
        let event = complete(
            &mut job,
            "tok",
            Outcome::Success {
                result: json!(null),
            },
            0,
            t(50),
            0.0,
        )
        .expect("ok");
        assert_eq!(job.updated_at, t(100));
        assert_eq!(event.at, t(100));
    }
}
