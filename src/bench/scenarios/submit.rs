//! Unary Submit from N concurrent producers: throughput and per-call latency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use super::super::conn::Conn;
use super::super::error::BenchError;
use super::load::job;

/// What a submit run measured.
#[derive(Debug)]
pub struct Submitted {
    /// From the first call's start to the last call's end.
    pub elapsed: Duration,
    /// One per call.
    pub latencies: Vec<Duration>,
}

/// Submits `jobs` jobs into `queue` from `producers` concurrent producers,
/// each on its own connection.
pub async fn run(
    conn: &Conn,
    queue: &str,
    producers: usize,
    jobs: u64,
) -> Result<Submitted, BenchError> {
    let mut clients = Vec::new();
    for _ in 0..producers.max(1) {
        clients.push(conn.new_jobs().await?);
    }
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for mut client in clients {
        let next = Arc::clone(&next);
        let queue = queue.to_owned();
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= jobs {
                    return Ok::<_, BenchError>(latencies);
                }
                let call = Instant::now();
                client
                    .submit(job(&queue, n, 0, None))
                    .await
                    .map_err(|s| BenchError::rpc("Submit", s))?;
                latencies.push(call.elapsed());
            }
        });
    }
    let mut latencies = Vec::with_capacity(usize::try_from(jobs).unwrap_or(0));
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined??);
    }
    Ok(Submitted {
        elapsed: started.elapsed(),
        latencies,
    })
}
