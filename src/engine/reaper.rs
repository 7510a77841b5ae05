//! The reaper: reclaims expired leases (including cancels past their grace)
//! and expires queued jobs past their deadline. Every replica runs one; the
//! store's row locks keep them from processing a job twice.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::Store;

/// Rows of each kind handled per transaction, so one pass never holds many
/// locks or blocks the hot path for long.
const BATCH: u32 = 500;

/// Runs passes every `interval` until `stop` fires. A pass that filled its
/// batch is followed at once by another.
pub async fn run(store: Arc<dyn Store>, interval: Duration, stop: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        loop {
            match store.reap(BATCH).await {
                Ok(reaped) => {
                    if reaped.expired_leases > 0 || reaped.expired_deadlines > 0 {
                        tracing::info!(
                            expired_leases = reaped.expired_leases,
                            expired_deadlines = reaped.expired_deadlines,
                            "reaper pass"
                        );
                    }
                    let full = reaped.expired_leases == u64::from(BATCH)
                        || reaped.expired_deadlines == u64::from(BATCH);
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
