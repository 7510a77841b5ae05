//! The coalescers of the hot path: unary `Submit`, `Lease` and `Complete`
//! calls of one replica share transactions (see [`super::coalesce`]).
//!
//! `Lease` and `Complete` calls share one coalescer: a worker completes a
//! job and asks for the next, so both kinds are waiting at any moment, and
//! one statement for both ([`Store::complete_and_lease`]) costs less than a
//! statement each.

use std::sync::Arc;

use crate::domain::{CompleteSpec, Job, LeaseSpec, NewJob};
use crate::store::{Ended, Store, StoreError, StoreResult, Submitted};

use super::coalesce::{Coalescer, Flush, FlushFuture, Sizing};
use super::detach::detached;
use super::handoff::{self, Parked, Parking};
use super::observer::Observer;

/// Most jobs in one shared transaction (the API's batch limit).
const MAX_WEIGHT: usize = 1000;

/// Fewest jobs for which a shared transaction starts beside a running one
/// (see [`Sizing::overlap_weight`]). A claim's fixed cost is about that of
/// ten jobs' rows (in psql: 0.73 ms for one job, 5.99 ms for 100); e2e (32
/// workers leasing one job each) ran 5-13 % faster with 32 than with
/// overlapping every batch. With `Lease` and `Complete` in one batch, 8
/// and 16 made e2e slower again and 64 measured the same as 32
/// (docs/performance-log.md). Burn-down's leases ask for 100 jobs each and
/// still overlap.
const OVERLAP_WEIGHT: usize = 32;

/// The two coalescers, sharing one store, and the idle `Lease` calls that
/// submits may hand jobs to.
pub struct Batchers {
    store: Arc<dyn Store>,
    observer: Arc<Observer>,
    parking: Arc<Parking>,
    submit: Coalescer<SubmitFlush>,
    work: Coalescer<WorkFlush>,
}

impl Batchers {
    /// Starts the coalescing tasks: the submit one runs at most
    /// `submit_in_flight` transactions at once, the lease and complete one
    /// `in_flight`. Every attempt ended here is reported to `observer`:
    /// on the caller's side once its answer arrives (off the shared
    /// transaction's path), by the answer itself when its caller went away
    /// without reading it (`Answer`), and inside the detached write of
    /// a batch ([`Self::complete_batch`]).
    pub fn start(
        store: Arc<dyn Store>,
        observer: Arc<Observer>,
        submit_in_flight: usize,
        in_flight: usize,
    ) -> Self {
        let parking = Arc::new(Parking::new(Arc::clone(&store)));
        let submit = SubmitFlush {
            store: Arc::clone(&store),
            parking: Arc::clone(&parking),
        };
        let sizing = |in_flight| Sizing {
            in_flight,
            max_weight: MAX_WEIGHT,
            overlap_weight: OVERLAP_WEIGHT,
        };
        Batchers {
            submit: Coalescer::start(submit, sizing(submit_in_flight)),
            work: Coalescer::start(
                WorkFlush {
                    store: Arc::clone(&store),
                    observer: Arc::clone(&observer),
                },
                sizing(in_flight),
            ),
            store,
            observer,
            parking,
        }
    }

    /// Stores a batch of jobs in one transaction of its own, handing due
    /// ones to idle `Lease` calls like a unary submit. It runs to its end
    /// in a task of its own even if its caller goes away: once it has
    /// committed, the jobs leased to parked calls must reach them.
    pub async fn submit_batch(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        let store = Arc::clone(&self.store);
        let parking = Arc::clone(&self.parking);
        let tenant = tenant.to_owned();
        tokio::spawn(async move { handoff::submit(&store, &parking, &tenant, jobs).await })
            .await
            .map_err(|err| StoreError::Internal(format!("the batch submit task failed: {err}")))?
    }

    /// Parks a `Lease` call that found nothing, so that submits can hand
    /// it jobs; `None` for a call that cannot take hand-offs.
    pub fn park(&self, tenant: &str, spec: &LeaseSpec) -> Option<Parked> {
        self.parking.park(tenant, spec)
    }

    /// Stores one job, in a transaction shared with concurrent submits of
    /// the same tenant.
    pub async fn submit(&self, tenant: &str, job: NewJob) -> StoreResult<StoreResult<Submitted>> {
        self.submit.call(tenant.to_owned(), job).await
    }

    /// One claim, in a statement shared with concurrent claims of the same
    /// tenant, queues and kinds (and with completes of the same tenant).
    pub async fn lease(&self, tenant: &str, spec: &LeaseSpec) -> StoreResult<Vec<Job>> {
        match self
            .work
            .call(tenant.to_owned(), Work::Lease(spec.clone()))
            .await?
            .read()?
        {
            Done::Leased(jobs) => jobs,
            Done::Completed(_) | Done::Both(..) => Err(mismatched()),
        }
    }

