//! The Rust worker library (`intray::worker`) against the real server, on
//! SQLite and PostgreSQL: success, retries, cancellation, lost leases,
//! draining, and a server that is not there.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{self, Fault};
use common::*;
use intray::pb::{self, JobState as St};
use intray::worker::{CancelReason, Job, JobContext, JobError, Worker, WorkerBuilder, WorkerError};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

common::backend_tests!(
    handler_success,
    a_busy_slot_gets_its_next_job_with_its_outcome,
    a_server_without_complete_and_lease_gets_plain_completes,
    a_refused_claim_sends_the_outcome_alone,
    a_negative_cost_keeps_the_outcome,
    a_nul_in_progress_keeps_the_lease,
    an_unreported_outcome_holds_the_next_job_back_a_third_of_a_lease,
    heartbeats_ride_out_a_blip,
    progress_waits_out_a_failed_heartbeats_backoff,
    a_hung_heartbeat_stops_the_handler_within_its_lease,
    error_then_retry,
    cancellation_reaches_handler_within_one_heartbeat,
    a_handler_deaf_to_a_cancel_is_dropped_after_cancel_timeout,
    a_deaf_handlers_report_lands_within_a_short_lease,
    a_deaf_handlers_report_lands_within_the_cancel_grace,
    dropping_the_worker_stops_its_handlers,
    lost_lease_fires_token,
    drain_finishes_running_jobs_and_leases_no_more,
    drain_hands_back_jobs_that_overrun_the_grace,
    refused_worker_stops_with_an_error,
    an_idle_worker_without_a_wait_calls_once_a_second,
    numbers_keep_their_kind_both_ways,
);

const TENANT: &str = "acme";
const LONG: Duration = Duration::from_secs(15);

/// A running worker and the switch that stops it.
struct Running {
    stop: CancellationToken,
    task: JoinHandle<Result<(), WorkerError>>,
}

impl Running {
    fn start(builder: WorkerBuilder) -> Running {
        let worker = builder.build().expect("worker settings are valid");
        let stop = CancellationToken::new();
        let task = tokio::spawn(worker.run(stop.clone().cancelled_owned()));
        Running { stop, task }
    }

    /// Asks the worker to stop and waits for it, at most `within`.
    async fn stop(self, within: Duration) -> Result<(), WorkerError> {
        self.stop.cancel();
        within_time(within, "worker drain", self.task)
            .await
            .expect("worker task did not panic")
    }
}

async fn within_time<T>(d: Duration, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    common::within(d, what, fut).await
}

