//! What a committed transaction changed, as wake-ups for waiting calls: the
//! local notifier directly, other replicas through a `NOTIFY` sent after the
//! commit, coalesced over whatever committed meanwhile (never one per job,
//! and never inside the job's transaction: NOTIFY serialises commits).
//!
//! A replica hears its own notifications too. Each payload names the replica
//! that sent it, so that its own are dropped: it has already woken its
//! waiters, and a second wake-up would send every woken watcher to the
//! database for nothing (two reads per watched job per transition).

use std::collections::BTreeSet;

use uuid::Uuid;

use super::RunningCaps;
use crate::domain::{Job, JobEvent, JobState};
use crate::engine::notifier::{ANY_QUEUE, Notifier, queue_key};

/// The channel intray's replicas `LISTEN` on.
pub const CHANNEL: &str = "intray";

/// PostgreSQL refuses NOTIFY payloads of 8000 bytes or more.
const MAX_PAYLOAD: usize = 7900;

/// Beyond this many payloads one coalesced notification says `*` instead.
const MAX_PAYLOADS: usize = 32;

/// Jobs and queues touched by one transaction.
#[derive(Debug, Default)]
pub struct Changes {
    queues: BTreeSet<String>,
    /// Tenants and queues where a job ended: under a running cap each end
    /// frees a slot, and the queue's waiting workers may claim again. A
    /// list looked through before each insert: a batch's jobs are nearly
    /// always of one queue, and a completion then costs no allocation.
    ended: Vec<(String, String)>,
    /// Changed jobs whose events are not in `events`: this replica's
    /// watchers of them read the database.
    jobs: Vec<Uuid>,
    /// Events this process wrote, kept for its own watchers (other replicas
    /// read them from the database).
    events: Vec<JobEvent>,
}

impl Changes {
    /// Records a job as it is after the transition.
    pub fn job(&mut self, job: &Job) {
        self.jobs.push(job.id);
        self.runnable(job);
    }

    /// Records a job as it is after the transition, and the event it wrote.
    pub fn job_event(&mut self, job: &Job, event: &JobEvent) {
        self.events.push(event.clone());
        self.runnable(job);
    }

    fn runnable(&mut self, job: &Job) {
        if job.state == JobState::Queued {
            self.queues.insert(queue_key(&job.tenant, &job.queue));
        } else if job.state.is_terminal()
            && !self
                .ended
                .iter()
                .any(|(tenant, queue)| *tenant == job.tenant && *queue == job.queue)
        {
            self.ended.push((job.tenant.clone(), job.queue.clone()));
        }
    }

    /// Records a new job: nobody can be watching it yet, but its queue wakes
    /// unless the job went straight to a waiting worker.
    pub fn submitted(&mut self, job: &Job) {
        if job.state == JobState::Queued {
            self.queues.insert(queue_key(&job.tenant, &job.queue));
        }
    }

    /// Records a job whose watchers should look again (a progress event).
    pub fn watched(&mut self, id: Uuid) {
        self.jobs.push(id);
    }

    /// Records a queue whose waiting workers may claim again (a resume).
    pub fn queue(&mut self, tenant: &str, queue: &str) {
        self.queues.insert(queue_key(tenant, queue));
    }

    /// Nothing to tell anyone.
    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
            && self.ended.is_empty()
            && self.jobs.is_empty()
            && self.events.is_empty()
    }

    /// The queues where a job ended and a running cap applies. Only those
    /// wake on an end: elsewhere an ended job makes nothing claimable.
    fn freed<'a>(&'a self, caps: &'a RunningCaps) -> impl Iterator<Item = String> + 'a {
        self.ended
            .iter()
            .filter(|(_, queue)| caps.covers(queue))
            .map(|(tenant, queue)| queue_key(tenant, queue))
    }

    /// Turns the ends of jobs under `caps` into queue wake-ups, so that the
    /// other replicas' waiting workers hear of the freed slots too.
    pub fn capped_slots_freed(&mut self, caps: &RunningCaps) {
        let freed: Vec<String> = self.freed(caps).collect();
        self.queues.extend(freed);
        self.ended.clear();
    }

    /// Wakes this process's waiters, those of queues where a job under
    /// `caps` ended included.
    pub fn wake(&self, notifier: &Notifier, caps: &RunningCaps) {
        notifier.events_committed(&self.events);
        for key in self.queues.iter().cloned().chain(self.freed(caps)) {
            notifier.queue_ready(&key);
        }
        for id in &self.jobs {
            notifier.job_changed(*id);
        }
    }

    /// Adds what another transaction changed, for the other replicas.
    pub fn merge(&mut self, other: Changes) {
        self.queues.extend(other.queues);
        for ended in other.ended {
            if !self.ended.contains(&ended) {
                self.ended.push(ended);
            }
        }
        self.jobs.extend(other.jobs);
        self.events.extend(other.events);
    }

    /// The NOTIFY payloads: each starts with the line `r:origin` (the
    /// sending replica) followed by lines of `q:tenant/queue` or `j:id`,
    /// under PostgreSQL's size limit; or the one payload `r:origin` + `*`
    /// (wake everything) when there would be too many.
    pub fn payloads(&self, origin: Uuid) -> Vec<String> {
        let header = format!("r:{origin}\n");
        let lines = self.queues.iter().map(|key| format!("q:{key}\n")).chain(
            self.jobs
                .iter()
                .chain(self.events.iter().map(|e| &e.job_id))
                .map(|id| format!("j:{id}\n")),
        );
        let mut out: Vec<String> = Vec::new();
        for line in lines {
            let fits = out
                .last()
                .is_some_and(|last| last.len() + line.len() <= MAX_PAYLOAD);
            if fits {
                if let Some(last) = out.last_mut() {
                    last.push_str(&line);
                }
            } else if out.len() == MAX_PAYLOADS {
                return vec![format!("{header}*")];
            } else {
                out.push(format!("{header}{line}"));
            }
        }
        out
    }
}

