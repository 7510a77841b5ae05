//! Spend-bounded retries, queue pause/resume, the queue bound, retention and
//! the job counts behind them, on both backends through real gRPC.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use intray::pb::{self, JobState as St};
use serde_json::json;
use tonic::Code;
use tonic_types::StatusExt;

common::backend_tests!(
    budget_exhausted_stops_retries,
    paused_queue_accepts_but_leases_nothing,
    resume_wakes_a_waiting_worker,
    queue_bound_refuses_with_retry_info,
    a_batch_repeating_a_key_takes_one_slot,
    a_submit_that_stores_nothing_gives_its_slot_back,
    retention_deletes_old_finished_jobs,
    retention_forgets_workers_unseen_and_idle,
    counts_follow_concurrent_transitions,
);

fn with_cost(mut r: pb::CompleteRequest, cents: i64) -> pb::CompleteRequest {
    r.cost_cents = cents;
    r
}

/// Costs add up over attempts; the failure that finds the budget spent is
/// final with class `budget_exhausted`, although attempts were left.
async fn budget_exhausted_stops_retries(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let mut r = submit_req("paid", "llm", json!({}));
    r.max_attempts = Some(10);
    r.max_cost_cents = Some(10);
    let job = submit_with(&mut jobs, r).await;
    assert_eq!(job.max_cost_cents, 10);

    let first = lease_one(&mut workers, "w", "paid").await;
    let req = failure_req(&first, "rate_limited", Some(true), Some(Duration::ZERO));
    let after_first = workers
        .complete(with_cost(req, 6))
        .await
        .expect("Complete")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&after_first), St::Queued, "6 of 10 cents: retried");

    let second = lease_one(&mut workers, "w", "paid").await;
    let req = failure_req(&second, "rate_limited", Some(true), Some(Duration::ZERO));
    let after_second = workers
        .complete(with_cost(req, 5))
        .await
        .expect("Complete")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&after_second), St::Failed, "11 of 10 cents: final");
    assert_eq!(after_second.cost_cents, 11);
    assert_eq!(after_second.attempt, 2);
    let error = after_second.error.expect("error");
    assert_eq!(error.class, "budget_exhausted");

    expect_invalid(
        jobs.submit({
            let mut r = submit_req("paid", "llm", json!({}));
            r.max_cost_cents = Some(0);
            r
        })
        .await,
        &["max_cost_cents"],
        "zero budget",
    );
    server.stop().await;
}

async fn paused_queue_accepts_but_leases_nothing(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    jobs.pause_queue(pb::PauseQueueRequest { queue: "p".into() })
        .await
        .expect("PauseQueue");
    let job = submit(&mut jobs, "p", "k", json!({})).await;
    assert_eq!(state(&job), St::Queued, "a paused queue still accepts jobs");
    assert!(lease_now(&mut workers, "w", "p").await.is_empty());

    let stats = jobs
        .stats(pb::StatsRequest { queue: "p".into() })
        .await
        .expect("Stats")
        .into_inner();
    assert!(
        stats.queues.iter().any(|q| q.queue == "p" && q.paused),
        "{stats:?}"
    );

    // Another tenant's queue of the same name is not paused.
    let mut other_jobs = server.jobs_client("u");
    let mut other_workers = server.workers_client("u");
    submit(&mut other_jobs, "p", "k", json!({})).await;
    assert_eq!(lease_now(&mut other_workers, "w", "p").await.len(), 1);

    jobs.resume_queue(pb::ResumeQueueRequest { queue: "p".into() })
        .await
        .expect("ResumeQueue");
    let leased = lease_now(&mut workers, "w", "p").await;
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, job.id);
    server.stop().await;
}

