//! `intray bench --spawn` (the built binary) with tiny sizes on SQLite and on
//! a fresh PostgreSQL database: every scenario prints parseable JSON lines
//! with its keys, and the server's Stats count every job as succeeded (the
//! bench itself fails when they do not). Shape and counts only: nothing
//! here depends on how fast anything is.

mod common;

use std::path::Path;

use serde_json::Value;
use sqlx::Connection;

/// Warm-up jobs per scenario (dispatch samples too, below 100).
const WARMUP: u64 = 3;
const E2E_JOBS: u64 = 30;
/// Small enough that the producers wait for completions.
const E2E_OUTSTANDING: u64 = 4;
const BATCHED_JOBS: u64 = 120;
const BATCH: u64 = 50;
/// The least allowed: one batch at a time.
const BATCHED_OUTSTANDING: u64 = BATCH;
const WORKERS: u64 = 2;
const BURN_DOWN_JOBS: u64 = 150;
const SAMPLES: u64 = 5;
const BACKLOG: u64 = 1500;
const BACKLOG_JOBS: u64 = 20;
const WATCHERS: u64 = 25;

/// The JSON lines of a run, and its progress output (stderr).
async fn bench(database_url: &str, log: &Path) -> (Vec<Value>, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_intray"))
        .args(["bench", "--json", "--spawn", "--database-url", database_url])
        .args(["--server-log", &log.display().to_string()])
        .args(["--submit-producers", "1,2", "--submit-jobs", "20"])
        .args(["--producers", "2", "--workers", &WORKERS.to_string()])
        .args(["--e2e-jobs", &E2E_JOBS.to_string()])
        .args(["--e2e-outstanding", &E2E_OUTSTANDING.to_string()])
        .args(["--batched-jobs", &BATCHED_JOBS.to_string()])
        .args(["--batch", &BATCH.to_string()])
        .args(["--batched-outstanding", &BATCHED_OUTSTANDING.to_string()])
        .args(["--burn-down-jobs", &BURN_DOWN_JOBS.to_string()])
        .args(["--dispatch-samples", &SAMPLES.to_string()])
        .args(["--dispatch-spacing", "1ms"])
        .args(["--backlog-size", &BACKLOG.to_string()])
        .args(["--backlog-jobs", &BACKLOG_JOBS.to_string()])
        .args([
            "--watchers",
            &WATCHERS.to_string(),
            "--watchers-per-channel",
            "10",
        ])
        .args(["--warmup", &WARMUP.to_string()])
        // Long enough to run the settling step, short enough not to wait
        // for a busy test machine to calm down.
        .args(["--settle", "1ms"])
        .output()
        .await
        .expect("run intray bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "intray bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver log:\n{}",
        output.status,
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let reports = stdout
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("--json prints only JSON lines: {e}: {line:?}"))
        })
        .collect();
    (reports, stderr)
}

/// Before each of the ten scenarios, and before each backlog size's e2e
/// and dispatch parts in each of its four rounds, the run took the machine's CPU share (settled, or
/// gave up waiting); on PostgreSQL after a CHECKPOINT that went through.
fn check_settled(stderr: &str) {
    let sampled = stderr
        .lines()
        .filter(|l| l.starts_with("bench: settle: CPU"))
        .count();
    assert_eq!(sampled, 10 + 4 * 2 * 2, "{stderr}");
    assert!(!stderr.contains("no CHECKPOINT"), "{stderr}");
}

fn lines<'a>(reports: &'a [Value], scenario: &str) -> Vec<&'a Value> {
    reports
        .iter()
        .filter(|r| r["scenario"] == scenario)
        .collect()
}

