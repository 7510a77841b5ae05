//! Producers and remote workers running at once until a fixed number of jobs
//! has completed: the engine of e2e, e2e-batched, burn-down and backlog.
//!
//! Producers left to submit as fast as they can finish long before the
//! workers: the queue then grows through the run, time in queue grows with
//! the run's length, and the run ends in a drain with no producer calls
//! competing, faster than the loaded part, which flatters jobs/s. So a
//! producer takes room for each job before submitting it, and a worker
//! gives the room back once the job's completion has been answered: the
//! jobs outstanding (queued, leased or being completed) never exceed
//! [`Pipeline::outstanding`], and the queue's depth stays level.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::super::conn::{Conn, Jobs, Workers};
use super::super::error::BenchError;
use super::load::{job, submit_batch, success};
use crate::pb::{
    CompleteAndLeaseRequest, CompleteBatchRequest, CompleteBatchResult, LeaseRequest, LeasedJob,
    complete_batch_result,
};

/// How long a worker's Lease long-polls when the queue is empty.
const LEASE_WAIT: Duration = Duration::from_secs(5);
/// A run with no job completed for this long has lost jobs or its server.
const STALL: Duration = Duration::from_secs(60);

/// How jobs are submitted and worked.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// Queue of every job.
    pub queue: String,
    /// Concurrent producers, each on its own connection.
    pub producers: usize,
    /// Concurrent workers, each on its own connection.
    pub workers: usize,
    /// Jobs per submit call: 1 is unary Submit, more is SubmitBatch.
    pub submit_batch: usize,
    /// Lease `max_jobs`: 1 completes each job with Complete, more with one CompleteBatch per lease.
    pub lease_max: u32,
    /// Priority of the submitted jobs.
    pub priority: i32,
    /// Workers report outcomes with CompleteAndLease, which claims their
    /// next jobs in the same call; they Lease only when it found none.
    pub chain: bool,
    /// Most jobs of the queue submitted and not yet answered as completed;
    /// producers wait for room before each submit call. At least
    /// `submit_batch`, or a batch would never find room.
    pub outstanding: u64,
}

/// What a run measured.
#[derive(Debug)]
pub struct Outcome {
    /// From the first submit (or the workers' start, when draining) until
    /// the run's `jobs`-th completion was answered.
    pub elapsed: Duration,
    /// Completions answered: the run's `jobs`, and, when more jobs were
    /// queued than the run completes (behind a backlog), one more at most
    /// per other worker: the job it held, or was leasing, as the count was
    /// reached, completed after the clock stopped.
    pub completed: u64,
    /// Per job: lease received minus submit returned (empty when draining).
    pub queue_times: Vec<Duration>,
}

/// What one task hands back: job ids with the instant they were submitted
/// (producers) or received in a lease (workers).
enum Times {
    Submitted(Vec<(String, Instant)>),
    Leased(Vec<(String, Instant)>),
}

/// Counters shared by a run's tasks.
struct Shared {
    jobs: u64,
    next: AtomicU64,
    completed: AtomicU64,
    /// A permit per job that may still be submitted without exceeding the
    /// outstanding bound.
    room: Semaphore,
    /// More jobs are queued than the run completes.
    behind_backlog: bool,
    done: CancellationToken,
}

impl Pipeline {
    /// Submits `jobs` jobs into an empty queue while the workers complete them.
    pub async fn run(&self, conn: &Conn, jobs: u64) -> Result<Outcome, BenchError> {
        self.go(conn, jobs, Some(0)).await
    }

    /// Submits `jobs` jobs into a queue that already holds `queued` runnable
    /// jobs, which count against the outstanding bound, while the workers
    /// complete `jobs` jobs, oldest first: with `queued` equal to the bound,
    /// each completion lets one job in, and the queue stays `queued` deep.
    pub async fn run_behind(
        &self,
        conn: &Conn,
        jobs: u64,
        queued: u64,
    ) -> Result<Outcome, BenchError> {
        self.go(conn, jobs, Some(queued)).await
    }

    /// Workers drain `jobs` jobs already queued.
    pub async fn drain(&self, conn: &Conn, jobs: u64) -> Result<Outcome, BenchError> {
        self.go(conn, jobs, None).await
    }

