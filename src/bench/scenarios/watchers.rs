//! Many concurrent WatchJob streams, one per job, spread over several HTTP/2
//! connections; then the jobs are leased and completed. Measures the
//! server's memory above idle, the connections it holds to its database,
//! and how long a terminal event takes from the Complete call to its watcher.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::super::conn::{Conn, Workers};
use super::super::error::BenchError;
use super::super::probe;
use super::load::{prefill, progress, success};
use crate::pb::{JobState, LeaseRequest, WatchJobRequest};

/// How long opening every stream, or delivering every terminal event, may take.
const PHASE_LIMIT: Duration = Duration::from_secs(180);

/// What the watchers scenario measured.
#[derive(Debug)]
pub struct Watched {
    /// Streams open at once.
    pub streams: u64,
    /// HTTP/2 connections they were spread over.
    pub channels: usize,
    /// Server RSS before the streams were opened.
    pub rss_idle: Option<u64>,
    /// Server RSS with every stream open.
    pub rss_watching: Option<u64>,
    /// Database connections in use with every stream open (PostgreSQL).
    pub db_connections: Option<probe::PgConnections>,
    /// Per job: Complete call start to its watcher receiving the terminal event.
    pub latencies: Vec<Duration>,
    /// Per job: the Complete call itself, the part of `latencies` spent
    /// before the event is committed (the rest is delivery).
    pub completes: Vec<Duration>,
    /// Per job: the Complete call's answer to the watcher receiving the
    /// event, zero when the event came first. The answer leaves after the
    /// commit, so this bounds the delivery of a committed event from above.
    pub deliveries: Vec<Duration>,
}

/// Where the scenario looks at the server from outside.
pub struct Probes<'a> {
    /// The server's process, for its RSS.
    pub server_pid: Option<u32>,
    /// Its PostgreSQL database, to count connections.
    pub pg_url: Option<&'a str>,
}

fn is_terminal(state: i32) -> bool {
    [
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Expired,
    ]
    .iter()
    .any(|s| *s as i32 == state)
}

