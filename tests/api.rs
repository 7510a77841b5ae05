//! Behavioural suite of the gRPC API (SPEC sections 2-4), run against the real
//! server on both SQLite and PostgreSQL, each test on its own fresh database.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use common::*;
use futures::StreamExt;
use intray::pb::{self, JobEventType as Ev, JobState as St};
use serde_json::json;
use tokio::sync::Mutex;
use tonic::Code;

common::backend_tests!(
    lifecycle,
    a_watch_resumed_past_the_last_event_ends_with_the_job,
    retry_after_backoff,
    a_retry_answers_the_run_at_it_stored,
    backoff_full_jitter,
    retries_exhausted_then_replay,
    bulk_retry_by_filter,
    idempotency,
    a_submit_sent_again_after_its_deadline_gets_the_original,
    cancel_queued_and_running,
    cancel_grace_revokes_lease,
    heartbeat_renews_by_the_leased_length,
    a_renewal_never_runs_past_the_longest_lease,
    watch_resume_from_sequence,
    watch_resumed_across_an_event_not_kept_in_memory,
    watch_live_push,
    concurrent_drain,
    long_poll_wake,
    validation,
    stale_lease_token,
    lease_expiry_reclaims,
    unreadable_rows_are_set_aside,
    an_unreadable_row_fails_only_its_own_batch_item,
    a_reaper_batch_of_unreadable_rows_does_not_stall_it,
    not_found_and_tenant_isolation,
    reflection_and_health,
    list_filters_and_pagination,
    stats_counts,
    submit_batch_partial,
    complete_batch_stale_item,
    deadline_expires_queued,
    deadline_before_run_at,
    deadline_between_attempts,
    retry_beyond_deadline_expires,
    lease_order_and_kind_filter,
    a_queue_named_twice_in_a_lease_counts_once,
    answers_read_as_the_job_is_stored,
    coalesced_neighbours_are_independent,
);

mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn complete_keeps_a_change_made_after_its_read() {
        super::complete_keeps_a_change_made_after_its_read().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn complete_where_leased_sees_another_replicas_changes() {
        super::complete_where_leased_sees_another_replicas_changes().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_write_whose_caller_left_mid_commit_still_wakes_its_watchers() {
        super::a_write_whose_caller_left_mid_commit_still_wakes_its_watchers().await
    }
}

const LONG: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// 1. lifecycle
// ---------------------------------------------------------------------------

async fn lifecycle(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("acme");
    let mut workers = server.workers_client("acme");

    let payload = json!({"prompt": "hello", "n": 3, "nested": {"list": [1, "two", null, true]}});
    let mut r = submit_req("emails", "llm/summarize", payload.clone());
    r.priority = 5;
    r.labels.insert("team".into(), "core".into());
    let resp = jobs.submit(r).await.expect("Submit").into_inner();
    assert!(resp.created, "a new job is created");
    let job = resp.job.expect("job");
    assert_eq!(state(&job), St::Queued);
    assert_eq!(job.attempt, 0, "no attempt before the first lease");
    assert_eq!(job.max_attempts, 3, "default max_attempts");
    assert_eq!(job.tenant, "acme");
    assert_eq!(job.queue, "emails");
    assert_eq!(job.kind, "llm/summarize");
    assert_eq!(job.priority, 5);
    assert_eq!(job.labels.get("team").map(String::as_str), Some("core"));
    assert_eq!(
        job.payload,
        Some(json_to_value(payload.clone())),
        "payload round-trips"
    );
    let uuid = uuid::Uuid::parse_str(&job.id).expect("job id is a UUID");
    assert_eq!(uuid.get_version_num(), 7, "job id is a UUIDv7");

    // A job without a payload answers with a null one, not an empty
    // `Value` (which grpcurl, like other runtimes, would not print).
    let mut bare = submit_req("bare", "k", json!(null));
    bare.payload = None;
    let bare = jobs.submit(bare).await.expect("Submit").into_inner().job;
    assert_eq!(
        bare.and_then(|j| j.payload).and_then(|p| p.kind),
        Some(pbjson_types::value::Kind::NullValue(0)),
        "a payload left out is null"
    );
    assert!(job.created_at.is_some() && job.run_at.is_some());

    let before_lease = Utc::now();
    let leased = workers
        .lease(pb::LeaseRequest {
            worker_id: "w-1".into(),
            queues: vec!["emails".into()],
            max_jobs: Some(1),
            lease_duration: Some(secs(30)),
            wait: Some(secs(5)),
            ..Default::default()
        })
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 1, "the queued job is leased");
    let leased = &leased[0];
    assert_eq!(leased.job_id, job.id);
    assert_eq!(leased.attempt, 1);
    assert_eq!(leased.max_attempts, 3);
    assert!(!leased.lease_token.is_empty(), "lease token is set");
    assert_eq!(leased.queue, "emails");
    assert_eq!(leased.kind, "llm/summarize");
    assert_eq!(leased.payload, Some(json_to_value(payload)));
    let expires = time(&leased.lease_expires_at, "lease_expires_at");
    assert!(
        expires >= before_lease + chrono::Duration::seconds(25)
            && expires <= Utc::now() + chrono::Duration::seconds(35),
        "lease expires about 30 s from now, got {expires}"
    );

    let running = get(&mut jobs, &job.id).await;
    assert_eq!(state(&running), St::Running);
    assert_eq!(running.attempt, 1);
    assert_eq!(running.lease_owner, "w-1");
    assert!(
        running.started_at.is_some(),
        "started_at set at the first lease"
    );

    let hb = workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: Some(secs(120)),
            progress: Some(0.5),
            message: "halfway".into(),
        })
        .await
        .expect("Heartbeat")
        .into_inner();
    assert!(!hb.cancel_requested);
    let extended = time(&hb.lease_expires_at, "heartbeat lease_expires_at");
    assert!(
        extended > expires + chrono::Duration::seconds(60),
        "heartbeat extends the lease: {expires} -> {extended}"
    );

    let result = json!({"summary": "hi", "tokens": 42});
    let done = workers
        .complete(pb::CompleteRequest {
            cost_cents: 7,
            ..success_req(leased, result.clone())
        })
        .await
        .expect("Complete")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&done), St::Succeeded);

    let job = get(&mut jobs, &job.id).await;
    assert_eq!(state(&job), St::Succeeded);
    assert_eq!(job.result, Some(json_to_value(result)));
    assert!(
        (job.progress - 0.5).abs() < 1e-9,
        "progress kept: {}",
        job.progress
    );
    assert_eq!(job.cost_cents, 7);
    assert!(job.error.is_none(), "no error on success: {:?}", job.error);
    let finished = time(&job.finished_at, "finished_at");
    assert!(finished >= time(&job.started_at, "started_at"));

    let events = watch_all(&mut jobs, &job.id, 0, LONG).await;
    assert_eq!(
        event_types(&events),
        vec![Ev::Submitted, Ev::Leased, Ev::Progress, Ev::Succeeded]
    );
    assert_eq!(sequences(&events), vec![1, 2, 3, 4]);
    let states: Vec<St> = events
        .iter()
        .map(|e| St::try_from(e.state).unwrap_or(St::Unspecified))
        .collect();
    assert_eq!(
        states,
        vec![St::Queued, St::Running, St::Running, St::Succeeded]
    );
    assert!(events.iter().all(|e| e.job_id == job.id));
    assert_eq!(events[1].worker_id, "w-1");
    assert_eq!(events[1].attempt, 1);
    let ats: Vec<_> = events.iter().map(|e| time(&e.at, "event at")).collect();
    assert!(
        ats.windows(2).all(|w| w[0] <= w[1]),
        "event times grow: {ats:?}"
    );

    server.stop().await;
}

// ---------------------------------------------------------------------------
// 2. failure -> retry after backoff -> success
// ---------------------------------------------------------------------------

async fn retry_after_backoff(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("llm", "chat", json!({"q": 1}));
    r.max_attempts = Some(3);
    let job = submit_with(&mut jobs, r).await;
    let first = lease_one(&mut workers, "w", "llm").await;
    assert_eq!(first.attempt, 1);

    let t0 = Instant::now();
    let wall0 = Utc::now();
    let failed = workers
        .complete(pb::CompleteRequest {
            cost_cents: 3,
            ..failure_req(
                &first,
                "rate_limited",
                None,
                Some(Duration::from_millis(300)),
            )
        })
        .await
        .expect("Complete(failure)")
        .into_inner()
        .job
        .expect("job");
    let wall1 = Utc::now();
    assert_eq!(
        state(&failed),
        St::Queued,
        "retryable failure with attempts left requeues"
    );
    let err = failed.error.clone().expect("error is recorded");
    assert_eq!(err.class, "rate_limited");
    let run_at = time(&failed.run_at, "run_at");
    assert!(
        run_at >= wall0 + chrono::Duration::milliseconds(280)
            && run_at <= wall1 + chrono::Duration::milliseconds(350),
        "run_at = now + retry_after (300 ms): wall0 {wall0}, run_at {run_at}, wall1 {wall1}"
    );

    let now = lease_now(&mut workers, "w", "llm").await;
    assert!(now.is_empty(), "not leasable before run_at: {now:?}");

    let second = lease_one(&mut workers, "w", "llm").await;
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "leased again only after the retry delay, got it after {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(4),
        "leased soon after run_at: {waited:?}"
    );
    assert_eq!(second.job_id, job.id);
    assert_eq!(second.attempt, 2);
    assert_ne!(
        second.lease_token, first.lease_token,
        "fresh token per attempt"
    );

    let done = workers
        .complete(pb::CompleteRequest {
            cost_cents: 4,
            ..success_req(&second, json!("ok"))
        })
        .await
        .expect("Complete")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.attempt, 2);
    assert_eq!(done.cost_cents, 7, "cost_cents accumulates over attempts");

    let events = watch_all(&mut jobs, &job.id, 0, LONG).await;
    assert_eq!(
        event_types(&events),
        vec![
            Ev::Submitted,
            Ev::Leased,
            Ev::RetryScheduled,
            Ev::Leased,
            Ev::Succeeded
        ]
    );
    assert_eq!(sequences(&events), vec![1, 2, 3, 4, 5]);
    assert_eq!(
        events[2].state,
        St::Queued as i32,
        "RETRY_SCHEDULED leaves the job QUEUED"
    );
    server.stop().await;
}

async fn backoff_full_jitter(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("jit", "chat", json!({}));
    r.max_attempts = Some(3);
    r.backoff = Some(pb::Backoff {
        initial: Some(ms(100)),
        max: Some(ms(200)),
    });
    let job = submit_with(&mut jobs, r).await;
    let tol = chrono::Duration::milliseconds(50);

    for attempt in 1..=3u32 {
        let leased = within(
            LONG,
            "lease after backoff",
            lease_one(&mut workers, "w", "jit"),
        )
        .await;
        assert_eq!(leased.job_id, job.id);
        assert_eq!(leased.attempt, attempt);
        let after = workers
            .complete(failure_req(&leased, "upstream_5xx", Some(true), None))
            .await
            .expect("Complete(failure)")
            .into_inner()
            .job
            .expect("job");
        if attempt < 3 {
            assert_eq!(state(&after), St::Queued, "attempt {attempt} requeues");
            let run_at = time(&after.run_at, "run_at");
            let updated = time(&after.updated_at, "updated_at");
            assert!(
                run_at >= updated - tol
                    && run_at <= updated + chrono::Duration::milliseconds(200) + tol,
                "attempt {attempt}: run_at {run_at} must be within [updated_at, updated_at + 200 ms] (updated_at {updated})"
            );
        } else {
            assert_eq!(state(&after), St::Failed, "attempts exhausted");
            assert_eq!(after.error.expect("error").class, "upstream_5xx");
        }
    }
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 3. retries exhausted -> FAILED -> Retry
// ---------------------------------------------------------------------------

async fn retries_exhausted_then_replay(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("dq", "chat", json!({"x": 1}));
    r.max_attempts = Some(2);
    let job = submit_with(&mut jobs, r).await;

    let a1 = lease_one(&mut workers, "w", "dq").await;
    let after1 = workers
        .complete(failure_req(
            &a1,
            "upstream_error",
            None,
            Some(Duration::from_millis(10)),
        ))
        .await
        .expect("Complete 1")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&after1), St::Queued);
    let a2 = lease_one(&mut workers, "w", "dq").await;
    assert_eq!(a2.attempt, 2);
    let after2 = workers
        .complete(failure_req(
            &a2,
            "upstream_error",
            None,
            Some(Duration::from_millis(10)),
        ))
        .await
        .expect("Complete 2")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&after2), St::Failed, "no attempts left");
    assert_eq!(after2.error.clone().expect("error").class, "upstream_error");
    assert!(after2.finished_at.is_some());
    assert!(
        lease_now(&mut workers, "w", "dq").await.is_empty(),
        "a FAILED job is not leased"
    );

    let dead = list_all(
        &mut jobs,
        pb::ListJobsRequest {
            states: vec![St::Failed as i32],
            ..list_req()
        },
    )
    .await;
    assert!(ids(&dead).contains(&job.id), "the dead set lists the job");

    let retried = jobs
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Id(job.id.clone())),
            ..Default::default()
        })
        .await
        .expect("Retry")
        .into_inner();
    assert_eq!(retried.retried, vec![job.id.clone()]);
    let replayed = get(&mut jobs, &job.id).await;
    assert_eq!(state(&replayed), St::Queued);
    assert_eq!(replayed.attempt, 0, "fresh attempt budget");
    assert!(
        replayed.started_at.is_none(),
        "the new run has not started: {:?}",
        replayed.started_at
    );
    let events = watch_all_until_now(&mut jobs, &job.id).await;
    assert_eq!(event_types(&events).last(), Some(&Ev::Replayed));
    assert_eq!(events.last().map(|e| e.state), Some(St::Queued as i32));

    let a3 = lease_one(&mut workers, "w", "dq").await;
    assert_eq!(a3.job_id, job.id);
    assert_eq!(a3.attempt, 1, "attempts count again from 1 after a replay");
    assert_ne!(a3.lease_token, a2.lease_token);
    // A watch from the start passes the old FAILED event and stays open
    // while the replayed job runs.
    let mut watch = open_watch(&mut jobs, &job.id, 0).await;
    let mut seen = Vec::new();
    while seen.last() != Some(&Ev::Leased) || !seen.contains(&Ev::Replayed) {
        let event = next_event(&mut watch, LONG, "history of the replayed job").await;
        seen.push(Ev::try_from(event.r#type).expect("event type"));
    }
    assert!(
        seen.contains(&Ev::Failed),
        "history holds the FAILED: {seen:?}"
    );
    let open = tokio::time::timeout(Duration::from_millis(500), watch.next()).await;
    assert!(
        open.is_err(),
        "the watch of a running job stays open: {open:?}"
    );
    let done = complete_ok(&mut workers, &a3).await;
    assert_eq!(state(&done), St::Succeeded);
    let last = next_event(&mut watch, LONG, "SUCCEEDED after the replay").await;
    assert_eq!(last.r#type, Ev::Succeeded as i32);
    assert!(
        tokio::time::timeout(LONG, watch.next())
            .await
            .expect("the stream ends")
            .is_none(),
        "the stream ends after the latest terminal event"
    );

    let again = jobs
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Id(job.id.clone())),
            ..Default::default()
        })
        .await;
    expect_code(again, Code::FailedPrecondition, "Retry of a SUCCEEDED job");
    assert_eq!(state(&get(&mut jobs, &job.id).await), St::Succeeded);

    // Non-retryable failure on attempt 1 of 3 is final at once.
    let mut r = submit_req("nr", "chat", json!({}));
    r.max_attempts = Some(3);
    let nr = submit_with(&mut jobs, r).await;
    let l = lease_one(&mut workers, "w", "nr").await;
    let f = workers
        .complete(failure_req(&l, "bad_input", Some(false), None))
        .await
        .expect("Complete")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&f), St::Failed, "retryable=false fails at once");
    assert_eq!(f.attempt, 1);
    assert_eq!(f.error.expect("error").class, "bad_input");
    let events = watch_all(&mut jobs, &nr.id, 0, LONG).await;
    assert_eq!(
        event_types(&events),
        vec![Ev::Submitted, Ev::Leased, Ev::Failed]
    );
    server.stop().await;
}

