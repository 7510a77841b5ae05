//! The queue bound: `Submit` into a tenant's queue that already holds
//! `queue_bound` queued jobs is refused with `RESOURCE_EXHAUSTED`.
//!
//! Counting a large queue on every submit would put a scan on the hot path,
//! so each replica counts a queue now and then and adds what it admitted
//! since. How long a count is trusted depends on how far the queue is from
//! its bound: ten seconds while it is under half the bound; above that, the
//! time this replica would take to fill the remaining room at the rate it
//! has been admitting, divided by four to leave room for other replicas
//! admitting as fast, but never less than a second. (Counting a queue of a
//! million jobs costs about a tenth of a second of database CPU, so a
//! count every second was a tax on a deep queue far from its bound.) One
//! call recounts while the others go on with the previous figure. The bound
//! is therefore approximate: several replicas may together overshoot it by
//! what they accept within one trusted interval, which shrinks to a second
//! as the queue nears the bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::status::ApiError;
use crate::store::Store;

/// The shortest time a count is trusted.
const REFRESH: Duration = Duration::from_secs(1);
/// The longest time a count is trusted.
const REFRESH_FAR: Duration = Duration::from_secs(10);
/// Other replicas are assumed to admit up to this many times as fast as
/// this one when a count's trust is sized to the room left.
const REPLICA_ALLOWANCE: f64 = 4.0;

/// One queue's depth as this replica sees it.
#[derive(Clone, Copy, Debug)]
struct Depth {
    /// The last count plus what this replica admitted since.
    queued: u64,
    /// What this replica admitted since the count.
    admitted: u64,
    /// When it was counted.
    at: Instant,
    /// Which count this is: one made since a slot was taken leaves out
    /// that slot's job if it was not stored.
    count: u64,
}

/// The figures of every queue, shared with the slots taken from them.
type Counted = Arc<Mutex<HashMap<(String, String), Depth>>>;

/// A job's place in its queue's depth, taken by [`QueueDepths::admit`]. It
/// is given back when dropped unless [`Slot::keep`] says its job was
/// stored: a repeat of an accepted submit, a refused item, or a call whose
/// caller went away before its transaction must not count against the
/// bound until the next count. (A caller that goes away while its
/// transaction commits the job gives its slot back too; the next count
/// puts the job back in the figure.)
#[derive(Debug)]
pub struct Slot {
    counted: Counted,
    key: (String, String),
    count: u64,
    kept: bool,
}

impl Slot {
    /// The job was stored: the slot stays taken.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(depth) = counted.get_mut(&self.key)
            && depth.count == self.count
        {
            depth.queued = depth.queued.saturating_sub(1);
            depth.admitted = depth.admitted.saturating_sub(1);
        }
    }
}

/// Per-replica view of queue depths.
pub struct QueueDepths {
    bound: u64,
    counted: Counted,
    /// The last count's number ([`Depth::count`]).
    counts: std::sync::atomic::AtomicU64,
}