    /// Runs producers when `queued` (the jobs already outstanding) is given,
    /// only workers when it is not.
    async fn go(&self, conn: &Conn, jobs: u64, queued: Option<u64>) -> Result<Outcome, BenchError> {
        // Connections first, so the clock measures jobs, not handshakes.
        let mut producers = Vec::new();
        if queued.is_some() {
            for _ in 0..self.producers.max(1) {
                producers.push(conn.new_jobs().await?);
            }
        }
        let room = queued.map_or(0, |q| self.outstanding.saturating_sub(q));
        let mut workers = Vec::new();
        for _ in 0..self.workers.max(1) {
            workers.push(conn.new_workers().await?);
        }
        let shared = Arc::new(Shared {
            jobs,
            next: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            room: Semaphore::new(
                usize::try_from(room)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS),
            ),
            behind_backlog: queued.is_some_and(|q| q > 0),
            done: CancellationToken::new(),
        });
        let mut tasks = JoinSet::new();
        let started = Instant::now();
        for client in producers {
            tasks.spawn(produce_loop(self.clone(), client, Arc::clone(&shared)));
        }
        for (n, client) in workers.into_iter().enumerate() {
            let worker_id = format!("bench-{}-{n}", std::process::id());
            tasks.spawn(work_loop(
                self.clone(),
                client,
                worker_id,
                Arc::clone(&shared),
            ));
        }
        let mut submitted = Vec::new();
        let mut leased = Vec::new();
        let mut collect = |times: Times| match times {
            Times::Submitted(t) => submitted.extend(t),
            Times::Leased(t) => leased.extend(t),
        };
        let supervised = supervise(&shared, &mut tasks, &mut collect).await;
        let elapsed = started.elapsed();
        if let Err(e) = supervised {
            shared.done.cancel();
            tasks.abort_all();
            return Err(e);
        }
        while let Some(joined) = tasks.join_next().await {
            collect(joined??);
        }
        let submitted: HashMap<String, Instant> = submitted.into_iter().collect();
        let queue_times = leased
            .iter()
            .filter_map(|(id, at)| submitted.get(id).map(|s| at.saturating_duration_since(*s)))
            .collect();
        Ok(Outcome {
            elapsed,
            completed: shared.completed.load(Ordering::Relaxed),
            queue_times,
        })
    }
}

/// Waits until every job has completed, failing on the first task error or
/// when nothing completes for [`STALL`].
async fn supervise(
    shared: &Shared,
    tasks: &mut JoinSet<Result<Times, BenchError>>,
    collect: &mut impl FnMut(Times),
) -> Result<(), BenchError> {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last = (0, Instant::now());
    loop {
        tokio::select! {
            () = shared.done.cancelled() => return Ok(()),
            Some(joined) = tasks.join_next() => collect(joined??),
            _ = tick.tick() => {
                let completed = shared.completed.load(Ordering::Relaxed);
                if completed != last.0 {
                    last = (completed, Instant::now());
                } else if last.1.elapsed() > STALL {
                    return Err(BenchError::Stalled(format!(
                        "no job completed for {STALL:?}: {completed} of {} done",
                        shared.jobs
                    )));
                }
            }
        }
    }
}

async fn produce_loop(
    p: Pipeline,
    mut client: Jobs,
    shared: Arc<Shared>,
) -> Result<Times, BenchError> {
    let batch = p.submit_batch.max(1) as u64;
    let mut times = Vec::new();
    loop {
        let start = shared.next.fetch_add(batch, Ordering::Relaxed);
        if start >= shared.jobs {
            return Ok(Times::Submitted(times));
        }
        let end = (start + batch).min(shared.jobs);
        // Given back by the workers, one per completion answered; the
        // semaphore is never closed.
        let permits = u32::try_from(end - start).unwrap_or(u32::MAX);
        shared
            .room
            .acquire_many(permits)
            .await
            .map_err(|_| BenchError::Stalled("the outstanding bound was closed".into()))?
            .forget();
        if batch == 1 {
            let response = client
                .submit(job(&p.queue, start, p.priority, None))
                .await
                .map_err(|s| BenchError::rpc("Submit", s))?
                .into_inner();
            let at = Instant::now();
            times.push((response.job.map(|j| j.id).unwrap_or_default(), at));
        } else {
            let jobs = (start..end)
                .map(|n| job(&p.queue, n, p.priority, None))
                .collect();
            let ids = submit_batch(&mut client, jobs).await?;
            let at = Instant::now();
            times.extend(ids.into_iter().map(|id| (id, at)));
        }
    }
}

