//! Direct hand-off of new jobs to idle workers.
//!
//! A `Lease` call that found nothing to claim parks here while it waits. A
//! submit that runs meanwhile reserves parked calls whose queues and kinds
//! fit its jobs and asks the store to insert those jobs already leased to
//! them ([`Store::submit_handing`]), so an idle worker gets its job after
//! one commit (the submit's) instead of two (the submit's, then its own
//! claim's), and nothing wakes every waiter of the queue. The store has
//! the last word: a job it keeps queued (a better one is due, the queue is
//! paused, ...) is claimed as usual by the reserved call, which then gets
//! an empty answer here and claims again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::Utc;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::domain::{Handoff, Job, JobState, LeaseSpec, NewJob};
use crate::store::{Store, StoreResult, Submitted};

/// The idle `Lease` calls of this replica, oldest first.
pub struct Parking {
    inner: Mutex<Waiting>,
    /// Gives back jobs handed to a call that went away unread.
    store: Arc<dyn Store>,
}

#[derive(Debug, Default)]
struct Waiting {
    next_id: u64,
    calls: VecDeque<Waiter>,
}

/// One parked call: what it accepts, and where its jobs go.
#[derive(Debug)]
struct Waiter {
    id: u64,
    tenant: String,
    queues: Vec<String>,
    kinds: Vec<String>,
    handoff: Handoff,
    max_jobs: usize,
    jobs: oneshot::Sender<Vec<Job>>,
}

impl Waiter {
    fn accepts(&self, tenant: &str, job: &NewJob) -> bool {
        self.tenant == tenant
            && self.queues.contains(&job.queue)
            && (self.kinds.is_empty() || self.kinds.contains(&job.kind))
    }
}

/// A parked call's side: registered until it leaves or is dropped.
pub struct Parked {
    id: u64,
    parking: Arc<Parking>,
    jobs: oneshot::Receiver<Vec<Job>>,
}

impl Parking {
    /// No calls parked yet; `store` gives back jobs that reach a call
    /// after it went away.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Parking {
            inner: Mutex::default(),
            store,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parks an idle `Lease` call. Calls across tenants are not parked:
    /// their claim weighs tenants against each other, which a hand-off
    /// cannot.
    pub fn park(self: &Arc<Self>, tenant: &str, spec: &LeaseSpec) -> Option<Parked> {
        if spec.all_tenants {
            return None;
        }
        let (sender, receiver) = oneshot::channel();
        let mut waiting = self.lock();
        waiting.next_id += 1;
        let id = waiting.next_id;
        waiting.calls.push_back(Waiter {
            id,
            tenant: tenant.to_owned(),
            queues: spec.queues.clone(),
            kinds: spec.kinds.clone(),
            handoff: Handoff {
                worker_id: spec.worker_id.clone(),
                lease_duration: spec.lease_duration,
            },
            max_jobs: spec.max_jobs as usize,
            jobs: sender,
        });
        Some(Parked {
            id,
            parking: Arc::clone(self),
            jobs: receiver,
        })
    }

    /// Takes parked calls for the due jobs among `jobs`: the jobs in
    /// priority order, each to the longest-waiting call that accepts it,
    /// spreading over calls before giving one call a second job.
    fn reserve(&self, tenant: &str, jobs: &[NewJob]) -> Reservation {
        let mut reservation = Reservation {
            handoffs: vec![None; jobs.len()],
            waiters: Vec::new(),
        };
        let mut waiting = self.lock();
        if waiting.calls.is_empty() {
            return reservation;
        }
        let now = Utc::now();
        let mut due: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].run_at.is_none_or(|at| at <= now))
            .collect();
        due.sort_by_key(|&i| std::cmp::Reverse(jobs[i].priority));
        for i in due {
            let job = &jobs[i];
            let parked = waiting.calls.iter().position(|w| w.accepts(tenant, job));
            let taken = match parked {
                Some(at) => waiting.calls.remove(at).map(|w| {
                    reservation.waiters.push((w, Vec::new()));
                    reservation.waiters.len() - 1
                }),
                None => reservation
                    .waiters
                    .iter()
                    .position(|(w, got)| got.len() < w.max_jobs && w.accepts(tenant, job)),
            };
            if let Some(at) = taken {
                let (waiter, got) = &mut reservation.waiters[at];
                got.push(i);
                reservation.handoffs[i] = Some(waiter.handoff.clone());
            }
        }
        reservation
    }
}

/// Calls taken out of the parking for one submit, and their jobs.
struct Reservation {
    /// Per job, the worker it may go to.
    handoffs: Vec<Option<Handoff>>,
    /// The calls taken, with the indexes of the jobs reserved for them.
    waiters: Vec<(Waiter, Vec<usize>)>,
}

impl Parked {
    /// Jobs handed to this call: `None` when the submit that reserved it
    /// ended without one for it.
    pub async fn handed(&mut self) -> Option<Vec<Job>> {
        (&mut self.jobs).await.ok().filter(|jobs| !jobs.is_empty())
    }

