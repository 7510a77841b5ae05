//! Delays between reconnect attempts: exponential, capped, jittered.

use std::time::Duration;

/// Exponential backoff with "equal jitter": half the capped delay plus a
/// random part up to the other half, so a fleet of workers that lost the same
/// server does not come back in lockstep, and no retry is ever immediate.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            failures: 0,
        }
    }

    /// The delay before the next try; each call doubles the cap.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let factor = 2u32.saturating_pow(self.failures.min(20));
        self.failures = self.failures.saturating_add(1);
        let cap = self.initial.saturating_mul(factor).min(self.max);
        let half = cap / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    /// [`Self::next_delay`], but no shorter than the delay the server
    /// asked for in a `google.rpc.RetryInfo` (a rate limit, a full queue).
    pub(crate) fn next_delay_after(&mut self, status: &tonic::Status) -> Duration {
        let own = self.next_delay();
        server_delay(status).map_or(own, |asked| own.max(asked))
    }

    /// Consecutive failures so far.
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    /// Back to the initial delay after a success.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

/// The delay a status's `google.rpc.RetryInfo` asks for, if it has one.
fn server_delay(status: &tonic::Status) -> Option<Duration> {
    use tonic_types::StatusExt;
    let delay = status.get_details_retry_info()?.retry_delay?;
    // At most a minute: a worker should not sleep for an hour on one answer.
    Some(delay.min(Duration::from_secs(60)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_info_delay_is_waited_out() {
        use tonic_types::{ErrorDetails, StatusExt};
        let limited = tonic::Status::with_error_details(
            tonic::Code::ResourceExhausted,
            "over the rate",
            ErrorDetails::with_retry_info(Some(Duration::from_secs(3))),
        );
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
        assert_eq!(b.next_delay_after(&limited), Duration::from_secs(3));
        let plain = tonic::Status::unavailable("down");
        assert!(b.next_delay_after(&plain) < Duration::from_secs(1));
    }

    #[test]
    fn grows_within_half_and_full_cap_then_stays_capped() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let caps = [100u64, 200, 400, 800, 1600, 2000, 2000, 2000];
        for cap in caps {
            let d = b.next_delay();
            let cap = Duration::from_millis(cap);
            assert!(
                d >= cap / 2 && d <= cap,
                "{d:?} not in [{:?}, {cap:?}]",
                cap / 2
            );
        }
        assert_eq!(b.failures(), 8);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn many_failures_do_not_overflow() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        for _ in 0..100 {
            assert!(b.next_delay() <= Duration::from_secs(30));
        }
    }
}