/// Events recorded so far for a job that is not terminal: reads the watch
/// until it has been quiet for a moment.
async fn watch_all_until_now(jobs: &mut JobsClient, id: &str) -> Vec<pb::JobEvent> {
    let mut stream = jobs
        .watch_job(pb::WatchJobRequest {
            id: id.into(),
            after_sequence: 0,
        })
        .await
        .expect("WatchJob")
        .into_inner();
    let mut out = Vec::new();
    while let Ok(Some(item)) = tokio::time::timeout(Duration::from_millis(700), stream.next()).await
    {
        out.push(item.expect("WatchJob item"));
    }
    out
}

async fn bulk_retry_by_filter(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut quota = HashSet::new();
    for _ in 0..3 {
        quota.insert(
            make_failed(&mut jobs, &mut workers, "bulk", "quota")
                .await
                .id,
        );
    }
    let other_class = make_failed(&mut jobs, &mut workers, "bulk", "other").await;
    let other_queue = make_failed(&mut jobs, &mut workers, "elsewhere", "quota").await;
    let filter = pb::RetryFilter {
        queue: "bulk".into(),
        error_class: "quota".into(),
        ..Default::default()
    };

    let dry = jobs
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Filter(filter.clone())),
            dry_run: true,
            limit: None,
        })
        .await
        .expect("Retry dry_run")
        .into_inner();
    assert_eq!(dry.matched, 3, "dry run counts the matching dead jobs");
    for id in &quota {
        assert_eq!(
            state(&get(&mut jobs, id).await),
            St::Failed,
            "dry run changes nothing"
        );
    }

    let real = jobs
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Filter(filter)),
            dry_run: false,
            limit: None,
        })
        .await
        .expect("Retry")
        .into_inner();
    assert_eq!(real.matched, 3);
    let got: HashSet<String> = real.retried.iter().cloned().collect();
    assert_eq!(got, quota, "exactly the matching jobs are retried");
    for id in &quota {
        let j = get(&mut jobs, id).await;
        assert_eq!(state(&j), St::Queued);
        assert_eq!(j.attempt, 0);
    }
    assert_eq!(state(&get(&mut jobs, &other_class.id).await), St::Failed);
    assert_eq!(state(&get(&mut jobs, &other_queue.id).await), St::Failed);

    // The replayed jobs go through the normal claim path.
    let leased = workers
        .lease(lease_req("w", "bulk", 10, Duration::from_secs(2)))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    let leased_ids: HashSet<String> = leased.iter().map(|l| l.job_id.clone()).collect();
    assert_eq!(leased_ids, quota);
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 4. idempotency
// ---------------------------------------------------------------------------

/// A producer that lost the answer to a submit with a deadline and sends
/// it again after the deadline has passed gets the original job (SPEC:
/// same key, same input), not `INVALID_ARGUMENT` for the deadline; other
/// input under the key is still `ALREADY_EXISTS`, and a job nobody
/// submitted before is still refused for its deadline.
async fn a_submit_sent_again_after_its_deadline_gets_the_original(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut r = submit_req("q", "k", json!({"n": 1}));
    r.idempotency_key = "soon-late".into();
    r.deadline = Some(ts(chrono::Utc::now() + chrono::Duration::seconds(2)));
    let first = jobs.submit(r.clone()).await.expect("Submit").into_inner();
    assert!(first.created);
    let first = first.job.expect("job");
    tokio::time::sleep(Duration::from_millis(2300)).await;

    let again = jobs
        .submit(r.clone())
        .await
        .expect("sent again")
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.job.expect("job").id, first.id, "the original job");
    let batch = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![r.clone()],
        })
        .await
        .expect("SubmitBatch")
        .into_inner();
    match &batch.results[0].result {
        Some(pb::submit_batch_result::Result::Ok(again)) => {
            assert!(!again.created);
            assert_eq!(
                again.job.as_ref().map(|j| j.id.clone()),
                Some(first.id.clone())
            );
        }
        other => panic!("the original in a batch too: {other:?}"),
    }

    let mut changed = r.clone();
    changed.payload = Some(json_to_value(json!({"n": 2})));
    expect_code(
        jobs.submit(changed).await,
        Code::AlreadyExists,
        "other input",
    );
    let mut fresh = r.clone();
    fresh.idempotency_key = "never-seen".into();
    expect_invalid(
        jobs.submit(fresh.clone()).await,
        &["deadline"],
        "a passed deadline",
    );
    fresh.idempotency_key.clear();
    let batch = jobs
        .submit_batch(pb::SubmitBatchRequest { jobs: vec![fresh] })
        .await
        .expect("SubmitBatch")
        .into_inner();
    match &batch.results[0].result {
        Some(pb::submit_batch_result::Result::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32);
            assert_eq!(e.field, "jobs[0].deadline");
        }
        other => panic!("refused in a batch: {other:?}"),
    }
    let stored = list_all(&mut jobs, list_req()).await;
    assert_eq!(stored.len(), 1, "nothing but the original was stored");
    server.stop().await;
}

/// The job a retryable failure's `Complete` answers shows the `run_at`
/// that was stored, whatever the delay's precision: a jittered backoff
/// (nanoseconds) and a worker's `retry_after` with nanoseconds. SQLite
/// keeps milliseconds and PostgreSQL microseconds; the answer showed the
/// unrounded time, later than the job would really run.
async fn a_retry_answers_the_run_at_it_stored(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    for retry_after in [None, Some(Duration::new(30, 123_456_789))] {
        let job = submit(&mut jobs, "precise", "k", json!({})).await;
        let leased = lease_one(&mut workers, "w", "precise").await;
        let answered = workers
            .complete(failure_req(&leased, "later", Some(true), retry_after))
            .await
            .expect("Complete")
            .into_inner()
            .job
            .expect("job");
        assert_eq!(state(&answered), St::Queued);
        let stored = get(&mut jobs, &job.id).await;
        assert_eq!(
            answered.run_at, stored.run_at,
            "retry_after {retry_after:?}"
        );
    }
    server.stop().await;
}

async fn idempotency(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut anon = server.jobs_client_no_tenant();
    let mut default = server.jobs_client("default");
    let mut other = server.jobs_client("t2");

    let mut r = submit_req("q", "k", json!({"a": 1, "b": [1, 2]}));
    r.idempotency_key = "order-42".into();
    let first = anon.submit(r.clone()).await.expect("Submit").into_inner();
    assert!(first.created);
    let first = first.job.expect("job");
    assert_eq!(
        first.tenant, "default",
        "no tenant metadata means tenant \"default\""
    );
    assert_eq!(first.idempotency_key, "order-42");
    assert_eq!(
        first.input_hash.len(),
        64,
        "input_hash is hex sha256: {}",
        first.input_hash
    );
    assert!(first.input_hash.chars().all(|c| c.is_ascii_hexdigit()));

    let again = default
        .submit(r.clone())
        .await
        .expect("Submit again")
        .into_inner();
    assert!(!again.created, "same key, same input: not created");
    let again_job = again.job.expect("job");
    assert_eq!(
        again_job.id, first.id,
        "same key, same input: the original job"
    );
    assert_eq!(again_job.input_hash, first.input_hash);

    let mut changed = r.clone();
    changed.payload = Some(json_to_value(json!({"a": 2, "b": [1, 2]})));
    expect_code(
        default.submit(changed).await,
        Code::AlreadyExists,
        "same key, different payload",
    );
    let mut changed_opt = r.clone();
    changed_opt.priority = 9;
    expect_code(
        default.submit(changed_opt).await,
        Code::AlreadyExists,
        "same key, different options",
    );
    let mut changed_kind = r.clone();
    changed_kind.kind = "k2".into();
    expect_code(
        default.submit(changed_kind).await,
        Code::AlreadyExists,
        "same key, different kind",
    );

    let t2 = other.submit(r).await.expect("Submit in t2").into_inner();
    assert!(t2.created, "keys are scoped to the tenant");
    let t2 = t2.job.expect("job");
    assert_ne!(t2.id, first.id);
    assert_eq!(t2.tenant, "t2");

    assert_eq!(
        list_all(&mut default, list_req()).await.len(),
        1,
        "one job in default"
    );
    assert_eq!(
        list_all(&mut other, list_req()).await.len(),
        1,
        "one job in t2"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 5. cancel
// ---------------------------------------------------------------------------

async fn cancel_queued_and_running(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    // Queued -> CANCELLED at once, idempotently.
    let q = submit(&mut jobs, "cq", "k", json!({})).await;
    let c = jobs
        .cancel(pb::CancelJobRequest {
            id: q.id.clone(),
            reason: "changed my mind".into(),
        })
        .await
        .expect("Cancel")
        .into_inner();
    assert_eq!(state(&c), St::Cancelled);
    assert_eq!(state(&get(&mut jobs, &q.id).await), St::Cancelled);
    let c2 = jobs
        .cancel(pb::CancelJobRequest {
            id: q.id.clone(),
            reason: String::new(),
        })
        .await
        .expect("second Cancel is OK");
    assert_eq!(state(&c2.into_inner()), St::Cancelled);
    assert!(
        lease_now(&mut workers, "w", "cq").await.is_empty(),
        "cancelled job is not leased"
    );
    let ev = watch_all(&mut jobs, &q.id, 0, LONG).await;
    assert_eq!(event_types(&ev), vec![Ev::Submitted, Ev::Cancelled]);

    // Running -> cancel_requested -> worker learns it -> CANCELLED, result discarded.
    let r = submit(&mut jobs, "cr", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "cr").await;
    let c = jobs
        .cancel(pb::CancelJobRequest {
            id: r.id.clone(),
            reason: "stop".into(),
        })
        .await
        .expect("Cancel running")
        .into_inner();
    assert!(
        c.cancel_requested,
        "cancel of a running job sets cancel_requested"
    );
    assert_eq!(
        state(&c),
        St::Running,
        "still running until the worker reports"
    );
    let j = get(&mut jobs, &r.id).await;
    assert!(j.cancel_requested);
    let hb = workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: r.id.clone(),
            lease_token: leased.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("Heartbeat")
        .into_inner();
    assert!(
        hb.cancel_requested,
        "the worker learns of the cancel from its heartbeat"
    );
    let done = workers
        .complete(success_req(&leased, json!({"should": "be discarded"})))
        .await
        .expect("Complete after cancel")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(state(&done), St::Cancelled);
    let j = get(&mut jobs, &r.id).await;
    assert_eq!(state(&j), St::Cancelled);
    assert!(
        j.result.is_none(),
        "the result of a cancelled job is discarded: {:?}",
        j.result
    );
    let ev = event_types(&watch_all(&mut jobs, &r.id, 0, LONG).await);
    assert!(ev.contains(&Ev::CancelRequested), "events: {ev:?}");
    assert_eq!(ev.last(), Some(&Ev::Cancelled), "events: {ev:?}");
    assert!(!ev.contains(&Ev::Succeeded), "events: {ev:?}");
    assert!(
        lease_now(&mut workers, "w", "cr").await.is_empty(),
        "never retried"
    );

    // Succeeded -> FAILED_PRECONDITION.
    let s = submit(&mut jobs, "cs", "k", json!({})).await;
    let l = lease_one(&mut workers, "w", "cs").await;
    complete_ok(&mut workers, &l).await;
    expect_code(
        jobs.cancel(pb::CancelJobRequest {
            id: s.id.clone(),
            reason: String::new(),
        })
        .await,
        Code::FailedPrecondition,
        "Cancel of a SUCCEEDED job",
    );
    assert_eq!(state(&get(&mut jobs, &s.id).await), St::Succeeded);
    server.stop().await;
}

async fn cancel_grace_revokes_lease(backend: Backend) {
    let (server, mut jobs, mut workers, job, leased, t0) =
        cancelled_while_leased(backend, Duration::from_millis(200)).await;
    let j = wait_for_state(&mut jobs, &job.id, St::Cancelled, Duration::from_secs(6)).await;
    assert!(
        t0.elapsed() >= Duration::from_secs(1),
        "cancelled only after the grace period, got {:?}",
        t0.elapsed()
    );
    assert!(j.finished_at.is_some());
    expect_revoked(
        &mut workers,
        &job,
        &leased,
        "after the grace and the reaper",
    )
    .await;
    assert_eq!(state(&get(&mut jobs, &job.id).await), St::Cancelled);
    assert!(
        lease_now(&mut workers, "w", "g").await.is_empty(),
        "never retried"
    );
    // A cancel's lease ended on purpose: no worker died or hung.
    let metrics = parse(&scrape(server.http_addr).await);
    assert_eq!(
        metrics.get("intray_lease_expirations_total{queue=\"g\"}"),
        None,
        "not counted as an expired lease"
    );
    server.stop().await;

    // Revoked and CANCELLED at the end of the grace (SPEC: "at the
    // latest"), not at the reaper's next interval pass, ten minutes on.
    let (server, mut jobs, mut workers, job, leased, t0) =
        cancelled_while_leased(backend, Duration::from_secs(600)).await;
    let j = wait_for_state(&mut jobs, &job.id, St::Cancelled, Duration::from_secs(4)).await;
    assert!(
        t0.elapsed() >= Duration::from_secs(1),
        "cancelled only after the grace period, got {:?}",
        t0.elapsed()
    );
    assert!(j.cancel_requested);
    expect_revoked(&mut workers, &job, &leased, "past the grace").await;
    server.stop().await;
}

/// A job leased to a worker that never heartbeats, then cancelled, on a
/// server with a 1 s cancel grace and a reaper every `reaper_interval`;
/// with the moment before the `Cancel` was sent.
async fn cancelled_while_leased(
    backend: Backend,
    reaper_interval: Duration,
) -> (
    TestServer,
    JobsClient,
    WorkersClient,
    pb::Job,
    pb::LeasedJob,
    Instant,
) {
    let server = TestServer::start_with(backend, |s| {
        s.cancel_grace = Duration::from_secs(1);
        s.reaper_interval = reaper_interval;
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "g", "k", json!({})).await;
    let leased = lease_one(&mut workers, "deaf-worker", "g").await;
    let sent = Instant::now();
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "grace".into(),
    })
    .await
    .expect("Cancel");
    (server, jobs, workers, job, leased, sent)
}

/// `Heartbeat` and `Complete` under a revoked lease's token get `ABORTED`.
async fn expect_revoked(
    workers: &mut WorkersClient,
    job: &pb::Job,
    leased: &pb::LeasedJob,
    when: &str,
) {
    expect_code(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: job.id.clone(),
                lease_token: leased.lease_token.clone(),
                ..Default::default()
            })
            .await,
        Code::Aborted,
        &format!("Heartbeat {when}"),
    );
    expect_code(
        workers.complete(success_req(leased, json!(1))).await,
        Code::Aborted,
        &format!("Complete {when}"),
    );
}

