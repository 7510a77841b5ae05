//! Fairness between tenants and per-tenant running caps, on both backends
//! through real gRPC.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use intray::pb;
use serde_json::json;
use tokio::sync::Mutex;

common::backend_tests!(
    a_small_tenant_is_not_starved_by_a_big_one,
    running_cap_per_tenant_and_queue,
    all_tenants_lease_respects_pause_and_caps,
    running_cap_holds_across_replicas,
    a_freed_slot_wakes_a_worker_waiting_at_the_cap,
);

fn shared_lease(worker: &str, queue: &str, max_jobs: u32) -> pb::LeaseRequest {
    pb::LeaseRequest {
        all_tenants: true,
        ..lease_req(worker, queue, max_jobs, Duration::from_millis(500))
    }
}

async fn submit_many(jobs: &mut JobsClient, queue: &str, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch = pb::SubmitBatchRequest {
            jobs: chunk
                .iter()
                .map(|i| submit_req(queue, "k", json!({ "i": i })))
                .collect(),
        };
        let results = jobs
            .submit_batch(batch)
            .await
            .expect("SubmitBatch")
            .into_inner()
            .results;
        assert!(
            results
                .iter()
                .all(|r| matches!(r.result, Some(pb::submit_batch_result::Result::Ok(_)))),
            "every item accepted"
        );
    }
}

/// Issue 3's scenario: tenant A queues 10,000 jobs, 4 shared workers drain
/// them, then tenant B submits 10; all of B's are leased within the first 50
/// leases after B's submit.
async fn a_small_tenant_is_not_starved_by_a_big_one(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut a = server.jobs_client("tenant-a");
    let mut b = server.jobs_client("tenant-b");
    submit_many(&mut a, "shared", 10_000).await;

    // Every lease in order: the tenant of the job it handed out.
    let leases: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let b_leased = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut client = server.workers_client_own_conn("ops").await;
        let leases = Arc::clone(&leases);
        let b_leased = Arc::clone(&b_leased);
        let stop = Arc::clone(&stop);
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let got = client
                    .lease(shared_lease(&format!("w{w}"), "shared", 1))
                    .await
                    .expect("Lease")
                    .into_inner()
                    .jobs;
                for job in got {
                    leases.lock().await.push(job.tenant.clone());
                    if job.tenant == "tenant-b" {
                        b_leased.fetch_add(1, Ordering::Relaxed);
                    }
                    client
                        .complete(req(&job.tenant, success_req(&job, json!(null))))
                        .await
                        .expect("Complete with the job's tenant");
                }
            }
        }));
    }
    // Let A's drain get going before B arrives.
    while leases.lock().await.len() < 40 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = leases.lock().await.len();
    submit_many(&mut b, "shared", 10).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while b_leased.load(Ordering::Relaxed) < 10 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        within(Duration::from_secs(10), "worker", worker)
            .await
            .expect("worker task");
    }
    let leases = leases.lock().await;
    let b_positions: Vec<usize> = leases
        .iter()
        .enumerate()
        .filter(|(_, t)| t.as_str() == "tenant-b")
        .map(|(i, _)| i.saturating_sub(before))
        .collect();
    assert_eq!(
        b_positions.len(),
        10,
        "all of B's jobs leased: {b_positions:?}"
    );
    assert!(
        b_positions.iter().all(|p| *p < 50),
        "B's jobs within the first 50 leases after its submit: {b_positions:?}"
    );
    server.stop().await;
}

async fn running_cap_per_tenant_and_queue(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.max_running_per_tenant = Some(2);
        s.queue_max_running_per_tenant.insert("wide".into(), 3);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit_many(&mut jobs, "narrow", 5).await;
    submit_many(&mut jobs, "wide", 5).await;

    let first = lease_now(&mut workers, "w1", "narrow").await;
    assert_eq!(
        first.len(),
        2,
        "the default cap is 2 running per tenant and queue"
    );
    assert!(
        lease_now(&mut workers, "w2", "narrow").await.is_empty(),
        "at the cap"
    );
    assert_eq!(
        lease_now(&mut workers, "w3", "wide").await.len(),
        3,
        "the override"
    );

    // Another tenant has its own cap.
    let mut other_jobs = server.jobs_client("u");
    let mut other_workers = server.workers_client("u");
    submit_many(&mut other_jobs, "narrow", 3).await;
    assert_eq!(lease_now(&mut other_workers, "w4", "narrow").await.len(), 2);

    complete_ok(&mut workers, &first[0]).await;
    let next = lease_now(&mut workers, "w2", "narrow").await;
    assert_eq!(next.len(), 1, "a finished job frees one slot");
    server.stop().await;
}

