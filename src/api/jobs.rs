//! `intray.v1.JobService`: the producers' and operators' API.

use std::collections::{HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};
use uuid::Uuid;

use super::Context;
use super::backpressure::{QueueDepths, Slot};
use super::convert;
use super::status::{ApiError, item_error, watch_interrupted};
use super::tenant::{grant_of, tenant_of};
use crate::auth::{AuthError, Grant};
use crate::domain::validate::{self, MAX_BATCH, ValidationError};
use crate::domain::{Job, JobEvent, JobState, NewJob};
use crate::engine::detach::detached;
use crate::engine::notifier::JobWatch;
use crate::pb;
use crate::pb::job_service_server::JobService;
use crate::store::{Store, StoreError};
use crate::telemetry::rpc::CallTrace;

/// Events fetched per read of a watched job.
const WATCH_BATCH: u32 = 500;
/// Most jobs [`JobsApi::dead_set`] counts: each is a row read, and the
/// dashboard asks again on every refresh.
const GROUPED_JOBS: u32 = 100_000;
/// How long after a cancelled running job's lease ends its reaper pass
/// comes: the replica's reading of the database's clock is off by up to
/// half a round trip.
const REAP_MARGIN: std::time::Duration = std::time::Duration::from_millis(25);

/// The JobService implementation.
pub struct JobsApi {
    ctx: Context,
    depths: QueueDepths,
}

impl JobsApi {
    /// A service over the given context.
    pub fn new(ctx: Context) -> Self {
        let depths = QueueDepths::new(ctx.settings.queue_bound);
        JobsApi { ctx, depths }
    }

    async fn set_paused(&self, tenant: &str, queue: &str, paused: bool) -> Result<String, Status> {
        let queue = validate::queue("queue", queue)?;
        let store = Arc::clone(&self.ctx.store);
        let (owner, name) = (tenant.to_owned(), queue.clone());
        detached(async move { store.set_paused(&owner, &name, paused).await }).await?;
        tracing::info!(tenant, queue = %queue, paused, "queue pause changed");
        Ok(queue)
    }