fn number(report: &Value, key: &str) -> f64 {
    report[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is a number in {report}"))
}

fn check(reports: &[Value], backend: &str) {
    for report in reports {
        assert_eq!(report["backend"], backend, "{report}");
        assert_eq!(report["target"], "spawned", "{report}");
        let command = report["command"].as_str().expect("command");
        assert!(
            command.contains("bench") && command.contains("--spawn"),
            "{command}"
        );
    }

    let submit = lines(reports, "submit");
    assert_eq!(submit.len(), 2, "one submit row per producer count");
    for (row, producers) in submit.iter().zip([1.0, 2.0]) {
        assert_eq!(number(row, "producers"), producers);
        assert_eq!(number(row, "jobs"), 20.0);
        for key in [
            "jobs_per_s",
            "latency_p50_ms",
            "latency_p99_ms",
            "latency_max_ms",
        ] {
            assert!(number(row, key) > 0.0, "{key} in {row}");
        }
    }

    for (scenario, jobs, outstanding) in [
        ("e2e", E2E_JOBS, E2E_OUTSTANDING),
        ("e2e-chained", E2E_JOBS, E2E_OUTSTANDING),
        ("e2e-batched", BATCHED_JOBS, BATCHED_OUTSTANDING),
    ] {
        let rows = lines(reports, scenario);
        assert_eq!(rows.len(), 1, "{scenario}");
        let row = rows[0];
        assert!(number(row, "jobs_per_s") > 0.0, "{row}");
        for key in ["queue_p50_ms", "queue_p99_ms", "queue_max_ms"] {
            assert!(number(row, key) >= 0.0, "{key} in {row}");
        }
        assert_eq!(number(row, "completed"), jobs as f64, "{row}");
        assert_eq!(number(row, "outstanding"), outstanding as f64, "{row}");
        assert_eq!(
            number(row, "stats_succeeded"),
            (jobs + WARMUP) as f64,
            "{row}"
        );
        assert_eq!(row["stats_succeeded"], row["expected_succeeded"], "{row}");
        assert_eq!(
            row["complete_and_lease"],
            scenario == "e2e-chained",
            "{row}"
        );
    }
    assert_eq!(
        number(lines(reports, "e2e-batched")[0], "lease_max_jobs"),
        BATCH as f64
    );

    for scenario in ["burn-down", "burn-down-chained"] {
        let burn = lines(reports, scenario);
        assert_eq!(burn.len(), 1, "{scenario}");
        assert!(number(burn[0], "jobs_per_s") > 0.0);
        assert_eq!(number(burn[0], "completed"), BURN_DOWN_JOBS as f64);
        assert_eq!(
            number(burn[0], "stats_succeeded"),
            (BURN_DOWN_JOBS + WARMUP) as f64
        );
        assert_eq!(burn[0]["stats_succeeded"], burn[0]["expected_succeeded"]);
        assert_eq!(
            burn[0]["complete_and_lease"],
            scenario == "burn-down-chained"
        );
    }

    let dispatch = lines(reports, "dispatch");
    assert_eq!(dispatch.len(), 1);
    assert_eq!(number(dispatch[0], "samples"), SAMPLES as f64);
    for key in ["dispatch_p50_ms", "dispatch_p99_ms", "dispatch_max_ms"] {
        assert!(number(dispatch[0], key) > 0.0, "{key}");
    }
    assert_eq!(
        number(dispatch[0], "stats_succeeded"),
        (SAMPLES + WARMUP) as f64
    );
    assert_eq!(
        dispatch[0]["stats_succeeded"],
        dispatch[0]["expected_succeeded"]
    );

    let backlog = lines(reports, "backlog");
    assert_eq!(backlog.len(), 2, "one row per backlog size");
    assert_eq!(number(backlog[0], "backlog"), 1000.0);
    assert_eq!(number(backlog[1], "backlog"), BACKLOG as f64);
    for row in &backlog {
        assert!(number(row, "e2e_jobs_per_s") > 0.0, "{row}");
        assert!(number(row, "dispatch_p99_ms") > 0.0, "{row}");
        assert!(row["arrangement"].is_string(), "{row}");
        assert_eq!(row["e2e_backlog"], "runnable", "{row}");
        assert_eq!(row["dispatch_backlog"], "scheduled", "{row}");
        assert_eq!(row["e2e_outstanding"], row["backlog"], "{row}");
        // The size's e2e completions, warm-up included, and its dispatch
        // jobs (the probe's warm-up in each of the four rounds), each size
        // in queues of its own. Behind the runnable backlog each other
        // worker may complete one job beyond a run's count (in the warm-up
        // and in each of the four rounds); the scheduled backlog is never
        // claimed.
        let per_size = BACKLOG_JOBS + WARMUP + SAMPLES + 4 * WARMUP;
        let succeeded = number(row, "stats_succeeded");
        assert_eq!(row["stats_succeeded"], row["expected_succeeded"], "{row}");
        assert!(
            succeeded >= per_size as f64 && succeeded <= (per_size + 5 * (WORKERS - 1)) as f64,
            "{row}"
        );
    }
    for key in ["e2e_ratio", "dispatch_p50_ratio", "dispatch_p99_ratio"] {
        assert!(number(backlog[1], key) > 0.0, "{key}");
    }

    let transport = lines(reports, "transport");
    assert_eq!(transport.len(), 1);
    let row = transport[0];
    assert_eq!(number(row, "callers"), 4.0, "producers + workers");
    assert_eq!(number(row, "calls"), (3 * E2E_JOBS) as f64, "{row}");
    assert!(number(row, "calls_per_s") > 0.0, "{row}");
    // The ceiling is a third of the unrounded rate, and the row shows the
    // rate rounded to 0.1: 4159.49 calls/s shows as 4159.5, whose third
    // rounds to 1387 where the ceiling is 1386.
    assert!(
        (number(row, "e2e_ceiling_jobs_per_s") - number(row, "calls_per_s") / 3.0).abs() <= 0.52,
        "{row}"
    );

    let watchers = lines(reports, "watchers");
    assert_eq!(watchers.len(), 1);
    let row = watchers[0];
    assert_eq!(number(row, "watchers"), WATCHERS as f64);
    assert_eq!(number(row, "channels"), 3.0);
    assert!(number(row, "event_p99_ms") >= 0.0);
    // Per job, delivery after the answer is part of the latency from the
    // call's start, so no percentile of it can be larger.
    assert!(
        number(row, "delivery_after_answer_p99_ms") <= number(row, "event_p99_ms"),
        "{row}"
    );
    assert!(number(row, "rss_idle_mib") > 0.0 && number(row, "rss_above_idle_mib") >= 0.0);
    assert!(number(row, "rss_watching_mib") > 0.0, "{row}");
    assert_eq!(number(row, "stats_succeeded"), WATCHERS as f64);
    assert_eq!(row["stats_succeeded"], row["expected_succeeded"]);
    if backend == "postgres" {
        assert!(number(row, "db_connections") >= 0.0, "{row}");
        assert!(number(row, "db_connections_busy") >= 0.0, "{row}");
    } else {
        assert!(
            row["db_connections"].is_null() && row["db_pool"].is_string(),
            "{row}"
        );
    }
}

#[tokio::test]
async fn a_bound_smaller_than_a_batch_is_refused() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_intray"))
        .args(["bench", "--batch", "100", "--batched-outstanding", "99"])
        .output()
        .await
        .expect("run intray bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--batched-outstanding"), "{stderr}");
}

#[tokio::test]
async fn bench_on_sqlite() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let (reports, stderr) = bench(&url, &dir.path().join("server.log")).await;
    check(&reports, "sqlite");
    check_settled(&stderr);
}

#[tokio::test]
async fn bench_on_a_fresh_postgres_database() {
    let admin =
        std::env::var("INTRAY_TEST_PG_URL").unwrap_or_else(|_| common::DEFAULT_PG_URL.into());
    let name = format!("intray_test_bench_{:08x}", rand::random::<u32>());
    let (path, query) = admin.split_once('?').unwrap_or((&admin, ""));
    let (base, _) = path.rsplit_once('/').expect("a database URL with a path");
    let url = match query {
        "" => format!("{base}/{name}"),
        query => format!("{base}/{name}?{query}"),
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    // The bench creates the database itself (dropping it first).
    let (reports, stderr) = bench(&url, &dir.path().join("server.log")).await;
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .expect("connect to drop the bench database");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut conn)
    .await
    .expect("drop the bench database");
    check(&reports, "postgres");
    check_settled(&stderr);
}
