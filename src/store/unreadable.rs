//! Rows the server cannot read.
//!
//! Every row is written by intray, so a row that does not parse was changed
//! behind its back (by hand, or by a newer or broken version). Such a row
//! must not fail every call that meets it: a claim that failed on it would
//! fail all its callers (and where the claim rolls back, fail again on every
//! try, the row still at the head of its queue), and a reaper pass that
//! failed on it would leave every other expired lease unreclaimed. So batch
//! reads leave it out and log it with its id, for an operator to mend; a
//! claimed one stays `running` under a lease nobody holds, out of every
//! queue, and the reaper leaves it there. Each one left out is also
//! counted, for the `intray_unreadable_job_rows_total` metric: the reaper
//! meets an unmended row again on every pass, so the count keeps rising
//! until someone mends it.
//!
//! An unmended row stays at the head of the reaper's order, so a pass reads
//! as many rows more than its batch as the last pass left out: rows that
//! cannot be read never fill the batch and stall the reaper, and a mended
//! one is reaped like any other.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::StoreResult;

/// Most rows a reaper pass reads beyond its batch for those it left out
/// last time: each is read whole, payload and all, on every pass.
const MAX_REAPER_EXTRA: u32 = 10_000;

/// The jobs read from rows, each with its row.
type Readable<'r, R, T> = Vec<(&'r R, T)>;

/// The rows a store has left out since it opened.
#[derive(Debug, Default)]
pub struct Unreadable {
    left_out: AtomicU64,
    /// Rows the reaper's last pass left out, in the larger of its reads.
    reaper_head: AtomicU32,
}

impl Unreadable {
    /// What `read` makes of the rows that can be read (jobs), in row
    /// order, each with its row. A row that cannot is counted and logged
    /// at error level, with its id (`id` reads that alone) and `during`
    /// (what met it).
    pub fn readable<'r, R, T>(
        &self,
        rows: &'r [R],
        read: impl Fn(&R) -> StoreResult<T>,
        id: impl Fn(&R) -> Option<String>,
        during: &str,
    ) -> Vec<(&'r R, T)> {
        let mut jobs = Vec::with_capacity(rows.len());
        for row in rows {
            match read(row) {
                Ok(job) => jobs.push((row, job)),
                Err(err) => {
                    self.left_out.fetch_add(1, Ordering::Relaxed);
                    let job_id = id(row).unwrap_or_default();
                    tracing::error!(error = %err, job_id = %job_id, during, "left out a job row that cannot be read; mend or delete it");
                }
            }
        }
        jobs
    }

    /// Rows left out so far, each time one was met.
    pub fn left_out(&self) -> u64 {
        self.left_out.load(Ordering::Relaxed)
    }

    /// How many rows of each order a reaper pass of `batch` jobs reads: the
    /// batch and the rows the last pass left out.
    pub fn reaper_limit(&self, batch: u32) -> u32 {
        let extra = self.reaper_head.load(Ordering::Relaxed);
        batch.saturating_add(extra.min(MAX_REAPER_EXTRA))
    }

    /// The readable jobs of a reaper pass's two reads (expired leases, past
    /// deadlines; see [`Self::readable`]), at most `batch` of each. Notes
    /// how many rows each left out for [`Self::reaper_limit`].
    pub fn reaper_readable<'r, R, T>(
        &self,
        (leases, deadlines): (&'r [R], &'r [R]),
        read: impl Fn(&R) -> StoreResult<T>,
        id: impl Fn(&R) -> Option<String>,
        batch: u32,
    ) -> (Readable<'r, R, T>, Readable<'r, R, T>) {
        let batch = usize::try_from(batch).unwrap_or(usize::MAX);
        let mut expired = self.readable(leases, &read, &id, "the reaper");
        let mut past = self.readable(deadlines, &read, &id, "the reaper");
        self.reaper_read(&[(leases.len(), expired.len()), (deadlines.len(), past.len())]);
        expired.truncate(batch);
        past.truncate(batch);
        (expired, past)
    }

    /// What a reaper pass made of its reads (`read` rows each, `kept`
    /// readable), for [`Self::reaper_limit`] of the next.
    fn reaper_read(&self, reads: &[(usize, usize)]) {
        let left_out = reads
            .iter()
            .map(|&(read, kept)| read.saturating_sub(kept))
            .max()
            .unwrap_or(0);
        self.reaper_head.store(
            u32::try_from(left_out).unwrap_or(u32::MAX),
            Ordering::Relaxed,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;

    #[test]
    fn a_row_that_cannot_be_read_is_left_out() {
        let rows = ["a", "bad", "c"];
        let read = |row: &&str| {
            if *row == "bad" {
                Err(StoreError::Internal("labels".into()))
            } else {
                Ok(row.to_uppercase())
            }
        };
        let unreadable = Unreadable::default();
        let jobs = unreadable.readable(&rows, read, |row| Some(row.to_string()), "a test");
        let kept: Vec<(&str, &str)> = jobs
            .iter()
            .map(|(row, job)| (**row, job.as_str()))
            .collect();
        assert_eq!(kept, [("a", "A"), ("c", "C")]);
        unreadable.readable(&rows, read, |row| Some(row.to_string()), "a test");
        assert_eq!(unreadable.left_out(), 2, "counted each time it is met");
    }

    #[test]
    fn the_reaper_reads_past_the_rows_its_last_pass_left_out() {
        let unreadable = Unreadable::default();
        assert_eq!(unreadable.reaper_limit(500), 500);
        unreadable.reaper_read(&[(500, 0), (3, 3)]);
        assert_eq!(unreadable.reaper_limit(500), 1000);
        unreadable.reaper_read(&[(1000, 400), (0, 0)]);
        assert_eq!(unreadable.reaper_limit(500), 1100);
        unreadable.reaper_read(&[(u32::MAX as usize, 0)]);
        assert_eq!(unreadable.reaper_limit(500), 500 + MAX_REAPER_EXTRA);
        unreadable.reaper_read(&[(500, 500)]);
        assert_eq!(unreadable.reaper_limit(500), 500, "mended");
    }
}