    /// A job's completion-callback deliveries as JSON, for
    /// `GET /api/v1/jobs/{id}/deliveries` (not in the proto: an HTTP-face
    /// listing). `NOT_FOUND` for an unknown job or another tenant's.
    pub async fn deliveries(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<serde_json::Value>, Status> {
        let tenant = tenant_of(&request)?;
        let id = job_id(&request.get_ref().id)?;
        self.ctx.store.get(&tenant, id).await?;
        let deliveries = self.ctx.store.outbox().list(&tenant, id).await?;
        let deliveries: Vec<serde_json::Value> = deliveries.iter().map(convert::delivery).collect();
        Ok(Response::new(
            serde_json::json!({ "deliveries": deliveries }),
        ))
    }

    /// The job an ingress message keyed `key` was first received as, if it
    /// holds `payload`: a provider's retry of a message after its source's
    /// queue or kind changed in the webhooks file is still that message
    /// (its input hash, which covers queue and kind, no longer matches).
    pub async fn ingress_original(
        &self,
        tenant: &str,
        key: &str,
        payload: pbjson_types::Value,
    ) -> Result<Option<pb::Job>, Status> {
        let payload = convert::from_value("payload", Some(payload))?;
        let original = self.ctx.store.get_by_key(tenant, key).await?;
        Ok(original
            .filter(|job| job.payload == payload)
            .map(|job| convert::job(&job)))
    }

    /// The jobs a replay filter matches, grouped by error class and queue,
    /// as JSON for `GET /api/v1/dead-set` (not in the proto: the
    /// dashboard's dead-set view). Counts at most [`GROUPED_JOBS`] of them;
    /// `complete` says whether that was all.
    pub async fn dead_set(
        &self,
        request: Request<pb::RetryFilter>,
    ) -> Result<Response<serde_json::Value>, Status> {
        let tenant = tenant_of(&request)?;
        let f = request.get_ref();
        let states = convert::from_states("state", &f.states)?;
        // Refusals name the query's parameters, not the Retry filter's
        // fields this shares its checks with.
        let mut filter = validate::retry_filter(&f.queue, &f.kind, &f.error_class, states, None)
            .map_err(|mut invalid| {
                invalid.field = match invalid.field.as_str() {
                    "filter.states" => "state".into(),
                    field => field.trim_start_matches("filter.").into(),
                };
                invalid
            })?;
        filter.limit = GROUPED_JOBS;
        let grouped = self.ctx.store.group_matching(&tenant, &filter).await?;
        let groups: Vec<serde_json::Value> =
            grouped.groups.iter().map(convert::job_group).collect();
        Ok(Response::new(serde_json::json!({
            "groups": groups,
            "complete": grouped.complete,
        })))
    }

    /// Lets a job in: its deadline still ahead, its queue under its bound.
    /// A job refused for either that repeats an accepted one (its
    /// idempotency key, the same input) gets the original instead, as it
    /// would have at first: a producer retrying a submit whose answer it
    /// lost must not be told that a job it already has is invalid, or to
    /// come back later for it.
    async fn admit(&self, tenant: &str, new: &NewJob) -> Result<Admitted, ApiError> {
        let refused = match validate::not_expired(new, self.ctx.store.now()) {
            Err(expired) => ApiError::from(expired),
            Ok(()) => match self
                .depths
                .admit(&*self.ctx.store, tenant, &new.queue)
                .await
            {
                Ok(slot) => return Ok(Admitted::Slot(slot)),
                Err(full @ ApiError::QueueFull { .. }) => full,
                Err(other) => return Err(other),
            },
        };
        let Some(key) = &new.idempotency_key else {
            return Err(refused);
        };
        match self.ctx.store.get_by_key(tenant, key).await? {
            Some(original) if original.input_hash == new.input_hash => {
                Ok(Admitted::Original(Box::new(original)))
            }
            Some(_) => Err(StoreError::IdempotencyConflict.into()),
            None => Err(refused),
        }
    }

    /// [`Self::admit`] for an item of a `SubmitBatch`. An item repeating
    /// the key of an earlier item admitted in the same batch goes to the
    /// store with it, without a slot of its own: the store answers it from
    /// that item's job (or refuses other input), as it would a `Submit`
    /// made after the first. Admitted on its own, it would find the queue
    /// filled by the very job it repeats, and nothing stored yet to be
    /// answered from.
    async fn admit_item(
        &self,
        tenant: &str,
        new: &NewJob,
        admitted_keys: &HashSet<String>,
    ) -> Result<Admitted, ApiError> {
        match &new.idempotency_key {
            Some(key) if admitted_keys.contains(key) => Ok(Admitted::Repeat),
            _ => self.admit(tenant, new).await,
        }
    }

    /// Every check but the deadline's against the clock, which [`Self::admit`]
    /// makes. Keys in the ingress's space are the ingress's alone. A
    /// callback needs a secret to be signed with: without one for the
    /// tenant it could never be sent, so it is refused now rather than
    /// lost later.
    fn validate_submit(
        &self,
        tenant: &str,
        request: pb::SubmitRequest,
        from_ingress: bool,
    ) -> Result<NewJob, ValidationError> {
        let input = convert::submit_input(request)?;
        let keys = self.ctx.webhook_keys.current();
        let new = validate::submission(input, &self.ctx.limits, &keys.allow)?;
        if !from_ingress {
            validate::producer_key(&new)?;
        }
        if new.callback_url.is_some() && keys.secrets_for(tenant).is_none() {
            return Err(ValidationError::new(
                "callback_url",
                "this server has no webhook secret for the tenant to sign callbacks with (see the webhooks file)",
            ));
        }
        Ok(new)
    }
}

/// What [`JobsApi::admit`] let in.
enum Admitted {
    /// A job for the store, with its slot in the queue's depth.
    Slot(Slot),
    /// A batch item repeating the key of an earlier item of the batch: it
    /// goes to the store beside it, without a slot of its own.
    Repeat,
    /// A repeat of an accepted job refused for its deadline or the bound,
    /// answered with that job (boxed: a job is large beside a slot).
    Original(Box<Job>),
}

/// Marks a `Submit` made by the webhook ingress: a request extension only
/// the server sets, for the one caller whose idempotency keys may start
/// with [`validate::INGRESS_KEY_PREFIX`].
#[derive(Clone, Copy, Debug)]
pub struct FromIngress;

/// The call's trace context as a `traceparent`, stored with submitted jobs
/// (not part of their idempotency hash: a retried submit may come from
/// another trace).
fn call_trace<T>(request: &Request<T>) -> Option<String> {
    request
        .extensions()
        .get::<CallTrace>()
        .and_then(|t| t.0)
        .map(|t| t.to_string())
}

fn job_id(id: &str) -> Result<Uuid, Status> {
    Ok(validate::job_id("id", id)?)
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

#[tonic::async_trait]
impl JobService for JobsApi {
    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let trace_parent = call_trace(&request);
        let from_ingress = request.extensions().get::<FromIngress>().is_some();
        let mut new = self.validate_submit(&tenant, request.into_inner(), from_ingress)?;
        new.trace_parent = trace_parent;
        let slot = match self.admit(&tenant, &new).await? {
            Admitted::Original(original) => {
                return Ok(Response::new(pb::SubmitResponse {
                    job: Some(convert::job(&original)),
                    created: false,
                }));
            }
            Admitted::Slot(slot) => Some(slot),
            Admitted::Repeat => None,
        };
        // Dropped unkept (nothing stored, or this call gone before the
        // answer), the slot is given back.
        let submitted = self.ctx.batchers.submit(&tenant, new).await??;
        if let (true, Some(slot)) = (submitted.created, slot) {
            slot.keep();
        }
        if submitted.created {
            self.ctx.observer.submitted(&submitted.job);
        }
        Ok(Response::new(pb::SubmitResponse {
            job: Some(convert::job(&submitted.job)),
            created: submitted.created,
        }))
    }

    async fn submit_batch(
        &self,
        request: Request<pb::SubmitBatchRequest>,
    ) -> Result<Response<pb::SubmitBatchResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let trace_parent = call_trace(&request);
        let jobs = request.into_inner().jobs;
        if jobs.is_empty() || jobs.len() > MAX_BATCH {
            return Err(ValidationError::new("jobs", "send 1..=1000 jobs").into());
        }
        // Invalid items are answered in place; the valid ones go to the store
        // together and their answers are slotted back in order.
        let mut answers: Vec<Option<pb::submit_batch_result::Result>> =
            Vec::with_capacity(jobs.len());
        let mut valid = Vec::new();
        // Each valid item's slot (none for a repeated key), given back when
        // dropped unkept: its item stored nothing, or this call went away.
        let mut slots: Vec<Option<Slot>> = Vec::new();
        let mut admitted_keys = HashSet::new();
        for (i, job) in jobs.into_iter().enumerate() {
            let admitted = match self.validate_submit(&tenant, job, false) {
                Ok(new) => self
                    .admit_item(&tenant, &new, &admitted_keys)
                    .await
                    .map(|original| (new, original)),
                Err(invalid) => Err(invalid.into()),
            };
            match admitted {
                Ok((new, Admitted::Slot(slot))) => {
                    if let Some(key) = &new.idempotency_key {
                        admitted_keys.insert(key.clone());
                    }
                    slots.push(Some(slot));
                    valid.push(new);
                    answers.push(None);
                }
                Ok((new, Admitted::Repeat)) => {
                    slots.push(None);
                    valid.push(new);
                    answers.push(None);
                }
                Ok((_, Admitted::Original(original))) => answers.push(Some(
                    pb::submit_batch_result::Result::Ok(pb::SubmitResponse {
                        job: Some(convert::job(&original)),
                        created: false,
                    }),
                )),
                Err(mut refused) => {
                    if let ApiError::Invalid(invalid) = &mut refused {
                        invalid.field = format!("jobs[{i}].{}", invalid.field);
                    }
                    answers.push(Some(pb::submit_batch_result::Result::Error(item_error(
                        refused,
                    ))));
                }
            }
        }
        for new in &mut valid {
            new.trace_parent.clone_from(&trace_parent);
        }
        // Nothing to store is nothing to ask the database (or, on SQLite,
        // its writer lock) for: the answers are all in already.
        let stored = if valid.is_empty() {
            Vec::new()
        } else {
            self.ctx.batchers.submit_batch(&tenant, valid).await?
        };
        for (slot, item) in slots.into_iter().zip(&stored) {
            if let (Some(slot), Ok(submitted)) = (slot, item)
                && submitted.created
            {
                slot.keep();
            }
        }
        for submitted in stored.iter().flatten() {
            if submitted.created {
                self.ctx.observer.submitted(&submitted.job);
            }
        }
        let mut stored = stored.into_iter();
        let results = answers
            .into_iter()
            .map(|answer| {
                let result = answer.or_else(|| {
                    stored.next().map(|r| match r {
                        Ok(s) => pb::submit_batch_result::Result::Ok(pb::SubmitResponse {
                            job: Some(convert::job(&s.job)),
                            created: s.created,
                        }),
                        Err(e) => pb::submit_batch_result::Result::Error(item_error(e)),
                    })
                });
                pb::SubmitBatchResult { result }
            })
            .collect();
        Ok(Response::new(pb::SubmitBatchResponse { results }))
    }

