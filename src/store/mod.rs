//! Persistence: one [`Store`] interface, implemented on PostgreSQL and on
//! SQLite. Every transition writes the job row and its event in one
//! transaction; claims are decided by the database (`FOR UPDATE SKIP LOCKED`
//! on PostgreSQL, the single writer on SQLite).

/// The columns of `jobs` but `payload` and `result`, for a list without
/// them ([`crate::domain::ListFilter::with_payloads`]); each store adds its
/// stand-ins for the two. Defined before the stores, which use it.
macro_rules! job_columns_but_payloads {
    () => {
        "id, tenant, queue, kind, state, error_class, error_message, attempt, max_attempts,
         priority, idempotency_key, input_hash, labels, progress, cancel_requested,
         cancel_requested_at, cost_cents, lease_owner, lease_token, lease_expires_at, run_at,
         deadline, backoff_initial_ms, backoff_max_ms, callback_url, created_at, updated_at,
         started_at, finished_at, event_seq, max_cost_cents, trace_parent, leased_at, lease_ms"
    };
}

mod changes;
mod db_clock;
mod error;
pub mod outbox;
mod pg_caps;
mod pg_counts;
mod pg_hot;
mod pg_leased;
pub mod postgres;
pub mod sqlite;
mod unreadable;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::config::Settings;
use crate::domain::breaker::Breaker;
use crate::domain::{
    CompleteSpec, Handoff, HeartbeatAck, HeartbeatSpec, Job, JobEvent, JobState, LeaseSpec,
    ListFilter, NewJob, QueueStats, RetryFilter, RunningAttempt, WorkerSeen,
};
use crate::engine::notifier::Notifier;

pub use error::StoreError;

/// Result of a store call.
pub type StoreResult<T> = Result<T, StoreError>;

/// A job returned by `submit`, and whether this call created it.
#[derive(Clone, Debug, PartialEq)]
pub struct Submitted {
    pub job: Job,
    pub created: bool,
}

/// What a bulk retry did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Retried {
    pub retried: Vec<Uuid>,
    pub matched: u64,
}

/// Jobs matching a replay filter, grouped by error class and queue: what
/// the dashboard's dead-set view shows. Counted in the database, so that
/// the jobs themselves are not read out to be grouped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Grouped {
    /// Most jobs first.
    pub groups: Vec<JobGroup>,
    /// Whether every matching job was counted; `false` when the filter's
    /// limit was reached, and more may match.
    pub complete: bool,
}

/// Jobs sharing an error class (`None`: none recorded) and a queue.
#[derive(Clone, Debug, PartialEq)]
pub struct JobGroup {
    pub error_class: Option<String>,
    pub queue: String,
    pub jobs: u64,
    pub cost_cents: i64,
}

impl Grouped {
    /// Groups from their rows, `complete` unless `limit` jobs were counted.
    fn new(groups: Vec<JobGroup>, limit: u32) -> Grouped {
        let counted: u64 = groups.iter().map(|g| g.jobs).sum();
        Grouped {
            groups,
            complete: counted < u64::from(limit),
        }
    }
}

/// Queue counts and recently seen workers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub queues: Vec<QueueStats>,
    pub workers: Vec<WorkerSeen>,
}

/// Caps on the running jobs of one tenant in one queue, applied by the
/// claim itself so that they hold across replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningCaps {
    /// Cap of queues without an override (`i64::MAX`: none).
    pub default: i64,
    /// Per-queue overrides.
    pub queues: Vec<String>,
    pub caps: Vec<i64>,
}

impl RunningCaps {
    /// Whether a cap applies to `queue`: only then (or when claiming across
    /// tenants) does a claim from it need the running jobs counted, under
    /// its lock, and is a job submitted to it never handed off.
    pub fn covers(&self, queue: &str) -> bool {
        self.default != i64::MAX || self.queues.iter().any(|q| q == queue)
    }

    /// Whether a cap applies to any of `queues`.
    pub fn cover_any(&self, queues: &[String]) -> bool {
        queues.iter().any(|q| self.covers(q))
    }

