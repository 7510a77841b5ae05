//! The driver of the unary scenarios: many callers, each on its own
//! connection and its own task, taking call numbers from one shared counter
//! until the run's calls are used up, and timing every call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use super::super::error::BenchError;

/// One caller of a unary scenario: makes call number `n`.
pub trait Caller: Send + 'static {
    /// Makes one call and waits for its answer.
    fn call(&mut self, n: u64) -> impl Future<Output = Result<(), BenchError>> + Send;
}

/// What a run of timed calls measured.
#[derive(Debug)]
pub struct Timed {
    /// From the first call's start to the last call's end.
    pub elapsed: Duration,
    /// One per call.
    pub latencies: Vec<Duration>,
}

/// Makes `calls` calls, spread over `callers` as each becomes free.
pub async fn run<C: Caller>(callers: Vec<C>, calls: u64) -> Result<Timed, BenchError> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for mut caller in callers {
        let next = Arc::clone(&next);
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= calls {
                    return Ok::<_, BenchError>(latencies);
                }
                let call = Instant::now();
                caller.call(n).await?;
                latencies.push(call.elapsed());
            }
        });
    }
    let mut latencies = Vec::with_capacity(usize::try_from(calls).unwrap_or(0));
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined??);
    }
    Ok(Timed {
        elapsed: started.elapsed(),
        latencies,
    })
}
