//! Writes that run to their end when their caller goes away.
//!
//! A handler's future is dropped where it stands when its client cancels,
//! its deadline passes or the server's call timeout fires. A store write
//! awaited inside it stops there too, but the database may still commit
//! what it was sent (a COMMIT in flight), and then the wake-ups that follow
//! a commit in this process never run: this replica's watchers, parked
//! `Lease` calls and the other replicas' notification would each sit out
//! their fallback poll (30 s for a watch). Submit, Lease and Complete run in
//! the coalescers' own tasks already; the other writes go through here.

use std::future::Future;

use opentelemetry::context::FutureExt as _;
use tracing::Instrument;

use crate::store::{StoreError, StoreResult};

/// Runs `write` in a task of its own and waits for it: once started it
/// commits and wakes whoever waits for it, whether or not its caller is
/// still there to hear the answer. The task keeps the caller's trace
/// context, so the write's spans nest under the call's: a spawned task
/// starts outside it.
pub async fn detached<T, W>(write: W) -> StoreResult<T>
where
    T: Send + 'static,
    W: Future<Output = StoreResult<T>> + Send + 'static,
{
    let context = opentelemetry::Context::current();
    tokio::spawn(write.in_current_span().with_context(context))
        .await
        .map_err(|err| StoreError::Internal(format!("a write's task ended: {err}")))?
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_write_runs_on_after_its_caller_is_dropped() {
        let done = Arc::new(AtomicBool::new(false));
        let write = {
            let done = Arc::clone(&done);
            detached(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                done.store(true, Ordering::SeqCst);
                Ok(())
            })
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(10), write).await;
        assert!(gave_up.is_err(), "the caller went away first");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(done.load(Ordering::SeqCst), "the write ran to its end");
    }
}
