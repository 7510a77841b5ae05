//! Spend-bounded retries, queue pause/resume, the queue bound and retention,
//! on both backends through real gRPC.

mod common;

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
    retention_deletes_old_finished_jobs,
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
    for _ in 0..3 {
        submit(&mut jobs, "small", "k", json!({})).await;
    }
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
            ],
        })
        .await
        .expect("SubmitBatch")
        .into_inner();
    match &batch.results[0].result {
        Some(pb::submit_batch_result::Result::Error(e)) => {
            assert_eq!(e.code, Code::ResourceExhausted as i32)
        }
        other => panic!("the full queue's item must fail: {other:?}"),
    }
    assert!(matches!(
        batch.results[1].result,
        Some(pb::submit_batch_result::Result::Ok(_))
    ));
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
    server.stop().await;
}

/// Rows of `job_events` for one job, read directly from the database.
async fn event_rows(server: &TestServer, id: &str) -> i64 {
    let sql = "SELECT count(*) FROM job_events WHERE CAST(job_id AS TEXT) = $1";
    db_integers(server.backend, &server.settings.database_url, sql, &[id]).await[0]
}
