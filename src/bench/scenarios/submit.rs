//! Unary Submit from N concurrent producers: throughput and per-call latency.

use super::super::conn::{Conn, Jobs};
use super::super::error::BenchError;
use super::load::job;
use super::timed::{self, Caller, Timed};

/// One producer: a connection of its own and the queue it submits to.
struct Producer {
    client: Jobs,
    queue: String,
}

impl Caller for Producer {
    async fn call(&mut self, n: u64) -> Result<(), BenchError> {
        self.client
            .submit(job(&self.queue, n, 0, None))
            .await
            .map_err(|s| BenchError::rpc("Submit", s))?;
        Ok(())
    }
}

/// Submits `jobs` jobs into `queue` from `producers` concurrent producers,
/// each on its own connection.
pub async fn run(
    conn: &Conn,
    queue: &str,
    producers: usize,
    jobs: u64,
) -> Result<Timed, BenchError> {
    let mut callers = Vec::new();
    for _ in 0..producers.max(1) {
        callers.push(Producer {
            client: conn.new_jobs().await?,
            queue: queue.to_owned(),
        });
    }
    timed::run(callers, jobs).await
}
