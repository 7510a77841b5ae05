//! Refreshes the database gauges of `/metrics` (jobs by state, oldest
//! runnable age, leases in flight, workers) and the store's count of unreadable
//! rows on a timer, so that a scrape never queries the database and a
//! scraper cannot load it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::WORKERS_WINDOW;
use crate::store::Store;
use crate::telemetry::Metrics;

/// Reads the gauges every `interval` until `stop` fires.
pub async fn run(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        metrics.set_unreadable_rows(store.unreadable_rows());
        match store.queue_depths().await {
            Ok(depths) => metrics.set_depths(&depths),
            Err(err) => {
                metrics.refresh_failed();
                tracing::warn!(error = %err, "could not refresh the queue gauges");
            }
        }
        match store.active_workers(WORKERS_WINDOW).await {
            Ok(workers) => metrics.set_workers(&workers),
            Err(err) => {
                metrics.refresh_failed();
                tracing::warn!(error = %err, "could not refresh the workers gauge");
            }
        }
    }
}
