//! `intray.v1.WorkerService`: lease, heartbeat and complete.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::Context;
use super::convert;
use super::status::item_error;
use super::tenant::{grant_of, require_admin, tenant_of};
use crate::auth::{AuthError, Grant};
use crate::domain::validate::{self, MAX_BATCH, ValidationError};
use crate::domain::{CompleteSpec, Job, LeaseSpec};
use crate::engine::detach::detached;
use crate::engine::notifier::{ANY_QUEUE, queue_key};
use crate::pb;
use crate::pb::worker_service_server::WorkerService;
use crate::store::{Ended, StoreError};

/// How long past its wait a `Lease` waits for a submit that reserved it
/// (its jobs are being stored leased to it, normally within a commit):
/// without a bound, a submit stalled in the database held the call.
const RESERVED_GRACE: Duration = Duration::from_secs(1);

/// A worker's `workers` row is refreshed at most this often, so a busy
/// worker's polling does not turn into a write per call.
const WORKER_TOUCH_INTERVAL: Duration = Duration::from_secs(10);

/// The WorkerService implementation.
pub struct WorkersApi {
    ctx: Context,
    /// When this replica last recorded each (tenant, worker).
    touched: Mutex<HashMap<(String, String), Instant>>,
}

impl WorkersApi {
    /// Whether this server exports attempt spans, for leased jobs'
    /// `traceparent`.
    fn attempt_spans(&self) -> bool {
        self.ctx.observer.tracing().tracer().is_some()
    }

    /// A service over the given context.
    pub fn new(ctx: Context) -> Self {
        WorkersApi {
            ctx,
            touched: Mutex::new(HashMap::new()),
        }
    }

    /// Records the worker for `Stats`, at most once per interval. A failure
    /// here must not cost the worker its lease call, so it is only logged.
    async fn touch_worker(&self, tenant: &str, spec: &LeaseSpec) {
        let now = Instant::now();
        {
            let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
            let key = (tenant.to_owned(), spec.worker_id.clone());
            if touched
                .get(&key)
                .is_some_and(|at| now.duration_since(*at) < WORKER_TOUCH_INTERVAL)
            {
                return;
            }
            if touched.len() > 10_000 {
                touched.retain(|_, at| now.duration_since(*at) < WORKER_TOUCH_INTERVAL);
            }
            touched.insert(key, now);
        }
        if let Err(err) = self
            .ctx
            .store
            .touch_worker(tenant, &spec.worker_id, &spec.queues)
            .await
        {
            tracing::warn!(error = %err, worker_id = %spec.worker_id, "could not record worker");
        }
    }

    /// Claims, and while nothing is runnable waits until `spec.wait` ends
    /// for a job handed to it by a submit, or for a wake-up on one of the
    /// requested queues (or the fallback timer) to claim again. A reload
    /// that takes the caller's token away (`grant`) ends the wait
    /// `UNAUTHENTICATED`; a job handed to it meanwhile is given back.
    async fn lease_or_wait(
        &self,
        tenant: &str,
        spec: &LeaseSpec,
        grant: &mut Grant,
    ) -> Result<Vec<Job>, Status> {
        let give_up = Instant::now() + spec.wait;
        let keys: HashSet<String> = spec.queues.iter().map(|q| queue_key(tenant, q)).collect();
        // A worker of every tenant wakes for its queue names in any tenant.
        let wakes = |key: &str| {
            key == ANY_QUEUE
                || if spec.all_tenants {
                    key.split_once('/')
                        .is_some_and(|(_, queue)| spec.queues.iter().any(|q| q == queue))
                } else {
                    keys.contains(key)
                }
        };
        // Subscribed before the first claim, so a submit that commits between
        // the claim and the wait still wakes us.
        let mut wakeups = self.ctx.notifier.subscribe_queues();
        loop {
            let jobs = self.ctx.batchers.lease(tenant, spec).await?;
            let now = Instant::now();
            if !jobs.is_empty() || now >= give_up || self.ctx.shutdown.is_cancelled() {
                return Ok(jobs);
            }
            let retry_at = give_up.min(now + self.ctx.settings.fallback_poll);
            // Parked after the claim: a job submitted before this point
            // wakes us through `wakeups` instead.
            let mut parked = self.ctx.batchers.park(tenant, spec);
            loop {
                tokio::select! {
                    handed = async { parked.as_mut()?.handed().await }, if parked.is_some() => {
                        match handed {
                            Some(jobs) => return Ok(jobs),
                            // Reserved by a submit that kept its jobs queued.
                            None => {
                                parked = None;
                                break;
                            }
                        }
                    }
                    message = wakeups.recv() => match message {
                        Ok(key) if wakes(&key) => break,
                        Ok(_) => continue,
                        Err(RecvError::Lagged(_)) => break,
                        Err(RecvError::Closed) => {
                            tokio::time::sleep_until(retry_at).await;
                            break;
                        }
                    },
                    () = tokio::time::sleep_until(retry_at) => break,
                    () = self.ctx.shutdown.cancelled() => break,
                    // Dropping `parked` gives back what a submit handed it.
                    () = grant.revoked() => return Err(AuthError::Revoked.into()),
                }
            }
            if let Some(parked) = parked
                && let Some(jobs) = parked.leave(give_up + RESERVED_GRACE).await
            {
                return Ok(jobs);
            }
            if self.ctx.shutdown.is_cancelled() {
                return Ok(Vec::new());
            }
        }
    }