/// Says when a handler's future is dropped.
struct DropSignal(mpsc::UnboundedSender<()>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

fn builder(server: &TestServer) -> WorkerBuilder {
    builder_at(&server.url())
}

fn builder_at(url: &str) -> WorkerBuilder {
    Worker::builder(url)
        .tenant(TENANT)
        .worker_id("lib-worker")
        .poll_wait(Duration::from_secs(2))
}

fn error_class(job: &pb::Job) -> String {
    job.error
        .as_ref()
        .map(|e| e.class.clone())
        .unwrap_or_default()
}

async fn echo(job: Job, ctx: JobContext) -> Result<Value, JobError> {
    ctx.report_progress(0.5, "halfway");
    ctx.add_cost(5);
    // Long enough for the progress heartbeat to land before the outcome.
    tokio::time::sleep(Duration::from_millis(400)).await;
    Ok(json!({"echo": job.payload, "attempt": job.attempt, "kind": job.kind}))
}

// ---------------------------------------------------------------------------

async fn handler_success(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .concurrency(2)
            .handler("echo", echo),
    );

    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(submit(&mut jobs, "q", "echo", json!({"n": i})).await.id);
    }
    // A job of a kind the worker has no handler for is never leased.
    let other = submit(&mut jobs, "q", "other", json!({})).await;

    for (i, id) in ids.iter().enumerate() {
        let job = wait_for_state(&mut jobs, id, St::Succeeded, LONG).await;
        let result = job.result.as_ref().map(value_to_json);
        assert_eq!(
            result,
            Some(json!({"echo": {"n": i as f64}, "attempt": 1.0, "kind": "echo"})),
            "the handler's value is the result"
        );
        assert_eq!(job.cost_cents, 5, "cost reported with the outcome");
        assert_eq!(job.progress, 0.5, "progress reported by a heartbeat");
        assert_eq!(job.lease_owner, "", "lease released");
    }
    let events = watch_all(&mut jobs, &ids[0], 0, LONG).await;
    assert!(
        events
            .iter()
            .any(|e| e.r#type == pb::JobEventType::Progress as i32),
        "a PROGRESS event was written: {:?}",
        event_types(&events)
    );
    assert!(events.iter().any(|e| e.worker_id == "lib-worker"));
    assert_eq!(state(&get(&mut jobs, &other.id).await), St::Queued);

    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A payload's whole numbers reach a handler as integers (a protobuf
/// `Value` holds them as doubles: `5` arrived as `5.0`, and `as_u64` was
/// `None`), and an integer result past 2^53 (an id) is sent as the nearest
/// double instead of failing finished work for good.
async fn numbers_keep_their_kind_both_ways(backend: Backend) {
    async fn count(job: Job, _ctx: JobContext) -> Result<Value, JobError> {
        let n = job.payload["n"]
            .as_u64()
            .ok_or_else(|| JobError::fatal("not_an_integer", job.payload.to_string()))?;
        Ok(json!({"doubled": n * 2, "id": 9_007_199_254_740_993_u64}))
    }
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = Running::start(builder(&server).queue("q").handler("count", count));
    let job = submit(&mut jobs, "q", "count", json!({"n": 5})).await;
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(
        done.result.as_ref().map(value_to_json),
        Some(json!({"doubled": 10.0, "id": 9_007_199_254_740_992.0}))
    );
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A slot that reports an outcome while jobs are queued gets its next job
/// in the same call (`CompleteAndLease`): a one-slot worker drains a queue
/// with one `Lease` (two when the queue's end races a poll), and every
/// outcome goes through `CompleteAndLease`.
async fn a_busy_slot_gets_its_next_job_with_its_outcome(backend: Backend) {
    const JOBS: usize = 12;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut ids = Vec::new();
    for i in 0..JOBS {
        ids.push(submit(&mut jobs, "q", "echo", json!({"n": i})).await.id);
    }
    let worker = Running::start(builder(&server).queue("q").handler("echo", echo));
    for id in &ids {
        wait_for_state(&mut jobs, id, St::Succeeded, LONG).await;
    }
    worker.stop(LONG).await.expect("worker stops cleanly");
    let calls = |method| worker_calls_ok(server.http_addr, method);
    assert_eq!(calls("CompleteAndLease").await, JOBS as f64);
    assert_eq!(calls("Complete").await, 0.0);
    let leases = calls("Lease").await;
    assert!(leases <= 2.0, "Lease calls: {leases}");
    server.stop().await;
}

async fn a_server_without_complete_and_lease_gets_plain_completes(backend: Backend) {
    const JOBS: usize = 6;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut ids = Vec::new();
    for i in 0..JOBS {
        ids.push(submit(&mut jobs, "q", "echo", json!({"n": i})).await.id);
    }
    let (addr, calls) = proxy::start(&server, TENANT, Fault::OlderServer).await;
    let url = format!("http://{addr}");
    let worker = Running::start(builder_at(&url).queue("q").handler("echo", echo));
    for id in &ids {
        let done = wait_for_state(&mut jobs, id, St::Succeeded, LONG).await;
        assert_eq!(done.attempt, 1, "job {id} ran more than once");
    }
    worker.stop(LONG).await.expect("worker stops cleanly");
    assert_eq!(
        calls.chained(),
        1,
        "one UNIMPLEMENTED answer switches the worker to Complete for good"
    );
    let calls = |method| worker_calls_ok(server.http_addr, method);
    assert_eq!(calls("Complete").await, JOBS as f64);
    assert_eq!(calls("CompleteAndLease").await, 0.0);
    server.stop().await;
}

/// A `CompleteAndLease` refused as a whole (`INVALID_ARGUMENT` for its
/// claim) applied nothing: the outcome is sent again alone, as it was, not
/// turned into a failure, and later outcomes go alone from the start.
async fn a_refused_claim_sends_the_outcome_alone(backend: Backend) {
    const JOBS: usize = 3;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut ids = Vec::new();
    for i in 0..JOBS {
        ids.push(submit(&mut jobs, "q", "echo", json!({"n": i})).await.id);
    }
    let (addr, calls) = proxy::start(&server, TENANT, Fault::ClaimRefused).await;
    let url = format!("http://{addr}");
    let worker = Running::start(builder_at(&url).queue("q").handler("echo", echo));
    for id in &ids {
        let done = wait_for_state(&mut jobs, id, St::Succeeded, LONG).await;
        assert_eq!(done.attempt, 1, "job {id} ran more than once");
        assert_eq!(done.cost_cents, 5, "job {id}'s cost went with its outcome");
    }
    worker.stop(LONG).await.expect("worker stops cleanly");
    assert_eq!(
        calls.chained(),
        1,
        "one refused claim switches the worker to Complete for good"
    );
    assert_eq!(
        worker_calls_ok(server.http_addr, "Complete").await,
        JOBS as f64
    );
    server.stop().await;
}

/// A handler that takes back more cost than it added still gets its
/// outcome reported: the worker never sends a negative cost, which the
/// server would refuse with the outcome.
async fn a_negative_cost_keeps_the_outcome(backend: Backend) {
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "q", "refund", json!({})).await;
    let refund = |_: Job, ctx: JobContext| async move {
        ctx.add_cost(-1);
        Ok(json!("done"))
    };
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .lease_duration(Duration::from_secs(2))
            .handler("refund", refund),
    );
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 1, "the outcome of the first attempt was kept");
    assert_eq!(done.cost_cents, 0);
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A progress message holding NUL (which the server refuses in text) does
/// not get the heartbeats refused: a 4.5 s job under a 2 s lease, reporting
/// such progress every 50 ms, keeps its lease and succeeds on its first
/// attempt.
async fn a_nul_in_progress_keeps_the_lease(backend: Backend) {
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "q", "chatty", json!({})).await;
    let chatty = |_: Job, ctx: JobContext| async move {
        // Often enough that every heartbeat carries the message.
        for i in 0..90 {
            ctx.report_progress(f64::from(i) / 90.0, "a\0b");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(json!("done"))
    };
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .lease_duration(Duration::from_secs(2))
            .handler("chatty", chatty),
    );
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 1, "the job kept its first lease");
    assert!(
        done.progress > 0.0,
        "progress was recorded: {}",
        done.progress
    );
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A slot whose outcome cannot be reported while `CompleteAndLease` has
/// already leased it the next job retries that outcome for a third of a
/// lease, not a whole one: the next job's lease runs from the claim, and
/// its first heartbeat comes a third of a lease after its handler starts.
/// Held back a whole lease, the next job would be reclaimed under its
/// handler (the reaper runs every 100 ms here) and run a second time.
async fn an_unreported_outcome_holds_the_next_job_back_a_third_of_a_lease(backend: Backend) {
    const LEASE: Duration = Duration::from_secs(6);
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let first = submit(&mut jobs, "q", "slow", json!({})).await;
    let next = submit(&mut jobs, "q", "slow", json!({})).await;
    let (addr, calls) = proxy::start(&server, TENANT, Fault::OutcomeUnavailable).await;
    let url = format!("http://{addr}");
    let slow = |_: Job, _: JobContext| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok(json!("done"))
    };
    let worker = Running::start(
        builder_at(&url)
            .queue("q")
            .lease_duration(LEASE)
            .handler("slow", slow),
    );
    let done = wait_for_state(&mut jobs, &next.id, St::Succeeded, LONG).await;
    // A lease that ran out would have put it back, to run a second time.
    assert_eq!(done.attempt, 1, "the next job kept its first lease");
    assert!(calls.chained() >= 1);
    // The lost outcome's job is reclaimed when its lease ends, and run again.
    let again = wait_for_state(&mut jobs, &first.id, St::Succeeded, LONG).await;
    assert_eq!(again.attempt, 2);
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// Heartbeats that fail for a moment (two answered `UNAVAILABLE` by the
/// proxy) are retried within the lease, and the job keeps it: a 4 s job
/// under a 3 s lease, with a reaper every 100 ms, succeeds on its first
/// attempt.
async fn heartbeats_ride_out_a_blip(backend: Backend) {
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "q", "slow", json!({})).await;
    let (addr, calls) = proxy::start(&server, TENANT, Fault::HeartbeatsUnavailable(2)).await;
    let slow = |_: Job, _: JobContext| async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        Ok(json!("done"))
    };
    let worker = Running::start(
        builder_at(&format!("http://{addr}"))
            .queue("q")
            .lease_duration(Duration::from_secs(3))
            .handler("slow", slow),
    );
    let done = wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    assert_eq!(done.attempt, 1, "the job kept its lease through the blip");
    let beats = calls.heartbeats();
    assert!(
        beats >= 3,
        "two failed heartbeats, then one that went through: {beats}"
    );
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A handler reporting progress every 50 ms while heartbeats fail makes no
/// more calls than the backoff allows (200 ms doubling, with jitter: about
/// six in three seconds), not one per 200 ms progress spacing (fifteen).
async fn progress_waits_out_a_failed_heartbeats_backoff(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let job = submit(&mut jobs, "q", "chatty", json!({})).await;
    let (addr, calls) = proxy::start(&server, TENANT, Fault::HeartbeatsUnavailable(1000)).await;
    let chatty = |_: Job, ctx: JobContext| async move {
        for i in 0..60 {
            ctx.report_progress(f64::from(i) / 60.0, format!("token {i}"));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(json!("done"))
    };
    let worker = Running::start(
        builder_at(&format!("http://{addr}"))
            .queue("q")
            .lease_duration(Duration::from_secs(30))
            .handler("chatty", chatty),
    );
    wait_for_state(&mut jobs, &job.id, St::Succeeded, LONG).await;
    let beats = calls.heartbeats();
    assert!(
        (1..=9).contains(&beats),
        "heartbeats while every one failed: {beats}"
    );
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A heartbeat that is never answered ends when the lease would: the
/// handler's token fires then, not a whole call timeout (10 s) later, while
/// the reaper may already have handed the job to another worker.
async fn a_hung_heartbeat_stops_the_handler_within_its_lease(backend: Backend) {
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (addr, calls) = proxy::start(&server, TENANT, Fault::HeartbeatsHang).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let worker = Running::start(
        builder_at(&format!("http://{addr}"))
            .queue("q")
            .lease_duration(Duration::from_secs(3))
            .handler("wait", move |job: Job, ctx: JobContext| {
                let _ = started_tx.send(Instant::now());
                reporting_handler(tx.clone())(job, ctx)
            }),
    );
    submit(&mut jobs, "q", "wait", json!({})).await;
    let started = within_time(LONG, "the handler's start", started.recv())
        .await
        .expect("the handler started");
    let (reason, fired_at) = within_time(LONG, "the handler's token", rx.recv())
        .await
        .expect("the handler reported");
    assert_eq!(reason, Some(CancelReason::LeaseLost));
    let took = fired_at.duration_since(started);
    // The call timed out at the lease's end; a 10 s timeout fired at 11 s.
    assert!(
        took <= Duration::from_secs(5),
        "the token fired {took:?} after the start, long past the 3 s lease"
    );
    assert!(calls.heartbeats() >= 1, "a heartbeat was sent and hung");
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// A handler that does not listen to its token is dropped `cancel_timeout`
/// after a cancel fired it, and the job ends CANCELLED then, not when its
/// lease (20 s) runs out.
async fn a_handler_deaf_to_a_cancel_is_dropped_after_cancel_timeout(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.cancel_grace = Duration::from_secs(30);
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .lease_duration(Duration::from_secs(20))
            .heartbeat_interval(Duration::from_secs(1))
            .cancel_timeout(Duration::from_millis(300))
            .handler("deaf", move |_: Job, _: JobContext| {
                let guard = DropSignal(dropped_tx.clone());
                async move {
                    let _guard = guard;
                    tokio::time::sleep(Duration::from_secs(600)).await;
                    Ok(Value::Null)
                }
            }),
    );
    let job = submit(&mut jobs, "q", "deaf", json!({})).await;
    wait_for_state(&mut jobs, &job.id, St::Running, LONG).await;
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    // One heartbeat (1 s) brings the cancel, 0.3 s later the handler goes.
    let done = wait_for_state(&mut jobs, &job.id, St::Cancelled, Duration::from_secs(6)).await;
    assert_eq!(done.attempt, 1);
    within_time(
        Duration::from_secs(1),
        "the handler dropped",
        dropped.recv(),
    )
    .await
    .expect("the guard reported");
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// After a cancel the server no longer extends the lease, so with a lease
/// (3 s) shorter than `cancel_timeout` (5 s, the default) the worker gives
/// up on a deaf handler early enough for its report to land: the job ends
/// CANCELLED with the cost the handler added. Reporting at the timeout, it
/// was refused (the lease had ended) and the cost was lost.
async fn a_deaf_handlers_report_lands_within_a_short_lease(backend: Backend) {
    deaf_handlers_report_lands(backend, Duration::from_secs(30), |b| {
        b.lease_duration(Duration::from_secs(3))
    })
    .await;
}

/// A cancel cuts the lease to the server's cancel grace (2 s here), far
/// shorter than the lease (30 s) and than `cancel_timeout` (10 s): the
/// worker learns the cut from the heartbeat that brings the cancel and gives
/// up on a deaf handler in time for its report, with the cost the handler
/// added, to land. Going by its own lease and timeout, it reported after the
/// grace, was refused, and the cost was lost.
async fn a_deaf_handlers_report_lands_within_the_cancel_grace(backend: Backend) {
    deaf_handlers_report_lands(backend, Duration::from_secs(2), |b| {
        b.lease_duration(Duration::from_secs(30))
            .heartbeat_interval(Duration::from_millis(500))
            .cancel_timeout(Duration::from_secs(10))
    })
    .await;
}

/// Cancels a running job whose handler adds a cost of 7 and then ignores
/// its token, on a server with `cancel_grace` and a worker set up by
/// `settings`: the job must end CANCELLED with the cost, so the report
/// landed before the lease ended.
async fn deaf_handlers_report_lands(
    backend: Backend,
    cancel_grace: Duration,
    settings: impl FnOnce(WorkerBuilder) -> WorkerBuilder,
) {
    let server = TestServer::start_with(backend, |s| s.cancel_grace = cancel_grace).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = Running::start(settings(builder(&server).queue("q")).handler(
        "deaf",
        |_: Job, ctx: JobContext| async move {
            ctx.add_cost(7);
            tokio::time::sleep(Duration::from_secs(600)).await;
            Ok(Value::Null)
        },
    ));
    let job = submit(&mut jobs, "q", "deaf", json!({})).await;
    wait_for_state(&mut jobs, &job.id, St::Running, LONG).await;
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    let done = wait_for_state(&mut jobs, &job.id, St::Cancelled, LONG).await;
    assert_eq!(done.cost_cents, 7, "the report landed: {done:?}");
    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// Dropping `Worker::run`'s future (not cancel-safe, as documented) stops
/// its handlers: they must not run on unsupervised, with nobody to
/// heartbeat or report, while their jobs come back to other workers.
async fn dropping_the_worker_stops_its_handlers(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
    let worker = Running::start(builder(&server).queue("q").handler(
        "long",
        move |_: Job, _: JobContext| {
            let guard = DropSignal(dropped_tx.clone());
            async move {
                let _guard = guard;
                tokio::time::sleep(Duration::from_secs(600)).await;
                Ok(Value::Null)
            }
        },
    ));
    let job = submit(&mut jobs, "q", "long", json!({})).await;
    wait_for_state(&mut jobs, &job.id, St::Running, LONG).await;
    worker.task.abort();
    within_time(
        Duration::from_secs(2),
        "the handler dropped with the worker",
        dropped.recv(),
    )
    .await
    .expect("the guard reported");
    server.stop().await;
}

async fn error_then_retry(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .handler("flaky", |job: Job, _ctx: JobContext| async move {
                if job.attempt == 1 {
                    Err(JobError::retryable("rate_limited", "429 from the provider")
                        .with_retry_after(Duration::from_millis(100)))
                } else {
                    Ok(json!("second time lucky"))
                }
            })
            .handler("broken", |_job: Job, _ctx: JobContext| async move {
                Err(JobError::fatal("bad_input", "the document is empty"))
            })
            .handler("panics", |job: Job, _ctx: JobContext| async move {
                if job.attempt == 1 {
                    panic!("handler bug");
                }
                Ok(Value::Null)
            })
            // Panics when called, before it has a future to poll.
            .handler("panics_early", |job: Job, _ctx: JobContext| {
                assert!(job.attempt > 1, "handler bug before its first await");
                async move { Ok(Value::Null) }
            }),
    );

    let flaky = submit(&mut jobs, "q", "flaky", json!({})).await;
    let broken = submit(&mut jobs, "q", "broken", json!({})).await;
    let panics = submit(&mut jobs, "q", "panics", json!({})).await;
    let panics_early = submit(&mut jobs, "q", "panics_early", json!({})).await;

    let job = wait_for_state(&mut jobs, &flaky.id, St::Succeeded, LONG).await;
    assert_eq!(job.attempt, 2, "the retryable failure was retried");
    assert_eq!(
        job.result.as_ref().map(value_to_json),
        Some(json!("second time lucky"))
    );
    let events = watch_all(&mut jobs, &flaky.id, 0, LONG).await;
    assert!(
        events
            .iter()
            .any(|e| e.r#type == pb::JobEventType::RetryScheduled as i32),
        "{:?}",
        event_types(&events)
    );

    let job = wait_for_state(&mut jobs, &broken.id, St::Failed, LONG).await;
    assert_eq!(job.attempt, 1, "a final error is not retried");
    assert_eq!(error_class(&job), "bad_input");
    assert_eq!(
        job.error.map(|e| e.message).as_deref(),
        Some("the document is empty")
    );

    let job = wait_for_state(&mut jobs, &panics.id, St::Succeeded, LONG).await;
    assert_eq!(job.attempt, 2, "a panic is a retryable failure");
    // Not left to wait out its 60 s lease: reported at once, as a panic.
    let job = wait_for_state(&mut jobs, &panics_early.id, St::Succeeded, LONG).await;
    assert_eq!(job.attempt, 2, "a panic before the first await too");
    let events = watch_all(&mut jobs, &panics_early.id, 0, LONG).await;
    assert!(
        has_retry_mentioning(&events, "handler_panicked"),
        "{events:?}"
    );

    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

/// Sends the reason and the time its token fired, then returns.
fn reporting_handler(
    tx: mpsc::UnboundedSender<(Option<CancelReason>, Instant)>,
) -> impl Fn(Job, JobContext) -> futures::future::BoxFuture<'static, Result<Value, JobError>>
+ Send
+ Sync
+ 'static {
    move |_job, ctx| {
        let tx = tx.clone();
        Box::pin(async move {
            ctx.cancelled().await;
            let _ = tx.send((ctx.cancel_reason(), Instant::now()));
            Err(JobError::retryable("stopped", "token fired"))
        })
    }
}

async fn cancellation_reaches_handler_within_one_heartbeat(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (tx, mut rx) = mpsc::unbounded_channel();
    // 3 s lease: a heartbeat every second.
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .lease_duration(Duration::from_secs(3))
            .handler("wait", reporting_handler(tx)),
    );
    let job = submit(&mut jobs, "q", "wait", json!({})).await;
    wait_for_state(&mut jobs, &job.id, St::Running, LONG).await;

    let cancelled_at = Instant::now();
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    let (reason, fired_at) = within_time(LONG, "the handler's token", rx.recv())
        .await
        .expect("the handler reported");
    assert_eq!(reason, Some(CancelReason::CancelRequested));
    let took = fired_at.duration_since(cancelled_at);
    assert!(
        took <= Duration::from_millis(1000 + 700),
        "the cancel reached the handler in {took:?}, more than one heartbeat (1 s)"
    );
    // The worker reports back at once, long before the 30 s cancel grace.
    let done = wait_for_state(&mut jobs, &job.id, St::Cancelled, Duration::from_secs(5)).await;
    assert_eq!(done.attempt, 1);

    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

async fn lost_lease_fires_token(backend: Backend) {
    let server = TestServer::start_reaping_fast(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Heartbeats less often than the lease lasts: the reaper takes it back.
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .lease_duration(Duration::from_secs(1))
            .heartbeat_interval(Duration::from_secs(3))
            .handler("wait", reporting_handler(tx)),
    );
    let mut request = submit_req("q", "wait", json!({}));
    request.max_attempts = Some(1);
    let job = submit_with(&mut jobs, request).await;

    let (reason, _) = within_time(LONG, "the handler's token", rx.recv())
        .await
        .expect("the handler reported");
    assert_eq!(reason, Some(CancelReason::LeaseLost));
    let done = wait_for_state(&mut jobs, &job.id, St::Failed, LONG).await;
    assert_eq!(
        error_class(&done),
        "lease_expired",
        "the reaper's outcome stands: the worker wrote nothing after losing the lease"
    );

    worker.stop(LONG).await.expect("worker stops cleanly");
    server.stop().await;
}

async fn drain_finishes_running_jobs_and_leases_no_more(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let seen = started.clone();
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .concurrency(3)
            .grace(Duration::from_secs(10))
            .handler("slow", move |job: Job, ctx: JobContext| {
                let seen = seen.clone();
                async move {
                    seen.add_permits(1);
                    // Work that ignores the token: only the grace saves it.
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    Ok(json!({"done": job.id, "cancelled": ctx.is_cancelled()}))
                }
            }),
    );
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(submit(&mut jobs, "q", "slow", json!({"n": i})).await.id);
    }
    within_time(LONG, "three handlers starting", started.acquire_many(3))
        .await
        .expect("semaphore open")
        .forget();

    worker.stop.cancel();
    // Submitted after the shutdown signal: must stay queued.
    let late = submit(&mut jobs, "q", "slow", json!({"late": true})).await;
    within_time(LONG, "worker drain", worker.task)
        .await
        .expect("worker task did not panic")
        .expect("worker stops cleanly");

    for id in &ids {
        let job = get(&mut jobs, id).await;
        assert_eq!(
            state(&job),
            St::Succeeded,
            "in-flight job {id} finished during the drain"
        );
        assert_eq!(job.attempt, 1);
        assert_eq!(
            job.result.as_ref().map(value_to_json),
            Some(json!({"done": id, "cancelled": false}))
        );
    }
    let late = get(&mut jobs, &late.id).await;
    assert_eq!(state(&late), St::Queued, "nothing is leased after shutdown");
    assert_eq!(late.attempt, 0);
    server.stop().await;
}

async fn drain_hands_back_jobs_that_overrun_the_grace(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let worker = Running::start(
        builder(&server)
            .queue("q")
            .grace(Duration::from_millis(300))
            .cancel_timeout(Duration::from_millis(300))
            .handler("stuck", move |_job: Job, ctx: JobContext| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(());
                    // Ignores its token entirely: it has to be dropped.
                    tokio::time::sleep(Duration::from_secs(600)).await;
                    Ok(json!({"finished": ctx.is_cancelled()}))
                }
            }),
    );
    let job = submit(&mut jobs, "q", "stuck", json!({})).await;
    within_time(LONG, "the handler starting", rx.recv()).await;

    let stopping = Instant::now();
    worker.stop(LONG).await.expect("worker stops cleanly");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "grace plus cancel timeout bound the drain, took {:?}",
        stopping.elapsed()
    );
    let back = get(&mut jobs, &job.id).await;
    assert_eq!(state(&back), St::Queued, "handed back, not lost");
    assert_eq!(error_class(&back), "worker_shutdown");
    // No retry delay: the next worker can take it at once.
    let mut workers = server.workers_client(TENANT);
    let leased = lease_now(&mut workers, "next", "q").await;
    assert_eq!(leased.len(), 1, "runnable again right away");
    assert_eq!(leased[0].attempt, 2);
    server.stop().await;
}

