//! What a committed transaction changed, as wake-ups for waiting calls: the
//! local notifier directly, other replicas through a `NOTIFY` sent after the
//! commit, coalesced over whatever committed meanwhile (never one per job,
//! and never inside the job's transaction: NOTIFY serialises commits).

use std::collections::BTreeSet;

use uuid::Uuid;

use crate::domain::{Job, JobEvent, JobState};
use crate::engine::notifier::{Notifier, queue_key};

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
    jobs: Vec<Uuid>,
    /// Events this process wrote, for its own watchers only (other replicas
    /// read them from the database).
    events: Vec<JobEvent>,
}

impl Changes {
    /// Records a job as it is after the transition.
    pub fn job(&mut self, job: &Job) {
        self.jobs.push(job.id);
        if job.state == JobState::Queued {
            self.queues.insert(queue_key(&job.tenant, &job.queue));
        }
    }

    /// Records a job as it is after the transition, and the event it wrote.
    pub fn job_event(&mut self, job: &Job, event: &JobEvent) {
        self.job(job);
        self.events.push(event.clone());
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
        self.queues.is_empty() && self.jobs.is_empty()
    }

    /// Wakes this process's waiters.
    pub fn wake(&self, notifier: &Notifier) {
        notifier.events_committed(&self.events);
        for key in &self.queues {
            notifier.queue_ready(key);
        }
        for id in &self.jobs {
            notifier.job_changed(*id);
        }
    }

    /// Adds what another transaction changed, for the other replicas.
    pub fn merge(&mut self, other: Changes) {
        self.queues.extend(other.queues);
        self.jobs.extend(other.jobs);
    }

    /// The NOTIFY payloads: lines of `q:tenant/queue` or `j:id`, each payload
    /// under PostgreSQL's size limit, or the one payload `*` (wake
    /// everything) when there would be too many.
    pub fn payloads(&self) -> Vec<String> {
        let lines = self
            .queues
            .iter()
            .map(|key| format!("q:{key}\n"))
            .chain(self.jobs.iter().map(|id| format!("j:{id}\n")));
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
                return vec!["*".into()];
            } else {
                out.push(line);
            }
        }
        out
    }
}

/// Applies a payload received from another replica's NOTIFY.
pub fn wake_from_payload(payload: &str, notifier: &Notifier) {
    if payload == "*" {
        notifier.queue_ready(crate::engine::notifier::ANY_QUEUE);
        notifier.all_jobs_changed();
        return;
    }
    for line in payload.lines() {
        if let Some(key) = line.strip_prefix("q:") {
            notifier.queue_ready(key);
        } else if let Some(id) = line
            .strip_prefix("j:")
            .and_then(|s| Uuid::parse_str(s).ok())
        {
            notifier.job_changed(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_split_under_the_limit_and_overflow_to_a_wildcard() {
        let mut changes = Changes::default();
        let id = Uuid::now_v7();
        changes.jobs.push(id);
        changes.queues.insert("t/q".into());
        assert_eq!(changes.payloads(), vec![format!("q:t/q\nj:{id}\n")]);
        let mut more = Changes::default();
        for _ in 0..1000 {
            more.jobs.push(Uuid::now_v7());
        }
        changes.merge(more);
        let payloads = changes.payloads();
        assert!(payloads.len() > 1);
        assert!(payloads.iter().all(|p| p.len() <= MAX_PAYLOAD));
        let notifier = Notifier::new();
        let mut rx = notifier.subscribe_queues();
        for p in &payloads {
            wake_from_payload(p, &notifier);
        }
        assert_eq!(&*rx.try_recv().expect("queue woken"), "t/q");
        let mut all = Changes::default();
        for _ in 0..(MAX_PAYLOADS * 250) {
            all.jobs.push(Uuid::now_v7());
        }
        assert_eq!(all.payloads(), vec!["*".to_string()]);
    }
}
