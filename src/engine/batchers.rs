//! The coalescers of the hot path: unary `Submit`, `Lease` and `Complete`
//! calls of one replica share transactions (see [`super::coalesce`]).

use std::sync::Arc;

use std::time::Duration;

use crate::domain::{CompleteSpec, HeartbeatSpec, Job, LeaseSpec, NewJob};
use crate::store::{Ended, Store, StoreResult, Submitted};

use super::coalesce::{Coalescer, Flush, FlushFuture};

/// Most jobs in one shared transaction (the API's batch limit).
const MAX_WEIGHT: usize = 1000;

/// The three coalescers, sharing one store.
pub struct Batchers {
    submit: Coalescer<SubmitFlush>,
    lease: Coalescer<LeaseFlush>,
    complete: Coalescer<CompleteFlush>,
}

impl Batchers {
    /// Starts the coalescing tasks; each runs at most `in_flight`
    /// transactions at once.
    pub fn start(store: Arc<dyn Store>, in_flight: usize) -> Self {
        Batchers {
            submit: Coalescer::start(SubmitFlush(Arc::clone(&store)), in_flight, MAX_WEIGHT),
            lease: Coalescer::start(LeaseFlush(Arc::clone(&store)), in_flight, MAX_WEIGHT),
            complete: Coalescer::start(CompleteFlush(store), in_flight, MAX_WEIGHT),
        }
    }

    /// Stores one job, in a transaction shared with concurrent submits of
    /// the same tenant.
    pub async fn submit(&self, tenant: &str, job: NewJob) -> StoreResult<StoreResult<Submitted>> {
        self.submit.call(tenant.to_owned(), job).await
    }

    /// One claim, in a statement shared with concurrent claims of the same
    /// tenant, queues and kinds.
    pub async fn lease(&self, tenant: &str, spec: &LeaseSpec) -> StoreResult<Vec<Job>> {
        let shape = LeaseShape {
            tenant: tenant.to_owned(),
            queues: spec.queues.clone(),
            kinds: spec.kinds.clone(),
            all_tenants: spec.all_tenants,
        };
        self.lease.call(shape, spec.clone()).await
    }

    /// Applies one outcome, in a transaction shared with concurrent
    /// completes of the same tenant.
    pub async fn complete(
        &self,
        tenant: &str,
        spec: CompleteSpec,
    ) -> StoreResult<StoreResult<Ended>> {
        self.complete.call(tenant.to_owned(), spec).await
    }
}

struct SubmitFlush(Arc<dyn Store>);

impl Flush for SubmitFlush {
    type Key = String;
    type Call = NewJob;
    type Answer = StoreResult<Submitted>;

    fn weight(_: &NewJob) -> usize {
        1
    }

    fn flush(&self, tenant: String, jobs: Vec<NewJob>) -> FlushFuture<'_, Self::Answer> {
        Box::pin(async move { self.0.submit(&tenant, jobs).await })
    }
}

struct CompleteFlush(Arc<dyn Store>);

impl Flush for CompleteFlush {
    type Key = String;
    type Call = CompleteSpec;
    type Answer = StoreResult<Ended>;

    fn weight(_: &CompleteSpec) -> usize {
        1
    }

    fn flush(&self, tenant: String, items: Vec<CompleteSpec>) -> FlushFuture<'_, Self::Answer> {
        Box::pin(async move { self.0.complete(&tenant, items).await })
    }
}

/// Claims that can be one statement: same tenant, queues, kinds and scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct LeaseShape {
    tenant: String,
    queues: Vec<String>,
    kinds: Vec<String>,
    all_tenants: bool,
}

struct LeaseFlush(Arc<dyn Store>);

impl Flush for LeaseFlush {
    type Key = LeaseShape;
    type Call = LeaseSpec;
    type Answer = Vec<Job>;

    fn weight(spec: &LeaseSpec) -> usize {
        spec.max_jobs as usize
    }

    fn flush(&self, shape: LeaseShape, specs: Vec<LeaseSpec>) -> FlushFuture<'_, Vec<Job>> {
        Box::pin(async move { self.0.lease(&shape.tenant, &specs).await })
    }

    /// Jobs leased to a caller that went away (a long-poll cut short by the
    /// worker's own deadline, say) would sit out a whole lease. Their leases
    /// are ended now instead, so the reaper's next pass hands them on, as
    /// after a worker crash.
    fn orphaned(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let store = Arc::clone(&self.0);
        tokio::spawn(async move {
            for job in jobs {
                let Some(lease_token) = job.lease_token else {
                    continue;
                };
                let end_now = HeartbeatSpec {
                    job_id: job.id,
                    lease_token,
                    extend_by: Duration::ZERO,
                    progress: None,
                    message: None,
                };
                if let Err(err) = store.heartbeat(&job.tenant, &end_now).await {
                    tracing::warn!(error = %err, job_id = %job.id, "could not end the lease of a job whose Lease call went away");
                }
            }
        });
    }
}