    /// [`Self::lease_or_wait`], counted as a long-poll while it may wait.
    async fn claim_or_wait(
        &self,
        tenant: &str,
        spec: &LeaseSpec,
        grant: &mut Grant,
    ) -> Result<Vec<Job>, Status> {
        if spec.wait.is_zero() {
            return self.lease_or_wait(tenant, spec, grant).await;
        }
        let _waiting = self.ctx.observer.metrics().long_poll();
        self.lease_or_wait(tenant, spec, grant).await
    }

    /// Validates the items of `CompleteBatch` or `CompleteAndLease`: the
    /// valid ones, and per item its error if it has one (its field named
    /// `{prefix}[i].field`).
    fn validate_items(
        &self,
        prefix: &str,
        items: Vec<pb::CompleteRequest>,
    ) -> Result<(Vec<CompleteSpec>, Vec<Option<pb::ItemError>>), ValidationError> {
        if items.is_empty() || items.len() > MAX_BATCH {
            return Err(ValidationError::new(prefix, "send 1..=1000 items"));
        }
        let mut refused = Vec::with_capacity(items.len());
        let mut valid = Vec::new();
        for (i, item) in items.into_iter().enumerate() {
            match self.validate_complete(item) {
                Ok(spec) => {
                    valid.push(spec);
                    refused.push(None);
                }
                Err(mut err) => {
                    err.field = format!("{prefix}[{i}].{}", err.field);
                    refused.push(Some(item_error(err)));
                }
            }
        }
        Ok((valid, refused))
    }

    /// Each item's result: its validation error, or the next stored outcome
    /// (reported where it was stored, [`crate::engine::batchers`]).
    fn item_results(
        refused: Vec<Option<pb::ItemError>>,
        stored: Vec<Result<Ended, StoreError>>,
    ) -> Vec<pb::CompleteBatchResult> {
        use pb::complete_batch_result::Result as Item;
        let mut stored = stored.into_iter();
        refused
            .into_iter()
            .map(|refused| {
                let result = match refused {
                    Some(err) => Some(Item::Error(err)),
                    None => stored.next().map(|r| match r {
                        Ok(ended) => Item::Job(convert::job(&ended.job)),
                        Err(e) => Item::Error(item_error(e)),
                    }),
                };
                pb::CompleteBatchResult { result }
            })
            .collect()
    }

    fn validate_complete(
        &self,
        request: pb::CompleteRequest,
    ) -> Result<CompleteSpec, ValidationError> {
        let outcome = convert::outcome_input(request.outcome)?;
        validate::complete(
            &request.job_id,
            &request.lease_token,
            outcome,
            request.cost_cents,
            &self.ctx.limits,
        )
    }
}

