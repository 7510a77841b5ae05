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
//! looks at an unmended row again every minute (below), so the count keeps
//! rising until someone mends it.
//!
//! An unmended row would stay at the head of the reaper's order, and 500 of
//! them would fill every pass's batch and stall the reaper. So the rows a
//! reaper pass leaves out are set aside (up to [`MAX_SET_ASIDE`]): later
//! passes read past them, and every [`RECHECK_EVERY`] they are read again
//! by key, and those mended (or deleted) since are let back in.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::{StoreError, StoreResult};

/// How often the rows set aside are read again.
const RECHECK_EVERY: Duration = Duration::from_secs(60);
/// Most rows set aside per store: each pass compares every expired row
/// with each of them. Beyond it the reaper meets the others on every pass
/// again, and 500 of those stall it until they are mended.
const MAX_SET_ASIDE: usize = 2_000;
/// Rows read per statement when the rows set aside are read again: each is
/// read whole, payload and all.
pub const RECHECK_CHUNK: usize = 100;

/// The answer to an item whose job row cannot be read: the item alone is
/// refused, its neighbours in the batch are answered.
pub fn refused() -> StoreError {
    StoreError::Internal("the job's row cannot be read; an operator must mend or delete it".into())
}

/// The jobs read from rows, each with its row.
type Readable<'r, R, T> = Vec<(&'r R, T)>;

/// Where a job row is: its tenant and id (as text), the primary key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RowKey {
    /// The row's tenant.
    pub tenant: String,
    /// The row's id.
    pub id: String,
}

/// The rows a store has left out since it opened.
#[derive(Debug, Default)]
pub struct Unreadable {
    left_out: AtomicU64,
    set_aside: Mutex<SetAside>,
}

/// The rows the reaper reads past, and when they were last read again.
#[derive(Debug, Default)]
struct SetAside {
    keys: HashSet<RowKey>,
    checked: Option<Instant>,
}