// ---------------------------------------------------------------------------
// 6. watch
// ---------------------------------------------------------------------------

/// A renewal never runs past the server's longest lease, whatever length
/// the row records: the migration that started recording lengths filled
/// them in from each running lease's time so far, hours for a job
/// heartbeating since it was claimed, and a worker that died after such a
/// renewal held its job that long.
async fn a_renewal_never_runs_past_the_longest_lease(backend: Backend) {
    let server = TestServer::start_with(backend, |s| s.max_lease = Duration::from_secs(120)).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "hb", "k", json!({})).await;
    let mut req = lease_req("w", "hb", 1, Duration::ZERO);
    req.lease_duration = Some(secs(100));
    let claimed = workers.lease(req).await.expect("Lease").into_inner().jobs;
    let claimed = claimed.first().expect("claimed");
    let sql = "UPDATE jobs SET lease_ms = 7200000 WHERE CAST(id AS TEXT) = $1 \
               RETURNING CAST(1 AS BIGINT)";
    db_integers(
        backend,
        &server.settings.database_url,
        sql,
        &[&claimed.job_id],
    )
    .await;
    let hb = workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: claimed.job_id.clone(),
            lease_token: claimed.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("Heartbeat")
        .into_inner();
    let left = (time(&hb.lease_expires_at, "lease_expires_at") - Utc::now()).num_seconds();
    assert!(
        (110..=120).contains(&left),
        "renewed by 120 s at most, {left} s left"
    );
    server.stop().await;
}

/// A `Heartbeat` without `extend_by` renews the lease by the length it was
/// taken with (the proto's contract), both for a claimed job and for one
/// handed to a parked call, and not by the server's 60 s default.
async fn heartbeat_renews_by_the_leased_length(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let beat = |leased: &pb::LeasedJob, extend_by: Option<u64>| pb::HeartbeatRequest {
        job_id: leased.job_id.clone(),
        lease_token: leased.lease_token.clone(),
        extend_by: extend_by.map(secs),
        ..Default::default()
    };
    let expires_in = |hb: pb::HeartbeatResponse| {
        (time(&hb.lease_expires_at, "lease_expires_at") - Utc::now()).num_seconds()
    };

    submit(&mut jobs, "hb", "k", json!({})).await;
    let mut req = lease_req("w", "hb", 1, Duration::ZERO);
    req.lease_duration = Some(secs(600));
    let claimed = workers.lease(req).await.expect("Lease").into_inner().jobs;
    let claimed = claimed.first().expect("claimed");
    let hb = workers
        .heartbeat(beat(claimed, None))
        .await
        .expect("Heartbeat");
    let left = expires_in(hb.into_inner());
    assert!(
        (590..=600).contains(&left),
        "renewed by 600 s, {left} s left"
    );
    let hb = workers
        .heartbeat(beat(claimed, Some(5)))
        .await
        .expect("Heartbeat");
    let left = expires_in(hb.into_inner());
    assert!((0..=5).contains(&left), "extend_by 5 s, {left} s left");
    let hb = workers
        .heartbeat(beat(claimed, None))
        .await
        .expect("Heartbeat");
    let left = expires_in(hb.into_inner());
    assert!((590..=600).contains(&left), "back to 600 s, {left} s left");

    // Handed off at submit to a parked call.
    let mut req = lease_req("w", "hb-parked", 1, Duration::from_secs(10));
    req.lease_duration = Some(secs(300));
    let mut parked_workers = workers.clone();
    let parked = tokio::spawn(async move { parked_workers.lease(req).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let job = submit(&mut jobs, "hb-parked", "k", json!({})).await;
    assert_eq!(state(&job), St::Running, "handed off in the submit");
    let handed = parked
        .await
        .expect("joined")
        .expect("Lease")
        .into_inner()
        .jobs;
    let handed = handed.first().expect("handed");
    let hb = workers
        .heartbeat(beat(handed, None))
        .await
        .expect("Heartbeat");
    let left = expires_in(hb.into_inner());
    assert!(
        (290..=300).contains(&left),
        "renewed by 300 s, {left} s left"
    );
    server.stop().await;
}

/// A watcher that resumes while another watcher keeps the job's recent
/// events in memory gets every event, also one that memory never had: a
/// heartbeat's PROGRESS sits between two kept events.
async fn watch_resumed_across_an_event_not_kept_in_memory(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let job = submit(&mut jobs, "w", "k", json!({})).await;
    let mut first = open_watch(&mut jobs, &job.id, 0).await;
    next_event(&mut first, LONG, "the first watcher's SUBMITTED").await;

    let leased = lease_one(&mut workers, "w1", "w").await;
    workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased.lease_token.clone(),
            progress: Some(0.5),
            ..Default::default()
        })
        .await
        .expect("Heartbeat");
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "enough".into(),
    })
    .await
    .expect("Cancel");
    // Opened while the first watcher still keeps LEASED (2) and
    // CANCEL_REQUESTED (4) in memory, but not PROGRESS (3).
    let resumed = open_watch(&mut jobs, &job.id, 1).await;
    complete_ok(&mut workers, &leased).await;

    let resumed = drain(resumed).await;
    assert_eq!(
        sequences(&resumed),
        vec![2, 3, 4, 5],
        "every event after 1: {:?}",
        event_types(&resumed)
    );
    assert_eq!(event_types(&resumed)[1], Ev::Progress);
    assert_eq!(
        sequences(&drain(first).await),
        vec![2, 3, 4, 5],
        "the first watcher too"
    );
}

/// The rest of a watch stream, which must end within [`LONG`].
async fn drain(mut stream: tonic::Streaming<pb::JobEvent>) -> Vec<pb::JobEvent> {
    within(LONG, "the rest of a watch stream", async {
        let mut events = Vec::new();
        while let Some(item) = stream.next().await {
            events.push(item.expect("event"));
        }
        events
    })
    .await
}

async fn watch_resume_from_sequence(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let job = submit(&mut jobs, "w", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w1", "w").await;

    {
        let mut stream = jobs
            .watch_job(pb::WatchJobRequest {
                id: job.id.clone(),
                after_sequence: 0,
            })
            .await
            .expect("WatchJob")
            .into_inner();
        let mut first = Vec::new();
        for _ in 0..2 {
            let e = within(LONG, "first watch events", stream.next())
                .await
                .expect("stream has an event")
                .expect("event");
            first.push(e);
        }
        assert_eq!(sequences(&first), vec![1, 2]);
        assert_eq!(event_types(&first), vec![Ev::Submitted, Ev::Leased]);
        // dropped here: the client disconnects
    }

    for p in [0.25, 0.75] {
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: job.id.clone(),
                lease_token: leased.lease_token.clone(),
                progress: Some(p),
                ..Default::default()
            })
            .await
            .expect("Heartbeat");
    }
    complete_ok(&mut workers, &leased).await;

    let rest = watch_all(&mut jobs, &job.id, 2, LONG).await;
    assert_eq!(
        sequences(&rest),
        vec![3, 4, 5],
        "exactly the events after 2"
    );
    assert_eq!(
        event_types(&rest),
        vec![Ev::Progress, Ev::Progress, Ev::Succeeded]
    );

    let tail = watch_all(&mut jobs, &job.id, 4, LONG).await;
    assert_eq!(sequences(&tail), vec![5]);
    let none = watch_all(&mut jobs, &job.id, 5, LONG).await;
    assert!(
        none.is_empty(),
        "nothing after the terminal event; stream ends: {none:?}"
    );
    server.stop().await;
}

/// A client may resume from a sequence the job has not reached, up to the
/// largest `u64`: the stream sends nothing at or below it, and ends as
/// soon as the job does, not at the next fallback read (30 s here), though
/// the job's own events wake it from memory without being sent.
async fn a_watch_resumed_past_the_last_event_ends_with_the_job(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let job = submit(&mut jobs, "ahead", "k", json!({})).await;
    let mut streams = Vec::new();
    for after in [50, u64::from(u32::MAX), i64::MAX as u64, u64::MAX] {
        streams.push((after, open_watch(&mut jobs, &job.id, after).await));
    }
    // Each stream has read the job and found it behind before the cancel.
    tokio::time::sleep(Duration::from_millis(300)).await;
    jobs.cancel(pb::CancelJobRequest {
        id: job.id.clone(),
        reason: "test".into(),
    })
    .await
    .expect("Cancel");
    for (after, mut stream) in streams {
        let end = within(Duration::from_secs(10), "the stream's end", stream.next()).await;
        assert!(end.is_none(), "after {after}: {end:?}");
    }
    server.stop().await;
}

