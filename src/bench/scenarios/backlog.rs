//! The e2e and dispatch figures with a small and a large backlog queued in
//! the same queue as the measured jobs.
//!
//! Each size has a queue of its own. In one queue grown from the small size
//! to the large, the large size's claims would also step over the index
//! entries that the small size's claimed jobs left (dead until vacuum:
//! every claim starts at its level's oldest entry), and the ratio would
//! compare one size's churn with two sizes' instead of one size with the
//! other.
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
     one queue per size; the sizes measured in turns over 4 rounds (small, large, large, small, ...); \
     a CHECKPOINT and a wait for the CPU to settle before each e2e and dispatch part";

/// The figures at one backlog size.
#[derive(Debug)]
pub struct AtSize {
    /// Jobs queued behind the measured ones.
    pub backlog: u64,
    /// The queue of this size's backlog and measured jobs.
    pub queue_name: String,
    /// e2e throughput of the measured jobs.
    pub e2e_jobs_per_s: f64,
    /// Their time in queue.
    pub queue: Option<Summary>,
    /// Dispatch latency to an idle worker.
    pub dispatch: Option<Summary>,
}

/// What to run at each size.
pub struct Plan {
    /// The e2e part; each size's queue is named after its queue.
    pub pipeline: Pipeline,
    /// Measured e2e jobs per size.
    pub e2e_jobs: u64,
    /// e2e jobs before those, not measured.
    pub warmup: u64,
    /// The dispatch part; its queue is each size's, like the e2e part's.
    pub dispatch: Dispatch,
    /// Run before each size's e2e and dispatch parts, so that the work the
    /// backlog's queueing left behind (WAL to write, a million rows to vacuum)
    /// is not measured as the large backlog's cost.
    pub settle: Settle,
}

/// Rounds each size's measured jobs and dispatch samples are split into.
/// The sizes take turns, in the order small, large, large, small, and so on,
/// so that a slow spell of this shared machine falls on both alike instead
/// of on whichever size it happened to meet.
const ROUNDS: u64 = 4;

/// What one size has measured so far.
struct Measured {
    backlog: u64,
    pipeline: Pipeline,
    dispatch: Dispatch,
    completed: u64,
    elapsed: Duration,
    queue_times: Vec<Duration>,
    dispatch_times: Vec<Duration>,
}

/// Queues a backlog of each of `sizes` in a queue of its own (named after
/// `plan`'s), then measures the sizes in turns over [`ROUNDS`] rounds;
/// `at_size` is called with each size's result at the end, in `sizes`'
/// order.
pub async fn run(
    conn: &Conn,
    plan: &Plan,
    sizes: &[u64],
    mut at_size: impl FnMut(AtSize) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let mut measured = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let queue = format!("{}-{size}", plan.pipeline.queue);
        progress(&format!("queueing a backlog of {size} jobs in {queue}"));
        let later = Utc::now() + chrono::Duration::days(1);
        prefill(conn, &queue, size, -1, Some(later.into())).await?;
        measured.push(Measured {
            backlog: size,
            pipeline: Pipeline {
                queue: queue.clone(),
                ..plan.pipeline.clone()
            },
            dispatch: Dispatch {
                queue,
                ..plan.dispatch.clone()
            },
            completed: 0,
            elapsed: Duration::ZERO,
            queue_times: Vec::new(),
            dispatch_times: Vec::new(),
        });
    }
    if plan.warmup > 0 {
        for m in &measured {
            m.pipeline.run(conn, plan.warmup).await?;
        }
    }
    for round in 0..ROUNDS {
        let mut turns: Vec<&mut Measured> = measured.iter_mut().collect();
        if round % 2 == 1 {
            turns.reverse();
        }
        for m in turns {
            progress(&format!(
                "backlog of {}: round {} of {ROUNDS}",
                m.backlog,
                round + 1
            ));
            let jobs = share(plan.e2e_jobs, round);
            if jobs > 0 {
                plan.settle.wait().await;
                let e2e = m.pipeline.run(conn, jobs).await?;
                m.completed += e2e.completed;
                m.elapsed += e2e.elapsed;
                m.queue_times.extend(e2e.queue_times);
            }
            plan.settle.wait().await;
            let probe = Dispatch {
                samples: share(plan.dispatch.samples, round),
                ..m.dispatch.clone()
            };
            m.dispatch_times.extend(probe.run(conn).await?);
        }
    }
    for m in measured {
        at_size(AtSize {
            backlog: m.backlog,
            queue_name: m.pipeline.queue,
            e2e_jobs_per_s: rate(m.completed, m.elapsed),
            queue: summarize(m.queue_times),
            dispatch: summarize(m.dispatch_times),
        })?;
    }
    Ok(())
}

/// Round `round`'s part of `total`: the rounds' parts add up to `total`.
fn share(total: u64, round: u64) -> u64 {
    total / ROUNDS + u64::from(round < total % ROUNDS)
}

/// `large / small` for a ratio in the report (`None` when undefined).
pub fn ratio(large: f64, small: f64) -> Option<f64> {
    (small > 0.0 && large.is_finite()).then(|| large / small)
}

/// A latency ratio: `large / small` in seconds.
pub fn latency_ratio(large: Option<Duration>, small: Option<Duration>) -> Option<f64> {
    ratio(large?.as_secs_f64(), small?.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rounds_share_out_every_job() {
        for total in [0, 1, 3, 4, 5, 1000, 1003] {
            let parts: Vec<u64> = (0..ROUNDS).map(|r| share(total, r)).collect();
            assert_eq!(parts.iter().sum::<u64>(), total, "{parts:?}");
            let (min, max) = (parts.iter().min(), parts.iter().max());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{parts:?}");
        }
    }

    #[test]
    fn the_arrangement_names_the_rounds() {
        assert!(ARRANGEMENT.contains(&format!("over {ROUNDS} rounds")));
    }
}