/// A worker long-polling at a queue's cap is woken when a running job of
/// that queue ends and frees a slot. Nothing was queued by the end, so it
/// waited for the next poll (60 s here) or the end of its wait (20 s), and
/// claimed then.
async fn a_freed_slot_wakes_a_worker_waiting_at_the_cap(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.max_running_per_tenant = Some(1);
        s.fallback_poll = Duration::from_secs(60);
    })
    .await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    submit_many(&mut jobs, "narrow", 2).await;
    let first = lease_now(&mut workers, "w1", "narrow").await;
    assert_eq!(first.len(), 1, "the cap is 1");
    let mut waiting = server.workers_client_own_conn("t").await;
    let parked = tokio::spawn(async move {
        waiting
            .lease(lease_req("w2", "narrow", 1, Duration::from_secs(20)))
            .await
            .expect("Lease")
            .into_inner()
            .jobs
    });
    // Parked: at the cap, nothing to claim.
    tokio::time::sleep(Duration::from_millis(500)).await;
    complete_ok(&mut workers, &first[0]).await;
    let freed = std::time::Instant::now();
    let got = parked.await.expect("the waiting Lease");
    let took = freed.elapsed();
    assert_eq!(got.len(), 1, "the waiting worker got the job");
    assert!(
        took < Duration::from_secs(10),
        "the job came {took:?} after its slot was freed: at the end of the wait, not on the freeing"
    );
    server.stop().await;
}

async fn all_tenants_lease_respects_pause_and_caps(backend: Backend) {
    let server = TestServer::start_with(backend, |s| s.max_running_per_tenant = Some(1)).await;
    let mut a = server.jobs_client("a");
    let mut b = server.jobs_client("b");
    let mut c = server.jobs_client("c");
    submit_many(&mut a, "q", 3).await;
    submit_many(&mut b, "q", 3).await;
    submit_many(&mut c, "q", 3).await;
    c.pause_queue(pb::PauseQueueRequest { queue: "q".into() })
        .await
        .expect("PauseQueue");
    let mut shared = server.workers_client("ops");
    let got = shared
        .lease(shared_lease("w", "q", 10))
        .await
        .expect("Lease")
        .into_inner()
        .jobs;
    let mut tenants: Vec<&str> = got.iter().map(|j| j.tenant.as_str()).collect();
    tenants.sort_unstable();
    assert_eq!(
        tenants,
        vec!["a", "b"],
        "one job per tenant (cap 1), none from the paused tenant queue"
    );
    server.stop().await;
}

/// Sixteen workers on two replicas of one database race for a queue capped
/// at three running jobs; every fourth leases across tenants, the others for
/// the tenant. A worker counts a job as held from its `Lease` answer (after
/// the claim committed) until just before its `Complete` (the job is still
/// running then), so the count never exceeds the jobs the database has
/// running: a count above the cap is a cap broken.
async fn running_cap_holds_across_replicas(backend: Backend) {
    const CAP: usize = 3;
    const JOBS: usize = 120;
    let first =
        TestServer::start_with(backend, |s| s.max_running_per_tenant = Some(CAP as u32)).await;
    let second = first.start_replica().await;
    let mut jobs = first.jobs_client("t");
    submit_many(&mut jobs, "capped", JOBS).await;

    let held = Arc::new(AtomicUsize::new(0));
    let most_held = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..16 {
        let server = if w % 2 == 0 { &first } else { &second };
        let across = w % 4 == 3;
        let mut client = server
            .workers_client_own_conn(if across { "ops" } else { "t" })
            .await;
        let (held, most_held, done) =
            (Arc::clone(&held), Arc::clone(&most_held), Arc::clone(&done));
        workers.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            while done.load(Ordering::SeqCst) < JOBS {
                let ask = if across {
                    shared_lease(&worker, "capped", 2)
                } else {
                    lease_req(&worker, "capped", 2, Duration::from_millis(100))
                };
                let leased = client.lease(ask).await.expect("Lease").into_inner().jobs;
                for job in leased {
                    let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                    most_held.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    held.fetch_sub(1, Ordering::SeqCst);
                    client
                        .complete(req(&job.tenant, success_req(&job, json!(null))))
                        .await
                        .expect("Complete with the job's tenant");
                    done.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for worker in workers {
        within(Duration::from_secs(60), "worker", worker)
            .await
            .expect("worker task");
    }
    assert_eq!(done.load(Ordering::SeqCst), JOBS, "every job ran once");
    assert_eq!(
        most_held.load(Ordering::SeqCst),
        CAP,
        "the cap was reached and never passed, across both replicas"
    );
    second.stop().await;
    first.stop().await;
}