    /// The caps configured in `settings`.
    pub fn from_settings(settings: &Settings) -> Self {
        let (queues, caps) = settings
            .queue_max_running_per_tenant
            .iter()
            .map(|(q, cap)| (q.clone(), i64::from(*cap)))
            .unzip();
        RunningCaps {
            default: settings.max_running_per_tenant.map_or(i64::MAX, i64::from),
            queues,
            caps,
        }
    }
}

/// Warns when the database holds migrations newer than this build's
/// (`applied`, the highest applied version): a previous build serving on a
/// schema a newer one migrated, during a rollout or after a rollback. It
/// serves on, as the migrations are additive; the README names those that
/// are not ("Deploy on Kubernetes").
fn migrations_ahead(known: &sqlx::migrate::Migrator, applied: Option<i64>) {
    let ours = known.iter().map(|m| m.version).max();
    if let (Some(applied), Some(ours)) = (applied, ours)
        && applied > ours
    {
        tracing::warn!(
            database = applied,
            build = ours,
            "the database has migrations this build does not know (a newer build applied them); serving on, as migrations are additive"
        );
    }
}

/// An attempt that a store call ended (`Complete`, or the reaper reclaiming
/// its lease): what it was, and the job and event it ended with. Telemetry
/// turns it into the attempt's span, metrics and log line.
#[derive(Clone, Debug, PartialEq)]
pub struct Ended {
    pub attempt: RunningAttempt,
    /// The job after the transition.
    pub job: Job,
    /// The event the transition recorded.
    pub event: JobEvent,
}

impl Ended {
    /// Pairs the attempt taken before a transition with its result; `None`
    /// when the job was not running (nothing to end).
    fn new(attempt: Option<RunningAttempt>, job: Job, event: JobEvent) -> Option<Ended> {
        attempt.map(|attempt| Ended {
            attempt,
            job,
            event,
        })
    }
}

/// Gathers the per-queue figures that `stats` reads in several queries.
#[derive(Default)]
struct QueueStatsBuilder(std::collections::BTreeMap<String, QueueStats>);

impl QueueStatsBuilder {
    fn entry(&mut self, queue: String) -> &mut QueueStats {
        self.0.entry(queue.clone()).or_insert_with(|| QueueStats {
            queue,
            ..Default::default()
        })
    }

    fn count(&mut self, queue: String, state: JobState, n: u64) {
        self.entry(queue).counts.insert(state.as_str(), n);
    }

    /// Only for queues that have counts: the age comes from queued jobs.
    fn oldest(&mut self, queue: &str, age: Duration) {
        if let Some(q) = self.0.get_mut(queue) {
            q.oldest_runnable_age = Some(age);
        }
    }

    fn paused(&mut self, queue: String) {
        self.entry(queue).paused = true;
    }

    fn breaker(&mut self, queue: String, kind: String, breaker: Breaker) {
        self.entry(queue).breakers.push((kind, breaker));
    }

    fn finish(self) -> Vec<QueueStats> {
        self.0.into_values().collect()
    }
}

/// What the reaper did in one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reaped {
    /// Running jobs whose lease ran out (requeued, failed, cancelled or expired).
    pub expired_leases: u64,
    /// Queued jobs past their deadline.
    pub expired_deadlines: u64,
    /// Finished jobs deleted by retention.
    pub deleted: u64,
    /// The attempts whose lease ran out, for their spans.
    pub ended: Vec<Ended>,
    /// Queued jobs past their deadline, each with its `EXPIRED` event, for
    /// the log.
    pub expired: Vec<(Job, JobEvent)>,
}

impl Reaped {
    /// A pass's report from the leases it reclaimed (each with the attempt
    /// taken before its transition), the `EXPIRED` events of the queued
    /// jobs past their deadline, and the jobs retention deleted.
    fn new(
        reclaimed: Vec<(Option<RunningAttempt>, Job, JobEvent)>,
        expired: Vec<(Job, JobEvent)>,
        deleted: u64,
    ) -> Reaped {
        Reaped {
            expired_leases: reclaimed.len() as u64,
            expired_deadlines: expired.len() as u64,
            deleted,
            ended: reclaimed
                .into_iter()
                .filter_map(|(attempt, job, event)| Ended::new(attempt, job, event))
                .collect(),
            expired,
        }
    }
}

