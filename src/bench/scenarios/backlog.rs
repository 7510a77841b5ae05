//! The e2e and dispatch figures with a small and a large backlog queued
//! beside the measured jobs.
//!
//! The two halves need different backlogs. e2e runs behind a runnable
//! backlog: jobs like the measured ones (same queue, priority 0, due now),
//! so every claim takes a backlog job, oldest first, and the producers'
//! outstanding bound, set to the backlog's size and taken up by it, lets one
//! new job in per completion: the queue stays as deep as the backlog for the
//! whole run. Dispatch needs a worker that stays idle, which no runnable job
//! may be in reach of, so it runs beside a scheduled backlog in a queue of
//! its own: priority -1 and `run_at` a day ahead, never claimed; there a
//! claim only has to find the one due job past the backlog's index entries.
//!
//! Each size has queues of its own. In one queue grown from the small size
//! to the large, the large size's claims would also step over the index
//! entries that the small size's claimed jobs left (dead until vacuum:
//! every claim starts at its level's oldest entry), and the ratio would
//! compare one size's churn with two sizes' instead of one size with the
//! other.

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
pub const ARRANGEMENT: &str = "e2e: behind a RUNNABLE backlog in the measured queue (priority 0, \
     due now, like the measured jobs; claimed oldest first), held at the backlog's size by the \
     producers' outstanding bound (one job submitted per job completed); dispatch: beside a \
     SCHEDULED backlog in a queue of its own (priority -1, run_at now+24h: never claimed, so the \
     worker stays idle); queues of their own per size; the sizes measured in turns over 4 rounds \
     (small, large, large, small, ...); a CHECKPOINT and a wait for the CPU to settle before each \
     e2e and dispatch part";

/// The figures at one backlog size.
#[derive(Debug)]
pub struct AtSize {
    /// Jobs in each of the size's backlogs.
    pub backlog: u64,
    /// The queue of the runnable backlog and the e2e jobs.
    pub e2e_queue: String,
    /// The queue of the scheduled backlog and the dispatch jobs.
    pub dispatch_queue: String,
    /// e2e throughput behind the runnable backlog.
    pub e2e_jobs_per_s: f64,
    /// Completions the e2e part's workers had answered, warm-up included:
    /// what the server must count as SUCCEEDED in `e2e_queue`.
    pub e2e_completed: u64,
    /// Dispatch latency to an idle worker beside the scheduled backlog.
    pub dispatch: Option<Summary>,
    /// Dispatch jobs, warm-ups included: what the server must count as
    /// SUCCEEDED in `dispatch_queue`.
    pub dispatch_jobs: u64,
}

/// What to run at each size.
pub struct Plan {
    /// The e2e part; each size's queue is named after its queue, and its
    /// outstanding bound is the size.
    pub pipeline: Pipeline,
    /// Measured e2e jobs per size.
    pub e2e_jobs: u64,
    /// e2e jobs before those, not measured.
    pub warmup: u64,
    /// The dispatch part; each size's queue is named after its queue.
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
    /// Jobs outstanding in the e2e queue now: the backlog, less what the
    /// last run's workers completed beyond its count (the next run's
    /// producers make that up first).
    queued: u64,
    dispatch: Dispatch,
    /// Completions inside the e2e clocks.
    timed: u64,
    elapsed: Duration,
    completed: u64,
    dispatch_times: Vec<Duration>,
    dispatch_jobs: u64,
}

/// Queues both backlogs of each of `sizes` in queues of their own (named
/// after `plan`'s), then measures the sizes in turns over [`ROUNDS`] rounds;
/// `at_size` is called with each size's result at the end, in `sizes`'
/// order. The runnable backlogs stay queued afterwards, like the scheduled.
pub async fn run(
    conn: &Conn,
    plan: &Plan,
    sizes: &[u64],
    mut at_size: impl FnMut(AtSize) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let mut measured = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let runnable = format!("{}-runnable-{size}", plan.pipeline.queue);
        progress(&format!(
            "queueing a runnable backlog of {size} jobs in {runnable}"
        ));
        prefill(conn, &runnable, size, plan.pipeline.priority, None).await?;
        let scheduled = format!("{}-scheduled-{size}", plan.dispatch.queue);
        progress(&format!(
            "queueing a scheduled backlog of {size} jobs in {scheduled}"
        ));
        let later = Utc::now() + chrono::Duration::days(1);
        prefill(conn, &scheduled, size, -1, Some(later.into())).await?;
        measured.push(Measured {
            backlog: size,
            pipeline: Pipeline {
                queue: runnable,
                outstanding: size,
                ..plan.pipeline.clone()
            },
            queued: size,
            dispatch: Dispatch {
                queue: scheduled,
                ..plan.dispatch.clone()
            },
            timed: 0,
            elapsed: Duration::ZERO,
            completed: 0,
            dispatch_times: Vec::new(),
            dispatch_jobs: 0,
        });
    }
    if plan.warmup > 0 {
        for m in &mut measured {
            let warm = m.pipeline.run_behind(conn, plan.warmup, m.queued).await?;
            m.account(plan.warmup, warm.completed);
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
                let e2e = m.pipeline.run_behind(conn, jobs, m.queued).await?;
                m.account(jobs, e2e.completed);
                m.timed += jobs;
                m.elapsed += e2e.elapsed;
            }
            plan.settle.wait().await;
            let probe = Dispatch {
                samples: share(plan.dispatch.samples, round),
                ..m.dispatch.clone()
            };
            m.dispatch_times.extend(probe.run(conn).await?);
            m.dispatch_jobs += probe.warmup + probe.samples;
        }
    }
    for m in measured {
        at_size(AtSize {
            backlog: m.backlog,
            e2e_queue: m.pipeline.queue,
            dispatch_queue: m.dispatch.queue,
            e2e_jobs_per_s: rate(m.timed, m.elapsed),
            e2e_completed: m.completed,
            dispatch: summarize(m.dispatch_times),
            dispatch_jobs: m.dispatch_jobs,
        })?;
    }
    Ok(())
}

impl Measured {
    /// Books an e2e run that submitted `submitted` jobs and completed
    /// `completed` (more, when other workers held or were leasing jobs as
    /// the count was reached).
    fn account(&mut self, submitted: u64, completed: u64) {
        self.completed += completed;
        self.queued = (self.queued + submitted).saturating_sub(completed);
    }
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
