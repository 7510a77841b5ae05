//! The queue bound: `Submit` into a tenant's queue that already holds
//! `queue_bound` queued jobs is refused with `RESOURCE_EXHAUSTED`.
//!
//! Counting a large queue on every submit would put a scan on the hot path,
//! so each replica counts a queue at most once a second (once every ten
//! seconds while it is under half the bound, since only a queue near its
//! bound needs a fresh count) and adds what it admitted since. One call
//! recounts while the others go on with the previous figure. The bound is
//! therefore approximate: several replicas may together overshoot it by what
//! they accept within one second.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::status::ApiError;
use crate::store::Store;

/// How long a counted depth is trusted near the bound.
const REFRESH: Duration = Duration::from_secs(1);
/// How long a counted depth under half the bound is trusted.
const REFRESH_FAR: Duration = Duration::from_secs(10);

/// Per-replica view of queue depths.
pub struct QueueDepths {
    bound: u64,
    counted: Mutex<HashMap<(String, String), (u64, Instant)>>,
}

impl QueueDepths {
    /// Enforces `bound` queued jobs per tenant and queue.
    pub fn new(bound: u64) -> Self {
        QueueDepths {
            bound,
            counted: Mutex::new(HashMap::new()),
        }
    }

    /// Whether this call should recount: the figure is missing or stale.
    /// A stale figure is marked fresh at once, so that concurrent calls go
    /// on with it instead of counting too.
    fn claim_recount(&self, key: &(String, String), now: Instant) -> bool {
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        if counted.len() > 10_000 {
            counted.retain(|_, (_, at)| now.duration_since(*at) < REFRESH_FAR);
        }
        match counted.get_mut(key) {
            None => true,
            Some((depth, at)) => {
                let trusted = if *depth < self.bound / 2 {
                    REFRESH_FAR
                } else {
                    REFRESH
                };
                if now.duration_since(*at) < trusted {
                    return false;
                }
                *at = now;
                true
            }
        }
    }

    /// Admits one more job into `queue`, or refuses it when the queue is full.
    pub async fn admit(
        &self,
        store: &dyn Store,
        tenant: &str,
        queue: &str,
    ) -> Result<(), ApiError> {
        let key = (tenant.to_owned(), queue.to_owned());
        let now = Instant::now();
        if self.claim_recount(&key, now) {
            let depth = store.queued_count(tenant, queue).await?;
            let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
            counted.insert(key.clone(), (depth, now));
        }
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        let entry = counted.entry(key).or_insert((0, now));
        if entry.0 >= self.bound {
            return Err(ApiError::QueueFull {
                queue: queue.to_owned(),
                bound: self.bound,
                retry_after: REFRESH,
            });
        }
        entry.0 += 1;
        Ok(())
    }
}