/// A worker long-polling a paused queue gets its job soon after the resume,
/// through the notifier (the fallback poll is set far beyond the test).
async fn resume_wakes_a_waiting_worker(backend: Backend) {
    let server =
        TestServer::start_with(backend, |s| s.fallback_poll = Duration::from_secs(60)).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    jobs.pause_queue(pb::PauseQueueRequest { queue: "p".into() })
        .await
        .expect("PauseQueue");
    submit(&mut jobs, "p", "k", json!({})).await;
    let waiter = tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let got = workers
            .lease(lease_req("w", "p", 1, Duration::from_secs(20)))
            .await
            .expect("Lease")
            .into_inner()
            .jobs;
        (got, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    jobs.resume_queue(pb::ResumeQueueRequest { queue: "p".into() })
        .await
        .expect("ResumeQueue");
    let (got, waited) = within(Duration::from_secs(25), "waiter", waiter)
        .await
        .expect("task");
    assert_eq!(got.len(), 1, "the resumed queue's job is leased");
    assert!(
        waited < Duration::from_secs(5),
        "woken by the resume, not a timer: {waited:?}"
    );
    server.stop().await;
}

async fn queue_bound_refuses_with_retry_info(backend: Backend) {
    let server = TestServer::start_with(backend, |s| s.queue_bound = 3).await;
    let mut jobs = server.jobs_client("t");
    let mut keyed = submit_req("small", "k", json!({"n": 0}));
    keyed.idempotency_key = "first".into();
    let original = submit_with(&mut jobs, keyed.clone()).await;
    for _ in 0..2 {
        submit(&mut jobs, "small", "k", json!({})).await;
    }
    // A repeat of an accepted submit gets its job, full queue or not.
    let repeat = jobs
        .submit(keyed.clone())
        .await
        .expect("a repeat of an accepted submit")
        .into_inner();
    assert!(!repeat.created);
    assert_eq!(repeat.job.map(|j| j.id), Some(original.id.clone()));
    let mut other_input = keyed.clone();
    other_input.payload = Some(json_to_value(json!({"n": 1})));
    expect_code(
        jobs.submit(other_input).await,
        Code::AlreadyExists,
        "the key with other input",
    );
    let status = expect_code(
        jobs.submit(submit_req("small", "k", json!({}))).await,
        Code::ResourceExhausted,
        "fourth job",
    );
    let retry = status.get_error_details().retry_info().cloned();
    assert!(
        retry.and_then(|r| r.retry_delay).is_some(),
        "RetryInfo with a delay: {status:?}"
    );
    // A batch: every item into the full queue fails alone; another queue is fine.
    let batch = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![
                submit_req("small", "k", json!({})),
                submit_req("other", "k", json!({})),
                keyed,
            ],
        })
        .await
        .expect("SubmitBatch")
        .into_inner();
    match &batch.results[0].result {
        Some(pb::submit_batch_result::Result::Error(e)) => {
            assert_eq!(e.code, Code::ResourceExhausted as i32);
            assert!(e.retry_delay.is_some(), "the item's retry delay: {e:?}");
        }
        other => panic!("the full queue's item must fail: {other:?}"),
    }
    assert!(matches!(
        batch.results[1].result,
        Some(pb::submit_batch_result::Result::Ok(_))
    ));
    match &batch.results[2].result {
        Some(pb::submit_batch_result::Result::Ok(repeat)) => {
            assert!(!repeat.created);
            assert_eq!(repeat.job.as_ref().map(|j| &j.id), Some(&original.id));
        }
        other => panic!("the repeat gets its job: {other:?}"),
    }
    let stored = list_all(
        &mut jobs,
        pb::ListJobsRequest {
            queue: "small".into(),
            ..list_req()
        },
    )
    .await;
    assert_eq!(stored.len(), 3, "nothing was written beyond the bound");
    server.stop().await;
}

/// Items of one batch with the same key behave as `Submit`s one after the
/// other: the first takes the queue's last slot, the repeat gets its job,
/// the key with other input is a conflict; none is told the queue is full.
async fn a_batch_repeating_a_key_takes_one_slot(backend: Backend) {
    use pb::submit_batch_result::Result as R;
    let server = TestServer::start_with(backend, |s| s.queue_bound = 1).await;
    let mut jobs = server.jobs_client("t");
    let mut keyed = submit_req("single", "k", json!({"n": 0}));
    keyed.idempotency_key = "twice".into();
    let mut other_input = keyed.clone();
    other_input.payload = Some(json_to_value(json!({"n": 1})));
    let results = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![keyed.clone(), keyed, other_input],
        })
        .await
        .expect("SubmitBatch")
        .into_inner()
        .results;
    let answer = |i: usize| match &results[i].result {
        Some(R::Ok(ok)) => (ok.created, ok.job.as_ref().map(|j| j.id.clone())),
        other => panic!("item {i} must get a job: {other:?}"),
    };
    let (created, id) = answer(0);
    assert!(created, "the first item is stored");
    assert_eq!(
        answer(1),
        (false, id),
        "the repeat gets the first item's job"
    );
    match &results[2].result {
        Some(R::Error(e)) => assert_eq!(e.code, Code::AlreadyExists as i32, "{e:?}"),
        other => panic!("the key with other input is a conflict: {other:?}"),
    }
    let stored = list_all(
        &mut jobs,
        pb::ListJobsRequest {
            queue: "single".into(),
            ..list_req()
        },
    )
    .await;
    assert_eq!(stored.len(), 1, "one job for the key");
    server.stop().await;
}

