//! A job submitted while a worker waits idle in `Lease` goes straight to it,
//! in the submit's own transaction, unless a claim made then would have
//! picked something else. On both backends through real gRPC.

mod common;

use std::time::Duration;

use chrono::Utc;
use common::*;
use intray::pb::{self, JobEventType as Ev, JobState as St};
use serde_json::json;

common::backend_tests!(
    idle_worker_gets_the_job_in_the_submit,
    due_job_ahead_is_claimed_first,
    kinds_filter_and_pause_keep_jobs_queued,
    batch_spreads_over_idle_workers,
);

mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_batch_whose_caller_left_still_reaches_the_idle_worker() {
        super::a_batch_whose_caller_left_still_reaches_the_idle_worker().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_lease_reserved_by_a_stalled_submit_ends_near_its_wait() {
        super::a_lease_reserved_by_a_stalled_submit_ends_near_its_wait().await
    }
}

/// Long-polls `queue` (and `kinds`) in a task; its answer comes back
/// through the handle.
fn wait_for_jobs(
    server: &TestServer,
    worker: &str,
    queue: &str,
    kinds: &[&str],
    wait: Duration,
) -> tokio::task::JoinHandle<Vec<pb::LeasedJob>> {
    let mut workers = server.workers_client("t");
    let mut request = lease_req(worker, queue, 1, wait);
    request.kinds = kinds.iter().map(|k| (*k).to_owned()).collect();
    tokio::spawn(async move {
        workers
            .lease(request)
            .await
            .expect("Lease")
            .into_inner()
            .jobs
    })
}

/// Starts a server whose workers are only woken by the notifier or a
/// hand-off, never by the fallback timer within a test.
async fn server(backend: Backend) -> TestServer {
    TestServer::start_with(backend, |s| {
        s.fallback_poll = Duration::from_secs(30);
    })
    .await
}

/// Time for a `Lease` call to find nothing and park.
const PARK: Duration = Duration::from_millis(300);