impl QueueDepths {
    /// Enforces `bound` queued jobs per tenant and queue.
    pub fn new(bound: u64) -> Self {
        QueueDepths {
            bound,
            counted: Arc::new(Mutex::new(HashMap::new())),
            counts: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How long `depth` may go without a recount at `now`.
    fn trusted(&self, depth: &Depth, now: Instant) -> Duration {
        if depth.queued < self.bound / 2 {
            return REFRESH_FAR;
        }
        let room = self.bound.saturating_sub(depth.queued) as f64;
        let elapsed = now.duration_since(depth.at).as_secs_f64().max(0.001);
        let rate = depth.admitted as f64 / elapsed;
        let seconds = room / (rate * REPLICA_ALLOWANCE).max(1.0);
        Duration::from_secs_f64(seconds.min(REFRESH_FAR.as_secs_f64())).max(REFRESH)
    }

    /// Whether this call should recount: the figure is missing or stale.
    /// A stale figure is marked fresh at once, so that concurrent calls go
    /// on with it instead of counting too.
    fn claim_recount(&self, key: &(String, String), now: Instant) -> bool {
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        if counted.len() > 10_000 {
            counted.retain(|_, d| now.duration_since(d.at) < REFRESH_FAR);
        }
        let Some(depth) = counted.get(key).copied() else {
            return true;
        };
        if now.duration_since(depth.at) < self.trusted(&depth, now) {
            return false;
        }
        if let Some(depth) = counted.get_mut(key) {
            depth.at = now;
            depth.admitted = 0;
        }
        true
    }

    /// Admits one more job into `queue`, or refuses it when the queue is
    /// full. The slot is given back when dropped unless it is kept.
    pub async fn admit(
        &self,
        store: &dyn Store,
        tenant: &str,
        queue: &str,
    ) -> Result<Slot, ApiError> {
        let key = (tenant.to_owned(), queue.to_owned());
        let now = Instant::now();
        if self.claim_recount(&key, now) {
            let queued = store.queued_count(tenant, queue).await?;
            let count = self.next_count();
            let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
            counted.insert(
                key.clone(),
                Depth {
                    queued,
                    admitted: 0,
                    at: now,
                    count,
                },
            );
        }
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        let depth = counted.entry(key.clone()).or_insert_with(|| Depth {
            queued: 0,
            admitted: 0,
            at: now,
            count: self.next_count(),
        });
        if depth.queued >= self.bound {
            return Err(ApiError::QueueFull {
                queue: queue.to_owned(),
                bound: self.bound,
                retry_after: REFRESH,
            });
        }
        depth.queued += 1;
        depth.admitted += 1;
        Ok(Slot {
            counted: Arc::clone(&self.counted),
            key,
            count: depth.count,
            kept: false,
        })
    }

    fn next_count(&self) -> u64 {
        self.counts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::engine::notifier::Notifier;
    use crate::store::sqlite::SqliteStore;

    /// A slot dropped unkept (nothing stored, or the caller gone) frees
    /// its room; a kept one holds it; a slot from before a recount takes
    /// nothing off the new figure, which never counted it.
    #[tokio::test]
    async fn a_slot_is_given_back_unless_kept_and_only_to_its_count() {
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("sqlite://{}", dir.path().join("jobs.db").display());
        let store = SqliteStore::open(&Settings::new(&url), Arc::new(Notifier::new()))
            .await
            .expect("open");
        let depths = QueueDepths::new(2);
        let admit = || depths.admit(&store, "t", "q");
        let full = |res: &Result<Slot, ApiError>| matches!(res, Err(ApiError::QueueFull { .. }));

        drop(admit().await.expect("room"));
        admit().await.expect("room").keep();
        let old = admit().await.expect("the room the dropped slot gave back");
        assert!(full(&admit().await), "two slots taken");
        // At half the bound a count is trusted for a second: the next
        // admit counts the queue again, and finds nothing stored.
        tokio::time::sleep(REFRESH + Duration::from_millis(100)).await;
        let fresh = admit().await.expect("room after the count");
        drop(old);
        let last = admit().await;
        assert!(!full(&last), "one slot of the new count taken: {last:?}");
        assert!(full(&admit().await), "the new count's two slots taken");
        drop((fresh, last));
    }

    fn depth(queued: u64, admitted: u64, at: Instant) -> Depth {
        Depth {
            queued,
            admitted,
            at,
            count: 0,
        }
    }

    #[test]
    fn a_count_is_trusted_longer_the_more_room_is_left() {
        let depths = QueueDepths::new(1_000_000);
        let at = Instant::now();
        let later = at + Duration::from_secs(1);
        // Under half the bound: ten seconds.
        assert_eq!(
            depths.trusted(&depth(400_000, 5_000, at), later),
            REFRESH_FAR
        );
        // 500k of room at 1k/s here (4k/s allowed for all): still ten.
        assert_eq!(
            depths.trusted(&depth(500_000, 1_000, at), later),
            REFRESH_FAR
        );
        // 20k of room at 1k/s: 20k / 4k = 5 s.
        assert_eq!(
            depths.trusted(&depth(980_000, 1_000, at), later),
            Duration::from_secs(5)
        );
        // Almost full, or full: one second.
        assert_eq!(depths.trusted(&depth(999_000, 1_000, at), later), REFRESH);
        assert_eq!(depths.trusted(&depth(1_000_000, 0, at), later), REFRESH);
    }
}