/// A submit the store answers without storing a job (a repeat of an
/// accepted one, its key with other input), alone or in a batch, leaves the
/// queue's room as it was: counted as a job until the next count (up to
/// ten seconds), such answers refused new jobs near the bound. The six
/// such answers here keep the figure under half the bound, where a count
/// is trusted for ten seconds, so no recount can hide them.
async fn a_submit_that_stores_nothing_gives_its_slot_back(backend: Backend) {
    use pb::submit_batch_result::Result as R;
    const BOUND: u64 = 20;
    let server = TestServer::start_with(backend, |s| s.queue_bound = BOUND).await;
    let mut jobs = server.jobs_client("t");
    let mut keyed = submit_req("room", "k", json!({"n": 0}));
    keyed.idempotency_key = "once".into();
    let mut other_input = keyed.clone();
    other_input.payload = Some(json_to_value(json!({"n": 1})));
    assert!(submit_with_answer(&mut jobs, keyed.clone()).await.created);
    for _ in 0..2 {
        assert!(!submit_with_answer(&mut jobs, keyed.clone()).await.created);
        expect_code(
            jobs.submit(other_input.clone()).await,
            Code::AlreadyExists,
            "the key with other input",
        );
    }
    let results = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![keyed.clone(), other_input],
        })
        .await
        .expect("SubmitBatch")
        .into_inner()
        .results;
    assert!(matches!(&results[0].result, Some(R::Ok(ok)) if !ok.created));
    assert!(
        matches!(&results[1].result, Some(R::Error(e)) if e.code == Code::AlreadyExists as i32)
    );
    for n in 1..BOUND {
        let room = jobs
            .submit(submit_req("room", "k", json!({"new": n})))
            .await;
        assert!(
            room.is_ok(),
            "job {n} of the {BOUND} the bound holds: {room:?}"
        );
    }
    expect_code(
        jobs.submit(submit_req("room", "k", json!({}))).await,
        Code::ResourceExhausted,
        "the bound still holds",
    );
    server.stop().await;
}

async fn submit_with_answer(jobs: &mut JobsClient, r: pb::SubmitRequest) -> pb::SubmitResponse {
    jobs.submit(r).await.expect("Submit").into_inner()
}

/// Finished jobs older than the retention window are deleted with their
/// events; queued and recent ones stay.
async fn retention_deletes_old_finished_jobs(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.retention = Duration::from_millis(500);
        s.reaper_interval = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let done = submit(&mut jobs, "r", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "r").await;
    complete_ok(&mut workers, &leased).await;
    let waiting = submit(&mut jobs, "r2", "k", json!({})).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match jobs
            .get(pb::GetJobRequest {
                id: done.id.clone(),
            })
            .await
        {
            Err(status) if status.code() == Code::NotFound => break,
            Ok(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("the finished job should be deleted: {other:?}"),
        }
    }
    let events = jobs
        .watch_job(pb::WatchJobRequest {
            id: done.id.clone(),
            after_sequence: 0,
        })
        .await;
    expect_code(events, Code::NotFound, "events go with the job");
    assert_eq!(
        event_rows(&server, &done.id).await,
        0,
        "the job's events are deleted from the table, not only hidden"
    );
    assert_eq!(
        state(&get(&mut jobs, &waiting.id).await),
        St::Queued,
        "queued jobs stay"
    );
    let counted = stats_counts(&mut jobs).await;
    assert_eq!(
        counted.get(&("r".to_owned(), St::Succeeded)),
        None,
        "a deleted job leaves the counts: {counted:?}"
    );
    assert_eq!(counted.get(&("r2".to_owned(), St::Queued)), Some(&1));
    server.stop().await;
}

