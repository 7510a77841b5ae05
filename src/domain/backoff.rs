//! Exponential backoff with full jitter (SPEC section 3):
//! `delay = uniform(0, min(max, initial * 2^(attempt-1)))`.
//!
//! Full jitter spreads the retries of many jobs that failed together (a
//! provider outage) over the whole window instead of bunching them up.

use std::time::Duration;

/// Shortest allowed base delay.
pub const MIN_INITIAL: Duration = Duration::from_millis(1);
/// Longest allowed base delay.
pub const MAX_INITIAL: Duration = Duration::from_secs(3600);
/// Longest allowed cap.
pub const MAX_CAP: Duration = Duration::from_secs(24 * 3600);

/// A validated backoff policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
}

/// Why a backoff policy was refused; the field is `initial` or `max`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct BackoffError {
    pub field: &'static str,
    pub reason: String,
}

impl Backoff {
    /// Builds a policy, refusing a base outside 1ms..=1h or a cap below the
    /// base or above 24h.
    pub fn try_new(initial: Duration, max: Duration) -> Result<Backoff, BackoffError> {
        if !(MIN_INITIAL..=MAX_INITIAL).contains(&initial) {
            return Err(BackoffError {
                field: "initial",
                reason: "must be between 1ms and 1h".into(),
            });
        }
        if max < initial || max > MAX_CAP {
            return Err(BackoffError {
                field: "max",
                reason: "must be at least initial and at most 24h".into(),
            });
        }
        Ok(Backoff { initial, max })
    }

    /// Base delay.
    pub fn initial(&self) -> Duration {
        self.initial
    }

    /// Cap on the delay.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The upper bound of the jitter window after failed attempt `attempt`
    /// (1-based): `min(max, initial * 2^(attempt-1))`, without overflow.
    pub fn window(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1).min(63);
        let factor = 1u64 << exponent;
        let millis = u64::try_from(self.initial.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_mul(factor);
        Duration::from_millis(millis).min(self.max)
    }

    /// The delay before the next attempt, with `jitter` a uniform draw in
    /// `[0, 1)` supplied by the caller (so this stays pure and testable).
    pub fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.window(attempt).mul_f64(jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(initial_ms: u64, max_ms: u64) -> Backoff {
        Backoff::try_new(
            Duration::from_millis(initial_ms),
            Duration::from_millis(max_ms),
        )
        .expect("valid policy")
    }

    #[test]
    fn window_doubles_then_caps() {
        let b = policy(5_000, 300_000);
        assert_eq!(b.window(1), Duration::from_secs(5));
        assert_eq!(b.window(2), Duration::from_secs(10));
        assert_eq!(b.window(3), Duration::from_secs(20));
        assert_eq!(b.window(7), Duration::from_secs(300));
        assert_eq!(b.window(1000), Duration::from_secs(300));
    }

    #[test]
    fn delay_stays_inside_the_window_for_every_draw() {
        let b = policy(100, 10_000);
        for attempt in 1..=40 {
            for i in 0..=100 {
                let jitter = f64::from(i) / 100.0;
                let d = b.delay(attempt, jitter);
                assert!(d <= b.window(attempt), "attempt {attempt} jitter {jitter}");
            }
            assert_eq!(b.delay(attempt, 0.0), Duration::ZERO);
        }
    }

    #[test]
    fn odd_jitter_values_are_clamped() {
        let b = policy(1_000, 1_000);
        assert_eq!(b.delay(1, f64::NAN), Duration::ZERO);
        assert_eq!(b.delay(1, -3.0), Duration::ZERO);
        assert_eq!(b.delay(1, 7.0), Duration::from_secs(1));
    }

    #[test]
    fn refuses_bad_policies() {
        assert_eq!(
            Backoff::try_new(Duration::ZERO, Duration::from_secs(1))
                .unwrap_err()
                .field,
            "initial"
        );
        assert_eq!(
            Backoff::try_new(Duration::from_secs(2), Duration::from_secs(1))
                .unwrap_err()
                .field,
            "max"
        );
        assert_eq!(
            Backoff::try_new(Duration::from_secs(2), Duration::from_secs(25 * 3600))
                .unwrap_err()
                .field,
            "max"
        );
    }
}
