//! The fault battery (issue 3): real `intray serve` and `intray work`
//! processes (the built binary), killed, frozen, cut off from their database
//! and raced against cancels, while the database is checked directly.
//!
//! Every scenario asserts: no accepted job is lost (each reaches the final
//! state it must), no job has more than one accepted outcome (one terminal
//! event; a SUCCEEDED event belongs to the job's final attempt), event
//! histories are gap-free and end at the terminal event, and every recorded
//! success belongs to an attempt whose command really ran to its effect.
//! Effects themselves may repeat (delivery is at least once); that count is
//! reported, not asserted. Each prints one `FAULTS` line with its figures
//! (`cargo test --test faults -- --nocapture`).
//!
//! Worker kills, frozen worker and the cancellation race run on both
//! backends; server kills, connection cuts and clock skew need several
//! processes on one database, so PostgreSQL only.

mod common;
#[path = "faults/harness.rs"]
mod harness;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::Backend;
use harness::*;
use intray::pb;
use nix::sys::signal::Signal;
use serde_json::json;
use tonic::Code;

common::backend_tests!(
    worker_kills,
    frozen_worker,
    cancel_race,
    sighup_with_nothing_to_reload_keeps_serving,
);

mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn server_kills() {
        super::server_kills().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn database_connections_cut() {
        super::database_connections_cut().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn clock_skew() {
        super::clock_skew().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn ports_open_after_migrations() {
        super::ports_open_after_migrations().await
    }
}

/// The longest any scenario may take before it fails as stuck.
const LIMIT: Duration = Duration::from_secs(150);

fn succeeded_jobs(queue: &str, n: usize) -> Vec<pb::SubmitRequest> {
    (0..n)
        .map(|i| job_req(queue, &format!("{queue}-{i}"), json!({"i": i}), 20))
        .collect()
}

async fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter_mut() {
        p.stop(Duration::from_secs(10)).await;
    }
}

// ---------------------------------------------------------------------------
// 1. Worker kills
// ---------------------------------------------------------------------------

/// 2,000 jobs, 8 `intray work` processes; every 200 ms one of them, chosen at
/// random, is SIGKILLed with its process group and started again. Catches: a
/// lease that is never reclaimed (job stuck RUNNING: lost), a stale Complete
/// accepted after the job was re-leased (two SUCCEEDED events, or one for an
/// older attempt), a claim handing one job to two workers.
async fn worker_kills(backend: Backend) {
    let db = Db::create(backend).await;
    let server = Server::start(&db, "server", &[], &[]).await;
    let n = 2000;
    let started = Instant::now();
    let accepted = submit_all(&[server.url()], succeeded_jobs("kills", n), LIMIT).await;
    assert_eq!(accepted.len(), n);
    let mut workers: Vec<Proc> = (0..8)
        .map(|i| worker(&db, &server.url(), &format!("w{i}"), "kills", 2, LEASE))
        .collect();
    for w in &mut workers {
        w.spawn();
    }
    let mut kills = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (open, _) = db.progress().await;
        if open == 0 {
            break;
        }
        assert!(
            started.elapsed() < LIMIT,
            "{open} jobs still open after {LIMIT:?}"
        );
        let victim = rand::random_range(0..workers.len());
        workers[victim].kill().await;
        kills += 1;
        workers[victim].spawn();
    }
    let last_terminal = started.elapsed();
    stop_all(&mut workers).await;

    let mut a = Analysis::run(&db, &accepted, &["succeeded"]).await;
    a.effects(&db);
    let expired = a.count_events("lease_expired");
    a.report_and_assert(
        &format!("worker kills ({backend:?})"),
        &format!(
            "{kills} worker SIGKILLs ({expired} leases reclaimed); last job terminal after {last_terminal:?}"
        ),
        started.elapsed(),
    );
    assert!(
        kills >= 5,
        "the run was too short to kill anything: {kills}"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 2. Server kills
// ---------------------------------------------------------------------------

/// Two `intray serve` processes on one PostgreSQL database, four workers on
/// each, jobs submitted through both while they run; server B is SIGKILLed
/// at about a quarter of the run and started again on the same port, then
/// server A at about two thirds. Catches: work or submits lost with a
/// process (state held in memory), an outcome applied twice when a worker
/// retries `Complete` after a connection died mid-call, a lease stranded by
/// a dead replica's reaper.
async fn server_kills() {
    let db = Db::create(Backend::Postgres).await;
    let mut a = Server::start(&db, "server-a", &[], &[]).await;
    let mut b = Server::start(&db, "server-b", &[], &[]).await;
    let mut workers: Vec<Proc> = (0..8)
        .map(|i| {
            let url = if i % 2 == 0 { a.url() } else { b.url() };
            worker(&db, &url, &format!("w{i}"), "servers", 2, LEASE)
        })
        .collect();
    for w in &mut workers {
        w.spawn();
    }
    let n = 1000;
    let started = Instant::now();
    let urls = vec![a.url(), b.url()];
    let producer = tokio::spawn(async move {
        // Submits spread over the run, through both servers.
        let mut ids = Vec::new();
        for chunk in succeeded_jobs("servers", n).chunks(100) {
            ids.extend(submit_all(&urls, chunk.to_vec(), LIMIT).await);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        ids
    });
    let mut kills = Vec::new();
    for (fraction, name) in [(0.25, "b"), (0.65, "a")] {
        while (db.count_state("succeeded").await as f64) < fraction * n as f64 {
            assert!(started.elapsed() < LIMIT, "stuck before the {name} kill");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let server = if name == "a" { &mut a } else { &mut b };
        server.kill().await;
        let killed_at = started.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        server.restart().await;
        kills.push(format!(
            "server {name} SIGKILLed at {killed_at:?}, back after {:?}",
            started.elapsed() - killed_at
        ));
    }
    let accepted = producer.await.expect("producer");
    assert_eq!(accepted.len(), n);
    db.wait_all_terminal(n as i64, LIMIT).await;
    let last = started.elapsed();
    stop_all(&mut workers).await;

    let mut an = Analysis::run(&db, &accepted, &["succeeded"]).await;
    an.effects(&db);
    assert_eq!(an.jobs, n, "one job per idempotency key");
    an.report_and_assert(
        "server kills (Postgres)",
        &format!(
            "{}; {} leases reclaimed; last job terminal after {last:?}",
            kills.join("; "),
            an.count_events("lease_expired"),
        ),
        started.elapsed(),
    );
    a.stop().await;
    b.stop().await;
}

// ---------------------------------------------------------------------------
// 3. Database connections cut
// ---------------------------------------------------------------------------

/// While workers run, every connection to the test database (the server's
/// pool and its LISTEN connection) is cut with `pg_terminate_backend`, four
/// times 700 ms apart. The shared PostgreSQL server keeps running. Catches:
/// a transaction half-applied or acknowledged and then lost, a server that
/// exits or stays broken (dead pooled connections, a dead LISTEN) until
/// restarted.
async fn database_connections_cut() {
    let db = Db::create(Backend::Postgres).await;
    let mut server = Server::start(&db, "server", &[], &[]).await;
    let mut workers: Vec<Proc> = (0..4)
        .map(|i| worker(&db, &server.url(), &format!("w{i}"), "cuts", 2, LEASE))
        .collect();
    for w in &mut workers {
        w.spawn();
    }
    let n = 1000;
    let started = Instant::now();
    let urls = vec![server.url()];
    let producer = tokio::spawn(async move {
        let mut ids = Vec::new();
        for chunk in succeeded_jobs("cuts", n).chunks(100) {
            ids.extend(submit_all(&urls, chunk.to_vec(), LIMIT).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ids
    });
    while db.count_state("succeeded").await < 100 {
        assert!(started.elapsed() < LIMIT, "stuck before the cuts");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut cut = Vec::new();
    for _ in 0..4 {
        cut.push(db.terminate_connections().await);
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let accepted = producer.await.expect("producer");
    db.wait_all_terminal(n as i64, LIMIT).await;
    let last = started.elapsed();
    assert!(
        !server.proc.exited(),
        "the server process must survive its database connections being cut"
    );

    let mut an = Analysis::run(&db, &accepted, &["succeeded"]).await;
    an.effects(&db);
    an.report_and_assert(
        "database connections cut (Postgres)",
        &format!(
            "4 rounds of pg_terminate_backend cutting {cut:?} connections; {} leases reclaimed; \
             last job terminal after {last:?}; then 10 submit+lease+complete at the first try",
            an.count_events("lease_expired")
        ),
        started.elapsed(),
    );
    // Recovered unaided: new submits, leases and completes work at the
    // first try, on the same process.
    let mut jobs = server.jobs().await;
    let mut lease_client = server.workers().await;
    for i in 0..10 {
        let job = jobs
            .submit(job_req("after-cut", &format!("after-{i}"), json!({}), 3))
            .await
            .unwrap_or_else(|s| panic!("Submit after the cuts: {s:?}"))
            .into_inner()
            .job
            .expect("job");
        let leased = lease_client
            .lease(common::lease_req(
                "probe",
                "after-cut",
                1,
                Duration::from_secs(5),
            ))
            .await
            .unwrap_or_else(|s| panic!("Lease after the cuts: {s:?}"))
            .into_inner()
            .jobs;
        assert_eq!(leased.len(), 1, "Lease after the cuts found the new job");
        assert_eq!(leased[0].job_id, job.id);
        lease_client
            .complete(common::success_req(&leased[0], json!({"ok": true})))
            .await
            .unwrap_or_else(|s| panic!("Complete after the cuts: {s:?}"));
    }
    stop_all(&mut workers).await;
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 4. Frozen worker
// ---------------------------------------------------------------------------

/// Worker "frozen" leases three jobs (each sleeps 1 s) and is SIGSTOPped past
/// its 2 s lease; the reaper reclaims the jobs, worker "rescuer" runs them to
/// success; then "frozen" gets SIGCONT. Its heartbeat or Complete must get
/// ABORTED (it logs "lease lost") and write nothing: the jobs' outcome is
/// the rescuer's. Catches: a fencing check that accepts a stale token (a
/// second SUCCEEDED event, or the frozen worker's), a heartbeat that
/// re-extends a reclaimed lease.
async fn frozen_worker(backend: Backend) {
    let db = Db::create(backend).await;
    let server = Server::start(&db, "server", &[], &[]).await;
    let started = Instant::now();
    let mut frozen = worker(&db, &server.url(), "frozen", "frozen", 3, LEASE);
    frozen.spawn();
    let reqs = (0..3)
        .map(|i| job_req("frozen", &format!("f{i}"), json!({"sleep": "1"}), 5))
        .collect();
    let accepted = submit_all(&[server.url()], reqs, LIMIT).await;

    let mut jobs = server.jobs().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut owners = Vec::new();
        for id in &accepted {
            owners.push(common::get(&mut jobs, id).await.lease_owner);
        }
        if owners.iter().all(|o| o == "frozen") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "frozen never held all three: {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    frozen.signal(Signal::SIGSTOP);
    let stopped_at = Instant::now();

    // Reclaimed by the reaper once the lease ran out.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, events) = db.snapshot().await;
        let reclaimed = accepted
            .iter()
            .filter(|id| events[*id].iter().any(|e| e.kind == "lease_expired"))
            .count();
        if reclaimed == accepted.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "leases of the frozen worker never reclaimed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut rescuer = worker(&db, &server.url(), "rescuer", "frozen", 3, LEASE);
    rescuer.spawn();
    db.wait_all_terminal(3, Duration::from_secs(30)).await;
    rescuer.stop(Duration::from_secs(10)).await;
    let (_, before) = db.snapshot().await;

    frozen.signal(Signal::SIGCONT);
    let frozen_for = stopped_at.elapsed();
    // Its next heartbeat is overdue at once; give it time to call and log.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let log = frozen.log_text();
        let told = accepted
            .iter()
            .filter(|id| {
                log.lines()
                    .any(|l| l.contains("lease lost") && l.contains(id.as_str()))
            })
            .count();
        if told == accepted.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the frozen worker did not report every lease lost after SIGCONT; its log:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Whatever it sent after waking up wrote nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, after) = db.snapshot().await;
    for id in &accepted {
        assert_eq!(
            before[id].len(),
            after[id].len(),
            "job {id}: the frozen worker's late calls wrote events: {:?}",
            &after[id][before[id].len()..]
        );
        let wins: Vec<&Event> = after[id].iter().filter(|e| e.kind == "succeeded").collect();
        assert_eq!(
            wins.len(),
            1,
            "job {id}: one SUCCEEDED event: {:?}",
            after[id]
        );
        assert_eq!(
            wins[0].worker_id.as_deref(),
            Some("rescuer"),
            "job {id}: the outcome is the rescuer's"
        );
        assert_eq!(wins[0].attempt, 2, "job {id}: the rescuer's attempt");
    }
    frozen.stop(Duration::from_secs(10)).await;

    let mut a = Analysis::run(&db, &accepted, &["succeeded"]).await;
    a.effects(&db);
    a.report_and_assert(
        &format!("frozen worker ({backend:?})"),
        &format!(
            "1 worker SIGSTOPped for {frozen_for:?} holding 3 leases of 2 s, then SIGCONT: \
             its calls got ABORTED, 0 events written by it afterwards"
        ),
        started.elapsed(),
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 5. Cancellation race
// ---------------------------------------------------------------------------

/// 500 jobs that sleep a random 0-300 ms, 4 workers of 4 slots, and a Cancel
/// for every job at a random moment in the first 4 s. Each job ends
/// CANCELLED or SUCCEEDED, never both; a Cancel that returned OK means
/// CANCELLED, one refused with FAILED_PRECONDITION means it had already
/// SUCCEEDED; nothing is leased after a cancel. Catches: a Complete that
/// overwrites a cancel (or the reverse), a cancelled job requeued by a
/// retryable failure or a lease expiry, a cancel acknowledged and then lost.
async fn cancel_race(backend: Backend) {
    let db = Db::create(backend).await;
    let server = Server::start(&db, "server", &[], &[]).await;
    let n = 500;
    let reqs = (0..n)
        .map(|i| {
            let sleep = format!("{:.3}", rand::random_range(0..=300) as f64 / 1000.0);
            job_req("cancels", &format!("c{i}"), json!({"sleep": sleep}), 3)
        })
        .collect();
    let started = Instant::now();
    let accepted = submit_all(&[server.url()], reqs, LIMIT).await;
    let mut workers: Vec<Proc> = (0..4)
        .map(|i| worker(&db, &server.url(), &format!("w{i}"), "cancels", 4, "3s"))
        .collect();
    for w in &mut workers {
        w.spawn();
    }
    let mut cancels = tokio::task::JoinSet::new();
    for id in accepted.clone() {
        let jobs = server.jobs().await;
        cancels.spawn(async move {
            let mut jobs = jobs;
            tokio::time::sleep(Duration::from_millis(rand::random_range(0..4000))).await;
            let res = jobs
                .cancel(pb::CancelJobRequest {
                    id: id.clone(),
                    reason: "race".into(),
                })
                .await;
            (id, res.map(|_| ()).map_err(|s| s.code()))
        });
    }
    let mut answered: HashMap<String, Result<(), Code>> = HashMap::new();
    while let Some(done) = cancels.join_next().await {
        let (id, res) = done.expect("cancel task");
        if let Err(code) = res {
            assert_eq!(
                code,
                Code::FailedPrecondition,
                "Cancel {id}: only a job that already ended may refuse a cancel"
            );
        }
        answered.insert(id, res);
    }
    db.wait_all_terminal(n as i64, LIMIT).await;
    let last = started.elapsed();
    stop_all(&mut workers).await;

    let mut a = Analysis::run(&db, &accepted, &["succeeded", "cancelled"]).await;
    a.effects(&db);
    let mut mismatched = Vec::new();
    let mut leased_after_cancel = Vec::new();
    for (id, res) in &answered {
        let want = if res.is_ok() {
            "cancelled"
        } else {
            "succeeded"
        };
        let row = &a.rows[id];
        if row.state != want {
            mismatched.push(format!(
                "{id}: Cancel answered {res:?}, job ended {}",
                row.state
            ));
        }
        let evs = &a.events[id];
        let both =
            evs.iter().any(|e| e.kind == "cancelled") && evs.iter().any(|e| e.kind == "succeeded");
        if both {
            mismatched.push(format!("{id}: both CANCELLED and SUCCEEDED: {evs:?}"));
        }
        if let Some(first_cancel) = evs
            .iter()
            .position(|e| e.kind == "cancel_requested" || e.kind == "cancelled")
            && evs[first_cancel..].iter().any(|e| e.kind == "leased")
        {
            leased_after_cancel.push(format!("{id}: {evs:?}"));
        }
    }
    let requested = a.count_events("cancel_requested");
    a.report_and_assert(
        &format!("cancellation race ({backend:?})"),
        &format!(
            "{n} cancels: {} accepted ({requested} of them while running), {} refused as too late; \
             last job terminal after {last:?}",
            answered.values().filter(|r| r.is_ok()).count(),
            answered.values().filter(|r| r.is_err()).count(),
        ),
        started.elapsed(),
    );
    assert!(mismatched.is_empty(), "cancel outcomes: {mismatched:#?}");
    assert!(
        leased_after_cancel.is_empty(),
        "jobs leased again after a cancel: {leased_after_cancel:#?}"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// 7. Clock skew
// ---------------------------------------------------------------------------

/// Debian's libfaketime, under the machine's multiarch folder (or the
/// path `INTRAY_FAKETIME_LIB` names, which scripts/test.sh sets).
fn libfaketime() -> Option<String> {
    if let Ok(path) = std::env::var("INTRAY_FAKETIME_LIB") {
        return Some(path);
    }
    let libs = std::fs::read_dir("/usr/lib").ok()?;
    libs.flatten()
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .find(|lib| lib.exists())
        .map(|lib| lib.display().to_string())
}

/// Two replicas on one PostgreSQL database, one of them with its clock two
/// minutes ahead (libfaketime, Debian package `faketime`; wall clock only,
/// so its timers still run at real speed). Workers on both, 2 s leases, half
/// the jobs fail their first attempt with a 100-200 ms backoff, every job
/// has a deadline 90 s away, and a quarter is submitted through the skewed one.
/// Catches any lease, deadline or backoff decision taken on a replica's
/// clock instead of the database's: the skewed replica would refuse the
/// jobs submitted through it or expire every job (its deadline looks 30 s
/// past), reclaim every running lease at once (LEASE_EXPIRED, second
/// LEASED), or schedule retries two minutes late (the run would not
/// finish).
async fn clock_skew() {
    // scripts/test.sh installs it; never skip silently.
    let libfaketime = libfaketime().expect(
        "libfaketime.so.1 is missing: install Debian's faketime package (scripts/test.sh does)",
    );
    let db = Db::create(Backend::Postgres).await;
    let a = Server::start(&db, "server-a", &[], &[]).await;
    let skewed = Server::start(
        &db,
        "server-skewed",
        &[],
        &[
            ("LD_PRELOAD", libfaketime.as_str()),
            ("FAKETIME", "+2m"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    )
    .await;
    // Prove the skew: the skewed replica's log stamps its lines two minutes ahead.
    let first = skewed.proc.log_text();
    let stamp = first
        .split_whitespace()
        .next()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .unwrap_or_else(|| panic!("no timestamp in the skewed server's log: {first:.300}"));
    let ahead = stamp.with_timezone(&chrono::Utc) - chrono::Utc::now();
    assert!(
        ahead > chrono::Duration::seconds(100),
        "the skewed replica's clock is not ahead: {ahead:?}"
    );

    let mut workers: Vec<Proc> = (0..6)
        .map(|i| {
            let url = if i % 2 == 0 { a.url() } else { skewed.url() };
            worker(&db, &url, &format!("w{i}"), "skew", 2, LEASE)
        })
        .collect();
    for w in &mut workers {
        w.spawn();
    }
    let n = 400;
    let deadline = chrono::Utc::now() + chrono::Duration::seconds(90);
    let reqs: Vec<pb::SubmitRequest> = (0..n)
        .map(|i| {
            let mut r = job_req(
                "skew",
                &format!("s{i}"),
                json!({"sleep": "0.3", "fail_first": i % 2 == 0}),
                3,
            );
            r.backoff = Some(pb::Backoff {
                initial: Some(common::ms(100)),
                max: Some(common::ms(200)),
            });
            // 90 s away by the database's clock, 30 s past by the skewed
            // replica's: `Submit`'s "deadline must be in the future" check
            // must take the database's, or the skewed replica refuses half.
            r.deadline = Some(common::ts(deadline));
            r
        })
        .collect();
    let started = Instant::now();
    // The first hundred through the skewed replica, every one accepted.
    let mut reqs = reqs;
    let through_skewed: Vec<pb::SubmitRequest> = reqs.drain(..100).collect();
    let results = skewed
        .jobs()
        .await
        .submit_batch(pb::SubmitBatchRequest {
            jobs: through_skewed,
        })
        .await
        .expect("SubmitBatch through the skewed replica")
        .into_inner()
        .results;
    let mut accepted: Vec<String> = results
        .into_iter()
        .map(|r| match r.result {
            Some(pb::submit_batch_result::Result::Ok(ok)) => ok.job.expect("SubmitResponse.job").id,
            other => panic!(
                "the skewed replica refused a job whose deadline is 90 s away by the database's clock: {other:?}"
            ),
        })
        .collect();
    accepted.extend(submit_all(&[a.url()], reqs, LIMIT).await);
    let last = db
        .wait_all_terminal(n as i64, Duration::from_secs(60))
        .await;
    stop_all(&mut workers).await;

    let mut an = Analysis::run(&db, &accepted, &["succeeded"]).await;
    an.effects(&db);
    let mut reclaimed = Vec::new();
    for (id, evs) in &an.events {
        let leases = evs.iter().filter(|e| e.kind == "leased").count();
        let want = 1 + evs.iter().filter(|e| e.kind == "retry_scheduled").count();
        if leases != want || evs.iter().any(|e| e.kind == "lease_expired") {
            reclaimed.push(format!("{id}: {evs:?}"));
        }
    }
    an.report_and_assert(
        "clock skew (Postgres)",
        &format!(
            "one of two replicas {}s ahead; {} retries scheduled; {} leases reclaimed; last job terminal after {last:?}",
            ahead.num_seconds(),
            an.count_events("retry_scheduled"),
            an.count_events("lease_expired")
        ),
        started.elapsed(),
    );
    assert!(
        reclaimed.is_empty(),
        "leases reclaimed early or twice: {reclaimed:#?}"
    );
    assert_eq!(
        an.count_events("retry_scheduled"),
        n / 2,
        "every fail_first job retried once"
    );
    a.stop().await;
    skewed.stop().await;
}

// ---------------------------------------------------------------------------
// Startup during a migration
// ---------------------------------------------------------------------------

/// A server opens its ports only once its migrations are applied. While
/// another session holds the migrations table, the server's migrator
/// waits and its gRPC port refuses connections; so a TCP startup probe
/// (the Helm chart's) waits out a long migration, where an open port
/// that did not answer would let the liveness probe restart the pod.
async fn ports_open_after_migrations() {
    use sqlx::Connection;
    let db = Db::create(Backend::Postgres).await;
    intray::store::migrate(&db.url, true)
        .await
        .expect("migrate");
    let mut holder = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    sqlx::raw_sql("BEGIN; LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut holder)
        .await
        .expect("hold the migrations table");
    let mut server = Server::launch(&db, "server", &[], &[]);
    // Outside a transaction, so that each read of the activity is fresh.
    let mut probe = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let started = Instant::now();
    loop {
        if common::lock_waiters(&mut probe).await > 0 {
            break;
        }
        assert!(!server.proc.exited(), "the server exited during startup");
        assert!(
            started.elapsed() < LIMIT,
            "the server's migrator never waited for the migrations table"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        tokio::net::TcpStream::connect(server.addr).await.is_err(),
        "the gRPC port is open while the migrations wait"
    );
    sqlx::raw_sql("COMMIT")
        .execute(&mut holder)
        .await
        .expect("release the migrations table");
    server.wait_answering().await;
    server.stop().await;
}

/// SIGHUP to a server with no reloadable file (no tokens, webhooks or TLS
/// files: open mode) is not a stop: its default action ended the process
/// at once, without a drain, when nothing listened for it.
async fn sighup_with_nothing_to_reload_keeps_serving(backend: Backend) {
    let db = Db::create(backend).await;
    let mut server = Server::start(&db, "hup", &[], &[]).await;
    for _ in 0..2 {
        server.proc.signal(Signal::SIGHUP);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !server.proc.exited(),
            "SIGHUP stopped the server; log tail:\n{}",
            server.proc.log_text()
        );
    }
    let mut jobs = server.jobs().await;
    jobs.submit(job_req("hup", "k-hup", json!({}), 1))
        .await
        .expect("still serving after SIGHUP");
    server.stop().await;
}
