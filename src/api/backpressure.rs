//! The queue bound: `Submit` into a tenant's queue that already holds
//! `queue_bound` queued jobs is refused with `RESOURCE_EXHAUSTED`.
//!
//! Counting a large queue on every submit would put a scan on the hot path,
//! so each replica counts a queue at most once a second and adds what it
//! admitted since. The bound is therefore approximate: several replicas may
//! together overshoot it by what they accept within one second.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::status::ApiError;
use crate::store::Store;

/// How long a counted depth is trusted.
const REFRESH: Duration = Duration::from_secs(1);

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

    fn cached(&self, key: &(String, String), now: Instant) -> Option<u64> {
        let counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        counted
            .get(key)
            .filter(|(_, at)| now.duration_since(*at) < REFRESH)
            .map(|(depth, _)| *depth)
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
        if self.cached(&key, now).is_none() {
            let depth = store.queued_count(tenant, queue).await?;
            let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
            if counted.len() > 10_000 {
                counted.retain(|_, (_, at)| now.duration_since(*at) < REFRESH);
            }
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