async fn watch_live_push(backend: Backend) {
    // A long fallback poll: the pushes must come from the notifier.
    let server = TestServer::start_with(backend, |s| {
        s.fallback_poll = Duration::from_secs(60);
        s.watch_fallback_poll = Duration::from_secs(60);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "live", "k", json!({})).await;

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher_client = jobs.clone();
    let id = job.id.clone();
    let watcher = tokio::spawn(async move {
        let mut stream = watcher_client
            .watch_job(pb::WatchJobRequest {
                id,
                after_sequence: 0,
            })
            .await
            .expect("WatchJob")
            .into_inner();
        while let Some(item) = stream.next().await {
            if tx.send(item).is_err() {
                break;
            }
        }
    });
    let quick = Duration::from_secs(3);

    let e1 = recv_event(&mut rx, quick).await;
    assert_eq!((e1.sequence, event_type(&e1)), (1, Ev::Submitted));

    let leased = lease_one(&mut workers, "w", "live").await;
    let e2 = recv_event(&mut rx, quick).await;
    assert_eq!((e2.sequence, event_type(&e2)), (2, Ev::Leased));

    complete_ok(&mut workers, &leased).await;
    let e3 = recv_event(&mut rx, quick).await;
    assert_eq!((e3.sequence, event_type(&e3)), (3, Ev::Succeeded));

    let end = tokio::time::timeout(quick, rx.recv()).await;
    assert!(
        matches!(end, Ok(None)),
        "the stream ends after the terminal event, got {end:?}"
    );
    within(quick, "watcher task", watcher)
        .await
        .expect("watcher task");

    if let Backend::Postgres = backend {
        // A watcher on another replica: its events come through NOTIFY and
        // a read there (nothing is kept in that replica's memory).
        let replica = server
            .start_replica_with(|s| {
                s.fallback_poll = Duration::from_secs(60);
                s.watch_fallback_poll = Duration::from_secs(60);
            })
            .await;
        let job = submit(&mut jobs, "live-remote", "k", json!({})).await;
        let mut remote = replica.jobs_client("t");
        let mut stream = open_watch(&mut remote, &job.id, 1).await;
        let leased = lease_one(&mut workers, "w", "live-remote").await;
        complete_ok(&mut workers, &leased).await;
        let mut seen = Vec::new();
        while let Some(item) = tokio::time::timeout(quick, stream.next())
            .await
            .expect("remote events pushed within 3 s")
        {
            seen.push(item.expect("event, not an error"));
        }
        assert_eq!(sequences(&seen), vec![2, 3]);
        assert_eq!(event_types(&seen), vec![Ev::Leased, Ev::Succeeded]);

        // Mixed: the lease is committed on the watcher's replica (its event
        // comes from memory, after which the watcher does not read), the
        // completion on the other one; that must still reach it.
        let job = submit(&mut jobs, "live-mixed", "k", json!({})).await;
        let mut stream = open_watch(&mut remote, &job.id, 1).await;
        let mut local_workers = replica.workers_client("t");
        let leased = lease_one(&mut local_workers, "w", "live-mixed").await;
        let first = next_event(&mut stream, quick, "the local lease event").await;
        assert_eq!((first.sequence, event_type(&first)), (2, Ev::Leased));
        complete_ok(&mut workers, &leased).await;
        let last = next_event(&mut stream, quick, "the remote completion").await;
        assert_eq!((last.sequence, event_type(&last)), (3, Ev::Succeeded));
        replica.stop().await;
    }
    server.stop().await;
}

async fn recv_event(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Result<pb::JobEvent, tonic::Status>>,
    d: Duration,
) -> pb::JobEvent {
    tokio::time::timeout(d, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("event pushed within {d:?}"))
        .expect("stream still open")
        .expect("event, not an error")
}

// ---------------------------------------------------------------------------
// 7. concurrency
// ---------------------------------------------------------------------------

#[derive(Default)]
struct DrainLog {
    leased: HashSet<(String, u32)>,
    tokens: HashSet<String>,
    duplicates: Vec<String>,
    completes: HashMap<String, u32>,
    errors: Vec<String>,
    leases: usize,
}

async fn concurrent_drain(backend: Backend) {
    const TOTAL: usize = 5000;
    const WORKERS: usize = 32;
    let server = TestServer::start(backend).await;
    let replica = match backend {
        Backend::Postgres => Some(server.start_replica().await),
        Backend::Sqlite => None,
    };
    let mut jobs = server.jobs_client("load");

    let mut submitted = HashSet::new();
    for b in 0..TOTAL / 500 {
        let items = (0..500)
            .map(|i| submit_req("bulk", "work", json!({"n": b * 500 + i})))
            .collect();
        let resp = jobs
            .submit_batch(pb::SubmitBatchRequest { jobs: items })
            .await
            .expect("SubmitBatch")
            .into_inner();
        assert_eq!(resp.results.len(), 500);
        for r in resp.results {
            match r.result {
                Some(pb::submit_batch_result::Result::Ok(ok)) => {
                    assert!(ok.created);
                    submitted.insert(ok.job.expect("job").id);
                }
                other => panic!("batch item failed: {other:?}"),
            }
        }
    }
    assert_eq!(submitted.len(), TOTAL);

    let log = Arc::new(Mutex::new(DrainLog::default()));
    let ok = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(240);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let target = match (&replica, w % 2) {
            (Some(rep), 1) => rep,
            _ => &server,
        };
        let mut client = target.workers_client_own_conn("load").await;
        let log = log.clone();
        let ok = ok.clone();
        let worker_id = format!("worker-{w}");
        let max_jobs = (w % 4) as u32 + 1;
        tasks.push(tokio::spawn(async move {
            while ok.load(Ordering::SeqCst) < TOTAL && Instant::now() < deadline {
                let leased = match client
                    .lease(lease_req(
                        &worker_id,
                        "bulk",
                        max_jobs,
                        Duration::from_secs(1),
                    ))
                    .await
                {
                    Ok(r) => r.into_inner().jobs,
                    Err(s) => {
                        log.lock()
                            .await
                            .errors
                            .push(format!("{worker_id} Lease: {s:?}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                assert!(
                    leased.len() <= max_jobs as usize,
                    "Lease returned more than max_jobs"
                );
                {
                    let mut l = log.lock().await;
                    for j in &leased {
                        l.leases += 1;
                        if !l.leased.insert((j.job_id.clone(), j.attempt)) {
                            l.duplicates
                                .push(format!("({}, {}) leased twice", j.job_id, j.attempt));
                        }
                        if !l.tokens.insert(j.lease_token.clone()) {
                            l.duplicates
                                .push(format!("token {} handed out twice", j.lease_token));
                        }
                    }
                }
                for j in leased {
                    match client
                        .complete(success_req(&j, json!({"w": worker_id})))
                        .await
                    {
                        Ok(_) => {
                            *log.lock()
                                .await
                                .completes
                                .entry(j.job_id.clone())
                                .or_default() += 1;
                            ok.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(s) => log
                            .lock()
                            .await
                            .errors
                            .push(format!("{worker_id} Complete {}: {s:?}", j.job_id)),
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker task");
    }
    let elapsed = started.elapsed();
    eprintln!(
        "{backend:?}: drained {} jobs with {WORKERS} workers in {elapsed:?} ({:.0} jobs/s)",
        ok.load(Ordering::SeqCst),
        ok.load(Ordering::SeqCst) as f64 / elapsed.as_secs_f64()
    );

    let log = log.lock().await;
    assert!(
        log.duplicates.is_empty(),
        "duplicates: {:?}",
        &log.duplicates[..log.duplicates.len().min(20)]
    );
    assert!(
        log.errors.is_empty(),
        "{} errors, first: {:?}",
        log.errors.len(),
        &log.errors[..log.errors.len().min(20)]
    );
    assert_eq!(ok.load(Ordering::SeqCst), TOTAL, "total OK completes");
    assert_eq!(log.leases, TOTAL, "every job leased exactly once");
    let completed: HashSet<String> = log.completes.keys().cloned().collect();
    assert_eq!(completed, submitted, "every submitted job completed");
    let multi: Vec<_> = log.completes.iter().filter(|(_, n)| **n != 1).collect();
    assert!(multi.is_empty(), "jobs completed more than once: {multi:?}");

    let succeeded = list_all(
        &mut jobs,
        pb::ListJobsRequest {
            queue: "bulk".into(),
            states: vec![St::Succeeded as i32],
            ..list_req()
        },
    )
    .await;
    assert_eq!(succeeded.len(), TOTAL, "List pages through every job once");
    assert_eq!(ids(&succeeded), submitted, "every job SUCCEEDED");
    let left = list_all(
        &mut jobs,
        pb::ListJobsRequest {
            queue: "bulk".into(),
            states: vec![St::Queued as i32, St::Running as i32, St::Failed as i32],
            ..list_req()
        },
    )
    .await;
    assert!(left.is_empty(), "{} jobs not SUCCEEDED", left.len());

    drop(log);
    if let Some(r) = replica {
        r.stop().await;
    }
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 8. long-poll wake
// ---------------------------------------------------------------------------

async fn long_poll_wake(backend: Backend) {
    // A long fallback poll: the wake-up must come from the notifier.
    let server = TestServer::start_with(backend, |s| {
        s.fallback_poll = Duration::from_secs(30);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    // An empty long poll returns empty after about `wait`.
    let t = Instant::now();
    let empty = workers
        .lease(lease_req("w", "nothing", 1, Duration::from_secs(1)))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert!(empty.is_empty());
    assert!(
        t.elapsed() >= Duration::from_millis(900) && t.elapsed() < Duration::from_secs(3),
        "empty long poll lasts about its wait (1 s): {:?}",
        t.elapsed()
    );

    wake_case(&mut workers, &mut jobs, "wake").await;

    if let Backend::Postgres = backend {
        // Across replicas: LISTEN/NOTIFY carries the wake-up.
        let replica = server.start_replica().await;
        let mut rworkers = replica.workers_client("t");
        wake_case(&mut rworkers, &mut jobs, "wake-replica").await;
        replica.stop().await;
    }
    server.stop().await;
}

async fn wake_case(workers: &mut WorkersClient, jobs: &mut JobsClient, queue: &str) {
    let mut w = workers.clone();
    let q = queue.to_string();
    let waiter = tokio::spawn(async move {
        let t = Instant::now();
        let r = w
            .lease(lease_req("sleeper", &q, 1, Duration::from_secs(10)))
            .await
            .expect("Lease")
            .into_inner()
            .jobs;
        (r, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let job = submit(jobs, queue, "k", json!({})).await;
    let (leased, elapsed) = within(Duration::from_secs(15), "long-poll Lease", waiter)
        .await
        .expect("waiter task");
    assert_eq!(
        leased.len(),
        1,
        "the long poll returns the new job ({queue})"
    );
    assert_eq!(leased[0].job_id, job.id);
    assert!(
        elapsed >= Duration::from_millis(250),
        "the Lease did wait for the submit: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(3),
        "woken by the submit, not by the end of the wait ({queue}): {elapsed:?}"
    );
}

// ---------------------------------------------------------------------------
// 9. validation
// ---------------------------------------------------------------------------

async fn validation(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("val");
    let mut workers = server.workers_client("val");
    let ok = || submit_req("q", "k", json!({"a": 1}));

    macro_rules! bad_submit {
        ($field:expr, $what:expr, |$r:ident| $edit:expr) => {{
            let mut $r = ok();
            $edit;
            expect_invalid(jobs.submit($r).await, $field, $what);
        }};
    }
    bad_submit!(&["queue"], "empty queue", |r| r.queue = String::new());
    bad_submit!(&["queue"], "queue with bad characters", |r| r.queue =
        "bad queue!".into());
    bad_submit!(&["queue"], "queue of 129 characters", |r| r.queue =
        "q".repeat(129));
    bad_submit!(&["kind"], "empty kind", |r| r.kind = String::new());
    bad_submit!(&["max_attempts"], "max_attempts 0", |r| r.max_attempts =
        Some(0));
    bad_submit!(&["max_attempts"], "max_attempts 101", |r| r.max_attempts =
        Some(101));
    bad_submit!(&["priority"], "priority 1001", |r| r.priority = 1001);
    bad_submit!(&["payload"], "payload over 1 MiB", |r| r.payload =
        Some(json_to_value(json!({"blob": "x".repeat(1024 * 1024 + 16)}))));
    bad_submit!(&["deadline"], "deadline in the past", |r| r.deadline =
        Some(ts(Utc::now() - chrono::Duration::seconds(60))));
    bad_submit!(&["labels"], "invalid label key", |r| r
        .labels
        .insert("Bad Key!".into(), "v".into()));
    bad_submit!(&["idempotency_key"], "idempotency_key of 257", |r| r
        .idempotency_key =
        "k".repeat(257));
    // PostgreSQL cannot store NUL in text, nor times before 4713 BC.
    bad_submit!(&["idempotency_key"], "idempotency_key with NUL", |r| r
        .idempotency_key =
        "a\0b".into());
    bad_submit!(&["run_at"], "run_at before year 1", |r| r.run_at =
        Some(pbjson_types::Timestamp {
            seconds: -5_000_000_000_000,
            nanos: 0,
        }));
    bad_submit!(&["backoff.initial", "backoff"], "backoff initial 0", |r| {
        r.backoff = Some(pb::Backoff {
            initial: Some(ms(0)),
            max: None,
        })
    });

    expect_invalid(
        jobs.submit_batch(pb::SubmitBatchRequest { jobs: vec![] })
            .await,
        &["jobs"],
        "SubmitBatch with 0 items",
    );
    expect_invalid(
        jobs.submit_batch(pb::SubmitBatchRequest {
            jobs: (0..1001).map(|_| ok()).collect(),
        })
        .await,
        &["jobs"],
        "SubmitBatch with 1001 items",
    );
    let written = list_all(&mut jobs, list_req()).await;
    assert!(
        written.is_empty(),
        "rejected submits wrote nothing: {written:?}"
    );

    expect_invalid(
        jobs.get(pb::GetJobRequest {
            id: "not-a-uuid".into(),
        })
        .await,
        &["id"],
        "Get with a malformed id",
    );

    let lease = || pb::LeaseRequest {
        worker_id: "w".into(),
        queues: vec!["q".into()],
        ..Default::default()
    };
    macro_rules! bad_lease {
        ($field:expr, $what:expr, |$r:ident| $edit:expr) => {{
            let mut $r = lease();
            $edit;
            expect_invalid(within(LONG, $what, workers.lease($r)).await, $field, $what);
        }};
    }
    bad_lease!(&["queues"], "Lease with no queues", |r| r.queues.clear());
    bad_lease!(&["worker_id"], "Lease with empty worker_id", |r| r
        .worker_id =
        String::new());
    bad_lease!(&["max_jobs"], "Lease max_jobs 0", |r| r.max_jobs = Some(0));
    bad_lease!(&["max_jobs"], "Lease max_jobs 101", |r| r.max_jobs =
        Some(101));
    bad_lease!(&["wait"], "Lease wait 61 s", |r| r.wait = Some(secs(61)));
    bad_lease!(&["worker_id"], "Lease with NUL in worker_id", |r| r
        .worker_id =
        "w\0".into());
    bad_lease!(&["lease_duration"], "Lease lease_duration 0", |r| r
        .lease_duration =
        Some(ms(0)));

    for (size, what) in [(0, "page_size 0"), (1001, "page_size 1001")] {
        expect_invalid(
            jobs.list(pb::ListJobsRequest {
                page_size: Some(size),
                ..list_req()
            })
            .await,
            &["page_size"],
            what,
        );
    }
    expect_invalid(
        jobs.list(pb::ListJobsRequest {
            page_token: "garbage!!".into(),
            ..list_req()
        })
        .await,
        &["page_token"],
        "List with a garbage page_token",
    );

    // Heartbeat / Complete on a real lease, so only the bad field is wrong.
    submit(&mut jobs, "q", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "q").await;
    expect_invalid(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: leased.job_id.clone(),
                lease_token: leased.lease_token.clone(),
                progress: Some(1.5),
                ..Default::default()
            })
            .await,
        &["progress"],
        "Heartbeat with progress 1.5",
    );
    expect_invalid(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: leased.job_id.clone(),
                lease_token: leased.lease_token.clone(),
                message: "a\0b".into(),
                ..Default::default()
            })
            .await,
        &["message"],
        "Heartbeat with NUL in its message",
    );
    expect_invalid(
        jobs.cancel(pb::CancelJobRequest {
            id: leased.job_id.clone(),
            reason: "a\0b".into(),
        })
        .await,
        &["reason"],
        "Cancel with NUL in its reason",
    );
    expect_invalid(
        workers
            .complete(pb::CompleteRequest {
                job_id: leased.job_id.clone(),
                lease_token: leased.lease_token.clone(),
                outcome: None,
                cost_cents: 0,
            })
            .await,
        &["outcome"],
        "Complete with no outcome",
    );
    let j = get(&mut jobs, &leased.job_id).await;
    assert_eq!(state(&j), St::Running, "rejected calls changed nothing");
    assert_eq!(j.progress, 0.0);
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 10. stale tokens, lease expiry, NOT_FOUND
// ---------------------------------------------------------------------------

async fn stale_lease_token(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let job = submit(&mut jobs, "s", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "s").await;
    let mut forged = leased.clone();
    forged.lease_token = uuid::Uuid::new_v4().to_string();

    expect_code(
        workers
            .complete(success_req(&forged, json!("forged")))
            .await,
        Code::Aborted,
        "Complete with a made-up token",
    );
    let j = get(&mut jobs, &job.id).await;
    assert_eq!(state(&j), St::Running, "a stale Complete writes nothing");
    assert!(j.result.is_none());
    expect_code(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: job.id.clone(),
                lease_token: forged.lease_token.clone(),
                ..Default::default()
            })
            .await,
        Code::Aborted,
        "Heartbeat with a made-up token",
    );
    expect_code(
        workers
            .complete(failure_req(&forged, "x", Some(false), None))
            .await,
        Code::Aborted,
        "Complete(failure) with a made-up token",
    );

    let done = complete_ok(&mut workers, &leased).await;
    assert_eq!(state(&done), St::Succeeded, "the real token still works");
    expect_code(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: job.id.clone(),
                lease_token: leased.lease_token.clone(),
                ..Default::default()
            })
            .await,
        Code::Aborted,
        "Heartbeat after the job ended",
    );
    expect_code(
        workers.complete(success_req(&leased, json!("twice"))).await,
        Code::Aborted,
        "second Complete with the same token",
    );
    server.stop().await;
}

async fn lease_expiry_reclaims(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let short = |queue: &str| short_lease_req("slow", queue, 1, Duration::from_secs(5));

    let job = submit(&mut jobs, "exp", "k", json!({})).await;
    let old = workers
        .lease(short("exp"))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(old.len(), 1);
    let old = &old[0];
    let t0 = Instant::now();
    let back = wait_for_state(&mut jobs, &job.id, St::Queued, Duration::from_secs(6)).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "reclaimed only after the lease expired: {:?}",
        t0.elapsed()
    );
    assert_eq!(back.attempt, 1);
    let ev = event_types(&watch_all_until_now(&mut jobs, &job.id).await);
    assert_eq!(ev, vec![Ev::Submitted, Ev::Leased, Ev::LeaseExpired]);

    expect_code(
        workers.complete(success_req(old, json!("late"))).await,
        Code::Aborted,
        "Complete with the expired lease's token",
    );
    let new = lease_one(&mut workers, "fast", "exp").await;
    assert_eq!(new.job_id, job.id);
    assert_eq!(new.attempt, 2);
    assert_ne!(
        new.lease_token, old.lease_token,
        "a new token for the new attempt"
    );
    expect_code(
        workers
            .heartbeat(pb::HeartbeatRequest {
                job_id: job.id.clone(),
                lease_token: old.lease_token.clone(),
                ..Default::default()
            })
            .await,
        Code::Aborted,
        "Heartbeat with the expired lease's token",
    );
    expect_code(
        workers.complete(success_req(old, json!("late"))).await,
        Code::Aborted,
        "the old token stays dead after the re-lease",
    );
    let done = complete_ok(&mut workers, &new).await;
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.result, Some(json_to_value(json!({"done": true}))));

    // Lease lost on the last attempt -> FAILED with lease_expired.
    let mut r = submit_req("exp1", "k", json!({}));
    r.max_attempts = Some(1);
    let last = submit_with(&mut jobs, r).await;
    let l = workers
        .lease(short("exp1"))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(l.len(), 1);
    let failed = wait_for_state(&mut jobs, &last.id, St::Failed, Duration::from_secs(6)).await;
    assert_eq!(
        failed.error.expect("error").class,
        "lease_expired",
        "a lost lease on the last attempt is a lease_expired failure"
    );
    server.stop().await;
}

/// A full reaper batch (500) of unreadable expired leases at the head of
/// the reaper's order does not keep it from the readable ones behind:
/// the next pass reads past the rows the last one left out.
async fn a_reaper_batch_of_unreadable_rows_does_not_stall_it(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
        s.metrics_refresh = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let items = (0..500)
        .map(|i| submit_req("bad", "k", json!({ "n": i })))
        .collect();
    jobs.submit_batch(pb::SubmitBatchRequest { jobs: items })
        .await
        .expect("SubmitBatch");
    // Broken while queued: the claims below lease them to nobody (see
    // `unreadable_rows_are_set_aside`), so their leases run out first.
    let url = &server.settings.database_url;
    let sql = "UPDATE jobs SET labels = '[1]' WHERE queue = 'bad' RETURNING CAST(1 AS BIGINT)";
    db_integers(backend, url, sql, &[]).await;
    let sql = "SELECT count(*) FROM jobs WHERE queue = 'bad' AND labels = '[1]'";
    assert_eq!(db_integers(backend, url, sql, &[]).await, [500]);
    for _ in 0..5 {
        let got = workers
            .lease(short_lease_req("w", "bad", 100, Duration::ZERO))
            .await
            .expect("Lease")
            .into_inner()
            .jobs;
        assert!(got.is_empty(), "unreadable jobs are not answered");
    }
    let good = submit(&mut jobs, "good", "k", json!({})).await;
    let leased = workers
        .lease(short_lease_req("gone", "good", 1, Duration::ZERO))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 1);
    let back = wait_for_state(&mut jobs, &good.id, St::Queued, Duration::from_secs(10)).await;
    assert_eq!(back.attempt, 1, "reclaimed behind 500 unreadable rows");
    // The reaper read them again by key (its first second look comes at
    // the pass after it set some aside) and found them still broken: the
    // claims met 500, the passes 500, the look at least one more.
    within(
        Duration::from_secs(10),
        "the rows to be met on the second look",
        async {
            loop {
                let metrics = parse(&scrape(server.http_addr).await);
                if metrics.get("intray_unreadable_job_rows_total") > Some(&1000.0) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    let sql = "SELECT count(*) FROM jobs WHERE queue = 'bad' AND state = 'running'";
    assert_eq!(
        db_integers(backend, url, sql, &[]).await,
        [500],
        "still set aside"
    );
    server.stop().await;
}

/// Changes a job row behind the server's back so that it no longer parses
/// (its labels become a list).
async fn mangle_row(server: &TestServer, id: &str) {
    let sql =
        "UPDATE jobs SET labels = '[1]' WHERE CAST(id AS TEXT) = $1 RETURNING CAST(1 AS BIGINT)";
    db_integers(server.backend, &server.settings.database_url, sql, &[id]).await;
}

/// A batch call that meets a row that no longer parses answers its other
/// items: `CompleteBatch` applies the other outcome, `SubmitBatch` stores
/// the other job (once) when an item's idempotency key is held by such a
/// row. Only the item of that row is `INTERNAL`.
async fn an_unreadable_row_fails_only_its_own_batch_item(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let bad = submit(&mut jobs, "q", "k", json!({})).await;
    let good = submit(&mut jobs, "q", "k", json!({})).await;
    let leased = workers
        .lease(lease_req("w", "q", 2, Duration::ZERO))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 2);
    mangle_row(&server, &bad.id).await;
    let items = leased
        .iter()
        .map(|l| success_req(l, json!("done")))
        .collect::<Vec<_>>();
    let answered = workers
        .complete_batch(pb::CompleteBatchRequest { items })
        .await
        .expect("CompleteBatch is answered")
        .into_inner()
        .results;
    for (leased, answer) in leased.iter().zip(&answered) {
        match (&answer.result, leased.job_id == bad.id) {
            (Some(pb::complete_batch_result::Result::Error(e)), true) => {
                assert_eq!(e.code, Code::Internal as i32, "{e:?}");
            }
            (Some(pb::complete_batch_result::Result::Job(_)), false) => {}
            (other, _) => panic!("item of {}: {other:?}", leased.job_id),
        }
    }
    assert_eq!(state(&get(&mut jobs, &good.id).await), St::Succeeded);

    let mut keyed = submit_req("q2", "k", json!({}));
    keyed.idempotency_key = "held".into();
    let holder = jobs
        .submit(keyed.clone())
        .await
        .expect("Submit")
        .into_inner();
    mangle_row(&server, &holder.job.expect("job").id).await;
    let answered = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![submit_req("q2", "k", json!({"n": 1})), keyed],
        })
        .await
        .expect("SubmitBatch is answered")
        .into_inner()
        .results;
    match (&answered[0].result, &answered[1].result) {
        (
            Some(pb::submit_batch_result::Result::Ok(stored)),
            Some(pb::submit_batch_result::Result::Error(e)),
        ) => {
            assert!(stored.created);
            assert_eq!(e.code, Code::Internal as i32, "{e:?}");
        }
        other => panic!("{other:?}"),
    }
    let sql = "SELECT count(*) FROM jobs WHERE queue = 'q2'";
    let url = &server.settings.database_url;
    assert_eq!(
        db_integers(backend, url, sql, &[]).await,
        [2],
        "the holder and the new job, once"
    );
    server.stop().await;
}

/// A job row changed behind the server's back so that it no longer parses
/// fails neither the claim that meets it (its neighbours are answered) nor
/// the reaper (other expired leases are still reclaimed): it is left out,
/// logged, and stays out of the queue.
async fn unreadable_rows_are_set_aside(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
        s.metrics_refresh = Duration::from_millis(100);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    // The reaper: two expired leases, one unreadable.
    let bad_running = submit(&mut jobs, "reaped", "k", json!({})).await;
    let good_running = submit(&mut jobs, "reaped", "k", json!({})).await;
    let leased = workers
        .lease(short_lease_req("gone", "reaped", 2, Duration::ZERO))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 2);
    mangle_row(&server, &bad_running.id).await;
    let back = wait_for_state(
        &mut jobs,
        &good_running.id,
        St::Queued,
        Duration::from_secs(6),
    )
    .await;
    assert_eq!(
        back.attempt, 1,
        "the readable job was reclaimed past the unreadable one"
    );

    // The claim: an unreadable job at the head of the queue.
    let bad_queued = submit(&mut jobs, "claimed", "k", json!({})).await;
    let good_queued = submit(&mut jobs, "claimed", "k", json!({})).await;
    mangle_row(&server, &bad_queued.id).await;
    let got = lease_now(&mut workers, "w", "claimed").await;
    let ids: Vec<&str> = got.iter().map(|j| j.job_id.as_str()).collect();
    assert_eq!(
        ids,
        [good_queued.id.as_str()],
        "the readable job is answered"
    );
    assert!(
        lease_now(&mut workers, "w", "claimed").await.is_empty(),
        "the unreadable job is out of the queue"
    );
    let leased_events = db_integers(
        server.backend,
        &server.settings.database_url,
        "SELECT count(*) FROM job_events WHERE CAST(job_id AS TEXT) = $1 AND type = 'leased'",
        &[&bad_queued.id],
    )
    .await;
    assert_eq!(
        leased_events,
        [1],
        "the unreadable job's lease is recorded like any other"
    );
    expect_code(
        jobs.get(pb::GetJobRequest {
            id: bad_queued.id.clone(),
        })
        .await,
        Code::Internal,
        "Get of an unreadable job",
    );
    // Both were counted: the claim met one, the reaper the other (again
    // every minute until mended).
    within(
        Duration::from_secs(10),
        "the unreadable rows to be counted",
        async {
            loop {
                let metrics = parse(&scrape(server.http_addr).await);
                if metrics.get("intray_unreadable_job_rows_total") >= Some(&2.0) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    server.stop().await;
}

async fn not_found_and_tenant_isolation(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut mine = server.jobs_client("alice");
    let mut theirs = server.jobs_client("mallory");

    let unknown = uuid::Uuid::now_v7().to_string();
    let job = submit(&mut mine, "private", "k", json!({"secret": "s3cr3t"})).await;

    for (client, id, who) in [
        (&mut mine, unknown.as_str(), "unknown id"),
        (&mut theirs, job.id.as_str(), "another tenant's job"),
    ] {
        let s = expect_code(
            client.get(pb::GetJobRequest { id: id.into() }).await,
            Code::NotFound,
            &format!("Get {who}"),
        );
        assert!(
            !s.message().contains("s3cr3t"),
            "no data of another tenant leaks"
        );
        expect_code(
            client
                .cancel(pb::CancelJobRequest {
                    id: id.into(),
                    reason: String::new(),
                })
                .await,
            Code::NotFound,
            &format!("Cancel {who}"),
        );
        let watch = client
            .watch_job(pb::WatchJobRequest {
                id: id.into(),
                after_sequence: 0,
            })
            .await;
        match watch {
            Err(s) => assert_eq!(s.code(), Code::NotFound, "WatchJob {who}: {s:?}"),
            Ok(resp) => {
                let mut stream = resp.into_inner();
                let first = within(LONG, "WatchJob NOT_FOUND", stream.next()).await;
                match first {
                    Some(Err(s)) => assert_eq!(s.code(), Code::NotFound, "WatchJob {who}: {s:?}"),
                    other => panic!("WatchJob {who}: expected NOT_FOUND, got {other:?}"),
                }
            }
        }
        expect_code(
            client
                .retry(pb::RetryJobRequest {
                    target: Some(pb::retry_job_request::Target::Id(id.into())),
                    ..Default::default()
                })
                .await,
            Code::NotFound,
            &format!("Retry {who}"),
        );
    }
    let j = get(&mut mine, &job.id).await;
    assert_eq!(
        state(&j),
        St::Queued,
        "the other tenant's Cancel did nothing"
    );
    assert!(
        list_all(&mut theirs, list_req()).await.is_empty(),
        "List is per tenant"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 11. reflection and health
// ---------------------------------------------------------------------------

const EXPECTED_SERVICES: [&str; 3] = [
    "intray.v1.JobService",
    "intray.v1.WorkerService",
    "grpc.health.v1.Health",
];

async fn reflection_and_health(backend: Backend) {
    let server = TestServer::start(backend).await;

    {
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut c = ServerReflectionClient::new(server.channel());
        let reqs = vec![
            ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::ListServices(String::new())),
            },
            ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::FileContainingSymbol(
                    "intray.v1.JobService".into(),
                )),
            },
        ];
        let mut stream = c
            .server_reflection_info(tokio_stream::iter(reqs))
            .await
            .expect("reflection v1")
            .into_inner();
        let first = within(LONG, "reflection v1", stream.next())
            .await
            .expect("a response")
            .expect("response");
        let names: Vec<String> = match first.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("v1 list_services: unexpected {other:?}"),
        };
        for s in EXPECTED_SERVICES {
            assert!(names.iter().any(|n| n == s), "v1 lists {s}: {names:?}");
        }
        let second = within(LONG, "reflection v1 symbol", stream.next())
            .await
            .expect("a response")
            .expect("response");
        match second.message_response {
            Some(MessageResponse::FileDescriptorResponse(f)) => {
                assert!(
                    !f.file_descriptor_proto.is_empty(),
                    "descriptor of JobService served"
                )
            }
            other => panic!("v1 file_containing_symbol: unexpected {other:?}"),
        }
    }
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let mut c = ServerReflectionClient::new(server.channel());
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = c
            .server_reflection_info(tokio_stream::once(req))
            .await
            .expect("reflection v1alpha")
            .into_inner();
        let first = within(LONG, "reflection v1alpha", stream.next())
            .await
            .expect("a response")
            .expect("response");
        let names: Vec<String> = match first.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("v1alpha list_services: unexpected {other:?}"),
        };
        for s in EXPECTED_SERVICES {
            assert!(names.iter().any(|n| n == s), "v1alpha lists {s}: {names:?}");
        }
    }

    use tonic_health::pb::health_check_response::ServingStatus;
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel());
    for service in ["", "intray.v1.JobService", "intray.v1.WorkerService"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|s| panic!("Health.Check({service:?}): {s:?}"))
            .into_inner();
        assert_eq!(
            r.status,
            ServingStatus::Serving as i32,
            "Health.Check({service:?}) is SERVING"
        );
    }
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 12. List and Stats
// ---------------------------------------------------------------------------

async fn list_filters_and_pagination(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let labelled = |q: &str, k: &str, labels: &[(&str, &str)]| {
        let mut r = submit_req(q, k, json!({}));
        for (key, v) in labels {
            r.labels.insert((*key).into(), (*v).into());
        }
        r
    };
    let a = submit_with(&mut jobs, labelled("fa", "k1", &[("team", "a")]))
        .await
        .id;
    let b = submit_with(
        &mut jobs,
        labelled("fa", "k2", &[("team", "b"), ("env", "prod")]),
    )
    .await
    .id;
    let c = submit_with(&mut jobs, labelled("fb", "k1", &[("team", "b")]))
        .await
        .id;
    let d = make_failed(&mut jobs, &mut workers, "fc", "boom").await.id;
    let e = make_failed(&mut jobs, &mut workers, "fc", "other").await.id;

    let set = |v: &[&String]| v.iter().map(|s| (*s).clone()).collect::<HashSet<String>>();
    let mut check = async |f: pb::ListJobsRequest, want: HashSet<String>, what: &str| {
        let got = ids(&list_all(&mut jobs, f).await);
        assert_eq!(got, want, "List filter {what}");
    };
    check(list_req(), set(&[&a, &b, &c, &d, &e]), "none").await;
    check(
        pb::ListJobsRequest {
            queue: "fa".into(),
            ..list_req()
        },
        set(&[&a, &b]),
        "queue",
    )
    .await;
    check(
        pb::ListJobsRequest {
            kind: "k1".into(),
            ..list_req()
        },
        set(&[&a, &c]),
        "kind",
    )
    .await;
    check(
        pb::ListJobsRequest {
            queue: "fa".into(),
            kind: "k2".into(),
            ..list_req()
        },
        set(&[&b]),
        "queue+kind",
    )
    .await;
    check(
        pb::ListJobsRequest {
            states: vec![St::Failed as i32],
            ..list_req()
        },
        set(&[&d, &e]),
        "states=[FAILED]",
    )
    .await;
    check(
        pb::ListJobsRequest {
            states: vec![St::Queued as i32],
            ..list_req()
        },
        set(&[&a, &b, &c]),
        "states=[QUEUED]",
    )
    .await;
    check(
        pb::ListJobsRequest {
            states: vec![St::Queued as i32, St::Failed as i32],
            ..list_req()
        },
        set(&[&a, &b, &c, &d, &e]),
        "states=[QUEUED,FAILED]",
    )
    .await;
    check(
        pb::ListJobsRequest {
            error_class: "boom".into(),
            ..list_req()
        },
        set(&[&d]),
        "error_class",
    )
    .await;
    let labels = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect::<HashMap<_, _>>()
    };
    check(
        pb::ListJobsRequest {
            labels: labels(&[("team", "b")]),
            ..list_req()
        },
        set(&[&b, &c]),
        "labels team=b",
    )
    .await;
    check(
        pb::ListJobsRequest {
            labels: labels(&[("team", "b"), ("env", "prod")]),
            ..list_req()
        },
        set(&[&b]),
        "labels team=b,env=prod",
    )
    .await;
    check(
        pb::ListJobsRequest {
            labels: labels(&[("team", "b"), ("env", "dev")]),
            ..list_req()
        },
        HashSet::new(),
        "labels team=b,env=dev",
    )
    .await;

    // Keyset pagination, newest first.
    let mut submitted = Vec::new();
    for i in 0..25 {
        submitted.push(submit(&mut jobs, "page", "k", json!({"i": i})).await.id);
    }
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = jobs
            .list(pb::ListJobsRequest {
                queue: "page".into(),
                page_size: Some(10),
                page_token: token.clone(),
                ..list_req()
            })
            .await
            .expect("List page")
            .into_inner();
        let last = page.next_page_token.is_empty();
        pages.push(page);
        if last || pages.len() > 5 {
            break;
        }
        token = pages.last().expect("page").next_page_token.clone();
    }
    let sizes: Vec<usize> = pages.iter().map(|p| p.jobs.len()).collect();
    assert_eq!(sizes, vec![10, 10, 5], "page sizes");
    assert!(!pages[0].next_page_token.is_empty() && !pages[1].next_page_token.is_empty());
    assert!(
        pages[2].next_page_token.is_empty(),
        "last page has no next token"
    );
    let listed: Vec<String> = pages
        .iter()
        .flat_map(|p| p.jobs.iter().map(|j| j.id.clone()))
        .collect();
    let unique: HashSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), 25, "no duplicates across pages");
    let newest_first: Vec<String> = submitted.iter().rev().cloned().collect();
    assert_eq!(listed, newest_first, "newest first");

    // A page that ends the list exactly says so: no token to an empty page.
    let exact = jobs
        .list(pb::ListJobsRequest {
            queue: "page".into(),
            page_size: Some(5),
            page_token: pages[1].next_page_token.clone(),
            ..list_req()
        })
        .await
        .expect("List the last five")
        .into_inner();
    assert_eq!(exact.jobs.len(), 5, "the last page is full");
    assert!(
        exact.next_page_token.is_empty(),
        "a full page that ends the list has no next token"
    );
    server.stop().await;
}