async fn work_loop(
    p: Pipeline,
    mut client: Workers,
    worker_id: String,
    shared: Arc<Shared>,
) -> Result<Times, BenchError> {
    let lease = |wait: Duration| LeaseRequest {
        worker_id: worker_id.clone(),
        queues: vec![p.queue.clone()],
        max_jobs: Some(p.lease_max.max(1)),
        wait: Some(wait.into()),
        ..Default::default()
    };
    let mut times = Vec::new();
    let mut held: Vec<LeasedJob> = Vec::new();
    loop {
        if held.is_empty() {
            if shared.done.is_cancelled() {
                return Ok(Times::Leased(times));
            }
            let answer = if shared.behind_backlog {
                // A Lease cut short may already have claimed a job, which
                // would stay leased with nobody to complete it; behind a
                // backlog every Lease returns at once, so none is cut.
                client.lease(lease(LEASE_WAIT)).await
            } else {
                // Nothing is left to claim at the end of this run: only the
                // long-poll is cut short, and a completion in flight always
                // finishes, so no job is left leased by a run that is done.
                tokio::select! {
                    biased;
                    () = shared.done.cancelled() => return Ok(Times::Leased(times)),
                    answer = client.lease(lease(LEASE_WAIT)) => answer,
                }
            };
            held = answer
                .map_err(|s| BenchError::rpc("Lease", s))?
                .into_inner()
                .jobs;
            if held.is_empty() {
                continue;
            }
        }
        let at = Instant::now();
        times.extend(held.iter().map(|j| (j.job_id.clone(), at)));
        let n = held.len();
        // Once the run is done no new claim: behind a backlog, chaining
        // would go on claiming for ever.
        let next = if p.chain && !shared.done.is_cancelled() {
            // No long-poll here: at the end of a run an idle worker must be
            // in a Lease, which the run can cut short.
            let answer = client
                .complete_and_lease(CompleteAndLeaseRequest {
                    items: held.iter().map(success).collect(),
                    lease: Some(lease(Duration::ZERO)),
                })
                .await
                .map_err(|s| BenchError::rpc("CompleteAndLease", s))?
                .into_inner();
            all_ended("CompleteAndLease", answer.results, n)?;
            shared.room.add_permits(n);
            answer.jobs
        } else if p.lease_max > 1 {
            let items = held.iter().map(success).collect();
            let results = client
                .complete_batch(CompleteBatchRequest { items })
                .await
                .map_err(|s| BenchError::rpc("CompleteBatch", s))?
                .into_inner()
                .results;
            all_ended("CompleteBatch", results, n)?;
            shared.room.add_permits(n);
            Vec::new()
        } else {
            for job in &held {
                client
                    .complete(success(job))
                    .await
                    .map_err(|s| BenchError::rpc("Complete", s))?;
                shared.room.add_permits(1);
            }
            Vec::new()
        };
        let n = n as u64;
        if shared.completed.fetch_add(n, Ordering::Relaxed) + n >= shared.jobs {
            shared.done.cancel();
        }
        held = next;
    }
}

/// Fails unless a batched completion of `sent` items answered a job for
/// each of them.
fn all_ended(
    call: &'static str,
    results: Vec<CompleteBatchResult>,
    sent: usize,
) -> Result<(), BenchError> {
    if results.len() != sent {
        return Err(BenchError::Answer {
            call,
            sent,
            answered: results.len(),
        });
    }
    for result in results {
        match result.result {
            Some(complete_batch_result::Result::Job(_)) => {}
            Some(complete_batch_result::Result::Error(e)) => {
                return Err(BenchError::Item {
                    call,
                    code: e.code,
                    message: e.message,
                });
            }
            None => {
                return Err(BenchError::Item {
                    call,
                    code: 0,
                    message: "empty result".into(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{ItemError, Job};

    fn ended() -> CompleteBatchResult {
        CompleteBatchResult {
            result: Some(complete_batch_result::Result::Job(Job::default())),
        }
    }

    #[test]
    fn a_batch_answer_needs_a_job_per_item() {
        assert!(all_ended("CompleteBatch", vec![ended(), ended()], 2).is_ok());
        assert!(matches!(
            all_ended("CompleteBatch", vec![ended()], 2),
            Err(BenchError::Answer {
                sent: 2,
                answered: 1,
                ..
            })
        ));
        let refused = CompleteBatchResult {
            result: Some(complete_batch_result::Result::Error(ItemError {
                code: 9,
                ..Default::default()
            })),
        };
        assert!(matches!(
            all_ended("CompleteBatch", vec![ended(), refused], 2),
            Err(BenchError::Item { code: 9, .. })
        ));
        let empty = CompleteBatchResult { result: None };
        assert!(all_ended("CompleteAndLease", vec![empty], 1).is_err());
    }
}