/// Jobs of one tenant's queue by state, and the age of its oldest runnable
/// job: the gauges behind `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueDepth {
    pub tenant: String,
    pub queue: String,
    pub counts: std::collections::BTreeMap<&'static str, u64>,
    pub oldest_runnable_age: Option<Duration>,
}

/// How many workers a tenant's queue has, for the metrics gauges.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueWorkers {
    pub tenant: String,
    pub queue: String,
    pub workers: u64,
}

/// The persistence interface. Every method is scoped to a tenant: another
/// tenant's job is `NotFound`, exactly like a missing one.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Stores new jobs with their `SUBMITTED` events. Each item succeeds or
    /// fails alone (an idempotency conflict is `AlreadyExists`); the accepted
    /// ones commit together.
    async fn submit(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>> {
        self.submit_handing(tenant, jobs, Vec::new()).await
    }

    /// Like [`Store::submit`], but the `i`-th job goes straight to the
    /// worker of `handoffs[i]` (stored `Running` under a new lease, with
    /// its `LEASED` event after `SUBMITTED`) when a claim made now would
    /// pick it: it is due, its queue is not paused, no breaker stands for
    /// its kind, no running cap applies, and no queued job of its queue
    /// that is due ranks above it. Otherwise it is stored `Queued`. Missing
    /// entries of `handoffs` mean no hand-off.
    async fn submit_handing(
        &self,
        tenant: &str,
        jobs: Vec<NewJob>,
        handoffs: Vec<Option<Handoff>>,
    ) -> StoreResult<Vec<StoreResult<Submitted>>>;

    /// One job.
    async fn get(&self, tenant: &str, id: Uuid) -> StoreResult<Job>;

    /// The job that holds idempotency key `key`, if any.
    async fn get_by_key(&self, tenant: &str, key: &str) -> StoreResult<Option<Job>>;

    /// Cancels a queued job, or requests the cancel of a running one (its
    /// lease is cut to `grace`).
    async fn cancel(
        &self,
        tenant: &str,
        id: Uuid,
        reason: Option<&str>,
        grace: Duration,
    ) -> StoreResult<Job>;

    /// Puts a job leased under `lease_token` to a call that went away back
    /// in the queue, its attempt given back ([`crate::domain::transition::give_back`]).
    async fn give_back(&self, tenant: &str, id: Uuid, lease_token: &str) -> StoreResult<Job>;

    /// Events with a sequence above `after`, in order, at most `limit`.
    async fn events_after(
        &self,
        tenant: &str,
        id: Uuid,
        after: u64,
        limit: u32,
    ) -> StoreResult<Vec<JobEvent>>;

    /// A page of jobs, newest first.
    async fn list(&self, tenant: &str, filter: &ListFilter) -> StoreResult<Vec<Job>>;

    /// Replays one job (`IllegalTransition` unless failed, cancelled or expired).
    async fn retry_one(&self, tenant: &str, id: Uuid) -> StoreResult<Job>;

    /// Replays every job matching the filter, up to its limit; with `dry_run`
    /// only counts them.
    async fn retry_matching(
        &self,
        tenant: &str,
        filter: &RetryFilter,
        dry_run: bool,
    ) -> StoreResult<Retried>;

    /// The jobs matching the filter (at most its limit of them) grouped by
    /// error class and queue, without replaying them.
    async fn group_matching(&self, tenant: &str, filter: &RetryFilter) -> StoreResult<Grouped>;

    /// Counts per queue (one queue, or all of the tenant's) and the workers
    /// seen since `workers_since` ago.
    async fn stats(
        &self,
        tenant: &str,
        queue: Option<&str>,
        workers_since: Duration,
    ) -> StoreResult<Stats>;

    /// Claims for several callers in one statement: for each spec up to
    /// `spec.max_jobs` runnable jobs, now `Running` under a fresh lease token
    /// held by its worker, the first specs served first. Every spec shares
    /// the queues, kinds and `all_tenants` of the first. Empty lists when
    /// nothing is runnable (no waiting here). With `all_tenants` it claims
    /// from every tenant (ignoring `tenant`), the tenant with the fewest
    /// running jobs first; either way no tenant exceeds its running cap in a
    /// queue.
    async fn lease(&self, tenant: &str, specs: &[LeaseSpec]) -> StoreResult<Vec<Vec<Job>>>;

    /// Records that a worker asked for work, for `Stats`.
    async fn touch_worker(
        &self,
        tenant: &str,
        worker_id: &str,
        queues: &[String],
    ) -> StoreResult<()>;

    /// Extends a lease held under `spec.lease_token` (`LeaseLost` otherwise).
    async fn heartbeat(&self, tenant: &str, spec: &HeartbeatSpec) -> StoreResult<HeartbeatAck>;

    /// Applies outcomes; each item is fenced by its lease token and fails alone.
    async fn complete(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
    ) -> StoreResult<Vec<StoreResult<Ended>>>;

    /// [`Store::complete`] of `items`, then [`Store::lease`] for `specs`,
    /// in one statement where the backend can. An error of the claim after
    /// outcomes have committed is the claim's alone (the outcomes stand);
    /// without outcomes it is the call's.
    async fn complete_and_lease(
        &self,
        tenant: &str,
        items: Vec<CompleteSpec>,
        specs: &[LeaseSpec],
    ) -> StoreResult<(Vec<StoreResult<Ended>>, StoreResult<Vec<Vec<Job>>>)> {
        complete_then_lease(self, tenant, items, specs).await
    }

    /// One reaper pass over at most `batch` rows of each kind, deleting
    /// jobs finished more than `retention` ago (with `None`, a pass booked
    /// for a cancel's grace, only leases and deadlines are looked at).
    /// Safe to run from several replicas at once.
    async fn reap(&self, batch: u32, retention: Option<Duration>) -> StoreResult<Reaped>;

    /// Pauses or resumes leasing from a queue (it keeps accepting jobs).
    async fn set_paused(&self, tenant: &str, queue: &str, paused: bool) -> StoreResult<()>;

    /// Jobs waiting in a queue (queued, runnable or not), for the queue bound.
    async fn queued_count(&self, tenant: &str, queue: &str) -> StoreResult<u64>;

    /// Every tenant's queues with their jobs by state and oldest runnable
    /// age, for the metrics gauges (run on a timer; PostgreSQL reads its kept
    /// counts, SQLite scans).
    async fn queue_depths(&self) -> StoreResult<Vec<QueueDepth>>;

    /// Every tenant's queues with the workers whose last `Lease` named them,
    /// made within `since` or holding a lease of the tenant now (as `Stats`
    /// counts them), for the metrics gauges.
    async fn active_workers(&self, since: Duration) -> StoreResult<Vec<QueueWorkers>>;

    /// Ends the store's background tasks once the server is done with it,
    /// and waits, briefly, for what they still owe: on PostgreSQL the last
    /// notification to the other replicas of what committed (the runtime
    /// ends with the server, and would drop it mid-send). Nothing on SQLite.
    async fn close(&self) {}

    /// Job rows this store has left out of claims and reaper passes since
    /// it opened because they could not be read (see `unreadable`), each
    /// time one was met.
    fn unreadable_rows(&self) -> u64;

    /// The webhook outbox on the same database (and, on SQLite, the same
    /// single writer).
    fn outbox(&self) -> Arc<dyn outbox::Outbox>;

    /// The database's time as this replica knows it, for checks taken
    /// before any statement (see `db_clock`).
    fn now(&self) -> chrono::DateTime<chrono::Utc>;

    /// Reads the database's clock again for [`Store::now`]; the reaper
    /// calls it once per interval. A store whose clock is the process's
    /// has nothing to read.
    async fn read_clock(&self) -> StoreResult<()> {
        Ok(())
    }
}