/// Runs the scenario with `streams` watchers, `per_channel` per connection,
/// and `workers` completing the jobs.
pub async fn run(
    conn: &Conn,
    queue: &str,
    streams: u64,
    per_channel: usize,
    workers: usize,
    probes: Probes<'_>,
) -> Result<Watched, BenchError> {
    let ids = prefill(conn, queue, streams, 0, None).await?;
    let rss_idle = probes.server_pid.and_then(probe::rss_bytes);
    let per_channel = per_channel.max(1);
    let mut channels = Vec::new();
    for _ in 0..ids.len().div_ceil(per_channel) {
        channels.push(conn.channel().await?);
    }
    progress(&format!(
        "opening {streams} WatchJob streams over {} connections",
        channels.len()
    ));
    let live = Arc::new(AtomicU64::new(0));
    let mut watchers = JoinSet::new();
    for (n, id) in ids.into_iter().enumerate() {
        let mut client = conn.jobs(channels[n / per_channel].clone());
        let live = Arc::clone(&live);
        watchers.spawn(async move {
            let mut stream = client
                .watch_job(WatchJobRequest {
                    id: id.clone(),
                    after_sequence: 0,
                })
                .await
                .map_err(|s| BenchError::rpc("WatchJob", s))?
                .into_inner();
            let mut first = true;
            while let Some(event) = stream
                .message()
                .await
                .map_err(|s| BenchError::rpc("WatchJob stream", s))?
            {
                if first {
                    // The history (SUBMITTED) has arrived: the stream is open
                    // and waiting for live events.
                    live.fetch_add(1, Ordering::Relaxed);
                    first = false;
                }
                if is_terminal(event.state) {
                    return Ok((id, Instant::now()));
                }
            }
            Err(BenchError::Stalled(format!(
                "the WatchJob stream of {id} ended before a terminal event"
            )))
        });
    }
    let opening = Instant::now();
    while live.load(Ordering::Relaxed) < streams {
        if opening.elapsed() > PHASE_LIMIT {
            return Err(BenchError::Stalled(format!(
                "only {} of {streams} WatchJob streams opened within {PHASE_LIMIT:?}",
                live.load(Ordering::Relaxed)
            )));
        }
        if let Some(Ok(Err(e))) = watchers.try_join_next() {
            return Err(e);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_watching = probes.server_pid.and_then(probe::rss_bytes);
    let db_connections = match probes.pg_url {
        Some(url) => Some(probe::pg_connections(url).await?),
        None => None,
    };
    progress(&format!("{streams} streams open; completing their jobs"));
    let started = complete_all(conn, queue, streams, workers).await?;
    let completes = started.values().map(|c| c.took).collect();
    let mut latencies = Vec::with_capacity(started.len());
    let mut deliveries = Vec::with_capacity(started.len());
    let delivered = tokio::time::timeout(PHASE_LIMIT, async {
        while let Some(joined) = watchers.join_next().await {
            let (id, at) = joined??;
            if let Some(call) = started.get(&id) {
                latencies.push(at.saturating_duration_since(call.start));
                deliveries.push(at.saturating_duration_since(call.start + call.took));
            }
        }
        Ok::<_, BenchError>(())
    })
    .await;
    match delivered {
        Ok(result) => result?,
        Err(_) => {
            return Err(BenchError::Stalled(format!(
                "terminal events not delivered to every watcher within {PHASE_LIMIT:?}"
            )));
        }
    }
    Ok(Watched {
        streams,
        channels: channels.len(),
        rss_idle,
        rss_watching,
        db_connections,
        latencies,
        completes,
        deliveries,
    })
}

/// When one job's Complete call started and how long it took.
struct CompleteCall {
    start: Instant,
    took: Duration,
}

/// Leases and completes `jobs` jobs with `workers` workers (unary Complete),
/// returning when each Complete call started and how long it took, by job id.
async fn complete_all(
    conn: &Conn,
    queue: &str,
    jobs: u64,
    workers: usize,
) -> Result<HashMap<String, CompleteCall>, BenchError> {
    let completed = Arc::new(AtomicU64::new(0));
    let done = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for n in 0..workers.max(1) {
        let client = conn.new_workers().await?;
        let request = LeaseRequest {
            worker_id: format!("bench-watchers-{}-{n}", std::process::id()),
            queues: vec![queue.to_owned()],
            max_jobs: Some(100),
            wait: Some(Duration::from_secs(1).into()),
            ..Default::default()
        };
        tasks.spawn(complete_loop(
            client,
            request,
            jobs,
            Arc::clone(&completed),
            done.clone(),
        ));
    }
    let mut started = HashMap::new();
    while let Some(joined) = tasks.join_next().await {
        match joined? {
            Ok(times) => started.extend(times),
            Err(e) => {
                done.cancel();
                return Err(e);
            }
        }
    }
    Ok(started)
}

async fn complete_loop(
    mut client: Workers,
    request: LeaseRequest,
    jobs: u64,
    completed: Arc<AtomicU64>,
    done: CancellationToken,
) -> Result<Vec<(String, CompleteCall)>, BenchError> {
    let mut started = Vec::new();
    let limit = Instant::now();
    while !done.is_cancelled() {
        if limit.elapsed() > PHASE_LIMIT {
            return Err(BenchError::Stalled(format!(
                "the watched jobs were not all completed within {PHASE_LIMIT:?}"
            )));
        }
        let leased = tokio::select! {
            biased;
            () = done.cancelled() => break,
            answer = client.lease(request.clone()) => answer.map_err(|s| BenchError::rpc("Lease", s))?,
        }
        .into_inner()
        .jobs;
        for job in &leased {
            let start = Instant::now();
            client
                .complete(success(job))
                .await
                .map_err(|s| BenchError::rpc("Complete", s))?;
            let took = start.elapsed();
            started.push((job.job_id.clone(), CompleteCall { start, took }));
        }
        let n = leased.len() as u64;
        if completed.fetch_add(n, Ordering::Relaxed) + n >= jobs {
            done.cancel();
        }
    }
    Ok(started)
}
