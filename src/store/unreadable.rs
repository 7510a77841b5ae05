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
//! meets an unmended row again every few passes (below), so the count
//! keeps rising until someone mends it.
//!
//! An unmended row would stay at the head of the reaper's order, and
//! enough of them would fill every pass's batch and stall the reaper. So
//! the rows a reaper pass leaves out are set aside: later passes read past
//! them, and every [`RECHECK_PASSES`]th pass reads them again by id and
//! lets back in those mended (or deleted) since.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::StoreResult;

/// How many reaper passes go by between readings of the rows set aside:
/// a minute at the default interval (5 s).
const RECHECK_PASSES: u32 = 12;
/// Most rows set aside: their ids are bound to every reaper pass. Rows
/// beyond it are left out on every pass they are met, as before they were
/// set aside.
const MAX_SET_ASIDE: usize = 100_000;

/// The jobs read from rows, each with its row.
type Readable<'r, R, T> = Vec<(&'r R, T)>;

/// The rows a store has left out since it opened.
#[derive(Debug, Default)]
pub struct Unreadable {
    left_out: AtomicU64,
    set_aside: Mutex<SetAside>,
}

/// Ids of the rows the reaper reads past, and the passes until they are
/// read again (0: at the next).
#[derive(Debug, Default)]
struct SetAside {
    ids: HashSet<String>,
    passes_left: u32,
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
    ) -> Readable<'r, R, T> {
        self.split_readable(rows, read, id, during).0
    }

    /// [`Self::readable`], and the ids of the rows left out.
    fn split_readable<'r, R, T>(
        &self,
        rows: &'r [R],
        read: impl Fn(&R) -> StoreResult<T>,
        id: impl Fn(&R) -> Option<String>,
        during: &str,
    ) -> (Readable<'r, R, T>, Vec<String>) {
        let mut jobs = Vec::with_capacity(rows.len());
        let mut left_out = Vec::new();
        for row in rows {
            match read(row) {
                Ok(job) => jobs.push((row, job)),
                Err(err) => {
                    self.left_out.fetch_add(1, Ordering::Relaxed);
                    let job_id = id(row).unwrap_or_default();
                    tracing::error!(error = %err, job_id = %job_id, during, "left out a job row that cannot be read; mend or delete it");
                    if !job_id.is_empty() {
                        left_out.push(job_id);
                    }
                }
            }
        }
        (jobs, left_out)
    }

    /// Rows left out so far, each time one was met.
    pub fn left_out(&self) -> u64 {
        self.left_out.load(Ordering::Relaxed)
    }

    /// The ids of the rows a reaper pass reads past.
    pub fn set_aside(&self) -> Vec<String> {
        self.lock().ids.iter().cloned().collect()
    }

    /// Called once per reaper pass: the ids to read again now, if any are
    /// set aside and [`RECHECK_PASSES`] passes went by since the last
    /// reading (the first comes at once). The caller hands the rows it read
    /// to [`Self::rechecked`].
    pub fn due_again(&self) -> Option<Vec<String>> {
        let mut set = self.lock();
        if set.ids.is_empty() {
            return None;
        }
        if set.passes_left > 0 {
            set.passes_left -= 1;
            return None;
        }
        set.passes_left = RECHECK_PASSES - 1;
        Some(set.ids.iter().cloned().collect())
    }

    /// Lets back in the rows of `ids` that `rows` (the rows of those ids
    /// that still exist) shows mended or gone; the others stay set aside,
    /// and are counted and logged again.
    pub fn rechecked<R, T>(
        &self,
        ids: &[String],
        rows: &[R],
        read: impl Fn(&R) -> StoreResult<T>,
        id: impl Fn(&R) -> Option<String>,
    ) {
        let (_, still) = self.split_readable(rows, read, id, "the reaper's second look");
        let still: HashSet<&String> = still.iter().collect();
        let mut set = self.lock();
        for id in ids.iter().filter(|id| !still.contains(id)) {
            set.ids.remove(id);
        }
    }

    /// The readable jobs of a reaper pass's two reads (expired leases, past
    /// deadlines; see [`Self::readable`]). The rows left out are set aside.
    pub fn reaper_readable<'r, R, T>(
        &self,
        (leases, deadlines): (&'r [R], &'r [R]),
        read: impl Fn(&R) -> StoreResult<T>,
        id: impl Fn(&R) -> Option<String>,
    ) -> (Readable<'r, R, T>, Readable<'r, R, T>) {
        let (expired, mut left_out) = self.split_readable(leases, &read, &id, "the reaper");
        let (past, more) = self.split_readable(deadlines, &read, &id, "the reaper");
        left_out.extend(more);
        if !left_out.is_empty() {
            let mut set = self.lock();
            for id in left_out {
                if set.ids.len() >= MAX_SET_ASIDE {
                    tracing::warn!(
                        max = MAX_SET_ASIDE,
                        "too many unreadable job rows to read past; the reaper meets the rest on every pass"
                    );
                    break;
                }
                set.ids.insert(id);
            }
        }
        (expired, past)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SetAside> {
        // The set holds no invariant a panic could break halfway.
        self.set_aside
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    fn the_reaper_sets_aside_what_it_left_out_until_mended() {
        let unreadable = Unreadable::default();
        let read = |row: &&str| {
            if row.starts_with("bad") {
                Err(StoreError::Internal("labels".into()))
            } else {
                Ok(row.to_uppercase())
            }
        };
        let id = |row: &&str| Some(row.trim_start_matches("bad").to_string());
        assert_eq!(unreadable.due_again(), None, "nothing set aside");
        let (expired, past) = unreadable.reaper_readable((&["bad1", "2"], &["bad3"]), read, id);
        assert_eq!((expired.len(), past.len()), (1, 0));
        let mut aside = unreadable.set_aside();
        aside.sort();
        assert_eq!(aside, ["1", "3"]);
        let ids = unreadable.due_again().expect("due at once");
        for _ in 1..RECHECK_PASSES {
            assert_eq!(unreadable.due_again(), None);
        }
        // Row 1 mended, row 3 still broken; a row deleted meanwhile is gone.
        unreadable.rechecked(&ids, &["1", "bad3"], read, id);
        assert_eq!(unreadable.set_aside(), ["3"]);
        assert_eq!(unreadable.left_out(), 3, "met again on the second look");
        assert!(unreadable.due_again().is_some(), "due after as many passes");
        unreadable.rechecked(&["3".to_string()], &[] as &[&str], read, id);
        assert!(unreadable.set_aside().is_empty(), "deleted");
    }
}
