//! What a committed transaction changed, as wake-ups for waiting calls: the
//! local notifier directly, other replicas through one `NOTIFY` per
//! transaction (never one per job: NOTIFY serialises commits).

use std::collections::BTreeSet;

use uuid::Uuid;

use crate::domain::{Job, JobState};
use crate::engine::notifier::{Notifier, queue_key};

/// The channel intray's replicas `LISTEN` on.
pub const CHANNEL: &str = "intray";

/// PostgreSQL refuses NOTIFY payloads of 8000 bytes or more.
const MAX_PAYLOAD: usize = 7900;

/// Jobs and queues touched by one transaction.
#[derive(Debug, Default)]
pub struct Changes {
    queues: BTreeSet<String>,
    jobs: Vec<Uuid>,
}

impl Changes {
    /// Records a job as it is after the transition.
    pub fn job(&mut self, job: &Job) {
        self.jobs.push(job.id);
        if job.state == JobState::Queued {
            self.queues.insert(queue_key(&job.tenant, &job.queue));
        }
    }

    /// Records a new job: nobody can be watching it yet, but its queue wakes.
    pub fn submitted(&mut self, job: &Job) {
        self.queues.insert(queue_key(&job.tenant, &job.queue));
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
        for key in &self.queues {
            notifier.queue_ready(key);
        }
        for id in &self.jobs {
            notifier.job_changed(*id);
        }
    }

    /// The NOTIFY payload: one `q:tenant/queue` or `j:id` per line, or `*`
    /// (wake everything) when that would not fit.
    pub fn payload(&self) -> String {
        let mut out = String::new();
        for key in &self.queues {
            out.push_str("q:");
            out.push_str(key);
            out.push('\n');
        }
        for id in &self.jobs {
            out.push_str("j:");
            out.push_str(&id.to_string());
            out.push('\n');
        }
        if out.len() > MAX_PAYLOAD {
            return "*".into();
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
    fn payload_round_trips_and_overflows_to_a_wildcard() {
        let mut changes = Changes::default();
        let id = Uuid::now_v7();
        changes.jobs.push(id);
        changes.queues.insert("t/q".into());
        assert_eq!(changes.payload(), format!("q:t/q\nj:{id}\n"));
        for _ in 0..300 {
            changes.jobs.push(Uuid::now_v7());
        }
        assert_eq!(changes.payload(), "*");
    }
}
