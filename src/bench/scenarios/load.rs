//! The requests every scenario sends, untimed pre-filling, and reading back
//! what the server counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pbjson_types::Timestamp;
use tokio::task::JoinSet;

use super::super::conn::{Conn, Jobs};
use super::super::error::BenchError;
use crate::pb::{
    self, CompleteRequest, JobState, StatsRequest, SubmitBatchRequest, SubmitRequest,
    complete_request, submit_batch_result,
};

/// The kind of every benchmark job.
pub const KIND: &str = "bench";
/// Most items per SubmitBatch / CompleteBatch call the API takes.
pub const MAX_BATCH: usize = 1000;
/// SubmitBatch calls in flight while pre-filling.
const PREFILL_CALLS: u64 = 4;

/// Prints progress on stderr, away from the report on stdout.
pub fn progress(text: &str) {
    eprintln!("bench: {text}");
}

/// A small job like a real one: a JSON payload of a few bytes.
pub fn job(queue: &str, n: u64, priority: i32, run_at: Option<Timestamp>) -> SubmitRequest {
    let mut fields = std::collections::HashMap::new();
    fields.insert("n".to_owned(), pbjson_types::Value::from(n as f64));
    SubmitRequest {
        queue: queue.to_owned(),
        kind: KIND.to_owned(),
        payload: Some(pbjson_types::Value::from(fields)),
        priority,
        run_at,
        ..Default::default()
    }
}

/// A successful outcome for a leased job.
pub fn success(job: &pb::LeasedJob) -> CompleteRequest {
    CompleteRequest {
        job_id: job.job_id.clone(),
        lease_token: job.lease_token.clone(),
        outcome: Some(complete_request::Outcome::Success(
            complete_request::Success { result: None },
        )),
        cost_cents: 0,
    }
}

/// Submits `jobs` with SubmitBatch, returning the ids in order; any rejected
/// item is an error (the benchmark only sends valid jobs).
pub async fn submit_batch(
    client: &mut Jobs,
    jobs: Vec<SubmitRequest>,
) -> Result<Vec<String>, BenchError> {
    let response = client
        .submit_batch(SubmitBatchRequest { jobs })
        .await
        .map_err(|s| BenchError::rpc("SubmitBatch", s))?
        .into_inner();
    response
        .results
        .into_iter()
        .map(|item| match item.result {
            Some(submit_batch_result::Result::Ok(ok)) => {
                Ok(ok.job.map(|j| j.id).unwrap_or_default())
            }
            Some(submit_batch_result::Result::Error(e)) => Err(BenchError::Item {
                call: "SubmitBatch",
                code: e.code,
                message: e.message,
            }),
            None => Err(BenchError::Item {
                call: "SubmitBatch",
                code: 0,
                message: "empty result".into(),
            }),
        })
        .collect()
}

/// Stores `count` jobs in `queue` with SubmitBatch calls of 1000, a few in
/// flight, untimed (the set-up of burn-down, backlog and watchers).
pub async fn prefill(
    conn: &Conn,
    queue: &str,
    count: u64,
    priority: i32,
    run_at: Option<Timestamp>,
) -> Result<Vec<String>, BenchError> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..PREFILL_CALLS.min(count.max(1)) {
        let mut client = conn.new_jobs().await?;
        let next = Arc::clone(&next);
        let queue = queue.to_owned();
        tasks.spawn(async move {
            let mut ids = Vec::new();
            loop {
                let start = next.fetch_add(MAX_BATCH as u64, Ordering::Relaxed);
                if start >= count {
                    return Ok::<_, BenchError>(ids);
                }
                let end = (start + MAX_BATCH as u64).min(count);
                let jobs = (start..end)
                    .map(|n| job(&queue, n, priority, run_at))
                    .collect();
                ids.extend(submit_batch(&mut client, jobs).await?);
                // A line per 10 % of a large pre-fill: a million jobs take a while.
                let tenth = (count / 10).max(1);
                if count >= 100_000 && end / tenth != start / tenth {
                    progress(&format!("pre-filled {end} of {count} jobs in {queue}"));
                }
            }
        });
    }
    let mut ids = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    while let Some(joined) = tasks.join_next().await {
        ids.extend(joined??);
    }
    Ok(ids)
}

/// How many jobs of `queue` the server counts as SUCCEEDED.
pub async fn succeeded(conn: &Conn, queue: &str) -> Result<u64, BenchError> {
    let stats = conn
        .new_jobs()
        .await?
        .stats(StatsRequest {
            queue: queue.to_owned(),
        })
        .await
        .map_err(|s| BenchError::rpc("Stats", s))?
        .into_inner();
    Ok(stats
        .queues
        .iter()
        .filter(|q| q.queue == queue)
        .flat_map(|q| &q.counts)
        .filter(|c| c.state == JobState::Succeeded as i32)
        .map(|c| c.count)
        .sum())
}

/// The server's count of `queue`'s SUCCEEDED jobs, which must be `expected`,
/// the jobs `scenario` completed (`what` says how they add up): a figure
/// is only worth printing when every job it counts really ended SUCCEEDED.
pub async fn verify_succeeded(
    conn: &Conn,
    scenario: &'static str,
    queue: &str,
    expected: u64,
    what: &str,
) -> Result<u64, BenchError> {
    let counted = succeeded(conn, queue).await?;
    if counted != expected {
        return Err(BenchError::Unaccounted {
            scenario,
            queue: queue.to_owned(),
            counted,
            expected,
            what: what.to_owned(),
        });
    }
    Ok(counted)
}
