//! In-process wake-ups for long-polling `Lease` calls and `WatchJob` streams.
//!
//! Stores call it after each commit; on PostgreSQL a `LISTEN` task also feeds
//! it from other replicas' `NOTIFY`. A wake-up is only a hint to re-read the
//! database: waiters also re-read on a timer, so a lost one costs latency,
//! never a job or an event.
//!
//! Events this replica committed for a watched job are also kept here for a
//! moment, so that its watchers take them from memory instead of each
//! reading the database after every wake-up (ten thousand streams woken at
//! once would queue for the connection pool). A watcher uses them only when
//! they continue its stream without a gap; otherwise it reads. Each watched
//! job also counts the changes whose events are not kept here (other
//! replicas', events dropped from memory): while that count stands still and
//! nothing newer is kept, a watcher that has read once has nothing to read.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, broadcast};
use uuid::Uuid;

use crate::domain::JobEvent;

/// Recent events kept per watched job; a watcher further behind reads.
const RECENT_EVENTS: usize = 16;

/// Fan-out of "something changed" to waiting calls.
#[derive(Debug)]
pub struct Notifier {
    /// `tenant/queue` of queues that got runnable jobs. A broadcast, because
    /// every waiting worker of that queue may want to try its claim.
    queues: broadcast::Sender<Arc<str>>,
    /// One entry per watched job, shared by its watchers.
    jobs: Mutex<HashMap<Uuid, Entry>>,
}

/// A watched job and how many watchers it has: counted under the map's
/// lock, so that two watchers leaving at once cannot both see the other
/// and leave the entry behind.
#[derive(Debug)]
struct Entry {
    watched: Arc<Watched>,
    watchers: usize,
}

/// What the watchers of one job share.
#[derive(Debug, Default)]
struct Watched {
    notify: Notify,
    /// The job's latest committed events, in sequence order.
    recent: Mutex<VecDeque<JobEvent>>,
    /// Changes whose events are not in `recent`: only the database has them.
    unkept: AtomicU64,
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

    /// Wakes the watchers of a job that changed in a way only the database
    /// knows (another replica's commit, or an event not kept here).
    pub fn job_changed(&self, id: Uuid) {
        if let Some(entry) = self.lock_jobs().get(&id) {
            entry.watched.unkept_change();
        }
    }

