//! In-process wake-ups for long-polling `Lease` calls and `WatchJob` streams.
//!
//! Stores call it after each commit; on PostgreSQL a `LISTEN` task also feeds
//! it from other replicas' `NOTIFY`. A wake-up is only a hint to re-read the
//! database: waiters also re-read on a timer, so a lost one costs latency,
//! never a job or an event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, broadcast};
use uuid::Uuid;

/// Fan-out of "something changed" to waiting calls.
#[derive(Debug)]
pub struct Notifier {
    /// `tenant/queue` of queues that got runnable jobs. A broadcast, because
    /// every waiting worker of that queue may want to try its claim.
    queues: broadcast::Sender<Arc<str>>,
    /// One `Notify` per watched job, shared by its watchers.
    jobs: Mutex<HashMap<Uuid, Arc<Notify>>>,
}

impl Default for Notifier {
    fn default() -> Self {
        Notifier::new()
    }
}

/// A queue wake-up that every waiting worker takes as its own.
pub const ANY_QUEUE: &str = "*";

/// The key a queue wake-up carries.
pub fn queue_key(tenant: &str, queue: &str) -> String {
    format!("{tenant}/{queue}")
}

impl Notifier {
    /// A notifier with nobody waiting.
    pub fn new() -> Self {
        let (queues, _) = broadcast::channel(1024);
        Notifier {
            queues,
            jobs: Mutex::new(HashMap::new()),
        }
    }

    /// Wakes the workers waiting on `tenant/queue`.
    pub fn queue_ready(&self, key: &str) {
        // No receiver means nobody is waiting: nothing to do.
        let _ = self.queues.send(Arc::from(key));
    }

    /// Subscribes to queue wake-ups; subscribe BEFORE trying a claim so that
    /// a job submitted in between is not missed.
    pub fn subscribe_queues(&self) -> broadcast::Receiver<Arc<str>> {
        self.queues.subscribe()
    }

    /// Wakes the watchers of a job.
    pub fn job_changed(&self, id: Uuid) {
        // Notified under the lock: a clone taken out of it would make a
        // concurrent drop believe another watcher is left.
        if let Some(notify) = self.lock_jobs().get(&id) {
            notify.notify_waiters();
        }
    }

    /// Wakes every watcher (used when a notification may have been lost).
    pub fn all_jobs_changed(&self) {
        for notify in self.lock_jobs().values() {
            notify.notify_waiters();
        }
    }

    /// Registers interest in a job until the returned guard is dropped.
    pub fn watch_job(self: &Arc<Self>, id: Uuid) -> JobWatch {
        let notify = self
            .lock_jobs()
            .entry(id)
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        JobWatch {
            notifier: Arc::clone(self),
            id,
            notify,
        }
    }

    fn lock_jobs(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<Notify>>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (each operation is a single insert, get or remove).
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A watcher's registration; unregisters on drop.
#[derive(Debug)]
pub struct JobWatch {
    notifier: Arc<Notifier>,
    id: Uuid,
    notify: Arc<Notify>,
}

impl JobWatch {
    /// The `Notify` to wait on. Call `enable()` on the future before reading
    /// the database so that a wake-up in between is kept.
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for JobWatch {
    fn drop(&mut self) {
        let mut jobs = self.notifier.lock_jobs();
        // Two references left (the map's and ours) means we are the last watcher.
        if Arc::strong_count(&self.notify) <= 2 {
            jobs.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_watcher_is_woken_and_unregistered_on_drop() {
        let notifier = Arc::new(Notifier::new());
        let id = Uuid::now_v7();
        let watch = notifier.watch_job(id);
        let second = notifier.watch_job(id);
        {
            let woken = watch.notify().notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            notifier.job_changed(id);
            tokio::time::timeout(Duration::from_secs(1), woken)
                .await
                .expect("woken");
        }
        drop(watch);
        assert_eq!(notifier.lock_jobs().len(), 1, "still watched by the second");
        drop(second);
        assert!(notifier.lock_jobs().is_empty());
    }

    #[tokio::test]
    async fn queue_wakeups_reach_subscribers() {
        let notifier = Notifier::new();
        let mut rx = notifier.subscribe_queues();
        notifier.queue_ready(&queue_key("t", "q"));
        assert_eq!(&*rx.recv().await.expect("message"), "t/q");
    }
}