    /// Stops waiting. A call still parked just leaves; one a submit has
    /// reserved waits for that submit's answer, whose jobs are already
    /// leased to it, until `until`: a submit stalled in the database (on
    /// another transaction's idempotency key) must not hold the call past
    /// its wait. Given up on, the call is dropped as one that went away,
    /// and the jobs the submit hands it later go back to the queue.
    pub async fn leave(mut self, until: Instant) -> Option<Vec<Job>> {
        let still_parked = {
            let mut waiting = self.parking.lock();
            let at = waiting.calls.iter().position(|w| w.id == self.id);
            at.and_then(|at| waiting.calls.remove(at)).is_some()
        };
        if still_parked {
            return None;
        }
        tokio::time::timeout_at(until, self.handed())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for Parked {
    /// A call that goes away (its client cancelled it, or its deadline
    /// passed) may have been handed jobs it never read: they are already
    /// leased to it, so they are given back rather than left to sit out
    /// their lease.
    fn drop(&mut self) {
        {
            let mut waiting = self.parking.lock();
            if let Some(at) = waiting.calls.iter().position(|w| w.id == self.id) {
                waiting.calls.remove(at);
            }
        }
        // Closed first: a submit sending now either fails (and gives the
        // jobs back itself) or has sent what is read here.
        self.jobs.close();
        if let Ok(unread) = self.jobs.try_recv() {
            give_back(&self.parking.store, unread);
        }
    }
}

/// Submits `jobs`, handing due ones to parked calls of this replica where
/// the store agrees, and answers those calls after the commit.
pub async fn submit(
    store: &Arc<dyn Store>,
    parking: &Parking,
    tenant: &str,
    jobs: Vec<NewJob>,
) -> StoreResult<Vec<StoreResult<Submitted>>> {
    let Reservation { handoffs, waiters } = parking.reserve(tenant, &jobs);
    if waiters.is_empty() {
        return store.submit(tenant, jobs).await;
    }
    // On an error the reserved calls' senders drop with `waiters`: they
    // hear "nothing handed" and claim again.
    let results = store.submit_handing(tenant, jobs, handoffs).await?;
    for (waiter, reserved) in waiters {
        let handed: Vec<Job> = reserved
            .iter()
            .filter_map(|&i| match results.get(i) {
                Some(Ok(Submitted { job, created: true })) if job.state == JobState::Running => {
                    Some(job.clone())
                }
                _ => None,
            })
            .collect();
        if let Err(orphans) = waiter.jobs.send(handed) {
            give_back(store, orphans);
        }
    }
    Ok(results)
}

/// Gives back jobs leased to a `Lease` call that went away (a long-poll
/// cut short by the worker's own deadline, say), which would otherwise sit
/// out a whole lease: they go back to the queue with their attempt
/// returned, in a task of its own, since the caller may be a drop. A drop
/// outside the runtime (as it shuts down) leaves them to their lease's end.
pub fn give_back(store: &Arc<dyn Store>, jobs: Vec<Job>) {
    if jobs.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let store = Arc::clone(store);
    runtime.spawn(async move {
        for job in jobs {
            let Some(lease_token) = job.lease_token else {
                continue;
            };
            match store.give_back(&job.tenant, job.id, &lease_token).await {
                Ok(back) => tracing::info!(
                    job_id = %back.id, kind = %back.kind, queue = %back.queue, tenant = %back.tenant,
                    worker_id = job.lease_owner.as_deref().unwrap_or_default(), to = %back.state,
                    "job given back: its Lease call went away"
                ),
                Err(err) => {
                    tracing::warn!(error = %err, job_id = %job.id, "could not give back a job whose Lease call went away; it waits out its lease")
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::domain::Backoff;

    fn new_job(queue: &str, kind: &str, priority: i32) -> NewJob {
        NewJob {
            queue: queue.into(),
            kind: kind.into(),
            payload: json!({}),
            idempotency_key: None,
            input_hash: String::new(),
            priority,
            run_at: None,
            deadline: None,
            max_attempts: 3,
            backoff: Backoff::try_new(Duration::from_secs(1), Duration::from_secs(60))
                .expect("backoff"),
            labels: BTreeMap::new(),
            callback_url: None,
            max_cost_cents: None,
            trace_parent: None,
        }
    }

    fn lease(worker: &str, queues: &[&str], kinds: &[&str], max_jobs: u32) -> LeaseSpec {
        LeaseSpec {
            worker_id: worker.into(),
            queues: queues.iter().map(|q| (*q).into()).collect(),
            kinds: kinds.iter().map(|k| (*k).into()).collect(),
            max_jobs,
            lease_duration: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            all_tenants: false,
        }
    }

    /// An empty parking over a fresh SQLite store (kept while the
    /// directory lives).
    async fn parking() -> (tempfile::TempDir, Arc<Parking>) {
        let (dir, store) = crate::store::scratch_sqlite().await;
        (dir, Arc::new(Parking::new(store)))
    }

    /// Which worker each job was reserved for.
    fn workers(reservation: &Reservation) -> Vec<Option<&str>> {
        reservation
            .handoffs
            .iter()
            .map(|h| h.as_ref().map(|h| h.worker_id.as_str()))
            .collect()
    }

    #[tokio::test]
    async fn jobs_go_in_priority_order_to_the_longest_waiting_calls() {
        let (_db, parking) = parking().await;
        let _a = parking.park("t", &lease("a", &["q"], &[], 1));
        let _b = parking.park("t", &lease("b", &["q"], &[], 1));
        let jobs = [
            new_job("q", "k", 0),
            new_job("q", "k", 5),
            new_job("q", "k", 0),
        ];
        let reservation = parking.reserve("t", &jobs);
        assert_eq!(workers(&reservation), [Some("b"), Some("a"), None]);
        assert!(parking.lock().calls.is_empty(), "both calls taken");
    }

    #[tokio::test]
    async fn calls_get_one_job_each_before_a_second() {
        let (_db, parking) = parking().await;
        let _a = parking.park("t", &lease("a", &["q"], &[], 2));
        let _b = parking.park("t", &lease("b", &["q"], &[], 1));
        let jobs = [
            new_job("q", "k", 0),
            new_job("q", "k", 0),
            new_job("q", "k", 0),
        ];
        let reservation = parking.reserve("t", &jobs);
        assert_eq!(workers(&reservation), [Some("a"), Some("b"), Some("a")]);
    }

    #[tokio::test]
    async fn only_matching_due_jobs_of_the_same_tenant_are_reserved() {
        let (_db, parking) = parking().await;
        let _a = parking.park("t", &lease("a", &["q"], &["wanted"], 5));
        let mut later = new_job("q", "wanted", 0);
        later.run_at = Some(Utc::now() + chrono::Duration::seconds(60));
        let jobs = [
            new_job("q", "other", 0),
            new_job("other", "wanted", 0),
            later,
            new_job("q", "wanted", 0),
        ];
        assert_eq!(workers(&parking.reserve("u", &jobs)), [None; 4]);
        let reservation = parking.reserve("t", &jobs);
        assert_eq!(workers(&reservation), [None, None, None, Some("a")]);
    }

    #[tokio::test]
    async fn calls_across_tenants_are_not_parked() {
        let (_db, parking) = parking().await;
        let mut spec = lease("a", &["q"], &[], 1);
        spec.all_tenants = true;
        assert!(parking.park("t", &spec).is_none());
    }

    #[tokio::test]
    async fn a_call_that_leaves_or_is_dropped_is_not_reserved() {
        let (_db, parking) = parking().await;
        let a = parking
            .park("t", &lease("a", &["q"], &[], 1))
            .expect("parked");
        assert_eq!(
            a.leave(Instant::now() + Duration::from_secs(60)).await,
            None,
            "still parked: just leaves"
        );
        drop(parking.park("t", &lease("b", &["q"], &[], 1)));
        assert_eq!(
            workers(&parking.reserve("t", &[new_job("q", "k", 0)])),
            [None]
        );
    }

    #[tokio::test]
    async fn jobs_handed_to_a_call_that_went_away_unread_are_given_back() {
        let (_db, parking) = parking().await;
        let store = Arc::clone(&parking.store);
        let parked = parking
            .park("t", &lease("a", &["q"], &[], 1))
            .expect("parked");
        let results = submit(&store, &parking, "t", vec![new_job("q", "k", 0)])
            .await
            .expect("submit");
        let Some(Ok(Submitted { job, .. })) = results.first() else {
            panic!("stored: {results:?}");
        };
        assert_eq!(job.state, JobState::Running, "handed to the parked call");
        drop(parked);
        let given_back = async {
            loop {
                let now = store.get("t", job.id).await.expect("job");
                if now.state == JobState::Queued {
                    return now;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let now = tokio::time::timeout(Duration::from_secs(10), given_back)
            .await
            .expect("the job is given back, not left to sit out its lease");
        assert_eq!(now.attempt, 0, "with its attempt");
    }

    #[tokio::test]
    async fn a_reserved_call_waits_for_the_submit_answer() {
        let (_db, parking) = parking().await;
        let parked = parking
            .park("t", &lease("a", &["q"], &[], 1))
            .expect("parked");
        let Reservation { waiters, .. } = parking.reserve("t", &[new_job("q", "k", 0)]);
        let leaving = tokio::spawn(parked.leave(Instant::now() + Duration::from_secs(60)));
        tokio::task::yield_now().await;
        assert!(!leaving.is_finished(), "waits for the submit");
        // The submit kept its job queued: the call hears "nothing".
        drop(waiters);
        assert_eq!(leaving.await.expect("joined"), None);
    }

    #[tokio::test]
    async fn a_reserved_call_waits_for_the_submit_no_longer_than_told() {
        let (_db, parking) = parking().await;
        let parked = parking
            .park("t", &lease("a", &["q"], &[], 1))
            .expect("parked");
        let Reservation { waiters, .. } = parking.reserve("t", &[new_job("q", "k", 0)]);
        let until = Instant::now() + Duration::from_millis(200);
        assert_eq!(parked.leave(until).await, None, "given up at its time");
        assert!(Instant::now() >= until);
        drop(waiters);
    }
}