impl Unreadable {
    /// What `read` makes of the rows that can be read (jobs), in row
    /// order, each with its row. A row that cannot is counted and logged
    /// at error level, with its id (`key` reads that alone) and `during`
    /// (what met it).
    pub fn readable<'r, R, T>(
        &self,
        rows: &'r [R],
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
        during: &str,
    ) -> Readable<'r, R, T> {
        self.split_readable(rows, read, key, during).0
    }

    /// [`Self::readable`] of one row, for the one item it answers: its job,
    /// or [`refused`] when it cannot be read.
    pub fn read_one<R, T>(
        &self,
        row: &R,
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
        during: &str,
    ) -> StoreResult<T> {
        self.readable(std::slice::from_ref(row), read, key, during)
            .pop()
            .map(|(_, job)| job)
            .ok_or_else(refused)
    }

    /// [`Self::readable`], and the ids of the jobs whose rows were left
    /// out: a batch refuses their items alone ([`refused`]).
    pub fn readable_by_id<'r, R, T>(
        &self,
        rows: &'r [R],
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
        during: &str,
    ) -> (Readable<'r, R, T>, HashSet<Uuid>) {
        let (jobs, left_out) = self.split_readable(rows, read, key, during);
        let ids = left_out
            .iter()
            .filter_map(|key| Uuid::parse_str(&key.id).ok())
            .collect();
        (jobs, ids)
    }

    /// [`Self::readable`], and the keys of the rows left out.
    fn split_readable<'r, R, T>(
        &self,
        rows: &'r [R],
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
        during: &str,
    ) -> (Readable<'r, R, T>, Vec<RowKey>) {
        let mut jobs = Vec::with_capacity(rows.len());
        let mut left_out = Vec::new();
        for row in rows {
            match read(row) {
                Ok(job) => jobs.push((row, job)),
                Err(err) => {
                    self.left_out.fetch_add(1, Ordering::Relaxed);
                    let key = key(row);
                    let job_id = key.as_ref().map_or("", |k| k.id.as_str());
                    tracing::error!(error = %err, job_id = %job_id, during, "left out a job row that cannot be read; mend or delete it");
                    left_out.extend(key);
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
        self.lock().keys.iter().map(|k| k.id.clone()).collect()
    }

    /// The rows to read again now (by key, in chunks of [`RECHECK_CHUNK`]),
    /// if any are set aside and the last reading was [`RECHECK_EVERY`] ago;
    /// the first after the set was empty comes at once. The caller hands what it read to
    /// [`Self::rechecked`].
    pub fn due_again(&self) -> Option<Vec<RowKey>> {
        self.due_again_at(Instant::now())
    }

    fn due_again_at(&self, now: Instant) -> Option<Vec<RowKey>> {
        let mut set = self.lock();
        if set.keys.is_empty() || set.checked.is_some_and(|at| now < at + RECHECK_EVERY) {
            return None;
        }
        set.checked = Some(now);
        Some(set.keys.iter().cloned().collect())
    }

    /// Lets back in the rows of `keys` that `rows` (the rows of those keys
    /// that still exist) shows mended or gone; the others stay set aside,
    /// and are counted and logged again.
    pub fn rechecked<R, T>(
        &self,
        keys: &[RowKey],
        rows: &[R],
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
    ) {
        let (_, still) = self.split_readable(rows, read, key, "the reaper's second look");
        let still: HashSet<&RowKey> = still.iter().collect();
        let mut set = self.lock();
        for key in keys.iter().filter(|key| !still.contains(key)) {
            set.keys.remove(key);
        }
        if set.keys.is_empty() {
            // Rows set aside later get their first look at once too.
            set.checked = None;
        }
    }

    /// The readable jobs of a reaper pass's two reads (expired leases, past
    /// deadlines; see [`Self::readable`]). The rows left out are set aside.
    pub fn reaper_readable<'r, R, T>(
        &self,
        (leases, deadlines): (&'r [R], &'r [R]),
        read: impl Fn(&R) -> StoreResult<T>,
        key: impl Fn(&R) -> Option<RowKey>,
    ) -> (Readable<'r, R, T>, Readable<'r, R, T>) {
        let (expired, mut left_out) = self.split_readable(leases, &read, &key, "the reaper");
        let (past, more) = self.split_readable(deadlines, &read, &key, "the reaper");
        left_out.extend(more);
        if !left_out.is_empty() {
            let mut set = self.lock();
            for key in left_out {
                if set.keys.len() >= MAX_SET_ASIDE {
                    tracing::warn!(
                        max = MAX_SET_ASIDE,
                        "too many unreadable job rows to read past; the reaper meets the rest on every pass"
                    );
                    break;
                }
                set.keys.insert(key);
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

    fn key(row: &&str) -> Option<RowKey> {
        Some(RowKey {
            tenant: "t".into(),
            id: row.trim_start_matches("bad").to_string(),
        })
    }

    fn read(row: &&str) -> StoreResult<String> {
        if row.starts_with("bad") {
            Err(StoreError::Internal("labels".into()))
        } else {
            Ok(row.to_uppercase())
        }
    }

    #[test]
    fn a_row_that_cannot_be_read_is_left_out() {
        let rows = ["a", "bad", "c"];
        let unreadable = Unreadable::default();
        let jobs = unreadable.readable(&rows, read, key, "a test");
        let kept: Vec<(&str, &str)> = jobs
            .iter()
            .map(|(row, job)| (**row, job.as_str()))
            .collect();
        assert_eq!(kept, [("a", "A"), ("c", "C")]);
        unreadable.readable(&rows, read, key, "a test");
        assert_eq!(unreadable.left_out(), 2, "counted each time it is met");
    }

    #[test]
    fn the_reaper_sets_aside_what_it_left_out_until_mended() {
        let unreadable = Unreadable::default();
        assert_eq!(unreadable.due_again(), None, "nothing set aside");
        let (expired, past) = unreadable.reaper_readable((&["bad1", "2"], &["bad3"]), read, key);
        assert_eq!((expired.len(), past.len()), (1, 0));
        let mut aside = unreadable.set_aside();
        aside.sort();
        assert_eq!(aside, ["1", "3"]);
        let start = Instant::now();
        let keys = unreadable.due_again_at(start).expect("due at once");
        assert_eq!(unreadable.due_again_at(start + RECHECK_EVERY / 2), None);
        // Row 1 mended, row 3 still broken.
        unreadable.rechecked(&keys, &["1", "bad3"], read, key);
        assert_eq!(unreadable.set_aside(), ["3"]);
        assert_eq!(unreadable.left_out(), 3, "met again on the second look");
        let keys = unreadable
            .due_again_at(start + RECHECK_EVERY)
            .expect("due a minute later");
        // Deleted meanwhile: no row came back.
        unreadable.rechecked(&keys, &[] as &[&str], read, key);
        assert!(unreadable.set_aside().is_empty());
        unreadable.reaper_readable((&["bad4"], &[]), read, key);
        assert!(
            unreadable.due_again().is_some(),
            "a new set is looked at once"
        );
    }

    #[test]
    fn at_most_so_many_rows_are_set_aside() {
        let unreadable = Unreadable::default();
        let rows: Vec<String> = (0..=MAX_SET_ASIDE).map(|i| format!("bad{i}")).collect();
        let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
        unreadable.reaper_readable((&rows, &[]), read, key);
        assert_eq!(unreadable.set_aside().len(), MAX_SET_ASIDE);
    }
}