    /// Keeps events this replica committed for the watchers of their jobs
    /// and wakes them; call it after the commit. Events of jobs nobody
    /// watches are not copied.
    pub fn events_committed<'a>(&self, events: impl IntoIterator<Item = &'a JobEvent>) {
        let jobs = self.lock_jobs();
        if jobs.is_empty() {
            return;
        }
        for event in events {
            if let Some(Entry { watched, .. }) = jobs.get(&event.job_id) {
                let mut recent = lock(&watched.recent);
                if recent.back().is_some_and(|e| e.sequence >= event.sequence) {
                    // Out of order (two transactions of one job committing
                    // close together): what was kept is forgotten, so the
                    // watchers read instead.
                    recent.clear();
                    watched.unkept.fetch_add(1, Ordering::SeqCst);
                }
                if recent.len() == RECENT_EVENTS {
                    recent.pop_front();
                }
                recent.push_back(event.clone());
                watched.notify.notify_waiters();
            }
        }
    }

    /// Wakes every watcher to read (used when a notification may have been
    /// lost).
    pub fn all_jobs_changed(&self) {
        for entry in self.lock_jobs().values() {
            entry.watched.unkept_change();
        }
    }

    /// Registers interest in a job until the returned guard is dropped.
    pub fn watch_job(self: &Arc<Self>, id: Uuid) -> JobWatch {
        let watched = {
            let mut jobs = self.lock_jobs();
            let entry = jobs.entry(id).or_insert_with(|| Entry {
                watched: Arc::default(),
                watchers: 0,
            });
            entry.watchers += 1;
            Arc::clone(&entry.watched)
        };
        JobWatch {
            notifier: Arc::clone(self),
            id,
            watched,
        }
    }

    fn lock_jobs(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Entry>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (each operation is a single insert, get or remove).
        lock(&self.jobs)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A watcher's registration; unregisters on drop.
#[derive(Debug)]
pub struct JobWatch {
    notifier: Arc<Notifier>,
    id: Uuid,
    watched: Arc<Watched>,
}

impl JobWatch {
    /// The `Notify` to wait on. Call `enable()` on the future before reading
    /// the database so that a wake-up in between is kept.
    pub fn notify(&self) -> &Notify {
        &self.watched.notify
    }

    /// The kept events that continue sequence `after` without a gap, up to
    /// the first one missing; empty when there are none or the database
    /// must be read ([`JobWatch::keeps_after`] tells which).
    ///
    /// Kept events can have gaps between them, not only before them: a
    /// change whose event is not kept (a heartbeat's progress, another
    /// replica's commit) still lets the next kept one in behind it.
    pub fn events_after(&self, after: u64) -> Vec<JobEvent> {
        let recent = lock(&self.watched.recent);
        // Checked: `after` is the caller's, and may be any u64.
        let mut next = after.checked_add(1);
        recent
            .iter()
            .skip_while(|e| e.sequence <= after)
            .take_while(|e| {
                let follows = Some(e.sequence) == next;
                next = e.sequence.checked_add(1);
                follows
            })
            .cloned()
            .collect()
    }

    /// Whether an event after `after` is kept, even one behind a gap.
    pub fn keeps_after(&self, after: u64) -> bool {
        lock(&self.watched.recent)
            .back()
            .is_some_and(|e| e.sequence > after)
    }

    /// How many changes of the job only the database knows about; a
    /// watcher that read after this count had its value, and finds it
    /// unchanged and nothing kept after its last event, has nothing to read.
    pub fn unkept_changes(&self) -> u64 {
        self.watched.unkept.load(Ordering::SeqCst)
    }
}

impl Watched {
    /// Counts a change only the database knows about, then wakes.
    fn unkept_change(&self) {
        self.unkept.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl Drop for JobWatch {
    fn drop(&mut self) {
        let mut jobs = self.notifier.lock_jobs();
        if let Some(entry) = jobs.get_mut(&self.id) {
            entry.watchers = entry.watchers.saturating_sub(1);
            if entry.watchers == 0 {
                jobs.remove(&self.id);
            }
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

    #[test]
    fn watchers_leaving_at_once_leave_no_entry() {
        let notifier = Arc::new(Notifier::new());
        let ids: Arc<Vec<Uuid>> = Arc::new((0..50_000).map(|_| Uuid::now_v7()).collect());
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (notifier, ids, barrier) = (
                    Arc::clone(&notifier),
                    Arc::clone(&ids),
                    Arc::clone(&barrier),
                );
                std::thread::spawn(move || {
                    for &id in ids.iter() {
                        let watch = notifier.watch_job(id);
                        barrier.wait();
                        drop(watch);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("joined");
        }
        let left = notifier.lock_jobs().len();
        assert_eq!(left, 0, "entries of jobs nobody watches");
    }

    fn event(id: Uuid, sequence: u64) -> JobEvent {
        JobEvent {
            job_id: id,
            sequence,
            kind: crate::domain::EventType::Progress,
            state: crate::domain::JobState::Running,
            attempt: 1,
            worker_id: None,
            at: chrono::Utc::now(),
            detail: None,
        }
    }

    #[test]
    fn kept_events_are_handed_out_only_without_a_gap() {
        let notifier = Arc::new(Notifier::new());
        let id = Uuid::now_v7();
        notifier.events_committed([&event(id, 1)]);
        let watch = notifier.watch_job(id);
        assert!(watch.events_after(0).is_empty(), "kept only while watched");
        notifier.events_committed([&event(id, 3), &event(id, 4), &event(Uuid::now_v7(), 5)]);
        assert!(
            watch.events_after(1).is_empty(),
            "2 is missing: read instead"
        );
        let seqs = |events: Vec<JobEvent>| events.iter().map(|e| e.sequence).collect::<Vec<_>>();
        assert_eq!(seqs(watch.events_after(2)), vec![3, 4]);
        assert_eq!(seqs(watch.events_after(3)), vec![4]);
        assert!(watch.events_after(4).is_empty());
        notifier.events_committed([&event(id, 2)]);
        assert!(watch.events_after(2).is_empty(), "out of order: dropped");
        for sequence in 5..40 {
            notifier.events_committed([&event(id, sequence)]);
        }
        assert!(watch.events_after(4).is_empty(), "too far behind: read");
        assert_eq!(watch.events_after(38).len(), 1);
    }

    #[test]
    fn kept_events_stop_at_a_gap_between_them() {
        let notifier = Arc::new(Notifier::new());
        let id = Uuid::now_v7();
        let watch = notifier.watch_job(id);
        notifier.events_committed([&event(id, 2)]);
        // 3 changed the job without a kept event (a heartbeat's progress).
        notifier.job_changed(id);
        notifier.events_committed([&event(id, 4), &event(id, 5)]);
        let seqs = |events: Vec<JobEvent>| events.iter().map(|e| e.sequence).collect::<Vec<_>>();
        assert_eq!(seqs(watch.events_after(1)), vec![2], "3 must be read");
        assert!(watch.events_after(2).is_empty() && watch.keeps_after(2));
        assert_eq!(seqs(watch.events_after(3)), vec![4, 5]);
    }

    #[tokio::test]
    async fn kept_events_wake_without_counting_and_the_rest_count() {
        let notifier = Arc::new(Notifier::new());
        let id = Uuid::now_v7();
        let watch = notifier.watch_job(id);
        let woken = watch.notify().notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        notifier.events_committed([&event(id, 1)]);
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("a kept event wakes");
        assert_eq!(watch.unkept_changes(), 0, "memory has it: nothing to read");
        assert!(watch.keeps_after(0) && !watch.keeps_after(1));
        notifier.job_changed(id);
        assert_eq!(watch.unkept_changes(), 1, "only the database has it");
        notifier.all_jobs_changed();
        assert_eq!(watch.unkept_changes(), 2);
        notifier.events_committed([&event(id, 3)]);
        assert_eq!(watch.unkept_changes(), 2, "in order, kept");
        assert!(watch.keeps_after(1), "3 kept behind the missing 2: read");
        notifier.events_committed([&event(id, 2)]);
        assert_eq!(watch.unkept_changes(), 3, "out of order: 3 forgotten, read");
    }

    #[tokio::test]
    async fn queue_wakeups_reach_subscribers() {
        let notifier = Notifier::new();
        let mut rx = notifier.subscribe_queues();
        notifier.queue_ready(&queue_key("t", "q"));
        assert_eq!(&*rx.recv().await.expect("message"), "t/q");
    }
}
