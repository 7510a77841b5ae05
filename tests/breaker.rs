//! Circuit breakers per queue and kind, on both backends through real gRPC.

mod common;

use std::time::Duration;

use common::*;
use intray::pb;
use serde_json::json;

common::backend_tests!(
    breaker_opens_probes_and_closes,
    breaker_honours_retry_after,
    breakers_turned_off_clear_those_left_open,
);

mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_breaker_begun_after_the_lease_counts_its_success() {
        super::a_breaker_begun_after_the_lease_counts_its_success().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_half_open_breaker_sends_one_probe_across_replicas() {
        super::a_half_open_breaker_sends_one_probe_across_replicas().await
    }
}

fn with_breaker(threshold: u32, cooldown: Duration) -> impl FnOnce(&mut intray::config::Settings) {
    move |s| {
        s.breaker.threshold = threshold;
        s.breaker.cooldown = cooldown;
    }
}

async fn lease_kind(workers: &mut WorkersClient, kind: &str, max_jobs: u32) -> Vec<pb::LeasedJob> {
    let mut r = lease_req("w", "llm", max_jobs, Duration::ZERO);
    r.kinds = vec![kind.into()];
    workers.lease(r).await.expect("Lease").into_inner().jobs
}

async fn fail(workers: &mut WorkersClient, job: &pb::LeasedJob, retry_after: Option<Duration>) {
    let r = failure_req(
        job,
        "rate_limited",
        Some(true),
        retry_after.or(Some(Duration::ZERO)),
    );
    workers.complete(r).await.expect("Complete(failure)");
}

async fn breaker_of(jobs: &mut JobsClient, kind: &str) -> Option<pb::BreakerInfo> {
    let stats = jobs
        .stats(pb::StatsRequest {
            queue: "llm".into(),
        })
        .await
        .expect("Stats")
        .into_inner();
    stats
        .queues
        .into_iter()
        .flat_map(|q| q.breakers)
        .find(|b| b.kind == kind)
}

fn state_of(b: &Option<pb::BreakerInfo>) -> Option<pb::BreakerState> {
    b.as_ref()
        .and_then(|b| pb::BreakerState::try_from(b.state).ok())
}

async fn breaker_opens_probes_and_closes(backend: Backend) {
    let server = TestServer::start_with(backend, with_breaker(3, Duration::from_millis(700))).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    for _ in 0..6 {
        let mut r = submit_req("llm", "chat", json!({}));
        r.max_attempts = Some(20);
        submit_with(&mut jobs, r).await;
    }
    submit(&mut jobs, "llm", "embed", json!({})).await;

    // Three consecutive transient failures of `chat` open its breaker.
    for n in 1..=3 {
        let leased = lease_kind(&mut workers, "chat", 1).await;
        assert_eq!(leased.len(), 1, "failure {n}: a chat job is leasable");
        fail(&mut workers, &leased[0], None).await;
    }
    let open = breaker_of(&mut jobs, "chat").await;
    assert_eq!(state_of(&open), Some(pb::BreakerState::Open), "{open:?}");
    assert_eq!(open.as_ref().map(|b| b.failures), Some(3));
    assert!(
        lease_kind(&mut workers, "chat", 10).await.is_empty(),
        "open: chat is not leased"
    );
    assert_eq!(
        lease_kind(&mut workers, "embed", 10).await.len(),
        1,
        "other kinds still run"
    );

    // After the cool-down exactly one probe goes through.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let probe = lease_kind(&mut workers, "chat", 10).await;
    assert_eq!(probe.len(), 1, "half-open: one probe");
    assert!(
        lease_kind(&mut workers, "chat", 10).await.is_empty(),
        "one probe at a time"
    );
    assert_eq!(
        state_of(&breaker_of(&mut jobs, "chat").await),
        Some(pb::BreakerState::HalfOpen)
    );

    // A failed probe reopens it; after the next cool-down a successful probe closes it.
    fail(&mut workers, &probe[0], None).await;
    assert_eq!(
        state_of(&breaker_of(&mut jobs, "chat").await),
        Some(pb::BreakerState::Open)
    );
    assert!(lease_kind(&mut workers, "chat", 10).await.is_empty());
    tokio::time::sleep(Duration::from_millis(800)).await;
    let probe = lease_kind(&mut workers, "chat", 10).await;
    assert_eq!(probe.len(), 1);
    complete_ok(&mut workers, &probe[0]).await;
    assert_eq!(
        breaker_of(&mut jobs, "chat").await,
        None,
        "closed and clean"
    );
    assert_eq!(
        lease_kind(&mut workers, "chat", 10).await.len(),
        5,
        "all remaining chat jobs run again"
    );
    server.stop().await;
}

/// The cool-down is the larger of the configured one and the largest
/// retry_after the provider asked for.
async fn breaker_honours_retry_after(backend: Backend) {
    let server = TestServer::start_with(backend, with_breaker(1, Duration::from_millis(100))).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let mut r = submit_req("llm", "chat", json!({}));
    r.max_attempts = Some(5);
    submit_with(&mut jobs, r).await;
    let leased = lease_kind(&mut workers, "chat", 1).await;
    let before = chrono::Utc::now();
    fail(&mut workers, &leased[0], Some(Duration::from_secs(5))).await;
    let open = breaker_of(&mut jobs, "chat").await.expect("breaker");
    let until = time(&open.open_until, "open_until");
    assert!(
        until >= before + chrono::Duration::milliseconds(4500),
        "open for the 5 s retry_after, not the 100 ms cool-down: {until} vs {before}"
    );
    assert_eq!(open.failures, 1);
    // Well past the configured 100 ms cool-down, it is still open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut r = submit_req("llm", "chat", json!({}));
    r.max_attempts = Some(5);
    submit_with(&mut jobs, r).await;
    assert!(lease_kind(&mut workers, "chat", 10).await.is_empty());
    assert_eq!(
        state_of(&breaker_of(&mut jobs, "chat").await),
        Some(pb::BreakerState::Open)
    );
    server.stop().await;
}