/// [`Store::complete_and_lease`] as two store calls, one after the other.
async fn complete_then_lease<S: Store + ?Sized>(
    store: &S,
    tenant: &str,
    items: Vec<CompleteSpec>,
    specs: &[LeaseSpec],
) -> StoreResult<(Vec<StoreResult<Ended>>, StoreResult<Vec<Vec<Job>>>)> {
    if items.is_empty() {
        return Ok((Vec::new(), Ok(store.lease(tenant, specs).await?)));
    }
    let ended = store.complete(tenant, items).await?;
    if specs.is_empty() {
        return Ok((ended, Ok(Vec::new())));
    }
    Ok((ended, store.lease(tenant, specs).await))
}

/// Opens the database named by `settings.database_url`, applies migrations,
/// and starts whatever the backend needs to feed `notifier` (PostgreSQL's
/// `LISTEN`).
pub async fn open(settings: &Settings, notifier: Arc<Notifier>) -> StoreResult<Arc<dyn Store>> {
    let url = settings.database_url.as_str();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(postgres::PgStore::open(settings, notifier).await?))
    } else if url.starts_with("sqlite:") {
        Ok(Arc::new(
            sqlite::SqliteStore::open(settings, notifier).await?,
        ))
    } else {
        Err(StoreError::Config(
            "database url must start with sqlite: or postgres://".into(),
        ))
    }
}

