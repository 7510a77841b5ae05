//! Unary calls that do no work: the gRPC health check, from many callers at
//! once, each on its own connection. It passes the server's layers (limits,
//! authentication, telemetry) and HTTP/2 on both sides like any call, but
//! touches no database, so its rate is what the transport alone allows on
//! this machine: a scenario that makes k calls per job cannot go above a
//! k-th of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::super::conn::Conn;
use super::super::error::BenchError;

/// What a transport run measured.
#[derive(Debug)]
pub struct Called {
    /// From the first call's start to the last call's end.
    pub elapsed: Duration,
    /// One per call.
    pub latencies: Vec<Duration>,
}

/// Makes `calls` health checks from `callers` concurrent callers.
pub async fn run(conn: &Conn, callers: usize, calls: u64) -> Result<Called, BenchError> {
    let mut clients = Vec::new();
    for _ in 0..callers.max(1) {
        clients.push(HealthClient::new(conn.channel().await?));
    }
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for mut client in clients {
        let next = Arc::clone(&next);
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < calls {
                let call = Instant::now();
                client
                    .check(HealthCheckRequest::default())
                    .await
                    .map_err(|s| BenchError::rpc("Health/Check", s))?;
                latencies.push(call.elapsed());
            }
            Ok::<_, BenchError>(latencies)
        });
    }
    let mut latencies = Vec::with_capacity(usize::try_from(calls).unwrap_or(0));
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined??);
    }
    Ok(Called {
        elapsed: started.elapsed(),
        latencies,
    })
}