/// Waits until `n` `Lease` calls wait on `server` (its long-poll gauge),
/// then for their first claim to find nothing and park: the sleep alone
/// lost the race on a loaded machine, before the calls had even arrived.
async fn parked(server: &TestServer, n: usize) {
    let line = format!("intray_long_polling_workers {n}\n");
    within(Duration::from_secs(10), "the Lease calls to wait", async {
        while !scrape(server.http_addr).await.contains(&line) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tokio::time::sleep(PARK).await;
}

async fn idle_worker_gets_the_job_in_the_submit(backend: Backend) {
    let server = server(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let waiter = wait_for_jobs(&server, "idle", "h", &[], Duration::from_secs(10));
    parked(&server, 1).await;

    // The submit's answer already shows the lease: one commit did both.
    let job = submit(&mut jobs, "h", "k", json!({"n": 1})).await;
    assert_eq!(state(&job), St::Running, "handed off in the submit");
    assert_eq!(job.lease_owner, "idle");
    assert_eq!(job.attempt, 1);

    let leased = within(Duration::from_secs(5), "the idle worker's Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, job.id);
    assert_eq!(leased[0].attempt, 1);
    assert!(!leased[0].lease_token.is_empty());

    // An ordinary lease from here on: heartbeats and the fenced complete.
    workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased[0].lease_token.clone(),
            extend_by: Some(secs(30)),
            progress: Some(0.5),
            ..Default::default()
        })
        .await
        .expect("Heartbeat on a handed-off lease");
    let done = complete_ok(&mut workers, &leased[0]).await;
    assert_eq!(state(&done), St::Succeeded);

    let events = watch_all(&mut jobs, &job.id, 0, Duration::from_secs(5)).await;
    assert_eq!(
        event_types(&events),
        vec![Ev::Submitted, Ev::Leased, Ev::Progress, Ev::Succeeded]
    );
    assert_eq!(sequences(&events), vec![1, 2, 3, 4]);
    assert_eq!(events[0].state(), St::Queued);
    assert_eq!(events[1].state(), St::Running);
    assert_eq!(events[1].worker_id, "idle");
    assert_eq!(events[1].attempt, 1);
    server.stop().await;
}

/// A job that became due while the worker waited (scheduled, nobody woken)
/// ranks above a new one of the same priority: the new one stays queued
/// and the worker's claim takes the older one.
async fn due_job_ahead_is_claimed_first(backend: Backend) {
    let server = server(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut scheduled = submit_req("d", "k", json!({"n": "older"}));
    scheduled.run_at = Some(ts(Utc::now() + chrono::Duration::milliseconds(500)));
    let older = submit_with(&mut jobs, scheduled).await;
    assert_eq!(state(&older), St::Queued);

    let waiter = wait_for_jobs(&server, "idle", "d", &[], Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(900)).await;
    let newer = submit(&mut jobs, "d", "k", json!({"n": "newer"})).await;
    assert_eq!(state(&newer), St::Queued, "not handed off past a due job");

    let leased = within(Duration::from_secs(5), "the idle worker's Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, older.id, "the due job ahead goes first");
    assert_eq!(state(&get(&mut jobs, &newer.id).await), St::Queued);

    // A higher priority does go past a due job.
    let mut scheduled = submit_req("d2", "k", json!({"n": "low"}));
    scheduled.run_at = Some(ts(Utc::now() + chrono::Duration::milliseconds(500)));
    let low = submit_with(&mut jobs, scheduled).await;
    let waiter = wait_for_jobs(&server, "idle-2", "d2", &[], Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(900)).await;
    let mut urgent = submit_req("d2", "k", json!({}));
    urgent.priority = 9;
    let urgent = submit_with(&mut jobs, urgent).await;
    assert_eq!(state(&urgent), St::Running);
    let leased = within(Duration::from_secs(5), "the second Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(leased[0].job_id, urgent.id);
    assert_eq!(state(&get(&mut jobs, &low.id).await), St::Queued);
    server.stop().await;
}

/// A worker that does not take the job's kind, or a paused queue, leaves
/// the job queued; the worker gets the kind it asked for.
async fn kinds_filter_and_pause_keep_jobs_queued(backend: Backend) {
    let server = server(backend).await;
    let mut jobs = server.jobs_client("t");
    let waiter = wait_for_jobs(&server, "picky", "f", &["wanted"], Duration::from_secs(10));
    parked(&server, 1).await;
    let other = submit(&mut jobs, "f", "other", json!({})).await;
    assert_eq!(
        state(&other),
        St::Queued,
        "a kind the worker did not ask for"
    );
    // Whether `wanted` is handed off or claimed (the queued job of another
    // kind is due ahead of it, and the guard does not look at kinds), the
    // worker gets it and nothing else.
    let wanted = submit(&mut jobs, "f", "wanted", json!({})).await;
    let leased = within(Duration::from_secs(5), "the picky Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, wanted.id);
    assert_eq!(state(&get(&mut jobs, &other.id).await), St::Queued);

    jobs.pause_queue(pb::PauseQueueRequest { queue: "p".into() })
        .await
        .expect("PauseQueue");
    let waiter = wait_for_jobs(&server, "paused", "p", &[], Duration::from_millis(1500));
    parked(&server, 1).await;
    let held = submit(&mut jobs, "p", "k", json!({})).await;
    assert_eq!(state(&held), St::Queued, "a paused queue hands nothing off");
    let leased = within(Duration::from_secs(5), "the paused Lease", waiter)
        .await
        .expect("waiter task");
    assert!(leased.is_empty(), "nothing leased from a paused queue");
    assert_eq!(state(&get(&mut jobs, &held.id).await), St::Queued);
    server.stop().await;
}

/// One `SubmitBatch` feeds several idle workers, one job each, and leaves
/// the rest queued for the next claims.
async fn batch_spreads_over_idle_workers(backend: Backend) {
    let server = server(backend).await;
    let mut jobs = server.jobs_client("t");
    let waiters: Vec<_> = (0..3)
        .map(|i| wait_for_jobs(&server, &format!("w{i}"), "b", &[], Duration::from_secs(10)))
        .collect();
    parked(&server, 3).await;
    let batch = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: (0..5)
                .map(|i| submit_req("b", "k", json!({ "i": i })))
                .collect(),
        })
        .await
        .expect("SubmitBatch")
        .into_inner()
        .results;
    let submitted: Vec<pb::Job> = batch
        .into_iter()
        .map(|r| match r.result {
            Some(pb::submit_batch_result::Result::Ok(ok)) => ok.job.expect("job"),
            other => panic!("item refused: {other:?}"),
        })
        .collect();
    let running: Vec<&pb::Job> = submitted
        .iter()
        .filter(|j| state(j) == St::Running)
        .collect();
    assert_eq!(running.len(), 3, "one job per idle worker");
    let owners: std::collections::HashSet<&str> =
        running.iter().map(|j| j.lease_owner.as_str()).collect();
    assert_eq!(owners.len(), 3, "spread over the three workers");
    // The oldest jobs go first.
    assert!(submitted[..3].iter().all(|j| state(j) == St::Running));

    let mut got = Vec::new();
    for waiter in waiters {
        let leased = within(Duration::from_secs(5), "an idle worker's Lease", waiter)
            .await
            .expect("waiter task");
        assert_eq!(leased.len(), 1);
        got.push(leased[0].job_id.clone());
    }
    got.sort();
    let mut expected: Vec<String> = running.iter().map(|j| j.id.clone()).collect();
    expected.sort();
    assert_eq!(got, expected, "each worker got the job leased to it");
    server.stop().await;
}

/// A `SubmitBatch` runs to its end even when its caller goes away while it
/// waits on the database: it may commit jobs leased to parked `Lease`
/// calls, and those calls must get them rather than hold them, unknown to
/// anyone, until their leases run out. The batch's insert is held by an
/// open transaction that gave another job the same idempotency key (the
/// unique index makes the insert wait for its outcome); its caller is
/// cancelled, then that transaction rolled back. (PostgreSQL: SQLite's
/// writer lock would hold the server's every write.)
async fn a_batch_whose_caller_left_still_reaches_the_idle_worker() {
    use sqlx::Connection;
    let server = server(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let other = submit(&mut jobs, "elsewhere", "k", json!({})).await;
    let url = server.settings.database_url.clone();
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("connect");
    let waiter = wait_for_jobs(&server, "idle", "left", &[], Duration::from_secs(20));
    parked(&server, 1).await;

    take_key(&mut holder, &other.id).await;
    let caller = tokio::spawn(async move {
        let mut job = submit_req("left", "k", json!({ "i": 1 }));
        job.idempotency_key = "taken".into();
        jobs.submit_batch(pb::SubmitBatchRequest { jobs: vec![job] })
            .await
    });
    waits_on_a_lock(&mut watcher, "the batch waits for the key").await;
    caller.abort();
    assert!(
        caller.await.is_err_and(|e| e.is_cancelled()),
        "the caller went away before the answer"
    );
    // Time for the server to see the stream reset before the batch can go
    // on. Were the batch dropped with its call, it would roll back and the
    // worker would get nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("ROLLBACK");

    let leased = within(Duration::from_secs(10), "the idle worker's Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(leased.len(), 1, "the batch's job reached the idle worker");
    let mut jobs = server.jobs_client("t");
    let job = get(&mut jobs, &leased[0].job_id).await;
    assert_eq!(state(&job), St::Running);
    assert_eq!(job.lease_owner, "idle");
    assert_eq!(job.idempotency_key, "taken");
    server.stop().await;
}

/// A parked `Lease` that a submit reserved waits for that submit only a
/// little past its own wait: the submit here stalls on an idempotency key
/// another open transaction holds, and the call (2 s wait) answers empty
/// instead of waiting for that transaction. The job the submit stores
/// leased to the call once it goes on is given back to the queue.
/// (PostgreSQL: SQLite's writer lock would hold every write.)
async fn a_lease_reserved_by_a_stalled_submit_ends_near_its_wait() {
    use sqlx::Connection;
    let server = server(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let other = submit(&mut jobs, "elsewhere", "k", json!({})).await;
    let url = server.settings.database_url.clone();
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("connect");
    let waiter = wait_for_jobs(&server, "idle", "stalled", &[], Duration::from_secs(2));
    parked(&server, 1).await;

    take_key(&mut holder, &other.id).await;
    let submitter = tokio::spawn(async move {
        let mut job = submit_req("stalled", "k", json!({ "i": 1 }));
        job.idempotency_key = "taken".into();
        jobs.submit(job).await
    });
    waits_on_a_lock(&mut watcher, "the submit waits for the key").await;
    // Its 2 s wait and the 1 s grace, not the other transaction's length.
    let leased = within(
        Duration::from_secs(8),
        "the reserved Lease's answer",
        waiter,
    )
    .await
    .expect("waiter task");
    assert!(leased.is_empty(), "nothing was handed over: {leased:?}");

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("ROLLBACK");
    let stored = submitter
        .await
        .expect("submit task")
        .expect("the submit goes on")
        .into_inner()
        .job
        .expect("the job");
    let mut jobs = server.jobs_client("t");
    within(
        Duration::from_secs(10),
        "the job back in the queue",
        async {
            loop {
                let job = get(&mut jobs, &stored.id).await;
                if state(&job) == St::Queued {
                    assert_eq!(job.attempt, 0, "the attempt given back");
                    assert!(job.started_at.is_none(), "nobody started it");
                    assert!(job.lease_owner.is_empty());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    server.stop().await;
}