/// A `Complete` on the replica that granted the lease writes without
/// reading the job back; a breaker that another replica began for the
/// job's kind in between must still hear of its success, which ends the
/// failure streak.
async fn a_breaker_begun_after_the_lease_counts_its_success() {
    let server =
        TestServer::start_with(Backend::Postgres, with_breaker(3, Duration::from_secs(60))).await;
    let replica = server.start_replica().await;
    let mut jobs = server.jobs_client("t");
    let mut here = server.workers_client("t");
    let mut there = replica.workers_client("t");
    for _ in 0..3 {
        let mut r = submit_req("llm", "chat", json!({}));
        r.max_attempts = Some(20);
        submit_with(&mut jobs, r).await;
    }
    let leased = lease_kind(&mut here, "chat", 1).await;
    assert_eq!(leased.len(), 1, "a chat job is leased here");
    for n in 1..=2 {
        let failing = lease_kind(&mut there, "chat", 1).await;
        assert_eq!(failing.len(), 1, "failure {n}: a chat job is leased there");
        fail(&mut there, &failing[0], None).await;
    }
    let begun = breaker_of(&mut jobs, "chat").await;
    assert_eq!(begun.as_ref().map(|b| b.failures), Some(2), "{begun:?}");

    complete_ok(&mut here, &leased[0]).await;
    let after = breaker_of(&mut jobs, "chat").await;
    assert_eq!(
        after.as_ref().map_or(0, |b| b.failures),
        0,
        "the success ended the streak: {after:?}"
    );
    replica.stop().await;
    server.stop().await;
}

/// Two replicas' claims of one instant both see a half-open breaker without
/// a probe; only one of them may send its candidate as the probe. Each
/// round, eight leases on each replica go out together; the probe fails,
/// the breaker opens again, and after its cool-down the next round races.
async fn a_half_open_breaker_sends_one_probe_across_replicas() {
    const ROUNDS: usize = 12;
    const PER_REPLICA: usize = 8;
    let cooldown = Duration::from_millis(300);
    let server = TestServer::start_with(Backend::Postgres, with_breaker(1, cooldown)).await;
    let replica = server.start_replica().await;
    let mut jobs = server.jobs_client("t");
    for _ in 0..ROUNDS + 1 {
        let mut r = submit_req("llm", "chat", json!({}));
        r.max_attempts = Some(100);
        submit_with(&mut jobs, r).await;
    }
    let mut here = server.workers_client("t");
    let first = lease_kind(&mut here, "chat", 1).await;
    assert_eq!(first.len(), 1, "a chat job is leasable");
    fail(&mut here, &first[0], None).await;

    let clients = [server.workers_client("t"), replica.workers_client("t")];
    for round in 1..=ROUNDS {
        tokio::time::sleep(cooldown + Duration::from_millis(100)).await;
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(2 * PER_REPLICA));
        let mut leases = tokio::task::JoinSet::new();
        for client in &clients {
            for _ in 0..PER_REPLICA {
                let mut client = client.clone();
                let start = std::sync::Arc::clone(&start);
                leases.spawn(async move {
                    start.wait().await;
                    lease_kind(&mut client, "chat", 1).await
                });
            }
        }
        let mut probes = Vec::new();
        while let Some(leased) = leases.join_next().await {
            probes.extend(leased.expect("lease task"));
        }
        assert_eq!(
            probes.len(),
            1,
            "round {round}: one probe for a half-open breaker, across both replicas: {probes:?}"
        );
        fail(&mut here, &probes[0], None).await;
        assert_eq!(
            state_of(&breaker_of(&mut jobs, "chat").await),
            Some(pb::BreakerState::Open),
            "round {round}: the failed probe opened it again"
        );
    }
    replica.stop().await;
    server.stop().await;
}

/// A replica started with breakers off (`--breaker-threshold 0`) clears the
/// breakers an earlier run left: the kind is leased in full at once. Left
/// in place, the open breaker kept the kind from leasing until its cooldown
/// ended, and then half-open for good (one job at a time), since with
/// breakers off no probe's outcome closes it.
async fn breakers_turned_off_clear_those_left_open(backend: Backend) {
    let server = TestServer::start_with(backend, with_breaker(1, Duration::from_secs(3600))).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit(&mut jobs, "llm", "chat", json!({})).await;
    let leased = lease_kind(&mut workers, "chat", 1).await;
    fail(&mut workers, &leased[0], None).await;
    assert_eq!(
        state_of(&breaker_of(&mut jobs, "chat").await),
        Some(pb::BreakerState::Open)
    );

    let off = server.start_replica_with(|s| s.breaker.threshold = 0).await;
    let mut jobs = off.jobs_client("t");
    let mut workers = off.workers_client("t");
    assert_eq!(breaker_of(&mut jobs, "chat").await, None, "cleared");
    for _ in 0..4 {
        submit(&mut jobs, "llm", "chat", json!({})).await;
    }
    let leased = lease_kind(&mut workers, "chat", 10).await;
    assert_eq!(leased.len(), 5, "the failed job and four new ones, at once");
    off.stop().await;
    server.stop().await;
}