    /// Applies one outcome, in a transaction shared with concurrent
    /// completes (and claims) of the same tenant.
    pub async fn complete(
        &self,
        tenant: &str,
        spec: CompleteSpec,
    ) -> StoreResult<StoreResult<Ended>> {
        match self
            .work
            .call(tenant.to_owned(), Work::Complete(spec))
            .await?
            .read()?
        {
            Done::Completed(ended) => {
                if let Ok(ended) = ended.as_ref() {
                    self.observer.ended(ended);
                }
                Ok(*ended)
            }
            Done::Leased(_) | Done::Both(..) => Err(mismatched()),
        }
    }

    /// Applies a batch of outcomes in a transaction of its own (each
    /// failing alone), and reports the attempts they end. It runs to its
    /// end in a task of its own: a caller that goes away while it commits
    /// must not take the wake-ups and the reports with it.
    pub async fn complete_batch(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>> {
        let store = Arc::clone(&self.store);
        let observer = Arc::clone(&self.observer);
        let tenant = tenant.to_owned();
        detached(async move {
            let ended = store.complete(&tenant, items).await?;
            observer.ended_all(&ended);
            Ok(ended)
        })
        .await
    }

    /// Applies outcomes, then claims for `spec`: the outcomes (each failing
    /// alone) and the claim's jobs, or the claim's error (the outcomes
    /// stand all the same). A light call shares one transaction with
    /// concurrent calls of the same tenant. A call of at least
    /// [`OVERLAP_WEIGHT`] jobs is `CompleteBatch` then `Lease`: its
    /// outcomes in a transaction of their own, its claim shared with other
    /// claims. Burn-down (100 outcomes and a claim of 100 per call) drained
    /// at 0.7x that rate with both in one statement, shared or not
    /// (docs/performance-log.md).
    pub async fn complete_and_lease(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
        spec: &LeaseSpec,
    ) -> StoreResult<(Vec<StoreResult<Ended>>, StoreResult<Vec<Job>>)> {
        if items.len() + spec.max_jobs as usize >= OVERLAP_WEIGHT {
            let ended = self.complete_batch(tenant, items).await?;
            let leased = self.lease(tenant, spec).await;
            return Ok((ended, leased));
        }
        match self
            .work
            .call(
                tenant.to_owned(),
                Work::CompleteAndLease(items, spec.clone()),
            )
            .await?
            .read()?
        {
            Done::Both(ended, leased) => {
                self.observer.ended_all(&ended);
                Ok((ended, leased))
            }
            Done::Leased(_) | Done::Completed(_) => Err(mismatched()),
        }
    }
}

fn mismatched() -> StoreError {
    StoreError::Internal("a coalesced call got the answer of another kind".into())
}

struct SubmitFlush {
    store: Arc<dyn Store>,
    parking: Arc<Parking>,
}

impl Flush for SubmitFlush {
    type Key = String;
    type Call = NewJob;
    type Answer = StoreResult<Submitted>;

    fn weight(_: &NewJob) -> usize {
        1
    }

    fn flush(&self, tenant: String, jobs: Vec<NewJob>) -> FlushFuture<'_, Self::Answer> {
        Box::pin(async move { handoff::submit(&self.store, &self.parking, &tenant, jobs).await })
    }
}

/// A worker's call.
#[derive(Clone, Debug)]
enum Work {
    Lease(LeaseSpec),
    Complete(CompleteSpec),
    /// Outcomes, then the claim that follows them.
    CompleteAndLease(Vec<CompleteSpec>, LeaseSpec),
}

/// A worker's answer: a claim's jobs, one outcome applied, or both.
enum Done {
    Leased(StoreResult<Vec<Job>>),
    /// Boxed: an ended job is large beside a list of jobs.
    Completed(Box<StoreResult<Ended>>),
    Both(Vec<StoreResult<Ended>>, StoreResult<Vec<Job>>),
}

/// One caller's [`Done`], as a shared transaction sends it. Dropped unread
/// (its caller went away before it was sent, or after, before reading it),
/// it reports the attempts its outcomes ended, as the caller would have,
/// and gives back the jobs claimed for it: a lease nobody holds would sit
/// out its length and cost its job an attempt.
struct Answer {
    done: Option<Done>,
    store: Arc<dyn Store>,
    observer: Arc<Observer>,
}

