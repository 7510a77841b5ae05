//! The coalescers of the hot path: unary `Submit`, `Lease` and `Complete`
//! calls of one replica share transactions (see [`super::coalesce`]).

use std::sync::Arc;

use crate::domain::{CompleteSpec, Job, LeaseSpec, NewJob};
use crate::store::{Ended, Store, StoreResult, Submitted};

use super::coalesce::{Coalescer, Flush, FlushFuture, Sizing};
use super::handoff::{self, Parked, Parking};

/// Most jobs in one shared transaction (the API's batch limit).
const MAX_WEIGHT: usize = 1000;

/// Fewest jobs for which a shared transaction starts beside a running one
/// (see [`Sizing::overlap_weight`]). A claim's fixed cost is about that of
/// ten jobs' rows (in psql: 0.73 ms for one job, 5.99 ms for 100); e2e (32
/// workers leasing one job each) ran 5-13 % faster with 32 than with
/// overlapping every batch, and 8 measured the same as 32
/// (docs/performance-log.md). Burn-down's leases ask for 100 jobs each and
/// still overlap.
const OVERLAP_WEIGHT: usize = 32;

/// The three coalescers, sharing one store, and the idle `Lease` calls that
/// submits may hand jobs to.
pub struct Batchers {
    store: Arc<dyn Store>,
    parking: Arc<Parking>,
    submit: Coalescer<SubmitFlush>,
    lease: Coalescer<LeaseFlush>,
    complete: Coalescer<CompleteFlush>,
}

impl Batchers {
    /// Starts the coalescing tasks: the submit one runs at most
    /// `submit_in_flight` transactions at once, the lease and complete
    /// ones `in_flight` each.
    pub fn start(store: Arc<dyn Store>, submit_in_flight: usize, in_flight: usize) -> Self {
        let parking = Arc::new(Parking::default());
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
            lease: Coalescer::start(LeaseFlush(Arc::clone(&store)), sizing(in_flight)),
            complete: Coalescer::start(CompleteFlush(Arc::clone(&store)), sizing(in_flight)),
            store,
            parking,
        }
    }

    /// Stores a batch of jobs in one transaction of its own, handing due
    /// ones to idle `Lease` calls like a unary submit.
    pub async fn submit_batch(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        handoff::submit(&self.store, &self.parking, tenant, jobs).await
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

    /// Jobs claimed for a caller that went away are not left to sit out
    /// their lease.
    fn orphaned(&self, jobs: Vec<Job>) {
        handoff::end_leases(&self.0, jobs);
    }
}
