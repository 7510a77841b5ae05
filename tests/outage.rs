//! A PostgreSQL outage: while the database refuses connections the server
//! keeps running and answers UNAVAILABLE (but what needs no database, such
//! as a batch of invalid items, is answered as ever); when it returns, the
//! server recovers by itself and a lease shorter-lived than the outage
//! survives.

mod common;

use std::time::{Duration, Instant};

use common::*;
use intray::pb;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use tonic::Code;

/// Runs a call until it stops failing UNAVAILABLE, for 20 s after `$back`
/// at most, and gives its response.
macro_rules! until_recovered {
    ($back:expr, $call:expr) => {
        loop {
            match $call.await {
                Ok(r) => break r.into_inner(),
                Err(s)
                    if s.code() == Code::Unavailable
                        && $back.elapsed() < Duration::from_secs(20) =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(s) => panic!("did not recover: {s:?}"),
            }
        }
    };
}

/// A PostgreSQL outage of one server's database: no new connections, and
/// every open one cut.
struct Outage {
    admin: sqlx::PgPool,
    db: String,
}

impl Outage {
    async fn begin(server: &TestServer) -> Outage {
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
        let outage = Outage { admin, db };
        outage.allow_connections(false).await;
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(&outage.db)
            .execute(&outage.admin)
            .await
            .expect("cut connections");
        outage
    }

    /// The database takes connections again.
    async fn end(self) {
        self.allow_connections(true).await;
    }

    async fn allow_connections(&self, allow: bool) {
        let db = &self.db;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{db}\" ALLOW_CONNECTIONS {allow}"
        )))
        .execute(&self.admin)
        .await
        .expect("change ALLOW_CONNECTIONS");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_outage_answers_unavailable_and_recovers() {
    let server = TestServer::start(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let mut workers = server.workers_client("t");
    let job = submit(&mut jobs, "q", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "q").await;

    let outage = Outage::begin(&server).await;

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

    outage.end().await;

    // Recovers unaided: no restart, the same server and clients. Each
    // pooled connection that the outage cut fails its next statement with
    // UNAVAILABLE and is then replaced, so a call may fail that way a few
    // times after the database is back; clients retry UNAVAILABLE.
    let back = Instant::now();
    let resubmitted = until_recovered!(
        back,
        jobs.submit(submit_req("q", "k", json!({"after": true})))
    );
    assert!(resubmitted.created);
    // The lease taken before the outage is still held: it outlived the outage.
    until_recovered!(
        back,
        workers.heartbeat(pb::HeartbeatRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            ..Default::default()
        })
    );
    let done = until_recovered!(
        back,
        workers.complete(success_req(&leased, json!({"done": true})))
    );
    assert_eq!(
        done.job.as_ref().map(|j| j.state()),
        Some(pb::JobState::Succeeded)
    );
    assert_eq!(
        state(&get(&mut jobs, &job.id).await),
        pb::JobState::Succeeded
    );
    server.stop().await;
}

/// A batch with nothing left to store is answered without the database:
/// during an outage its invalid items still get their own
/// `INVALID_ARGUMENT`, not the whole call `UNAVAILABLE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_with_nothing_to_store_is_answered_during_an_outage() {
    let server = TestServer::start(Backend::Postgres).await;
    let mut jobs = server.jobs_client("t");
    let outage = Outage::begin(&server).await;

    let answered = jobs
        .submit_batch(pb::SubmitBatchRequest {
            jobs: vec![submit_req("q", "", json!({}))],
        })
        .await;
    outage.end().await;
    let results = answered
        .expect("SubmitBatch is answered during the outage")
        .into_inner()
        .results;
    match &results[0].result {
        Some(pb::submit_batch_result::Result::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32, "{e:?}");
            assert_eq!(e.field, "jobs[0].kind", "{e:?}");
        }
        other => panic!("the item is invalid: {other:?}"),
    }
    server.stop().await;
}