async fn refused_worker_stops_with_an_error(backend: Backend) {
    let server = TestServer::start(backend).await;
    let worker = Running::start(builder(&server).queue("not a valid queue").handler(
        "x",
        |_job: Job, _ctx: JobContext| async move { Ok(Value::Null) },
    ));
    let result = within_time(LONG, "refused worker", worker.task)
        .await
        .expect("worker task did not panic");
    match result {
        Err(WorkerError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument)
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    server.stop().await;
}

/// Nothing listens: the worker keeps retrying (it does not give up or spin)
/// and still stops at once when asked.
#[tokio::test]
async fn unreachable_server_is_retried_until_shutdown() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    drop(listener);
    let worker = Running::start(
        Worker::builder(&format!("http://{addr}"))
            .queue("q")
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(200))
            .handler(
                "x",
                |_job: Job, _ctx: JobContext| async move { Ok(Value::Null) },
            ),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!worker.task.is_finished(), "the worker keeps retrying");
    let stopping = Instant::now();
    worker
        .stop(Duration::from_secs(5))
        .await
        .expect("clean stop");
    assert!(stopping.elapsed() < Duration::from_secs(1));
}

/// `poll_wait(0)` is allowed; an idle worker with it must not call `Lease`
/// in a tight loop, but at most about once a second.
async fn an_idle_worker_without_a_wait_calls_once_a_second(backend: Backend) {
    let server = TestServer::start(backend).await;
    let before = worker_calls_ok(server.http_addr, "Lease").await;
    let worker = Running::start(
        builder(&server)
            .queue("idle")
            .poll_wait(Duration::ZERO)
            .handler("echo", echo),
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    worker.stop(LONG).await.expect("clean stop");
    let calls = worker_calls_ok(server.http_addr, "Lease").await - before;
    assert!(
        (1.0..=4.0).contains(&calls),
        "{calls} Lease calls in 2.5 s while idle"
    );
    server.stop().await;
}