/// Applies the migrations of the database named by `url` and returns.
/// `strict` (`intray migrate`) refuses a database with a migration this
/// build does not know; `serve` tolerates one with a warning, so that a pod
/// of a previous build starts on a schema a newer build migrated.
pub async fn migrate(url: &str, strict: bool) -> StoreResult<()> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        postgres::migrate(url, strict).await
    } else if url.starts_with("sqlite:") {
        sqlite::migrate(url, strict).await
    } else {
        Err(StoreError::Config(
            "database url must start with sqlite: or postgres://".into(),
        ))
    }
}

/// Logs the circuit breakers a store cleared at start because breakers are
/// off (`--breaker-threshold 0`). Only a probe's outcome closes a breaker,
/// and with breakers off none is counted: one left from a run with them on
/// would keep its kind half-open, one job at a time, for good.
fn breakers_cleared(n: u64) {
    if n > 0 {
        tracing::info!(
            breakers = n,
            "circuit breakers are off (threshold 0): cleared those left by an earlier run"
        );
    }
}

/// A store on a fresh SQLite file, for engine tests that need a real one;
/// the file lives as long as the directory.
#[cfg(test)]
pub(crate) async fn scratch_sqlite() -> (tempfile::TempDir, Arc<dyn Store>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("scratch.db").display());
    let store = open(&Settings::new(url), Arc::new(Notifier::new()))
        .await
        .expect("store");
    (dir, store)
}

/// One job submitted to tenant `default` and leased for 50 ms, for store
/// tests that need an expired lease: its id.
#[cfg(test)]
pub(crate) async fn a_briefly_leased_job(store: &dyn Store) -> Uuid {
    use crate::domain::fixtures::{lease_spec, new_job};
    store
        .submit("default", vec![new_job()])
        .await
        .expect("submit");
    let short = LeaseSpec {
        lease_duration: Duration::from_millis(50),
        ..lease_spec("w", 1)
    };
    let leased = store
        .lease("default", &[short])
        .await
        .expect("lease")
        .concat();
    leased.first().expect("leased").id
}

/// A pass without a retention (booked for a cancel's grace) deletes no
/// finished job, however old; the interval's pass does. Run by each
/// store's tests.
#[cfg(test)]
pub(crate) async fn only_the_intervals_pass_deletes(store: &dyn Store) {
    use crate::domain::fixtures::new_job;
    let submitted = store
        .submit("default", vec![new_job()])
        .await
        .expect("submit");
    let id = match submitted.into_iter().next() {
        Some(Ok(submitted)) => submitted.job.id,
        other => panic!("submit: {other:?}"),
    };
    store
        .cancel("default", id, None, Duration::ZERO)
        .await
        .expect("cancel");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let booked = store.reap(10, None).await.expect("booked pass");
    assert_eq!(booked.deleted, 0, "a booked pass deletes nothing");
    store.get("default", id).await.expect("still there");
    let interval = store
        .reap(10, Some(Duration::ZERO))
        .await
        .expect("interval pass");
    assert_eq!(interval.deleted, 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(jobs: u64) -> JobGroup {
        JobGroup {
            error_class: None,
            queue: "q".into(),
            jobs,
            cost_cents: 0,
        }
    }

    #[test]
    fn groups_that_reach_the_limit_may_not_be_all() {
        assert!(Grouped::new(vec![group(2), group(7)], 10).complete);
        assert!(!Grouped::new(vec![group(3), group(7)], 10).complete);
        assert!(Grouped::new(Vec::new(), 10).complete);
    }
}