impl Answer {
    /// The answer, for its caller to report and hand on.
    fn read(mut self) -> StoreResult<Done> {
        self.done.take().ok_or_else(mismatched)
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        let Some(done) = self.done.take() else {
            return;
        };
        let (ended, leased) = match done {
            Done::Leased(leased) => (Vec::new(), Some(leased)),
            Done::Completed(ended) => (vec![*ended], None),
            Done::Both(ended, leased) => (ended, Some(leased)),
        };
        self.observer.ended_all(&ended);
        if let Some(Ok(jobs)) = leased {
            handoff::give_back(&self.store, jobs);
        }
    }
}

/// What one call of a batch gets back, gathered before it becomes a [`Done`].
#[derive(Default)]
struct Parts {
    ended: Vec<StoreResult<Ended>>,
    leased: Option<StoreResult<Vec<Job>>>,
}

/// Claims that can be one statement: same queues, kinds and scope (the
/// tenant is the coalescer's key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct LeaseShape {
    queues: Vec<String>,
    kinds: Vec<String>,
    all_tenants: bool,
}

impl LeaseShape {
    fn of(spec: &LeaseSpec) -> Self {
        LeaseShape {
            queues: spec.queues.clone(),
            kinds: spec.kinds.clone(),
            all_tenants: spec.all_tenants,
        }
    }
}

struct WorkFlush {
    store: Arc<dyn Store>,
    /// Reports the attempts ended for callers that went away.
    observer: Arc<Observer>,
}

impl WorkFlush {
    fn answer(&self, done: Done) -> Answer {
        Answer {
            done: Some(done),
            store: Arc::clone(&self.store),
            observer: Arc::clone(&self.observer),
        }
    }
}

impl Flush for WorkFlush {
    type Key = String;
    type Call = Work;
    type Answer = Answer;

    fn weight(call: &Work) -> usize {
        match call {
            Work::Lease(spec) => spec.max_jobs as usize,
            Work::Complete(_) => 1,
            Work::CompleteAndLease(items, spec) => items.len() + spec.max_jobs as usize,
        }
    }

    /// The completes with the claims of the first shape in one store call,
    /// then the claims of any other shape, each in a statement of its own.
    /// A call that both completes and claims has its outcomes applied
    /// before its claim, in the same transaction when the claim is of the
    /// first shape. Only the first call's failure fails the batch (to be
    /// run again one call at a time), so the others wait for it: nothing of
    /// theirs may have committed by then.
    fn flush(&self, tenant: String, calls: Vec<Work>) -> FlushFuture<'_, Answer> {
        Box::pin(async move {
            let mut completes = Vec::new();
            let mut shapes: Vec<(LeaseShape, Vec<usize>, Vec<LeaseSpec>)> = Vec::new();
            let mut claim = |index: usize, spec: LeaseSpec| {
                let shape = LeaseShape::of(&spec);
                match shapes.iter_mut().find(|(s, _, _)| *s == shape) {
                    Some((_, indexes, specs)) => {
                        indexes.push(index);
                        specs.push(spec);
                    }
                    None => shapes.push((shape, vec![index], vec![spec])),
                }
            };
            let mut kinds = Vec::with_capacity(calls.len());
            for (index, call) in calls.into_iter().enumerate() {
                kinds.push(Kind::of(&call));
                match call {
                    Work::Complete(spec) => completes.push((index, spec)),
                    Work::Lease(spec) => claim(index, spec),
                    Work::CompleteAndLease(items, spec) => {
                        completes.extend(items.into_iter().map(|item| (index, item)));
                        claim(index, spec);
                    }
                }
            }
            let (complete_at, items): (Vec<usize>, Vec<CompleteSpec>) =
                completes.into_iter().unzip();
            let mut shapes = shapes.into_iter();
            let (first_at, first_specs) = shapes
                .next()
                .map(|(_, indexes, specs)| (indexes, specs))
                .unwrap_or_default();
            let (ended, first_leased) = self
                .store
                .complete_and_lease(&tenant, items, &first_specs)
                .await?;
            let others = futures::future::join_all(shapes.map(|(_, indexes, specs)| {
                let store = &self.store;
                let tenant = &tenant;
                async move { (indexes, store.lease(tenant, &specs).await) }
            }))
            .await;
            let mut parts: Vec<Parts> = kinds.iter().map(|_| Parts::default()).collect();
            for (index, ended) in complete_at.into_iter().zip(ended) {
                parts[index].ended.push(ended);
            }
            for (indexes, leased) in std::iter::once((first_at, first_leased)).chain(others) {
                spread(&mut parts, indexes, leased);
            }
            kinds
                .into_iter()
                .zip(parts)
                .map(|(kind, parts)| kind.answer(parts).map(|done| self.answer(done)))
                .collect()
        })
    }
}