/// Applies a NOTIFY payload unless replica `own` sent it.
pub fn wake_from_payload(payload: &str, own: Uuid, notifier: &Notifier) {
    let mut lines = payload.lines().peekable();
    let origin = lines
        .peek()
        .and_then(|line| line.strip_prefix("r:"))
        .and_then(|id| Uuid::parse_str(id).ok());
    if origin == Some(own) {
        return;
    }
    if origin.is_some() {
        lines.next();
    }
    for line in lines {
        if line == "*" {
            wake_everything(notifier);
        } else if let Some(key) = line.strip_prefix("q:") {
            notifier.queue_ready(key);
        } else if let Some(id) = line
            .strip_prefix("j:")
            .and_then(|s| Uuid::parse_str(s).ok())
        {
            notifier.job_changed(id);
        }
    }
}

/// Wakes every waiter of this replica (a notification overflowed, or some
/// may have been lost).
pub fn wake_everything(notifier: &Notifier) {
    notifier.queue_ready(ANY_QUEUE);
    notifier.all_jobs_changed();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_split_under_the_limit_and_overflow_to_a_wildcard() {
        let (origin, other) = (Uuid::new_v4(), Uuid::new_v4());
        let mut changes = Changes::default();
        let id = Uuid::now_v7();
        changes.jobs.push(id);
        changes.queues.insert("t/q".into());
        assert_eq!(
            changes.payloads(origin),
            vec![format!("r:{origin}\nq:t/q\nj:{id}\n")]
        );
        let mut more = Changes::default();
        for _ in 0..1000 {
            more.jobs.push(Uuid::now_v7());
        }
        changes.merge(more);
        let payloads = changes.payloads(origin);
        assert!(payloads.len() > 1);
        assert!(payloads.iter().all(|p| p.len() <= MAX_PAYLOAD));
        assert!(
            payloads
                .iter()
                .all(|p| p.starts_with(&format!("r:{origin}\n")))
        );
        let notifier = Notifier::new();
        let mut rx = notifier.subscribe_queues();
        for p in &payloads {
            wake_from_payload(p, other, &notifier);
        }
        assert_eq!(&*rx.try_recv().expect("queue woken"), "t/q");
        let mut all = Changes::default();
        for _ in 0..(MAX_PAYLOADS * 250) {
            all.jobs.push(Uuid::now_v7());
        }
        assert_eq!(all.payloads(origin), vec![format!("r:{origin}\n*")]);
    }

    #[test]
    fn a_replica_ignores_its_own_payloads_and_applies_the_others() {
        let (own, other) = (Uuid::new_v4(), Uuid::new_v4());
        let notifier = Notifier::new();
        let mut rx = notifier.subscribe_queues();
        let mut changes = Changes::default();
        changes.queue("t", "q");
        for p in changes.payloads(own) {
            wake_from_payload(&p, own, &notifier);
        }
        assert!(rx.try_recv().is_err(), "its own wake-ups were already done");
        wake_from_payload(&format!("r:{other}\n*"), own, &notifier);
        assert_eq!(&*rx.try_recv().expect("wildcard"), ANY_QUEUE);
        // A payload without an origin (an older replica) is applied.
        wake_from_payload("q:t/q\n", own, &notifier);
        assert_eq!(&*rx.try_recv().expect("legacy payload"), "t/q");
    }
}