/// Workers unseen for the retention window and holding no job are
/// forgotten (each process adds one, so the table would only grow); one
/// that holds a job stays however long ago it leased.
async fn retention_forgets_workers_unseen_and_idle(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.retention = Duration::from_millis(500);
        s.reaper_interval = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "held", "k", json!({})).await;
    let mut r = lease_req("holder", "held", 1, Duration::ZERO);
    r.lease_duration = Some(secs(60));
    let held = workers.lease(r).await.expect("Lease").into_inner().jobs;
    assert_eq!(held.len(), 1);
    for idle in ["idle-1", "idle-2"] {
        lease_now(&mut workers, idle, "empty").await;
    }
    let names = || async {
        db_integers(
            server.backend,
            &server.settings.database_url,
            "SELECT count(*) FROM workers WHERE worker_id LIKE 'idle-%'",
            &[],
        )
        .await
    };
    assert_eq!(names().await, vec![2]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while names().await != vec![0] {
        assert!(tokio::time::Instant::now() < deadline, "idle workers kept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let holders = db_integers(
        server.backend,
        &server.settings.database_url,
        "SELECT count(*) FROM workers WHERE worker_id = 'holder'",
        &[],
    )
    .await;
    assert_eq!(holders, vec![1], "a worker holding a job stays");
    server.stop().await;
}

/// Stats counts by (queue, state), zero counts left out.
async fn stats_counts(jobs: &mut JobsClient) -> BTreeMap<(String, St), u64> {
    let stats = jobs
        .stats(pb::StatsRequest::default())
        .await
        .expect("Stats")
        .into_inner();
    let mut counted = BTreeMap::new();
    for queue in stats.queues {
        for c in queue.counts.iter().filter(|c| c.count > 0) {
            let state = St::try_from(c.state).expect("a known state");
            counted.insert((queue.queue.clone(), state), c.count);
        }
    }
    counted
}

/// The counts that Stats, the gauges and the queue bound read are kept
/// apart from the jobs (PostgreSQL folds per-statement deltas): after
/// concurrent submits, claims, successes, retries, final failures, expired
/// leases and cancels through two replicas, they equal a direct count of
/// the table.
async fn counts_follow_concurrent_transitions(backend: Backend) {
    const PRODUCERS: usize = 4;
    const PER_PRODUCER: usize = 40;
    const WORKERS: usize = 6;
    let server = TestServer::start_reaping_fast(backend).await;
    let replica = match backend {
        Backend::Postgres => Some(server.start_replica().await),
        Backend::Sqlite => None,
    };
    let target = |i: usize| match (&replica, i % 2) {
        (Some(rep), 1) => rep,
        _ => &server,
    };
    let queues = ["c1", "c2"];

    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let mut jobs = target(p).jobs_client("t");
        tasks.push(tokio::spawn(async move {
            for i in 0..PER_PRODUCER {
                let mut r = submit_req(queues[i % 2], "k", json!({"n": i}));
                r.max_attempts = Some(2);
                r.backoff = Some(pb::Backoff {
                    initial: Some(ms(10)),
                    max: Some(ms(10)),
                });
                let job = submit_with(&mut jobs, r).await;
                // Every fifth job is cancelled: queued, running, or too
                // late (already finished) when a worker was quicker.
                if i % 5 == 4 {
                    let cancelled = jobs
                        .cancel(pb::CancelJobRequest {
                            id: job.id,
                            reason: String::new(),
                        })
                        .await;
                    if let Err(status) = cancelled {
                        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
                    }
                }
            }
        }));
    }
    for w in 0..WORKERS {
        let mut workers = target(w).workers_client_own_conn("t").await;
        tasks.push(tokio::spawn(async move {
            let mut idle = 0;
            while idle < 10 {
                let mut req = short_lease_req(
                    &format!("w{w}"),
                    queues[w % 2],
                    3,
                    Duration::from_millis(200),
                );
                req.queues = queues.iter().map(|q| q.to_string()).collect();
                let leased = workers.lease(req).await.expect("Lease").into_inner().jobs;
                idle = if leased.is_empty() { idle + 1 } else { 0 };
                for (k, job) in leased.iter().enumerate() {
                    let outcome = match (w + k) % 4 {
                        0 => success_req(job, json!({})),
                        1 => failure_req(job, "fatal", Some(false), None),
                        2 => failure_req(job, "flaky", Some(true), Some(Duration::from_millis(10))),
                        // Abandoned: the reaper takes the lease back.
                        _ => continue,
                    };
                    // A cancelled or expired lease refuses the outcome; the
                    // counts must follow whatever the store decided.
                    let _ = workers.complete(outcome).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }

    let mut jobs = server.jobs_client("t");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let counted = loop {
        let counted = stats_counts(&mut jobs).await;
        let settled = !counted.keys().any(|(_, s)| *s == St::Running);
        if settled || tokio::time::Instant::now() > deadline {
            break counted;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let url = &server.settings.database_url;
    let mut direct = BTreeMap::new();
    for queue in queues {
        for (state, name) in [
            (St::Queued, "queued"),
            (St::Running, "running"),
            (St::Succeeded, "succeeded"),
            (St::Failed, "failed"),
            (St::Cancelled, "cancelled"),
            (St::Expired, "expired"),
        ] {
            let sql = "SELECT count(*) FROM jobs WHERE tenant = 't' AND queue = $1 AND state = $2";
            let n = db_integers(backend, url, sql, &[queue, name]).await[0];
            if n > 0 {
                direct.insert((queue.to_owned(), state), n as u64);
            }
        }
    }
    let total: u64 = direct.values().sum();
    assert_eq!(total, (PRODUCERS * PER_PRODUCER) as u64, "every job stored");
    for state in [St::Succeeded, St::Failed, St::Cancelled] {
        assert!(
            direct.keys().any(|(_, s)| *s == state),
            "the run reached {state:?}: {direct:?}"
        );
    }
    assert_eq!(counted, direct, "Stats counts against the table");
    if let Some(replica) = replica {
        replica.stop().await;
    }
    server.stop().await;
}

/// Rows of `job_events` for one job, read directly from the database.
async fn event_rows(server: &TestServer, id: &str) -> i64 {
    let sql = "SELECT count(*) FROM job_events WHERE CAST(job_id AS TEXT) = $1";
    db_integers(server.backend, &server.settings.database_url, sql, &[id]).await[0]
}
