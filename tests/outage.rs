//! A PostgreSQL outage: while the database refuses connections the server
//! keeps running and answers UNAVAILABLE; when it returns, the server
//! recovers by itself and a lease shorter-lived than the outage survives.

mod common;

use std::time::{Duration, Instant};

use common::*;
use intray::pb;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_outage_answers_unavailable_and_recovers() {
    let server = TestServer::start(Backend::Postgres).await;
    let db = server
        .settings
        .database_url
        .rsplit('/')
        .next()
        .expect("database name")
        .to_owned();
    let admin_url = std::env::var("INTRAY_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&admin_url)
        .await
        .expect("admin connection");
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "q", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "q").await;

    // The outage: no new connections, and every open one is cut.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS false"
    )))
    .execute(&admin)
    .await
    .expect("forbid connections");
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&db)
        .execute(&admin)
        .await
        .expect("cut connections");

    let refused = jobs.submit(submit_req("q", "k", json!({}))).await;
    let status = expect_code(refused, Code::Unavailable, "submit during the outage");
    assert!(
        !status.message().to_lowercase().contains("select"),
        "no SQL in the message: {status:?}"
    );
    let beat = workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            ..Default::default()
        })
        .await;
    expect_code(beat, Code::Unavailable, "heartbeat during the outage");

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS true"
    )))
    .execute(&admin)
    .await
    .expect("allow connections again");

    // Recovers unaided: no restart, the same server and clients.
    let back = Instant::now();
    let resubmitted = loop {
        match jobs
            .submit(submit_req("q", "k", json!({"after": true})))
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(s) if s.code() == Code::Unavailable && back.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(s) => panic!("did not recover: {s:?}"),
        }
    };
    assert!(resubmitted.created);
    // The lease taken before the outage is still held: it outlived the outage.
    workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("the lease survived the outage");
    complete_ok(&mut workers, &leased).await;
    assert_eq!(
        state(&get(&mut jobs, &job.id).await),
        pb::JobState::Succeeded
    );
    server.stop().await;
}