    async fn get(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::Job>, Status> {
        let tenant = tenant_of(&request)?;
        let id = job_id(&request.get_ref().id)?;
        let job = self.ctx.store.get(&tenant, id).await?;
        Ok(Response::new(convert::job(&job)))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let tenant = tenant_of(&request)?;
        let request = request.into_inner();
        let id = job_id(&request.id)?;
        let reason = validate::cancel_reason(&request.reason)?;
        let store = Arc::clone(&self.ctx.store);
        let reason = reason.map(str::to_owned);
        let grace = self.ctx.settings.cancel_grace;
        let reap_at = self.ctx.reap_at.clone();
        // The pass is asked for in the detached task too: a caller gone
        // after the commit must not leave the job to the next interval.
        let job = detached(async move {
            let job = store.cancel(&tenant, id, reason.as_deref(), grace).await?;
            if job.state == JobState::Running
                && let Some(end) = job.lease_expires_at
            {
                // The lease's end is the database's time; the pass comes
                // just after it, so that the database's clock has passed
                // it too.
                let left = (end - store.now()).to_std().unwrap_or_default();
                reap_at.after(left + REAP_MARGIN);
            }
            Ok::<_, StoreError>(job)
        })
        .await?;
        self.ctx.observer.cancelled(&job);
        Ok(Response::new(convert::job(&job)))
    }

    type WatchJobStream = WatchStream;

    async fn watch_job(
        &self,
        request: Request<pb::WatchJobRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let tenant = tenant_of(&request)?;
        let grant = grant_of(&self.ctx.tokens, &request);
        let request = request.into_inner();
        let id = job_id(&request.id)?;
        // Unknown or foreign ids fail the call itself, not the stream later.
        self.ctx.store.get(&tenant, id).await?;
        Ok(Response::new(watch_events(
            self.ctx.clone(),
            tenant,
            grant,
            id,
            request.after_sequence,
        )))
    }

    async fn list(
        &self,
        request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let mut filter = validate::list(convert::list_input(request.into_inner())?)?;
        let page = filter.page_size as usize;
        // One job past the page tells whether another page exists, so a
        // page that ends the list carries no token to an empty next page.
        filter.page_size = filter.page_size.saturating_add(1);
        let mut jobs = self.ctx.store.list(&tenant, &filter).await?;
        let more = jobs.len() > page;
        jobs.truncate(page);
        let next_page_token = match jobs.last() {
            Some(last) if more => last.id.to_string(),
            _ => String::new(),
        };
        let mut jobs: Vec<pb::Job> = jobs.iter().map(convert::job).collect();
        if !filter.with_payloads {
            for job in &mut jobs {
                job.payload = None;
                job.result = None;
            }
        }
        Ok(Response::new(pb::ListJobsResponse {
            jobs,
            next_page_token,
        }))
    }

    async fn retry(
        &self,
        request: Request<pb::RetryJobRequest>,
    ) -> Result<Response<pb::RetryJobResponse>, Status> {
        use pb::retry_job_request::Target;
        let tenant = tenant_of(&request)?;
        let request = request.into_inner();
        match request.target {
            None => Err(ValidationError::new("target", "set either id or filter").into()),
            Some(Target::Id(id)) => {
                let id = job_id(&id)?;
                if request.dry_run {
                    let job = self.ctx.store.get(&tenant, id).await?;
                    let matched = u64::from(job.state.is_replayable());
                    return Ok(Response::new(pb::RetryJobResponse {
                        retried: Vec::new(),
                        matched,
                    }));
                }
                let store = Arc::clone(&self.ctx.store);
                let job = detached(async move { store.retry_one(&tenant, id).await }).await?;
                self.ctx.observer.replayed(&job);
                Ok(Response::new(pb::RetryJobResponse {
                    retried: vec![job.id.to_string()],
                    matched: 1,
                }))
            }
            Some(Target::Filter(f)) => {
                let states = convert::from_states("filter.states", &f.states)?;
                let filter = validate::retry_filter(
                    &f.queue,
                    &f.kind,
                    &f.error_class,
                    states,
                    request.limit,
                )?;
                let store = Arc::clone(&self.ctx.store);
                let (owner, dry_run) = (tenant.clone(), request.dry_run);
                let (done, filter) = detached(async move {
                    let done = store.retry_matching(&owner, &filter, dry_run).await?;
                    Ok((done, filter))
                })
                .await?;
                if !request.dry_run {
                    self.ctx.observer.replayed_in_bulk(
                        &tenant,
                        &filter,
                        done.matched,
                        done.retried.len(),
                    );
                }
                Ok(Response::new(pb::RetryJobResponse {
                    retried: done.retried.iter().map(Uuid::to_string).collect(),
                    matched: done.matched,
                }))
            }
        }
    }

    async fn stats(
        &self,
        request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let queue = request.into_inner().queue;
        let queue = if queue.is_empty() {
            None
        } else {
            Some(validate::queue("queue", &queue)?)
        };
        let stats = self
            .ctx
            .store
            .stats(&tenant, queue.as_deref(), crate::domain::WORKERS_WINDOW)
            .await?;
        Ok(Response::new(convert::stats(&stats)))
    }

    async fn pause_queue(
        &self,
        request: Request<pb::PauseQueueRequest>,
    ) -> Result<Response<pb::PauseQueueResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let queue = self
            .set_paused(&tenant, &request.get_ref().queue, true)
            .await?;
        Ok(Response::new(pb::PauseQueueResponse {
            queue,
            paused: true,
        }))
    }

