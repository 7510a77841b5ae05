//! Latency percentiles and rates: pure functions over the samples a scenario
//! collected on the client side.

use std::time::Duration;

/// Percentiles of a set of latency samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Median (nearest rank).
    pub p50: Duration,
    /// 99th percentile (nearest rank).
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
    /// Arithmetic mean.
    pub mean: Duration,
}

/// The summary of `samples`, or `None` when there are none.
pub fn summarize(mut samples: Vec<Duration>) -> Option<Summary> {
    samples.sort_unstable();
    let count = samples.len();
    let max = *samples.last()?;
    let total: Duration = samples.iter().sum();
    // count fits in u32 for any sample set that fits in memory here; saturate
    // rather than wrap if it ever does not.
    let mean = total / u32::try_from(count).unwrap_or(u32::MAX);
    Some(Summary {
        count,
        p50: percentile(&samples, 0.50)?,
        p99: percentile(&samples, 0.99)?,
        max,
        mean,
    })
}

/// The `q` quantile (0..=1) of `sorted` by the nearest-rank method: the
/// smallest sample such that at least `q` of all samples are at or below it.
/// `None` for no samples.
pub fn percentile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    // Nearest rank is ceil(q * n), 1-based; q = 0 is the minimum.
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Events per second over `elapsed` (0 for no time at all).
pub fn rate(events: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        events as f64 / secs
    } else {
        0.0
    }
}

/// A duration in milliseconds, as the reports print it.
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn no_samples_no_summary() {
        assert_eq!(summarize(Vec::new()), None);
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn one_sample_is_every_percentile() {
        let s = summarize(vec![ms(7)]).expect("one sample");
        assert_eq!(
            (s.count, s.p50, s.p99, s.max, s.mean),
            (1, ms(7), ms(7), ms(7), ms(7))
        );
    }

    #[test]
    fn nearest_rank_over_one_to_a_hundred() {
        // Shuffled on purpose: summarize sorts.
        let samples: Vec<Duration> = (1..=100).rev().map(ms).collect();
        let s = summarize(samples).expect("samples");
        assert_eq!(s.count, 100);
        assert_eq!(s.p50, ms(50));
        assert_eq!(s.p99, ms(99));
        assert_eq!(s.max, ms(100));
        assert_eq!(s.mean, Duration::from_micros(50_500));
    }

    #[test]
    fn p99_of_few_samples_is_the_largest() {
        let sorted = [ms(1), ms(2), ms(3), ms(40)];
        assert_eq!(percentile(&sorted, 0.99), Some(ms(40)));
        assert_eq!(percentile(&sorted, 0.50), Some(ms(2)));
        assert_eq!(percentile(&sorted, 0.0), Some(ms(1)));
        assert_eq!(percentile(&sorted, 1.0), Some(ms(40)));
    }

    #[test]
    fn rates_and_millis() {
        assert_eq!(rate(500, Duration::from_millis(250)), 2000.0);
        assert_eq!(rate(5, Duration::ZERO), 0.0);
        assert_eq!(millis(Duration::from_micros(1500)), 1.5);
    }
}
