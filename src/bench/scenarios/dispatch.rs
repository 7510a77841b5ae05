//! One idle worker parked in a long-poll Lease; jobs submitted one at a time,
//! spaced out; the time from the start of each Submit call to the worker
//! holding the job.
//!
//! The pause before the next Submit starts once the worker has completed
//! the job and is about to Lease again: counted from the moment it held the
//! job, a Complete slower than the pause would leave the next job to a
//! plain claim, not to the parked long-poll this measures.

use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::super::conn::{Conn, Workers};
use super::super::error::BenchError;
use super::load::{job, success};
use crate::pb::LeaseRequest;

/// How long the idle worker's Lease waits before asking again.
const LEASE_WAIT: Duration = Duration::from_secs(10);
/// A job not dispatched and completed within this long is lost.
const LOST: Duration = Duration::from_secs(30);

/// What the dispatch probe sends.
#[derive(Clone, Debug)]
pub struct Dispatch {
    /// Queue of the probe jobs (the worker leases only from it).
    pub queue: String,
    /// Measured jobs.
    pub samples: u64,
    /// Jobs sent first and not measured.
    pub warmup: u64,
    /// Pause after the worker has completed each job, before the next Submit.
    pub spacing: Duration,
    /// Priority of the probe jobs.
    pub priority: i32,
}

impl Dispatch {
    /// Runs the probe; one latency per measured job.
    pub async fn run(&self, conn: &Conn) -> Result<Vec<Duration>, BenchError> {
        let mut producer = conn.new_jobs().await?;
        let worker = conn.new_workers().await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let done = CancellationToken::new();
        let parked = tokio::spawn(park(worker, self.queue.clone(), tx, done.clone()));
        // Let the first Lease reach the server and park before the first job.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut latencies = Vec::with_capacity(usize::try_from(self.samples).unwrap_or(0));
        let probed = async {
            for n in 0..self.warmup + self.samples {
                let started = Instant::now();
                let id = producer
                    .submit(job(&self.queue, n, self.priority, None))
                    .await
                    .map_err(|s| BenchError::rpc("Submit", s))?
                    .into_inner()
                    .job
                    .map(|j| j.id)
                    .unwrap_or_default();
                // The worker's report comes once it has completed the job.
                let held = tokio::time::timeout(LOST, async {
                    while let Some((got, at)) = rx.recv().await {
                        if got == id {
                            return Some(at);
                        }
                    }
                    None
                })
                .await;
                let at = match held {
                    Ok(Some(at)) => at,
                    Ok(None) => break,
                    Err(_) => {
                        return Err(BenchError::Stalled(format!(
                            "job {id} was not dispatched to and completed by the idle worker within {LOST:?}"
                        )));
                    }
                };
                if n >= self.warmup {
                    latencies.push(at.saturating_duration_since(started));
                }
                tokio::time::sleep(self.spacing).await;
            }
            Ok(())
        }
        .await;
        done.cancel();
        // The worker's own error explains an early end of the channel best.
        parked.await??;
        probed?;
        Ok(latencies)
    }
}

/// The idle worker: leases one job at a time and completes it, then reports
/// when it held it, just before its next Lease.
async fn park(
    mut client: Workers,
    queue: String,
    held: mpsc::UnboundedSender<(String, Instant)>,
    done: CancellationToken,
) -> Result<(), BenchError> {
    let worker_id = format!("bench-dispatch-{}", std::process::id());
    loop {
        let request = LeaseRequest {
            worker_id: worker_id.clone(),
            queues: vec![queue.clone()],
            max_jobs: Some(1),
            wait: Some(LEASE_WAIT.into()),
            ..Default::default()
        };
        let jobs = tokio::select! {
            biased;
            () = done.cancelled() => return Ok(()),
            answer = client.lease(request) => answer.map_err(|s| BenchError::rpc("Lease", s))?,
        }
        .into_inner()
        .jobs;
        let at = Instant::now();
        for job in jobs {
            client
                .complete(success(&job))
                .await
                .map_err(|s| BenchError::rpc("Complete", s))?;
            // The probe may have stopped listening after an error of its own.
            let _ = held.send((job.job_id, at));
        }
    }
}