async fn stats_counts(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let s0 = submit(&mut jobs, "s1", "k", json!({})).await;
    let l = lease_one(&mut workers, "finisher", "s1").await;
    assert_eq!(l.job_id, s0.id);
    complete_ok(&mut workers, &l).await;
    make_failed(&mut jobs, &mut workers, "s1", "boom").await;
    make_failed(&mut jobs, &mut workers, "s1", "boom").await;
    submit(&mut jobs, "s1", "k", json!({})).await;
    let held = lease_one(&mut workers, "stats-worker", "s1").await;
    let t_queued = Instant::now();
    for _ in 0..3 {
        submit(&mut jobs, "s1", "k", json!({})).await;
    }
    submit(&mut jobs, "s2", "k", json!({})).await;

    let stats = jobs
        .stats(pb::StatsRequest::default())
        .await
        .expect("Stats")
        .into_inner();
    let count = |qs: &pb::QueueStats, s: St| {
        qs.counts
            .iter()
            .filter(|c| c.state == s as i32)
            .map(|c| c.count)
            .sum::<u64>()
    };
    let s1 = stats
        .queues
        .iter()
        .find(|q| q.queue == "s1")
        .expect("stats for s1");
    let s2 = stats
        .queues
        .iter()
        .find(|q| q.queue == "s2")
        .expect("stats for s2");
    assert_eq!(count(s1, St::Queued), 3, "s1 queued: {s1:?}");
    assert_eq!(count(s1, St::Running), 1, "s1 running: {s1:?}");
    assert_eq!(count(s1, St::Succeeded), 1, "s1 succeeded: {s1:?}");
    assert_eq!(count(s1, St::Failed), 2, "s1 failed: {s1:?}");
    assert_eq!(count(s1, St::Cancelled), 0);
    assert_eq!(s1.running, 1);
    assert_eq!(s1.dead, 2, "dead counts FAILED");
    let age = to_std(
        s1.oldest_runnable_age
            .as_ref()
            .expect("oldest_runnable_age for s1"),
    );
    assert!(
        age <= t_queued.elapsed() + Duration::from_secs(1),
        "oldest runnable age {age:?} is no older than the queued jobs"
    );
    assert_eq!(count(s2, St::Queued), 1);
    assert_eq!(s2.dead, 0);
    assert_eq!(s2.running, 0);

    let w = stats
        .workers
        .iter()
        .find(|w| w.worker_id == "stats-worker")
        .unwrap_or_else(|| panic!("stats-worker listed: {:?}", stats.workers));
    assert_eq!(w.leases_held, 1);
    assert!(
        w.queues.iter().any(|q| q == "s1"),
        "worker queues: {:?}",
        w.queues
    );
    assert!(w.last_lease_at.is_some());
    let f = stats
        .workers
        .iter()
        .find(|w| w.worker_id == "finisher")
        .unwrap_or_else(|| panic!("finisher listed: {:?}", stats.workers));
    assert_eq!(f.leases_held, 0, "a worker that completed holds nothing");

    let only = jobs
        .stats(pb::StatsRequest { queue: "s2".into() })
        .await
        .expect("Stats s2")
        .into_inner();
    let names: Vec<&str> = only.queues.iter().map(|q| q.queue.as_str()).collect();
    assert_eq!(names, vec!["s2"], "Stats for one queue");
    drop(held);
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 13. SubmitBatch, 14. CompleteBatch
// ---------------------------------------------------------------------------

async fn submit_batch_partial(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");

    let mut keyed = submit_req("b", "k", json!({"keyed": true}));
    keyed.idempotency_key = "batch-key".into();
    let original = submit_with(&mut jobs, keyed.clone()).await;
    let mut conflicting = keyed.clone();
    conflicting.payload = Some(json_to_value(json!({"keyed": false})));

    let mut nul_key = submit_req("b", "k", json!({"i": 5}));
    nul_key.idempotency_key = "a\0b".into();
    let items = vec![
        submit_req("b", "k", json!({"i": 0})),
        submit_req("b", "", json!({"i": 1})),
        submit_req("b", "k", json!({"i": 2})),
        keyed,
        conflicting,
        nul_key,
    ];
    let res = jobs
        .submit_batch(pb::SubmitBatchRequest { jobs: items })
        .await
        .expect("SubmitBatch")
        .into_inner()
        .results;
    assert_eq!(res.len(), 6, "one result per item");
    use pb::submit_batch_result::Result as R;
    let created = |r: &pb::SubmitBatchResult| match &r.result {
        Some(R::Ok(ok)) => (ok.created, ok.job.clone().expect("job")),
        other => panic!("expected an ok item, got {other:?}"),
    };
    let (c0, j0) = created(&res[0]);
    let (c2, j2) = created(&res[2]);
    assert!(c0 && c2);
    assert_eq!(state(&j0), St::Queued);
    match &res[1].result {
        Some(R::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32);
            assert!(
                e.field == "kind" || e.field == "jobs[1].kind",
                "item error names the field: {e:?}"
            );
        }
        other => panic!("item 1 should fail alone, got {other:?}"),
    }
    let (c3, j3) = created(&res[3]);
    assert!(!c3, "an idempotent item returns the original");
    assert_eq!(j3.id, original.id);
    match &res[4].result {
        Some(R::Error(e)) => assert_eq!(e.code, Code::AlreadyExists as i32, "{e:?}"),
        other => panic!("item 4 reuses a key with other input, got {other:?}"),
    }
    match &res[5].result {
        Some(R::Error(e)) => assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}"),
        other => panic!("item 5 has NUL in its key, got {other:?}"),
    }
    let all = ids(&list_all(&mut jobs, list_req()).await);
    let want: HashSet<String> = [j0.id, j2.id, original.id].into_iter().collect();
    assert_eq!(all, want, "only the valid items were stored");
    server.stop().await;
}