#[tonic::async_trait]
impl WorkerService for WorkersApi {
    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let tenant = tenant_of(&request)?;
        if request.get_ref().all_tenants {
            require_admin(&request, "/intray.v1.WorkerService/Lease with all_tenants")?;
        }
        let mut grant = grant_of(&self.ctx.tokens, &request);
        let spec = validate::lease(
            convert::lease_input(request.into_inner())?,
            &self.ctx.limits,
        )?;
        self.touch_worker(&tenant, &spec).await;
        let jobs = self.claim_or_wait(&tenant, &spec, &mut grant).await?;
        self.ctx.observer.leased(&jobs);
        Ok(Response::new(pb::LeaseResponse {
            jobs: jobs
                .iter()
                .map(|job| convert::leased_job(job, self.attempt_spans()))
                .collect(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let spec = validate::heartbeat(
            convert::heartbeat_input(request.into_inner())?,
            &self.ctx.limits,
        )?;
        let store = Arc::clone(&self.ctx.store);
        let ack = detached(async move { store.heartbeat(&tenant, &spec).await }).await?;
        Ok(Response::new(pb::HeartbeatResponse {
            lease_expires_at: Some(convert::timestamp(ack.lease_expires_at)),
            cancel_requested: ack.cancel_requested,
        }))
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let spec = self.validate_complete(request.into_inner())?;
        let ended = self.ctx.batchers.complete(&tenant, spec).await??;
        Ok(Response::new(pb::CompleteResponse {
            job: Some(convert::job(&ended.job)),
        }))
    }

    async fn complete_batch(
        &self,
        request: Request<pb::CompleteBatchRequest>,
    ) -> Result<Response<pb::CompleteBatchResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let (valid, refused) = self.validate_items("items", request.into_inner().items)?;
        let stored = self.ctx.batchers.complete_batch(&tenant, valid).await?;
        Ok(Response::new(pb::CompleteBatchResponse {
            results: Self::item_results(refused, stored),
        }))
    }

    async fn complete_and_lease(
        &self,
        request: Request<pb::CompleteAndLeaseRequest>,
    ) -> Result<Response<pb::CompleteAndLeaseResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let across_tenants = request
            .get_ref()
            .lease
            .as_ref()
            .is_some_and(|l| l.all_tenants);
        if across_tenants {
            require_admin(
                &request,
                "/intray.v1.WorkerService/CompleteAndLease with all_tenants",
            )?;
        }
        let mut grant = grant_of(&self.ctx.tokens, &request);
        let pb::CompleteAndLeaseRequest { items, lease } = request.into_inner();
        let lease = lease.ok_or_else(|| ValidationError::new("lease", "required"))?;
        // The claim is checked before anything is written: a bad one
        // refuses the whole call, outcomes included.
        let spec = convert::lease_input(lease)
            .and_then(|input| validate::lease(input, &self.ctx.limits))
            .map_err(|mut err| {
                err.field = format!("lease.{}", err.field);
                err
            })?;
        let (valid, refused) = self.validate_items("items", items)?;
        self.touch_worker(&tenant, &spec).await;
        let (stored, leased) = self
            .ctx
            .batchers
            .complete_and_lease(&tenant, valid, &spec)
            .await?;
        let results = Self::item_results(refused, stored);
        // The outcomes have committed, so their results must reach the
        // worker: a failed claim answers no jobs, and the worker's next
        // claim meets the error itself.
        let claimed = match leased {
            Ok(jobs) if jobs.is_empty() && !spec.wait.is_zero() => {
                self.claim_or_wait(&tenant, &spec, &mut grant).await
            }
            claimed => claimed.map_err(Status::from),
        };
        let jobs = claimed.unwrap_or_else(|err| {
            if err.code() == tonic::Code::Unauthenticated {
                // Its token was revoked while it waited: the outcomes
                // stand, and the worker's next call meets the refusal.
                tracing::info!(worker_id = %spec.worker_id, "a CompleteAndLease stopped waiting: its token was revoked");
            } else {
                tracing::warn!(error = %err, worker_id = %spec.worker_id, "the claim of a CompleteAndLease failed after its outcomes committed");
            }
            Vec::new()
        });
        self.ctx.observer.leased(&jobs);
        Ok(Response::new(pb::CompleteAndLeaseResponse {
            results,
            jobs: jobs
                .iter()
                .map(|job| convert::leased_job(job, self.attempt_spans()))
                .collect(),
        }))
    }
}
