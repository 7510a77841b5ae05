//! The reaper: reclaims expired leases (including cancels past their grace),
//! expires queued jobs past their deadline, and deletes finished jobs older
//! than the retention window. Every replica runs one; the
//! store's row locks keep them from processing a job twice.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::observer::Observer;
use crate::store::{Reaped, Store};

/// Rows of each kind handled per transaction, so one pass never holds many
/// locks or blocks the hot path for long.
const BATCH: u32 = 500;

/// Passes asked for besides the interval's, at most this many at once;
/// past it the interval's passes still come.
const MOST_SCHEDULED: usize = 10_000;

/// Passes closer together than this are one pass, at the latest of their
/// times: a burst of cancels costs one.
const MERGE: Duration = Duration::from_millis(20);

/// Requests not yet read by a reaper busy with a long pass; past them a
/// request is dropped, and the interval's passes still come.
const WAITING_REQUESTS: usize = 1024;

/// A second pass this long after the first, for a job the first could not
/// end: its row locked at that moment, or this replica's reading of the
/// database's clock behind.
const FOLLOW_UP: Duration = Duration::from_secs(1);

/// Asks the reaper of this replica for a pass at a given time, besides
/// its interval's. A cancelled running job's lease ends when its grace
/// does, and SPEC has it `CANCELLED` at the latest then, not at the next
/// interval. The replica that took the cancel wakes for it; if it stops
/// first, another replica's interval pass ends the job.
#[derive(Clone, Debug)]
pub struct ReapAt {
    wakes: mpsc::Sender<Instant>,
}

impl ReapAt {
    /// A handle, and the receiver to give [`run`].
    pub fn new() -> (ReapAt, mpsc::Receiver<Instant>) {
        let (wakes, received) = mpsc::channel(WAITING_REQUESTS);
        (ReapAt { wakes }, received)
    }

    /// A pass once `delay` has passed, and a follow-up [`FOLLOW_UP`] later.
    pub fn after(&self, delay: Duration) {
        let at = Instant::now() + delay;
        // Full, or the reaper stopped (shutdown): the interval covers it.
        let _ = self.wakes.try_send(at);
        let _ = self.wakes.try_send(at + FOLLOW_UP);
    }
}

/// Runs passes every `interval`, and at the times `wakes` asks for, until
/// `stop` fires. A pass that filled its batch is followed at once by
/// another. What the pass ended goes to `observer` (spans, metrics, logs).
pub async fn run(
    store: Arc<dyn Store>,
    interval: Duration,
    retention: Duration,
    observer: Arc<Observer>,
    mut wakes: mpsc::Receiver<Instant>,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scheduled = BTreeSet::new();
    loop {
        let next = scheduled.first().copied();
        let on_tick = tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => true,
            Some(at) = wakes.recv() => {
                schedule(&mut scheduled, at);
                continue;
            }
            () = sleep_until(next) => {
                let now = Instant::now();
                scheduled.retain(|&at| at > now);
                false
            }
        };
        // Once per interval, not per batch: the reading only drifts slowly.
        if on_tick && let Err(err) = store.read_clock().await {
            tracing::warn!(error = %err, "reading the database's clock failed; retrying next interval");
        }
        // Deleting what is past retention is the interval's work: a pass
        // booked for a cancel's grace only ends leases and deadlines.
        let retention = on_tick.then_some(retention);
        loop {
            match store.reap(BATCH, retention).await {
                Ok(reaped) => {
                    for ended in &reaped.ended {
                        observer.reclaimed(ended);
                    }
                    for (job, event) in &reaped.expired {
                        observer.deadline_passed(job, event);
                    }
                    if reaped != Reaped::default() {
                        tracing::info!(
                            expired_leases = reaped.expired_leases,
                            expired_deadlines = reaped.expired_deadlines,
                            deleted = reaped.deleted,
                            "reaper pass"
                        );
                    }
                    let full = [
                        reaped.expired_leases,
                        reaped.expired_deadlines,
                        reaped.deleted,
                    ]
                    .contains(&u64::from(BATCH));
                    if !full || stop.is_cancelled() {
                        break;
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, "reaper pass failed; retrying next interval");
                    break;
                }
            }
        }
    }
}

/// Adds a pass at `at`, unless [`MOST_SCHEDULED`] are due. One due within
/// [`MERGE`] of it becomes a pass at the later of the two, so that no pass
/// comes before a time asked for.
fn schedule(scheduled: &mut BTreeSet<Instant>, at: Instant) {
    let from = at.checked_sub(MERGE).unwrap_or(at);
    let near: Vec<Instant> = scheduled.range(from..=at + MERGE).copied().collect();
    let latest = near.iter().copied().fold(at, Instant::max);
    for merged in &near {
        scheduled.remove(merged);
    }
    if scheduled.len() < MOST_SCHEDULED {
        scheduled.insert(latest);
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_asked_for_close_together_are_one_at_the_latest() {
        let mut scheduled = BTreeSet::new();
        let at = Instant::now() + Duration::from_secs(1);
        schedule(&mut scheduled, at);
        schedule(&mut scheduled, at + MERGE / 2);
        schedule(&mut scheduled, at - MERGE / 2);
        assert_eq!(
            scheduled.iter().copied().collect::<Vec<_>>(),
            [at + MERGE / 2],
            "never before a time asked for"
        );
        schedule(&mut scheduled, at + MERGE * 2);
        assert_eq!(scheduled.len(), 2);
    }

    #[test]
    fn passes_past_the_bound_are_left_to_the_interval() {
        let mut scheduled = BTreeSet::new();
        let start = Instant::now();
        for i in 0..=MOST_SCHEDULED as u32 {
            schedule(&mut scheduled, start + MERGE * 2 * (i + 1));
        }
        assert_eq!(scheduled.len(), MOST_SCHEDULED);
    }
}