async fn complete_batch_stale_item(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "cb", "k", json!({"n": 1})).await;
    submit(&mut jobs, "cb", "k", json!({"n": 2})).await;
    let leased = workers
        .lease(lease_req("w", "cb", 2, Duration::from_secs(5)))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 2, "max_jobs 2 leases both");
    let (good, stale) = (&leased[0], &leased[1]);
    let mut forged = stale.clone();
    forged.lease_token = uuid::Uuid::new_v4().to_string();

    let res = workers
        .complete_batch(pb::CompleteBatchRequest {
            items: vec![
                success_req(good, json!("good")),
                success_req(&forged, json!("stale")),
                success_req(good, json!("again")),
            ],
        })
        .await
        .expect("CompleteBatch")
        .into_inner()
        .results;
    assert_eq!(res.len(), 3);
    use pb::complete_batch_result::Result as R;
    match &res[0].result {
        Some(R::Job(j)) => {
            assert_eq!(j.id, good.job_id);
            assert_eq!(state(j), St::Succeeded);
        }
        other => panic!("item 0 should succeed, got {other:?}"),
    }
    match &res[1].result {
        Some(R::Error(e)) => assert_eq!(e.code, Code::Aborted as i32, "{e:?}"),
        other => panic!("item 1 has a stale token, got {other:?}"),
    }
    match &res[2].result {
        Some(R::Error(e)) => assert_eq!(e.code, Code::Aborted as i32, "{e:?}"),
        other => panic!("item 2 repeats item 0's job, which it ended, got {other:?}"),
    }
    let good_job = get(&mut jobs, &good.job_id).await;
    assert_eq!(state(&good_job), St::Succeeded);
    assert_eq!(
        good_job.result,
        Some(json_to_value(json!("good"))),
        "the first outcome stands"
    );
    let s = get(&mut jobs, &stale.job_id).await;
    assert_eq!(state(&s), St::Running, "the stale item wrote nothing");
    assert!(s.result.is_none());
    let done = complete_ok(&mut workers, stale).await;
    assert_eq!(state(&done), St::Succeeded);
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 15. deadline
// ---------------------------------------------------------------------------

