//! Producers and remote workers running at once until a fixed number of jobs
//! has completed: the engine of e2e, e2e-batched, burn-down and backlog.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
}

/// What a run measured.
#[derive(Debug)]
pub struct Outcome {
    /// From the first submit (or the workers' start, when draining) to the last completion.
    pub elapsed: Duration,
    /// Jobs completed.
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
    done: CancellationToken,
}

impl Pipeline {
    /// Submits `jobs` jobs while the workers drain them.
    pub async fn run(&self, conn: &Conn, jobs: u64) -> Result<Outcome, BenchError> {
        self.go(conn, jobs, true).await
    }

    /// Workers drain `jobs` jobs already queued.
    pub async fn drain(&self, conn: &Conn, jobs: u64) -> Result<Outcome, BenchError> {
        self.go(conn, jobs, false).await
    }

    async fn go(&self, conn: &Conn, jobs: u64, produce: bool) -> Result<Outcome, BenchError> {
        // Connections first, so the clock measures jobs, not handshakes.
        let mut producers = Vec::new();
        if produce {
            for _ in 0..self.producers.max(1) {
                producers.push(conn.new_jobs().await?);
            }
        }
        let mut workers = Vec::new();
        for _ in 0..self.workers.max(1) {
            workers.push(conn.new_workers().await?);
        }
        let shared = Arc::new(Shared {
            jobs,
            next: AtomicU64::new(0),
            completed: AtomicU64::new(0),
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
            // Only the long-poll is cut short at the end: a completion in
            // flight always finishes, so no job is left leased by a run
            // that is done.
            held = tokio::select! {
                biased;
                () = shared.done.cancelled() => return Ok(Times::Leased(times)),
                answer = client.lease(lease(LEASE_WAIT)) => answer.map_err(|s| BenchError::rpc("Lease", s))?,
            }
            .into_inner()
            .jobs;
            if held.is_empty() {
                continue;
            }
        }
        let at = Instant::now();
        times.extend(held.iter().map(|j| (j.job_id.clone(), at)));
        let n = held.len() as u64;
        let next = if p.chain {
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
            all_ended("CompleteAndLease", answer.results)?;
            answer.jobs
        } else if p.lease_max > 1 {
            let items = held.iter().map(success).collect();
            let results = client
                .complete_batch(CompleteBatchRequest { items })
                .await
                .map_err(|s| BenchError::rpc("CompleteBatch", s))?
                .into_inner()
                .results;
            all_ended("CompleteBatch", results)?;
            Vec::new()
        } else {
            for job in &held {
                client
                    .complete(success(job))
                    .await
                    .map_err(|s| BenchError::rpc("Complete", s))?;
            }
            Vec::new()
        };
        if shared.completed.fetch_add(n, Ordering::Relaxed) + n >= shared.jobs {
            shared.done.cancel();
        }
        held = next;
    }
}

/// Fails on the first item of a batched completion that was refused.
fn all_ended(call: &'static str, results: Vec<CompleteBatchResult>) -> Result<(), BenchError> {
    for result in results {
        if let Some(complete_batch_result::Result::Error(e)) = result.result {
            return Err(BenchError::Item {
                call,
                code: e.code,
                message: e.message,
            });
        }
    }
    Ok(())
}