    async fn resume_queue(
        &self,
        request: Request<pb::ResumeQueueRequest>,
    ) -> Result<Response<pb::ResumeQueueResponse>, Status> {
        let tenant = tenant_of(&request)?;
        let queue = self
            .set_paused(&tenant, &request.get_ref().queue, false)
            .await?;
        Ok(Response::new(pb::ResumeQueueResponse {
            queue,
            paused: false,
        }))
    }
}

/// Where a `WatchJob` stream is: the last sequence sent, events read but
/// not yet sent, and whether the terminal event (or an error) has been sent.
struct Watching {
    ctx: Context,
    tenant: String,
    /// Ends the stream when a reload takes the caller's token away.
    grant: Grant,
    id: Uuid,
    watch: JobWatch,
    after: u64,
    ready: VecDeque<JobEvent>,
    done: bool,
    /// The last read filled its batch: events may follow it.
    cut_short: bool,
    /// The job's count of unkept changes before the last read that found
    /// nothing new; `None` when the next wake-up must read.
    read_at: Option<u64>,
}

/// The events of a `WatchJob` stream: the stored events after `after`, then
/// new ones as they are committed, until the job's terminal event has been
/// sent; on shutdown before that, it ends with [`watch_interrupted`], and
/// when a reload takes the caller's token away, `UNAUTHENTICATED`. A
/// stream, not a task feeding a channel: an open watch costs only its
/// state, and a client that goes away drops it.
///
/// The database is the source of truth; a notification only says "read
/// again", and a timer re-reads anyway, so a lost notification costs latency
/// and never an event. Events this replica has just committed come from
/// memory when they follow the last one sent. Sequences are gap-free, so
/// resuming from the last one seen neither skips nor repeats.
fn watch_events(ctx: Context, tenant: String, grant: Grant, id: Uuid, after: u64) -> WatchStream {
    let watch = ctx.notifier.watch_job(id);
    let start = Watching {
        ctx,
        tenant,
        grant,
        id,
        watch,
        after,
        ready: VecDeque::new(),
        done: false,
        cut_short: false,
        read_at: None,
    };
    Box::pin(futures::stream::unfold(start, |mut w| async move {
        // Also between events: a stream with events to send never waits
        // where `refill` looks for a revocation.
        if !w.done && w.grant.revoked_now() {
            w.done = true;
            w.ready.clear();
            return Some((Err(AuthError::Revoked.into()), w));
        }
        if w.ready.is_empty()
            && !w.done
            && let Err(err) = w.refill().await
        {
            w.done = true;
            return Some((Err(err), w));
        }
        let event = w.ready.pop_front()?;
        w.after = event.sequence;
        // A replayed job's history holds earlier terminal events: only the
        // latest event known ends the stream, and not the last of a full
        // read, which may have left later ones behind.
        w.done = event.is_terminal() && w.ready.is_empty() && !w.cut_short;
        Some((Ok(convert::event(&event)), w))
    }))
}