/// Which of the three calls a batch entry was.
#[derive(Clone, Copy)]
enum Kind {
    Lease,
    Complete,
    Both,
}

impl Kind {
    fn of(call: &Work) -> Self {
        match call {
            Work::Lease(_) => Kind::Lease,
            Work::Complete(_) => Kind::Complete,
            Work::CompleteAndLease(..) => Kind::Both,
        }
    }

    /// The call's answer from what the batch gave it; an error if the
    /// store's answers do not line up with the calls.
    fn answer(self, mut parts: Parts) -> StoreResult<Done> {
        match self {
            Kind::Lease => parts.leased.map(Done::Leased),
            Kind::Complete => parts
                .ended
                .pop()
                .filter(|_| parts.ended.is_empty())
                .map(|ended| Done::Completed(Box::new(ended))),
            Kind::Both => parts.leased.map(|leased| Done::Both(parts.ended, leased)),
        }
        .ok_or_else(mismatched)
    }
}

/// Hands each caller at `indexes` its share of one claim, or the claim's error.
fn spread(parts: &mut [Parts], indexes: Vec<usize>, leased: StoreResult<Vec<Vec<Job>>>) {
    match leased {
        Ok(jobs) => {
            for (index, jobs) in indexes.into_iter().zip(jobs) {
                parts[index].leased = Some(Ok(jobs));
            }
        }
        Err(err) => {
            for index in indexes {
                parts[index].leased = Some(Err(err.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::domain::fixtures::{lease_spec, new_job};
    use crate::domain::{JobState, Outcome};
    use crate::telemetry::{Metrics, Tracing};

    /// A fresh SQLite store (kept while the directory lives) with two jobs
    /// leased from it.
    async fn two_leased() -> (tempfile::TempDir, Arc<dyn Store>, Vec<Job>) {
        let (dir, store) = crate::store::scratch_sqlite().await;
        store
            .submit("t", vec![new_job(), new_job()])
            .await
            .expect("submit");
        let mut leased = store
            .lease("t", &[lease_spec("w", 2)])
            .await
            .expect("lease");
        (dir, store, leased.remove(0))
    }

    /// An answer dropped unread (a caller gone at the moment it was sent)
    /// reports the attempt its outcome ended and gives back the job
    /// claimed for it: it was dropped with both.
    #[tokio::test]
    async fn an_answer_dropped_unread_reports_and_gives_back() {
        let (_dir, store, mut jobs) = two_leased().await;
        let metrics = Arc::new(Metrics::new());
        let observer = Arc::new(Observer::new(
            Tracing::off(),
            Arc::clone(&metrics),
            Duration::from_secs(60),
        ));
        let done = jobs.remove(0);
        let claimed = jobs.remove(0);
        let ended = store
            .complete(
                "t",
                vec![CompleteSpec {
                    job_id: done.id,
                    lease_token: done.lease_token.clone().unwrap_or_default(),
                    outcome: Outcome::Success { result: json!(1) },
                    cost_cents: 0,
                }],
            )
            .await
            .expect("complete");
        let flush = WorkFlush {
            store: Arc::clone(&store),
            observer,
        };
        drop(flush.answer(Done::Both(ended, Ok(vec![claimed.clone()]))));

        let counted =
            r#"intray_attempts_total{queue="q",kind="k",outcome="succeeded",error_class=""} 1"#;
        assert!(
            metrics.render().contains(counted),
            "the attempt is reported"
        );
        let back = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let job = store.get("t", claimed.id).await.expect("get");
                if job.state == JobState::Queued {
                    return job;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the claimed job is given back");
        assert_eq!(back.attempt, 0, "its attempt returned");
    }

    /// An answer read is its caller's to report: dropping it reports and
    /// gives back nothing.
    #[tokio::test]
    async fn an_answer_read_is_left_to_its_caller() {
        let (_dir, store, jobs) = two_leased().await;
        let metrics = Arc::new(Metrics::new());
        let observer = Arc::new(Observer::new(
            Tracing::off(),
            Arc::clone(&metrics),
            Duration::from_secs(60),
        ));
        let flush = WorkFlush {
            store: Arc::clone(&store),
            observer,
        };
        let answer = flush.answer(Done::Leased(Ok(jobs.clone())));
        assert!(matches!(answer.read(), Ok(Done::Leased(Ok(read))) if read.len() == 2));
        tokio::time::sleep(Duration::from_millis(200)).await;
        for job in jobs {
            let job = store.get("t", job.id).await.expect("get");
            assert_eq!(job.state, JobState::Running, "still leased");
        }
    }
}
