//! Graceful shutdown, on both backends: a parked long-poll `Lease` returns
//! empty at once, a `WatchJob` stream ends `UNAVAILABLE` (not OK, which
//! would say the job has ended: the client resumes from its last sequence
//! elsewhere), and the server stops well within its grace.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use intray::pb;
use serde_json::json;
use tonic_types::StatusExt;

common::backend_tests!(
    shutdown_ends_long_polls_and_streams_promptly,
    a_stalled_http_request_holds_shutdown_only_its_grace,
    the_shutdown_delay_serves_on_while_reporting_not_serving,
);

async fn shutdown_ends_long_polls_and_streams_promptly(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "elsewhere", "k", json!({})).await;

    let poll = tokio::spawn(async move {
        let started = Instant::now();
        let leased = workers
            .lease(lease_req("w", "empty", 1, Duration::from_secs(30)))
            .await
            .map(|r| r.into_inner().jobs.len());
        (leased, started.elapsed())
    });
    let mut stream = jobs
        .watch_job(pb::WatchJobRequest {
            id: job.id.clone(),
            after_sequence: 0,
        })
        .await
        .expect("WatchJob")
        .into_inner();
    let first = within(Duration::from_secs(5), "first event", stream.next())
        .await
        .expect("an event")
        .expect("not an error");
    assert_eq!(first.sequence, 1);
    let watch = tokio::spawn(async move {
        let started = Instant::now();
        let mut more = 0;
        let mut ended_with = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(_) => more += 1,
                Err(status) => {
                    ended_with = Some(status);
                    break;
                }
            }
        }
        (more, ended_with, started.elapsed())
    });
    // Let the long-poll park.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let stopping = Instant::now();
    server.stop().await;
    let stop_took = stopping.elapsed();
    assert!(
        stop_took < Duration::from_secs(10),
        "stopped in {stop_took:?}"
    );

    let (leased, waited) = within(Duration::from_secs(10), "long-poll", poll)
        .await
        .expect("task");
    assert_eq!(leased.expect("the long-poll answers OK"), 0, "with nothing");
    assert!(
        waited < Duration::from_secs(10),
        "returned at shutdown, not after its 30 s wait: {waited:?}"
    );
    let (more, ended_with, ended_after) = within(Duration::from_secs(10), "watch", watch)
        .await
        .expect("task");
    assert_eq!(more, 0, "no event was invented");
    let status = ended_with.expect("the stream ends UNAVAILABLE, not OK: the job has not ended");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // A client tells it from a database outage by its reason, not its text.
    assert!(intray::api::is_watch_interrupted(&status), "{status:?}");
    let info = status.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, intray::api::WATCH_INTERRUPTED);
    assert!(ended_after < Duration::from_secs(10), "{ended_after:?}");
}

/// A client that stalls in the middle of an HTTP request body keeps its
/// request in flight; shutdown waits for it only `shutdown_grace`, like
/// for a gRPC call, rather than until the client goes away.
async fn a_stalled_http_request_holds_shutdown_only_its_grace(backend: Backend) {
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start_with(backend, |s| {
        s.shutdown_grace = Duration::from_secs(1);
    })
    .await;
    let mut stalled = tokio::net::TcpStream::connect(server.http_addr)
        .await
        .expect("connect to the HTTP port");
    stalled
        .write_all(
            b"POST /api/v1/jobs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              x-intray-tenant: t\r\nContent-Length: 100\r\n\r\n{",
        )
        .await
        .expect("send a partial request");
    // Let the server start reading the body.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopping = Instant::now();
    server.stop().await;
    let stop_took = stopping.elapsed();
    assert!(
        stop_took < Duration::from_secs(10),
        "stopped in {stop_took:?}"
    );
    drop(stalled);
}

/// With `shutdown_delay`, a server told to stop reports `NOT_SERVING` at
/// once and goes on taking calls (a connection opened now, a `Submit`)
/// until the delay is over, then stops: the window in which a load
/// balancer still sends it calls. Without it, the port closed at once.
async fn the_shutdown_delay_serves_on_while_reporting_not_serving(backend: Backend) {
    let server = TestServer::start_with(backend, |s| {
        s.shutdown_delay = Duration::from_secs(5);
    })
    .await;
    let stopping = Instant::now();
    server.begin_shutdown();
    let status = within(Duration::from_secs(5), "not serving", async {
        loop {
            let mut health = tonic_health::pb::health_client::HealthClient::new(
                connect(&server.url())
                    .await
                    .expect("a new connection is taken"),
            );
            let answer = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .expect("health answers")
                .into_inner()
                .status;
            if answer == tonic_health::pb::health_check_response::ServingStatus::NotServing as i32 {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_ne!(status, 0);
    // A new connection, a new call, still inside the delay.
    let channel = connect(&server.url())
        .await
        .expect("connect during the delay");
    let mut jobs = intray::pb::job_service_client::JobServiceClient::with_interceptor(
        channel,
        Tenant::named("t"),
    );
    let submitted = jobs
        .submit(submit_req("late", "k", json!({})))
        .await
        .expect("a call inside the delay is served");
    assert!(submitted.into_inner().created);
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "the checks ran inside the delay"
    );
    server.stop().await;
    assert!(
        stopping.elapsed() >= Duration::from_secs(5),
        "stopped after the delay, not before"
    );
}
