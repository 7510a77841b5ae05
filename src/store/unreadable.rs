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

use std::sync::atomic::{AtomicU64, Ordering};

use super::StoreResult;

/// The rows a store has left out since it opened.
#[derive(Debug, Default)]
pub struct Unreadable {
    left_out: AtomicU64,
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
}
