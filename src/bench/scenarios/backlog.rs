//! The e2e and dispatch figures with a small and a large backlog queued in
//! the same queue as the measured jobs.
//!
//! The backlog must stay queued, untouched, while the measured jobs run: if
//! it were runnable, idle workers would claim it (so no worker would ever be
//! idle for the dispatch probe) and the small backlog would be gone within a
//! second. So backlog jobs are QUEUED with priority -1 and a `run_at` a day
//! ahead; the measured jobs have priority 0 and are due now. Every claim
//! still has to find the measured jobs among, or past, the backlog rows.

use std::time::Duration;

use chrono::Utc;

use super::super::conn::Conn;
use super::super::error::BenchError;
use super::super::stats::{Summary, rate, summarize};
use super::dispatch::Dispatch;
use super::load::{prefill, progress};
use super::pipeline::Pipeline;
use super::settle::Settle;

/// What the output says was done, so a reader knows what the figure means.
pub const ARRANGEMENT: &str = "backlog jobs QUEUED in the measured queue with priority -1 and \
     run_at now+24h (not runnable, never claimed); measured jobs priority 0, due now; \
     a CHECKPOINT and a wait for the CPU to settle before each size's e2e and dispatch parts";

/// The figures at one backlog size.
#[derive(Debug)]
pub struct AtSize {
    /// Jobs queued behind the measured ones.
    pub backlog: u64,
    /// e2e throughput of the measured jobs.
    pub e2e_jobs_per_s: f64,
    /// Their time in queue.
    pub queue: Option<Summary>,
    /// Dispatch latency to an idle worker.
    pub dispatch: Option<Summary>,
}

/// What to run at each size.
pub struct Plan {
    /// The e2e part.
    pub pipeline: Pipeline,
    /// Measured e2e jobs per size.
    pub e2e_jobs: u64,
    /// e2e jobs before those, not measured.
    pub warmup: u64,
    /// The dispatch part.
    pub dispatch: Dispatch,
    /// Run before each size's e2e and dispatch parts, so that the work the
    /// backlog's growth left behind (WAL to write, a million rows to vacuum)
    /// is not measured as the large backlog's cost.
    pub settle: Settle,
}

/// Grows the backlog of `plan`'s queue to each of `sizes` in turn (ascending)
/// and measures there; `at_size` is called with each result as it comes.
pub async fn run(
    conn: &Conn,
    plan: &Plan,
    sizes: &[u64],
    mut at_size: impl FnMut(AtSize) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let queue = &plan.pipeline.queue;
    let mut queued = 0;
    for &size in sizes {
        if size > queued {
            progress(&format!(
                "growing the backlog of {queue} from {queued} to {size} jobs"
            ));
            let later = Utc::now() + chrono::Duration::days(1);
            prefill(conn, queue, size - queued, -1, Some(later.into())).await?;
            queued = size;
        }
        plan.settle.wait().await;
        if plan.warmup > 0 {
            plan.pipeline.run(conn, plan.warmup).await?;
        }
        let e2e = plan.pipeline.run(conn, plan.e2e_jobs).await?;
        plan.settle.wait().await;
        let dispatch = plan.dispatch.run(conn).await?;
        at_size(AtSize {
            backlog: size,
            e2e_jobs_per_s: rate(e2e.completed, e2e.elapsed),
            queue: summarize(e2e.queue_times),
            dispatch: summarize(dispatch),
        })?;
    }
    Ok(())
}

/// `large / small` for a ratio in the report (`None` when undefined).
pub fn ratio(large: f64, small: f64) -> Option<f64> {
    (small > 0.0 && large.is_finite()).then(|| large / small)
}

/// A latency ratio: `large / small` in seconds.
pub fn latency_ratio(large: Option<Duration>, small: Option<Duration>) -> Option<f64> {
    ratio(large?.as_secs_f64(), small?.as_secs_f64())
}
