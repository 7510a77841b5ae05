//! The circuit breaker of a queue and kind: after `threshold` consecutive
//! transient failures (a provider rate-limiting or down), stop leasing that
//! kind for a cool-down that honours the largest `retry_after` reported, then
//! let one probe through (half-open): its success closes the breaker, its
//! transient failure opens it again. Pure: the store keeps the state in the
//! database so that every replica sees the same breaker.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::Outcome;

/// When and how breakers trip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive transient failures that open the breaker; 0 disables it.
    pub threshold: u32,
    /// Shortest time a breaker stays open.
    pub cooldown: Duration,
    /// Error classes that count as transient (the provider's fault).
    pub transient_classes: Vec<String>,
}

impl BreakerPolicy {
    /// Whether a failure of this class counts against the breaker.
    pub fn is_transient(&self, class: &str) -> bool {
        self.threshold > 0 && self.transient_classes.iter().any(|c| c == class)
    }
}

/// A breaker as stored. No row means closed with no failures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    /// Consecutive transient failures.
    pub failures: u32,
    /// Largest `retry_after` reported by those failures.
    pub max_retry_after: Duration,
    /// Leasing of the kind resumes (half-open) at this time; `None`: closed.
    pub open_until: Option<DateTime<Utc>>,
    /// The half-open probe in flight.
    pub probe_job: Option<Uuid>,
}

/// Where a breaker stands at a given time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    /// The cool-down is over: one probe may run (or is running).
    HalfOpen,
}

impl Breaker {
    /// The state at `now`.
    pub fn state(&self, now: DateTime<Utc>) -> BreakerState {
        match self.open_until {
            None => BreakerState::Closed,
            Some(until) if until > now => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }
}

/// What an attempt's outcome means for its breaker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BreakerChange {
    /// Nothing to write.
    Unchanged,
    /// Closed with no failures: delete the row.
    Reset,
    /// Store this state; `opened` when this outcome opened (or reopened) it.
    Update { breaker: Breaker, opened: bool },
}

/// The error class and `retry_after` of a failure, `None` for a success:
/// what a breaker learns from an outcome.
pub fn failure_of(outcome: &Outcome) -> Option<(String, Option<Duration>)> {
    match outcome {
        Outcome::Success { .. } => None,
        Outcome::Failure {
            error, retry_after, ..
        } => Some((error.class.clone(), *retry_after)),
    }
}

/// The effect of an attempt of `job` ending. `failure` is the error class
/// and `retry_after` of a failure, `None` for a success.
pub fn on_outcome(
    current: Option<&Breaker>,
    failure: Option<(&str, Option<Duration>)>,
    job: Uuid,
    now: DateTime<Utc>,
    policy: &BreakerPolicy,
) -> BreakerChange {
    let Some((_, retry_after)) = failure.filter(|(class, _)| policy.is_transient(class)) else {
        // A success, or a failure that is not the provider's: the provider
        // answered, so the streak is over.
        return match current {
            Some(_) => BreakerChange::Reset,
            None => BreakerChange::Unchanged,
        };
    };
    let mut next = current.cloned().unwrap_or(Breaker {
        failures: 0,
        max_retry_after: Duration::ZERO,
        open_until: None,
        probe_job: None,
    });
    next.failures = next.failures.saturating_add(1);
    next.max_retry_after = next.max_retry_after.max(retry_after.unwrap_or_default());
    let cool_down = policy.cooldown.max(next.max_retry_after);
    let reopen = next.probe_job == Some(job);
    let open = next.open_until.is_none() && next.failures >= policy.threshold;
    if reopen || open {
        next.open_until =
            Some(now + chrono::Duration::from_std(cool_down).unwrap_or(chrono::Duration::MAX));
        next.probe_job = None;
    }
    BreakerChange::Update {
        breaker: next,
        opened: reopen || open,
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + secs, 0)
            .single()
            .expect("valid time")
    }

    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            threshold: 3,
            cooldown: Duration::from_secs(30),
            transient_classes: vec!["rate_limited".into(), "timeout".into()],
        }
    }

    fn fail(
        b: Option<&Breaker>,
        class: &str,
        retry_after: Option<u64>,
        job: Uuid,
        now: DateTime<Utc>,
    ) -> BreakerChange {
        on_outcome(
            b,
            Some((class, retry_after.map(Duration::from_secs))),
            job,
            now,
            &policy(),
        )
    }

    fn updated(change: BreakerChange) -> (Breaker, bool) {
        match change {
            BreakerChange::Update { breaker, opened } => (breaker, opened),
            other => panic!("expected an update, got {other:?}"),
        }
    }

    #[test]
    fn opens_after_the_threshold_and_honours_the_largest_retry_after() {
        let job = Uuid::now_v7();
        let (b1, opened) = updated(fail(None, "rate_limited", Some(60), job, t(0)));
        assert!(!opened);
        let (b2, opened) = updated(fail(Some(&b1), "rate_limited", None, job, t(1)));
        assert!(!opened);
        let (b3, opened) = updated(fail(Some(&b2), "timeout", Some(5), job, t(2)));
        assert!(opened);
        // 60 s reported earlier beats the 30 s cool-down
        assert_eq!(b3.open_until, Some(t(62)));
        assert_eq!(b3.state(t(61)), BreakerState::Open);
        assert_eq!(b3.state(t(62)), BreakerState::HalfOpen);
    }

    #[test]
    fn other_failures_and_successes_end_the_streak() {
        let job = Uuid::now_v7();
        let (b1, _) = updated(fail(None, "rate_limited", None, job, t(0)));
        assert_eq!(
            fail(Some(&b1), "bad_input", None, job, t(1)),
            BreakerChange::Reset
        );
        assert_eq!(
            on_outcome(Some(&b1), None, job, t(1), &policy()),
            BreakerChange::Reset
        );
        assert_eq!(
            on_outcome(None, None, job, t(1), &policy()),
            BreakerChange::Unchanged
        );
        assert_eq!(
            fail(None, "bad_input", None, job, t(1)),
            BreakerChange::Unchanged
        );
    }

    #[test]
    fn a_failed_probe_reopens_and_a_stray_failure_does_not_extend() {
        let probe = Uuid::now_v7();
        let half_open = Breaker {
            failures: 3,
            max_retry_after: Duration::ZERO,
            open_until: Some(t(30)),
            probe_job: Some(probe),
        };
        let (b, opened) = updated(fail(Some(&half_open), "rate_limited", None, probe, t(40)));
        assert!(opened);
        assert_eq!((b.open_until, b.probe_job), (Some(t(70)), None));

        // A failure of a job leased before the breaker opened counts, but
        // does not move the cool-down.
        let other = Uuid::now_v7();
        let (b, opened) = updated(fail(Some(&half_open), "rate_limited", None, other, t(40)));
        assert!(!opened);
        assert_eq!(b.open_until, Some(t(30)));
    }

    #[test]
    fn threshold_zero_disables() {
        let mut p = policy();
        p.threshold = 0;
        let change = on_outcome(None, Some(("rate_limited", None)), Uuid::now_v7(), t(0), &p);
        assert_eq!(change, BreakerChange::Unchanged);
    }
}