impl Watching {
    /// Waits until there are events to send, or the stream is over (`done`
    /// with nothing ready); fails when the database does, or when the
    /// server shuts down first.
    async fn refill(&mut self) -> Result<(), Status> {
        loop {
            let woken = self.watch.notify().notified();
            tokio::pin!(woken);
            // Before reading, so that a commit in between still wakes us.
            woken.as_mut().enable();

            let unkept = self.watch.unkept_changes();
            let kept = self.watch.events_after(self.after);
            if !kept.is_empty() {
                self.cut_short = false;
                self.ready.extend(kept);
                return Ok(());
            }
            // Nothing kept continues the stream. Read, unless it was read
            // since the last change only the database knows about and
            // nothing newer is kept (behind a gap): then every event
            // committed since came through memory, and was sent. Without
            // this, each kept event sent would cost two reads.
            let settled = self.read_at == Some(unkept) && !self.watch.keeps_after(self.after);
            if !settled {
                let events = self
                    .ctx
                    .store
                    .events_after(&self.tenant, self.id, self.after, WATCH_BATCH)
                    .await?;
                if !events.is_empty() {
                    // A batch may not be all there is: read again after it.
                    self.read_at = None;
                    self.cut_short = events.len() >= WATCH_BATCH as usize;
                    self.ready.extend(events);
                    return Ok(());
                }
                match position(&*self.ctx.store, &self.tenant, self.id, self.after).await? {
                    Position::Finished => {
                        self.done = true;
                        return Ok(());
                    }
                    // The job's next events are at or below `after`: they
                    // wake this stream from memory without being sent, so
                    // only a read can tell that the job has ended.
                    Position::Behind => self.read_at = None,
                    Position::Caught => self.read_at = Some(unkept),
                }
            }
            tokio::select! {
                () = &mut woken => {}
                () = tokio::time::sleep(self.ctx.settings.watch_fallback_poll) => {
                    self.read_at = None;
                }
                () = self.ctx.shutdown.cancelled() => return Err(watch_interrupted()),
                () = self.grant.revoked() => return Err(AuthError::Revoked.into()),
            }
        }
    }
}

/// Where a watcher that found nothing after `after` stands.
enum Position {
    /// The job has ended with no event after `after`: nothing left to
    /// wait for (a watcher that resumed after the terminal event).
    Finished,
    /// The job has not reached `after` (a client resumed past its last
    /// event): its next events will not be sent.
    Behind,
    /// `after` is the job's last event.
    Caught,
}

async fn position(
    store: &dyn Store,
    tenant: &str,
    id: Uuid,
    after: u64,
) -> Result<Position, StoreError> {
    match store.get(tenant, id).await {
        Ok(job) if job.state.is_terminal() && job.event_seq <= after => Ok(Position::Finished),
        Ok(job) if job.event_seq < after => Ok(Position::Behind),
        Ok(_) => Ok(Position::Caught),
        // Deleted by retention meanwhile: nothing more will come.
        Err(StoreError::NotFound) => Ok(Position::Finished),
        Err(err) => Err(err),
    }
}