/// SPEC 2: "deadline passed while QUEUED ... -> EXPIRED"; nobody leases it.
async fn deadline_expires_queued(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("dlq", "k", json!({}));
    r.deadline = Some(ts(Utc::now() + chrono::Duration::seconds(1)));
    let t0 = Instant::now();
    let job = submit_with(&mut jobs, r).await;
    let expired = wait_for_state(&mut jobs, &job.id, St::Expired, Duration::from_secs(6)).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "expired only once the deadline passed: {:?}",
        t0.elapsed()
    );
    assert!(expired.finished_at.is_some());
    assert_eq!(expired.attempt, 0);
    let got = lease_now(&mut workers, "w", "dlq").await;
    assert!(got.is_empty(), "an expired job is never leased: {got:?}");
    let ev = event_types(&watch_all(&mut jobs, &job.id, 0, LONG).await);
    assert_eq!(ev, vec![Ev::Submitted, Ev::Expired]);
    server.stop().await;
}

/// A job whose deadline comes before its run_at could never run: the submit
/// is refused (README, "Deviations") and nothing is written.
async fn deadline_before_run_at(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");

    let now = Utc::now();
    let mut r = submit_req("dl", "k", json!({}));
    r.deadline = Some(ts(now + chrono::Duration::seconds(1)));
    r.run_at = Some(ts(now + chrono::Duration::seconds(3)));
    expect_invalid(
        jobs.submit(r).await,
        &["deadline"],
        "deadline before run_at",
    );
    // Apart by less than the stores' millisecond: equal once stored (on
    // SQLite), and refused on both backends alike.
    let at = chrono::DateTime::from_timestamp_millis(
        (now + chrono::Duration::seconds(60)).timestamp_millis(),
    )
    .expect("a time");
    let mut r = submit_req("dl", "k", json!({}));
    r.run_at = Some(ts(at + chrono::Duration::microseconds(200)));
    r.deadline = Some(ts(at + chrono::Duration::microseconds(700)));
    expect_invalid(
        jobs.submit(r).await,
        &["deadline"],
        "deadline within run_at's millisecond",
    );
    let listed = jobs
        .list(pb::ListJobsRequest::default())
        .await
        .expect("List")
        .into_inner()
        .jobs;
    assert!(
        listed.is_empty(),
        "a refused submit writes nothing: {listed:?}"
    );
    server.stop().await;
}

/// SPEC 2: the deadline passing while the job waits for its next attempt.
async fn deadline_between_attempts(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("dl2", "k", json!({}));
    r.deadline = Some(ts(Utc::now() + chrono::Duration::milliseconds(1500)));
    let job = submit_with(&mut jobs, r).await;
    let l = lease_one(&mut workers, "w", "dl2").await;
    let requeued = workers
        .complete(failure_req(
            &l,
            "slow",
            Some(true),
            Some(Duration::from_millis(10)),
        ))
        .await
        .expect("Complete(failure)")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(
        state(&requeued),
        St::Queued,
        "deadline not passed yet: requeued"
    );
    let expired = wait_for_state(&mut jobs, &job.id, St::Expired, Duration::from_secs(6)).await;
    assert_eq!(expired.attempt, 1);
    let ev = event_types(&watch_all(&mut jobs, &job.id, 0, LONG).await);
    assert_eq!(
        ev,
        vec![Ev::Submitted, Ev::Leased, Ev::RetryScheduled, Ev::Expired]
    );
    server.stop().await;
}

