//! `CompleteAndLease`: a worker reports its outcomes and gets its next jobs
//! in one call (one shared transaction). Each item fails alone, the claim
//! holds whatever became of the items, a bad claim writes nothing, and the
//! claim long-polls like `Lease`. On both backends through real gRPC.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use intray::pb::{self, JobEventType as Ev, JobState as St};
use serde_json::json;
use tonic::Code;

use pb::complete_batch_result::Result as Item;

common::backend_tests!(
    a_worker_chains_through_its_queue,
    a_bad_item_fails_alone_and_the_claim_holds,
    a_big_call_ends_its_batch_and_claims_the_next,
    a_bad_request_writes_nothing,
    the_claim_long_polls_like_lease,
    chaining_workers_run_each_job_once,
);

const LONG: Duration = Duration::from_secs(10);

fn chain_req(
    items: Vec<pb::CompleteRequest>,
    worker: &str,
    queue: &str,
    max_jobs: u32,
    wait: Duration,
) -> pb::CompleteAndLeaseRequest {
    pb::CompleteAndLeaseRequest {
        items,
        lease: Some(lease_req(worker, queue, max_jobs, wait)),
    }
}

async fn chain(
    workers: &mut WorkersClient,
    request: pb::CompleteAndLeaseRequest,
) -> pb::CompleteAndLeaseResponse {
    workers
        .complete_and_lease(request)
        .await
        .unwrap_or_else(|s| panic!("CompleteAndLease: {s:?}"))
        .into_inner()
}

fn ended(result: &pb::CompleteBatchResult) -> &pb::Job {
    match &result.result {
        Some(Item::Job(job)) => job,
        other => panic!("expected the ended job, got {other:?}"),
    }
}

fn refused(result: &pb::CompleteBatchResult) -> &pb::ItemError {
    match &result.result {
        Some(Item::Error(e)) => e,
        other => panic!("expected an item error, got {other:?}"),
    }
}

/// Each call ends the job the worker holds and hands it the next one, in
/// priority order, leased to that worker with its own LEASED event; the
/// last call of an empty queue answers no job.
async fn a_worker_chains_through_its_queue(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let low = submit(&mut jobs, "chain", "k", json!({"n": "low"})).await;
    let high = submit_with(
        &mut jobs,
        pb::SubmitRequest {
            priority: 5,
            ..submit_req("chain", "k", json!({"n": "high"}))
        },
    )
    .await;
    let first = lease_one(&mut workers, "w1", "chain").await;
    assert_eq!(first.job_id, high.id, "priority first");

    let answer = chain(
        &mut workers,
        chain_req(
            vec![success_req(&first, json!(1))],
            "w1",
            "chain",
            1,
            Duration::ZERO,
        ),
    )
    .await;
    assert_eq!(answer.results.len(), 1);
    let done = ended(&answer.results[0]);
    assert_eq!(
        (done.id.as_str(), state(done)),
        (high.id.as_str(), St::Succeeded)
    );
    assert_eq!(answer.jobs.len(), 1, "the next job comes with the answer");
    let next = &answer.jobs[0];
    assert_eq!(next.job_id, low.id);
    assert_eq!(next.attempt, 1);
    let running = get(&mut jobs, &low.id).await;
    assert_eq!(state(&running), St::Running);
    assert_eq!(running.lease_owner, "w1");

    let answer = chain(
        &mut workers,
        chain_req(
            vec![success_req(next, json!(2))],
            "w1",
            "chain",
            1,
            Duration::ZERO,
        ),
    )
    .await;
    assert_eq!(state(ended(&answer.results[0])), St::Succeeded);
    assert!(answer.jobs.is_empty(), "nothing left: {:?}", answer.jobs);

    let events = watch_all(&mut jobs, &low.id, 0, LONG).await;
    assert_eq!(
        event_types(&events),
        [Ev::Submitted, Ev::Leased, Ev::Succeeded]
    );
    assert_eq!(events[1].worker_id, "w1");
    server.stop().await;
}

