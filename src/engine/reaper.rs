//! The reaper: reclaims expired leases (including cancels past their grace),
//! expires queued jobs past their deadline, and deletes finished jobs older
//! than the retention window. Every replica runs one; the
//! store's row locks keep them from processing a job twice.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::observer::Observer;
use crate::store::{Reaped, Store};

/// Rows of each kind handled per transaction, so one pass never holds many
/// locks or blocks the hot path for long.
const BATCH: u32 = 500;

/// Runs passes every `interval` until `stop` fires. A pass that filled its
/// batch is followed at once by another.
/// What the pass ended goes to `observer` (spans, metrics, logs).
pub async fn run(
    store: Arc<dyn Store>,
    interval: Duration,
    retention: Duration,
    observer: Arc<Observer>,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        // Once per interval, not per batch: the reading only drifts slowly.
        if let Err(err) = store.read_clock().await {
            tracing::warn!(error = %err, "reading the database's clock failed; retrying next interval");
        }
        loop {
            match store.reap(BATCH, retention).await {
                Ok(reaped) => {
                    for ended in &reaped.ended {
                        observer.reclaimed(ended);
                    }
                    for event in &reaped.expired {
                        observer.deadline_passed(event);
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