/// SPEC 3 Complete: a retryable failure with attempts left and the deadline
/// not yet passed goes back to QUEUED, even when its retry delay ends after
/// the deadline; the deadline then passes while it waits -> EXPIRED.
async fn retry_beyond_deadline_expires(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.reaper_interval = Duration::from_millis(200);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let mut r = submit_req("dl3", "k", json!({}));
    r.deadline = Some(ts(Utc::now() + chrono::Duration::milliseconds(1500)));
    let job = submit_with(&mut jobs, r).await;
    let l = lease_one(&mut workers, "w", "dl3").await;
    let requeued = workers
        .complete(failure_req(
            &l,
            "slow",
            Some(true),
            Some(Duration::from_secs(10)),
        ))
        .await
        .expect("Complete(failure)")
        .into_inner()
        .job
        .expect("job");
    assert_eq!(
        state(&requeued),
        St::Queued,
        "deadline not passed yet: requeued"
    );
    let expired = wait_for_state(&mut jobs, &job.id, St::Expired, Duration::from_secs(6)).await;
    assert_eq!(expired.attempt, 1);
    let ev = event_types(&watch_all(&mut jobs, &job.id, 0, LONG).await);
    assert_eq!(
        ev,
        vec![Ev::Submitted, Ev::Leased, Ev::RetryScheduled, Ev::Expired]
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// extra: claim order and kind filter
// ---------------------------------------------------------------------------

/// The job a transition answers with reads as a later `Get` reads it: its
/// times at the precision the database keeps (SQLite milliseconds,
/// PostgreSQL microseconds), not the finer one of the clock it came from.
async fn answers_read_as_the_job_is_stored(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let times = |job: &pb::Job| (job.updated_at, job.finished_at);
    let queued = submit(&mut jobs, "stored", "k", json!({})).await;
    let cancelled = jobs
        .cancel(pb::CancelJobRequest {
            id: queued.id.clone(),
            reason: String::new(),
        })
        .await
        .expect("Cancel")
        .into_inner();
    assert_eq!(times(&cancelled), times(&get(&mut jobs, &queued.id).await));
    // Through the replica that leased it, as workers mostly do.
    for _ in 0..20 {
        let job = submit(&mut jobs, "stored", "k", json!({})).await;
        let leased = lease_one(&mut workers, "w", "stored").await;
        let done = complete_ok(&mut workers, &leased).await;
        assert_eq!(times(&done), times(&get(&mut jobs, &job.id).await));
    }
    server.stop().await;
}

/// A `Lease` naming a queue twice gets as many jobs as it asks for, not
/// fewer (each job was a candidate twice and took two slots).
async fn a_queue_named_twice_in_a_lease_counts_once(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    for _ in 0..3 {
        submit(&mut jobs, "twice", "k", json!({})).await;
    }
    let mut r = lease_req("w", "twice", 3, Duration::ZERO);
    r.queues.push("twice".into());
    let leased = workers.lease(r).await.expect("Lease").into_inner().jobs;
    assert_eq!(leased.len(), 3);
    server.stop().await;
}

async fn lease_order_and_kind_filter(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");

    let with = |prio: i32, run_at: Option<chrono::DateTime<Utc>>, kind: &str| {
        let mut r = submit_req("ord", kind, json!({}));
        r.priority = prio;
        r.run_at = run_at.map(ts);
        r
    };
    let p0 = submit_with(&mut jobs, with(0, None, "main")).await.id;
    let pa = submit_with(&mut jobs, with(1, None, "main")).await.id;
    let p10 = submit_with(&mut jobs, with(10, None, "main")).await.id;
    let pb_ = submit_with(&mut jobs, with(1, None, "main")).await.id;
    let neg = submit_with(&mut jobs, with(-5, None, "main")).await.id;
    let pc = submit_with(
        &mut jobs,
        with(1, Some(Utc::now() - chrono::Duration::hours(1)), "main"),
    )
    .await
    .id;
    let p5 = submit_with(&mut jobs, with(5, None, "main")).await.id;
    let future = submit_with(
        &mut jobs,
        with(1000, Some(Utc::now() + chrono::Duration::hours(1)), "main"),
    )
    .await
    .id;
    let other = submit_with(&mut jobs, with(100, None, "other")).await.id;

    let mut order = Vec::new();
    loop {
        let got = workers
            .lease(pb::LeaseRequest {
                worker_id: "w".into(),
                queues: vec!["ord".into()],
                kinds: vec!["main".into()],
                max_jobs: Some(1),
                ..Default::default()
            })
            .await
            .expect("Lease")
            .into_inner()
            .jobs;
        match got.as_slice() {
            [] => break,
            [one] => order.push(one.job_id.clone()),
            many => panic!("max_jobs 1 returned {}", many.len()),
        }
        assert!(order.len() <= 10, "too many leases");
    }
    assert_eq!(
        order,
        vec![p10, p5, pc, pa, pb_, p0, neg],
        "highest priority first, then oldest run_at; kind filter honoured; future run_at waits"
    );
    assert!(!order.contains(&future));
    let rest = lease_now(&mut workers, "w", "ord").await;
    let rest: Vec<String> = rest.into_iter().map(|l| l.job_id).collect();
    assert_eq!(
        rest,
        vec![other],
        "without a kind filter the other kind is leased"
    );

    // One claim across several priority levels, with levels that have only
    // jobs scheduled for later above them: the order holds within one lease.
    let ord2 = |prio: i32, later: bool| {
        let mut r = submit_req("ord2", "main", json!({}));
        r.priority = prio;
        r.run_at = later.then(|| ts(Utc::now() + chrono::Duration::hours(1)));
        r
    };
    let mut expected = Vec::new();
    for (prio, later) in [
        (7, true),
        (3, false),
        (9, true),
        (-1, false),
        (3, false),
        (0, false),
    ] {
        let id = submit_with(&mut jobs, ord2(prio, later)).await.id;
        if !later {
            expected.push((prio, id));
        }
    }
    // Stable: equal priorities stay in submit (run_at) order.
    expected.sort_by_key(|(prio, _)| -prio);
    let expected: Vec<String> = expected.into_iter().map(|(_, id)| id).collect();
    let got = workers
        .lease(lease_req("w", "ord2", 10, Duration::ZERO))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    let got: Vec<String> = got.into_iter().map(|l| l.job_id).collect();
    assert_eq!(got, expected, "one lease: levels in order, later jobs left");
    server.stop().await;
}

// ---------------------------------------------------------------------------
// Coalescing (issue 6): concurrent unary calls share transactions, and an
// item refused inside a shared transaction leaves its neighbours committed.
// ---------------------------------------------------------------------------

async fn coalesced_neighbours_are_independent(backend: Backend) {
    // One shared transaction at a time: concurrent calls queue up behind it
    // and go into the next one together.
    let server = TestServer::start_with(backend, |s| {
        s.coalesce_in_flight = 1;
        s.submit_in_flight = 1;
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut keyed = submit_req("co", "k", json!({"v": "original"}));
    keyed.idempotency_key = "shared-key".into();
    let original = submit_with(&mut jobs, keyed.clone()).await;

    // 64 concurrent Submits: every fourth reuses the key with other input
    // (refused), every fourth-plus-one with the same input (the original).
    let submits = (0..64).map(|i| {
        let mut jobs = server.jobs_client("t");
        let mut r = match i % 4 {
            0 => {
                let mut r = keyed.clone();
                r.payload = Some(json_to_value(json!({"v": i})));
                r
            }
            1 => keyed.clone(),
            _ => submit_req("co", "k", json!({"i": i})),
        };
        if i % 4 > 1 {
            r.idempotency_key = format!("own-{i}");
        }
        tokio::spawn(async move { (i, jobs.submit(r).await) })
    });
    let mut fresh = HashSet::new();
    for joined in futures::future::join_all(submits).await {
        let (i, answer) = joined.expect("joined");
        match i % 4 {
            0 => assert_eq!(answer.expect_err("conflict").code(), Code::AlreadyExists),
            1 => {
                let r = answer.expect("same input").into_inner();
                assert!(!r.created);
                assert_eq!(r.job.expect("job").id, original.id);
            }
            _ => {
                let r = answer.expect("new job").into_inner();
                assert!(r.created);
                fresh.insert(r.job.expect("job").id);
            }
        }
    }
    assert_eq!(fresh.len(), 32);
    let mut stored = ids(&list_all(&mut jobs, list_req()).await);
    assert!(stored.remove(&original.id));
    assert_eq!(
        stored, fresh,
        "every accepted neighbour of a refused item was stored"
    );

    // 40 concurrent Leases of one job each for 33 jobs: no job twice.
    let leases = (0..40).map(|i| {
        let mut workers = server.workers_client("t");
        tokio::spawn(async move {
            workers
                .lease(lease_req(&format!("w{i}"), "co", 1, Duration::ZERO))
                .await
                .expect("Lease")
                .into_inner()
                .jobs
        })
    });
    let mut leased = Vec::new();
    for joined in futures::future::join_all(leases).await {
        let got = joined.expect("joined");
        assert!(got.len() <= 1, "max_jobs 1 got {}", got.len());
        leased.extend(got);
    }
    let distinct: HashSet<&str> = leased.iter().map(|l| l.job_id.as_str()).collect();
    assert_eq!(leased.len(), 33, "all 33 queued jobs leased");
    assert_eq!(distinct.len(), 33, "no job leased twice");

    // Concurrent Completes, every third with a forged token: those are
    // ABORTED and write nothing; their neighbours succeed.
    let completes = leased.iter().enumerate().map(|(i, l)| {
        let mut workers = server.workers_client("t");
        let mut l = l.clone();
        if i % 3 == 0 {
            l.lease_token = uuid::Uuid::new_v4().to_string();
        }
        tokio::spawn(async move {
            (
                i,
                l.job_id.clone(),
                workers
                    .complete(success_req(&l, json!(format!("r{i}"))))
                    .await,
            )
        })
    });
    for joined in futures::future::join_all(completes).await {
        let (i, id, answer) = joined.expect("joined");
        let job = get(&mut jobs, &id).await;
        if i % 3 == 0 {
            assert_eq!(answer.expect_err("forged").code(), Code::Aborted);
            assert_eq!(state(&job), St::Running, "a refused complete wrote nothing");
        } else {
            answer.expect("complete");
            assert_eq!(state(&job), St::Succeeded);
            assert_eq!(
                job.result.as_ref().map(value_to_json),
                Some(json!(format!("r{i}")))
            );
        }
    }
    server.stop().await;
}

/// PostgreSQL's `Complete` reads the job without a lock and writes it only if
/// the row is unchanged. Here the row changes between the two (progress set
/// behind the server's back, as a heartbeat would, without an event): the
/// write must see it and redo the outcome on the new row rather than write
/// over it with what it read.
async fn complete_keeps_a_change_made_after_its_read() {
    use sqlx::Connection;
    let server = TestServer::start(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "race", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "race").await;
    let url = server.settings.database_url.clone();
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
    let mut watcher = sqlx::PgConnection::connect(&url).await.expect("connect");
    let id = uuid::Uuid::parse_str(&job.id).expect("a UUID");

    // Holding the row lock lets Complete's read through and stops its write.
    let mut tx = holder.begin().await.expect("BEGIN");
    sqlx::query("SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("lock the row");
    let mut completer = workers.clone();
    let call = leased.clone();
    let completing =
        tokio::spawn(async move { completer.complete(success_req(&call, json!("r"))).await });
    let deadline = Instant::now() + LONG;
    loop {
        if lock_waiters(&mut watcher).await > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Complete never waited for the row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sqlx::query("UPDATE jobs SET progress = 0.5 WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("change the row");
    tx.commit().await.expect("COMMIT");

    let done = completing
        .await
        .expect("joined")
        .expect("Complete succeeds on the changed row")
        .into_inner();
    let done = done.job.expect("CompleteResponse.job is set");
    assert_eq!(state(&done), St::Succeeded);
    let stored = get(&mut jobs, &job.id).await;
    assert_eq!(state(&stored), St::Succeeded);
    assert_eq!(
        stored.progress, 0.5,
        "the change made after the read is kept"
    );
    let events = watch_all_until_now(&mut jobs, &job.id).await;
    let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    let expected: Vec<u64> = (1..=events.len() as u64).collect();
    assert_eq!(sequences, expected, "one gap-free history");
    assert_eq!(
        events
            .iter()
            .filter(|e| e.r#type() == Ev::Succeeded)
            .count(),
        1,
        "one outcome recorded"
    );
    server.stop().await;
}

/// A `Cancel` whose caller gives up while its COMMIT is in flight still
/// commits, and its watchers hear of it then, not at their fallback poll
/// (30 s): the wake-up after a commit ran in the handler, which was dropped
/// with the call. A deferred trigger holds the COMMIT of a cancel for a
/// second; the call's deadline is 300 ms.
async fn a_write_whose_caller_left_mid_commit_still_wakes_its_watchers() {
    use sqlx::Connection;
    let server = TestServer::start(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let job = submit(&mut jobs, "slow", "k", json!({})).await;
    let mut watch = open_watch(&mut jobs, &job.id, 0).await;
    let submitted = next_event(&mut watch, LONG, "the submit's event").await;
    assert_eq!(submitted.r#type(), Ev::Submitted);

    let mut admin = sqlx::PgConnection::connect(&server.settings.database_url)
        .await
        .expect("connect");
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_cancel AFTER UPDATE ON jobs
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
             WHEN (NEW.state = 'cancelled') EXECUTE FUNCTION slow_commit();",
    )
    .execute(&mut admin)
    .await
    .expect("install the slow commit");

    let started = Instant::now();
    let mut call = req(
        "t",
        pb::CancelJobRequest {
            id: job.id.clone(),
            reason: "gave up waiting".into(),
        },
    );
    call.set_timeout(Duration::from_millis(300));
    let gave_up = jobs.cancel(call).await;
    assert!(
        gave_up.is_err(),
        "the caller went away before the COMMIT ended: {gave_up:?}"
    );
    let cancelled = next_event(&mut watch, Duration::from_secs(5), "the cancel's event").await;
    assert_eq!(cancelled.r#type(), Ev::Cancelled);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "heard {:?} after the cancel",
        started.elapsed()
    );
    assert_eq!(state(&get(&mut jobs, &job.id).await), St::Cancelled);
    server.stop().await;
}

/// The replica that grants a lease keeps the job as the lease left it, so
/// that its `Complete` need not read it back; what another replica changed
/// in between must still decide that `Complete`.
async fn complete_where_leased_sees_another_replicas_changes() {
    let server = TestServer::start(Backend::Postgres).await;
    let replica = server.start_replica().await;
    let mut jobs = server.jobs_client("t");
    let mut here = server.workers_client("t");
    let mut there = replica.workers_client("t");

    // Progress reported through the other replica is kept, in order.
    let job = submit(&mut jobs, "granted", "k", json!({})).await;
    let leased = lease_one(&mut here, "w1", "granted").await;
    there
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: None,
            progress: Some(0.5),
            message: "halfway".into(),
        })
        .await
        .expect("Heartbeat through the other replica");
    let done = complete_ok(&mut here, &leased).await;
    assert_eq!(state(&done), St::Succeeded);
    let events = watch_all_until_now(&mut jobs, &job.id).await;
    assert_eq!(
        event_types(&events),
        [Ev::Submitted, Ev::Leased, Ev::Progress, Ev::Succeeded]
    );
    assert_eq!(sequences(&events), [1, 2, 3, 4], "one gap-free history");

    // A lease that ran out and went to another worker through the other
    // replica: the first worker's late Complete is refused where it was
    // granted, and the second worker's counts.
    let (first, second) = run_out_and_leased_again(&mut jobs, &mut here, &mut there).await;
    expect_code(
        here.complete(success_req(&first, json!("late"))).await,
        Code::Aborted,
        "Complete under a lease that went to another worker",
    );
    let done = complete_ok(&mut there, &second).await;
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.attempt, 2, "the second attempt's outcome stands");
    assert_eq!(
        done.result,
        Some(json_to_value(json!({"done": true}))),
        "the late result was not written"
    );

    // The same, but the second worker's Complete reaches the replica that
    // still keeps the first lease (a client spreading its calls over
    // replicas): the row decides, not the lease kept there.
    let (_, second) = run_out_and_leased_again(&mut jobs, &mut here, &mut there).await;
    let done = complete_ok(&mut here, &second).await;
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.attempt, 2);

    // A lease extended through the other replica past the end the granting
    // replica knows of: its Complete there is still in time.
    let job = submit(&mut jobs, "granted", "k", json!({})).await;
    let leased = leased_for_a_second(&mut here).await;
    there
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: Some(secs(30)),
            progress: None,
            message: String::new(),
        })
        .await
        .expect("Heartbeat through the other replica");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let done = complete_ok(&mut here, &leased).await;
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.attempt, 1);

    // A cancel requested through the other replica: the worker's success
    // where the lease was granted ends the job CANCELLED, its result
    // discarded, as on one replica.
    let mut jobs_there = replica.jobs_client("t");
    let leased = leased_then_cancelled_there(&mut jobs, &mut here, &mut jobs_there).await;
    let done = complete_ok(&mut here, &leased).await;
    assert_eq!(state(&done), St::Cancelled);
    assert_eq!(done.result, None, "the result is discarded");

    // Heartbeats through the granting replica, with progress and without
    // an event, bring the job it keeps up to date: its Complete there
    // keeps the progress, in one gap-free history.
    let job = submit(&mut jobs, "granted", "k", json!({})).await;
    let leased = lease_one(&mut here, "w1", "granted").await;
    for progress in [Some(0.25), None, Some(0.75)] {
        here.heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: Some(secs(30)),
            progress,
            message: String::new(),
        })
        .await
        .expect("Heartbeat where the lease was granted");
    }
    let done = complete_ok(&mut here, &leased).await;
    assert_eq!(state(&done), St::Succeeded);
    assert_eq!(done.progress, 0.75);
    let events = watch_all_until_now(&mut jobs, &job.id).await;
    assert_eq!(
        event_types(&events),
        [
            Ev::Submitted,
            Ev::Leased,
            Ev::Progress,
            Ev::Progress,
            Ev::Succeeded
        ]
    );
    assert_eq!(sequences(&events), [1, 2, 3, 4, 5], "one gap-free history");

    // A cancel requested through the other replica, then a heartbeat where
    // the lease was granted: the heartbeat returns only what heartbeats
    // change, so the job kept there must not be taken as whole again; the
    // worker's success ends the job CANCELLED.
    let leased = leased_then_cancelled_there(&mut jobs, &mut here, &mut jobs_there).await;
    let beat = here
        .heartbeat(pb::HeartbeatRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: None,
            progress: Some(0.5),
            message: String::new(),
        })
        .await
        .expect("Heartbeat where the lease was granted")
        .into_inner();
    assert!(beat.cancel_requested, "the heartbeat hears of the cancel");
    let done = complete_ok(&mut here, &leased).await;
    assert_eq!(state(&done), St::Cancelled);
    assert_eq!(done.result, None, "the result is discarded");
    replica.stop().await;
    server.stop().await;
}

/// Submits a job to queue `granted`, leases it to `w1` through `here` and
/// cancels it through `there` (another replica's client): the lease the
/// cancel request reaches.
async fn leased_then_cancelled_there(
    jobs: &mut JobsClient,
    here: &mut WorkersClient,
    there: &mut JobsClient,
) -> pb::LeasedJob {
    let job = submit(jobs, "granted", "k", json!({})).await;
    let leased = lease_one(here, "w1", "granted").await;
    there
        .cancel(pb::CancelJobRequest {
            id: job.id,
            reason: "stop".into(),
        })
        .await
        .expect("Cancel through the other replica");
    leased
}

/// Submits a job to queue `granted`, leases it to `w1` through `here` for
/// a second, waits until the reaper has taken the lease back and leases it
/// again to `w2` through `there`: the run-out lease and the new one.
async fn run_out_and_leased_again(
    jobs: &mut JobsClient,
    here: &mut WorkersClient,
    there: &mut WorkersClient,
) -> (pb::LeasedJob, pb::LeasedJob) {
    let job = submit(jobs, "granted", "k", json!({})).await;
    let first = leased_for_a_second(here).await;
    wait_for_state(jobs, &job.id, St::Queued, Duration::from_secs(8)).await;
    let second = lease_one(there, "w2", "granted").await;
    assert_eq!(second.job_id, job.id);
    (first, second)
}

/// Leases one job of queue `granted` to `w1` for a second.
async fn leased_for_a_second(workers: &mut WorkersClient) -> pb::LeasedJob {
    let mut leased = workers
        .lease(short_lease_req("w1", "granted", 1, Duration::ZERO))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 1, "the job is leased");
    leased.remove(0)
}