/// A stale token and an invalid item are refused on their own; the good
/// item ends its job, and the claim hands out the queued job all the same.
async fn a_bad_item_fails_alone_and_the_claim_holds(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "mixed", "k", json!({"n": 1})).await;
    submit(&mut jobs, "mixed", "k", json!({"n": 2})).await;
    let leased = workers
        .lease(lease_req("w", "mixed", 2, LONG))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 2);
    let queued = submit(&mut jobs, "mixed", "k", json!({"n": 3})).await;
    let (good, other) = (&leased[0], &leased[1]);
    let mut forged = other.clone();
    forged.lease_token = uuid::Uuid::new_v4().to_string();
    let mut no_outcome = success_req(other, json!(null));
    no_outcome.outcome = None;

    let answer = chain(
        &mut workers,
        chain_req(
            vec![
                success_req(good, json!("good")),
                success_req(&forged, json!("stale")),
                no_outcome,
            ],
            "w",
            "mixed",
            5,
            Duration::ZERO,
        ),
    )
    .await;
    assert_eq!(answer.results.len(), 3);
    assert_eq!(state(ended(&answer.results[0])), St::Succeeded);
    let stale = refused(&answer.results[1]);
    assert_eq!(stale.code, Code::Aborted as i32, "{stale:?}");
    let invalid = refused(&answer.results[2]);
    assert_eq!(invalid.code, Code::InvalidArgument as i32, "{invalid:?}");
    assert_eq!(invalid.field, "items[2].outcome");
    let claimed: Vec<&str> = answer.jobs.iter().map(|j| j.job_id.as_str()).collect();
    assert_eq!(claimed, [queued.id.as_str()], "only the queued job");

    let untouched = get(&mut jobs, &other.job_id).await;
    assert_eq!(
        state(&untouched),
        St::Running,
        "refused items write nothing"
    );
    assert!(untouched.result.is_none());
    server.stop().await;
}

/// A call of many outcomes and a big claim (which runs as `CompleteBatch`
/// then `Lease` inside the server) ends its batch, refuses its stale item
/// alone, and claims the next batch.
async fn a_big_call_ends_its_batch_and_claims_the_next(backend: Backend) {
    const BATCH: usize = 40;
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let items = (0..2 * BATCH)
        .map(|n| submit_req("big", "k", json!({ "n": n })))
        .collect();
    jobs.submit_batch(pb::SubmitBatchRequest { jobs: items })
        .await
        .expect("SubmitBatch");
    let first = workers
        .lease(lease_req("w", "big", BATCH as u32, LONG))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(first.len(), BATCH);
    let mut outcomes: Vec<pb::CompleteRequest> =
        first.iter().map(|j| success_req(j, json!(null))).collect();
    outcomes[7].lease_token = uuid::Uuid::new_v4().to_string();

    let answer = chain(
        &mut workers,
        chain_req(outcomes, "w", "big", BATCH as u32, Duration::ZERO),
    )
    .await;
    assert_eq!(answer.results.len(), BATCH);
    for (i, result) in answer.results.iter().enumerate() {
        if i == 7 {
            assert_eq!(refused(result).code, Code::Aborted as i32);
        } else {
            assert_eq!(ended(result).id, first[i].job_id);
            assert_eq!(state(ended(result)), St::Succeeded);
        }
    }
    let before: HashSet<&str> = first.iter().map(|j| j.job_id.as_str()).collect();
    assert_eq!(answer.jobs.len(), BATCH, "the next batch");
    assert!(
        answer
            .jobs
            .iter()
            .all(|j| !before.contains(j.job_id.as_str()))
    );
    let stale = get(&mut jobs, &first[7].job_id).await;
    assert_eq!(state(&stale), St::Running, "the stale item wrote nothing");
    server.stop().await;
}

/// A missing or invalid claim, or no items, refuses the whole call with
/// INVALID_ARGUMENT naming the field, before anything is written: the job
/// stays leased and nothing is claimed.
async fn a_bad_request_writes_nothing(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "bad", "k", json!({"n": 1})).await;
    let queued = submit(&mut jobs, "bad", "k", json!({"n": 2})).await;
    let held = lease_one(&mut workers, "w", "bad").await;
    let item = || vec![success_req(&held, json!("x"))];

    let mut cases = vec![
        (
            pb::CompleteAndLeaseRequest {
                items: item(),
                lease: None,
            },
            "lease",
        ),
        (
            chain_req(item(), "w", "bad", 0, Duration::ZERO),
            "lease.max_jobs",
        ),
        (
            chain_req(item(), "", "bad", 1, Duration::ZERO),
            "lease.worker_id",
        ),
        (
            chain_req(Vec::new(), "w", "bad", 1, Duration::ZERO),
            "items",
        ),
        (
            chain_req(
                vec![success_req(&held, json!(1)); 1001],
                "w",
                "bad",
                1,
                Duration::ZERO,
            ),
            "items",
        ),
    ];
    let mut long_wait = chain_req(item(), "w", "bad", 1, Duration::ZERO);
    if let Some(lease) = long_wait.lease.as_mut() {
        lease.wait = Some(secs(61));
    }
    cases.push((long_wait, "lease.wait"));
    for (request, field) in cases {
        let status = expect_code(
            workers.complete_and_lease(request).await,
            Code::InvalidArgument,
            field,
        );
        assert_eq!(bad_request_fields(&status), [field], "{status:?}");
    }
    let still = get(&mut jobs, &held.job_id).await;
    assert_eq!(state(&still), St::Running, "no outcome was written");
    let waiting = get(&mut jobs, &queued.id).await;
    assert_eq!(state(&waiting), St::Queued, "nothing was claimed");
    server.stop().await;
}

