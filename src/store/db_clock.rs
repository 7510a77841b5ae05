//! The database's clock, as a replica knows it between statements.
//!
//! On PostgreSQL every lease, deadline and backoff decision is taken by the
//! database's `now()` inside the statement that acts on it, so replicas with
//! skewed clocks agree. A check that comes before any statement, such as
//! `Submit` refusing a deadline that has passed, reads this clock instead:
//! the replica's own clock corrected by the offset the database last
//! showed, measured the way NTP does (the database's time against the
//! middle of the round trip that asked for it), so the error is half a
//! round trip plus the drift since the last reading.

use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, Utc};

/// The database's time minus this process's, in microseconds.
#[derive(Debug, Default)]
pub struct DbClock {
    offset_us: AtomicI64,
}

impl DbClock {
    /// The database's time now, as best known.
    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + chrono::Duration::microseconds(self.offset_us.load(Ordering::Relaxed))
    }

    /// Takes a reading: the database said `db_time` in answer to a query
    /// sent at `sent` and answered at `answered` (both this process's time).
    pub fn observe(&self, sent: DateTime<Utc>, db_time: DateTime<Utc>, answered: DateTime<Utc>) {
        self.offset_us
            .store(offset(sent, db_time, answered), Ordering::Relaxed);
    }
}

/// `db_time` minus the middle of the round trip, in microseconds.
fn offset(sent: DateTime<Utc>, db_time: DateTime<Utc>, answered: DateTime<Utc>) -> i64 {
    let middle = sent + (answered - sent) / 2;
    (db_time - middle).num_microseconds().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp_millis(1_800_000_000_000 + ms).expect("a valid time")
    }

    #[test]
    fn the_offset_is_taken_against_the_middle_of_the_round_trip() {
        // Sent at 0, answered at 10 ms; the database said 120 s + 5 ms.
        assert_eq!(offset(at(0), at(120_005), at(10)), 120_000_000);
        // A database behind this process.
        assert_eq!(offset(at(0), at(-2_995), at(10)), -3_000_000);
    }

    #[test]
    fn the_clock_follows_the_last_reading() {
        let clock = DbClock::default();
        let drift = (clock.now() - Utc::now()).num_milliseconds().abs();
        assert!(drift < 1_000, "no reading yet: the process's own clock");
        let now = Utc::now();
        clock.observe(now, now + chrono::Duration::minutes(2), now);
        let ahead = clock.now() - Utc::now();
        assert!(
            ahead > chrono::Duration::seconds(119) && ahead < chrono::Duration::seconds(121),
            "{ahead:?}"
        );
    }
}