/// With nothing runnable the claim waits up to `wait`: a job submitted
/// meanwhile comes back with the results; with none, the call answers its
/// results and no job once the wait is over.
async fn the_claim_long_polls_like_lease(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "poll", "k", json!({"n": 1})).await;
    let held = lease_one(&mut workers, "w", "poll").await;

    let mut waiting = server.workers_client("t");
    let request = chain_req(vec![success_req(&held, json!(1))], "w", "poll", 1, LONG);
    let call = tokio::spawn(async move { chain(&mut waiting, request).await });
    wait_for_state(&mut jobs, &held.job_id, St::Succeeded, LONG).await;
    assert!(!call.is_finished(), "the call waits for a job");
    let later = submit(&mut jobs, "poll", "k", json!({"n": 2})).await;
    let answer = tokio::time::timeout(LONG, call)
        .await
        .expect("the submit wakes the call")
        .expect("joined");
    assert_eq!(state(ended(&answer.results[0])), St::Succeeded);
    let claimed: Vec<&str> = answer.jobs.iter().map(|j| j.job_id.as_str()).collect();
    assert_eq!(claimed, [later.id.as_str()]);

    let answer = chain(
        &mut workers,
        chain_req(
            vec![success_req(&answer.jobs[0], json!(2))],
            "w",
            "poll",
            1,
            Duration::from_millis(300),
        ),
    )
    .await;
    assert_eq!(state(ended(&answer.results[0])), St::Succeeded);
    assert!(answer.jobs.is_empty());
    server.stop().await;
}

/// Workers that only ever call `CompleteAndLease` after their first
/// `Lease`, spread over two replicas on PostgreSQL, run every job exactly
/// once: one LEASED and one SUCCEEDED event each.
async fn chaining_workers_run_each_job_once(backend: Backend) {
    const TOTAL: usize = 400;
    const WORKERS: usize = 12;
    let server = TestServer::start(backend).await;
    let replica = match backend {
        Backend::Postgres => Some(server.start_replica().await),
        Backend::Sqlite => None,
    };
    let mut jobs = server.jobs_client("t");
    let items = (0..TOTAL)
        .map(|n| submit_req("many", "k", json!({ "n": n })))
        .collect();
    let submitted: HashSet<String> = jobs
        .submit_batch(pb::SubmitBatchRequest { jobs: items })
        .await
        .expect("SubmitBatch")
        .into_inner()
        .results
        .into_iter()
        .map(|r| match r.result {
            Some(pb::submit_batch_result::Result::Ok(ok)) => ok.job.expect("job").id,
            other => panic!("submit failed: {other:?}"),
        })
        .collect();

    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..WORKERS {
        let mut workers = match (&replica, n % 2) {
            (Some(replica), 1) => replica.workers_client_own_conn("t").await,
            _ => server.workers_client_own_conn("t").await,
        };
        tasks.spawn(async move {
            let worker = format!("w{n}");
            let mut done = Vec::new();
            let mut held = workers
                .lease(lease_req(&worker, "many", 1, Duration::from_millis(200)))
                .await
                .expect("Lease")
                .into_inner()
                .jobs;
            while !held.is_empty() {
                let items = held.iter().map(|j| success_req(j, json!(null))).collect();
                let answer = chain(
                    &mut workers,
                    chain_req(items, &worker, "many", 1, Duration::from_millis(200)),
                )
                .await;
                for result in &answer.results {
                    done.push(ended(result).id.clone());
                }
                held = answer.jobs;
            }
            done
        });
    }
    let mut times: HashMap<String, usize> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        for id in done.expect("worker task") {
            *times.entry(id).or_default() += 1;
        }
    }
    let ran: HashSet<String> = times.keys().cloned().collect();
    assert_eq!(ran, submitted, "every job ran");
    assert!(times.values().all(|&n| n == 1), "no job ran twice");
    for id in submitted.iter().take(20) {
        let events = watch_all(&mut jobs, id, 0, LONG).await;
        assert_eq!(
            event_types(&events),
            [Ev::Submitted, Ev::Leased, Ev::Succeeded],
            "job {id}"
        );
    }
    if let Some(replica) = replica {
        replica.stop().await;
    }
    server.stop().await;
}
