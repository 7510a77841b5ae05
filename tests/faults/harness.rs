//! Real processes for the fault battery: `intray serve` and `intray work`
//! (the built binary), each in its own process group so a test can SIGKILL,
//! SIGSTOP and SIGCONT it; a database per test (a SQLite file or a fresh
//! PostgreSQL database) read directly with sqlx; an effect log written by the
//! workers' command; and the analysis every scenario shares (lost,
//! duplicated outcomes, gap-free events, slowest time to terminal).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use intray::pb;
use intray::pb::job_service_client::JobServiceClient;
use intray::pb::worker_service_client::WorkerServiceClient;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use sqlx::{Connection, Row};
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint};

use crate::common::{Backend, DEFAULT_PG_URL, Tenant, db_integers};

pub const BIN: &str = env!("CARGO_BIN_EXE_intray");
pub const TENANT: &str = "faults";
/// Lease asked for by the workers and given by the servers, and the reaper's
/// period: a killed worker's jobs come back within about 2.2 s.
pub const LEASE: &str = "2s";
pub const REAPER: &str = "200ms";
/// How long a server may take to come up (migrations included) on a loaded machine.
const STARTUP: Duration = Duration::from_secs(60);

/// The command every worker runs: reads the payload, sleeps the payload's
/// `sleep` seconds if it names one, fails its first attempt retryably (exit
/// 75) if the payload has `"fail_first": true`, then records its effect as one line
/// `JOB_ID ATTEMPT WORKER` appended to `$EFFECTS` (O_APPEND: lines from
/// concurrent processes do not interleave), and prints the attempt as result.
pub const SCRIPT: &str = r#"#!/bin/sh
payload=$(cat)
s=$(printf '%s' "$payload" | sed -n 's/.*"sleep": *"\([0-9.]*\)".*/\1/p')
if [ -n "$s" ]; then sleep "$s"; fi
case "$payload" in
  *'"fail_first":true'*|*'"fail_first": true'*)
    if [ "$INTRAY_ATTEMPT" = 1 ]; then echo "transient" >&2; exit 75; fi ;;
esac
echo "$INTRAY_JOB_ID $INTRAY_ATTEMPT $WORKER_NAME" >> "$EFFECTS"
echo "{\"attempt\": $INTRAY_ATTEMPT}"
"#;

// ---------------------------------------------------------------------------
// Database
// ---------------------------------------------------------------------------

/// A database for one scenario, plus a folder for logs, the script and the
/// effect log. A PostgreSQL database is dropped when this is dropped.
pub struct Db {
    pub backend: Backend,
    pub url: String,
    pub dir: tempfile::TempDir,
    pg: Option<(String, String)>,
}

/// One row of `job_events`.
#[derive(Clone, Debug)]
pub struct Event {
    pub sequence: i64,
    pub kind: String,
    pub attempt: i64,
    pub worker_id: Option<String>,
}

/// The columns of `jobs` the analysis needs.
#[derive(Clone, Debug)]
pub struct JobRow {
    pub id: String,
    pub state: String,
    pub attempt: i64,
    /// finished_at - created_at, for terminal jobs.
    pub to_terminal_ms: Option<i64>,
}

/// `postgres://u@h:p/admin?x=y` with the database name replaced.
fn replace_db_name(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[authority_start..].find('/') {
        Some(i) => &base[..authority_start + i],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

pub fn admin_url() -> String {
    std::env::var("INTRAY_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_PG_URL.into())
}

impl Db {
    pub async fn create(backend: Backend) -> Db {
        let dir = tempfile::Builder::new()
            .prefix("intray-faults-")
            .tempdir()
            .expect("temporary directory");
        std::fs::write(dir.path().join("job.sh"), SCRIPT).expect("write the job script");
        match backend {
            Backend::Sqlite => Db {
                backend,
                url: format!("sqlite://{}", dir.path().join("intray.db").display()),
                dir,
                pg: None,
            },
            Backend::Postgres => {
                let admin = admin_url();
                let name = format!("intray_test_{:016x}", rand::random::<u64>());
                let mut conn = sqlx::PgConnection::connect(&admin)
                    .await
                    .unwrap_or_else(|e| panic!("PostgreSQL at {admin}: {e}"));
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut conn)
                    .await
                    .expect("CREATE DATABASE");
                let _ = conn.close().await;
                let url = replace_db_name(&admin, &name);
                Db {
                    backend,
                    url,
                    dir,
                    pg: Some((admin, name)),
                }
            }
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Cuts every connection to this test's database (the servers' pools and
    /// their LISTEN connections) with `pg_terminate_backend`; returns how
    /// many were cut. The shared PostgreSQL server itself keeps running.
    pub async fn terminate_connections(&self) -> i64 {
        let (admin, name) = self.pg.as_ref().expect("a PostgreSQL database");
        let mut conn = sqlx::PgConnection::connect(admin)
            .await
            .expect("admin connection");
        let row = sqlx::query(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM pg_stat_activity
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .expect("pg_terminate_backend");
        let _ = conn.close().await;
        row.get::<i64, _>("n")
    }

    /// Jobs not yet in a terminal state, and all jobs.
    pub async fn progress(&self) -> (i64, i64) {
        let sql =
            "SELECT count(*) FILTER (WHERE state IN ('queued', 'running')), count(*) FROM jobs";
        let n = db_integers(self.backend, &self.url, sql, &[]).await;
        (n[0], n[1])
    }

    /// Jobs in `state`.
    pub async fn count_state(&self, state: &str) -> i64 {
        let sql = "SELECT count(*) FROM jobs WHERE state = $1";
        db_integers(self.backend, &self.url, sql, &[state]).await[0]
    }

    /// Every job, and every job's events in sequence order.
    pub async fn snapshot(&self) -> (Vec<JobRow>, HashMap<String, Vec<Event>>) {
        let jobs_pg = "SELECT CAST(id AS TEXT) AS id, state, CAST(attempt AS BIGINT) AS attempt,
                (EXTRACT(EPOCH FROM (finished_at - created_at)) * 1000)::bigint AS ms FROM jobs";
        let jobs_sqlite =
            "SELECT CAST(id AS TEXT) AS id, state, CAST(attempt AS BIGINT) AS attempt,
                (finished_at - created_at) AS ms FROM jobs";
        let events = "SELECT CAST(job_id AS TEXT) AS job_id, sequence, type,
                CAST(attempt AS BIGINT) AS attempt, worker_id FROM job_events ORDER BY job_id, sequence";
        macro_rules! read {
            ($conn:expr, $jobs_sql:expr) => {{
                let mut c = $conn;
                let jobs = sqlx::query($jobs_sql)
                    .fetch_all(&mut c)
                    .await
                    .expect("read jobs")
                    .iter()
                    .map(|r| JobRow {
                        id: r.get("id"),
                        state: r.get("state"),
                        attempt: r.get("attempt"),
                        to_terminal_ms: r.get("ms"),
                    })
                    .collect::<Vec<_>>();
                let mut by_job: HashMap<String, Vec<Event>> = HashMap::new();
                for r in sqlx::query(events)
                    .fetch_all(&mut c)
                    .await
                    .expect("read events")
                {
                    by_job.entry(r.get("job_id")).or_default().push(Event {
                        sequence: r.get("sequence"),
                        kind: r.get("type"),
                        attempt: r.get("attempt"),
                        worker_id: r.get("worker_id"),
                    });
                }
                (jobs, by_job)
            }};
        }
        match self.backend {
            Backend::Postgres => read!(
                sqlx::PgConnection::connect(&self.url)
                    .await
                    .expect("connect"),
                jobs_pg
            ),
            Backend::Sqlite => read!(
                sqlx::SqliteConnection::connect(&self.url)
                    .await
                    .expect("connect"),
                jobs_sqlite
            ),
        }
    }

    /// Waits until no job is queued or running and at least `at_least` jobs
    /// exist; returns how long that took. Panics after `limit`.
    pub async fn wait_all_terminal(&self, at_least: i64, limit: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let (open, n) = self.progress().await;
            if open == 0 && n >= at_least {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < limit,
                "{open} of {n} jobs still queued or running after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        // A failed test keeps its directory, with the servers' and workers'
        // logs, so that a failure seen once (under CI's load) can be read.
        if std::thread::panicking() {
            self.dir.disable_cleanup(true);
            eprintln!(
                "faults: kept {} (server and worker logs of the failed test)",
                self.dir.path().display()
            );
        }
        if let Some((admin, name)) = self.pg.take() {
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let drop_db = async {
                        let mut c = sqlx::PgConnection::connect(&admin).await.ok()?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .execute(&mut c)
                        .await
                        .ok()
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(20), drop_db).await;
                });
            })
            .join();
        }
    }
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local address").port()
}

fn append_log(path: &Path) -> std::fs::File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open a log file")
}

fn signal_group(child: &Child, signal: Signal) {
    if let Some(pid) = child.id() {
        let _ = killpg(Pid::from_raw(pid as i32), signal);
    }
}

/// One process (and its process group) that can be killed and started again
/// with the same command line.
pub struct Proc {
    pub name: String,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub log: PathBuf,
    child: Option<Child>,
    pub starts: u32,
}

impl Proc {
    fn new(
        name: &str,
        program: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Proc {
        Proc {
            name: name.into(),
            program: program.into(),
            args,
            env,
            log,
            child: None,
            starts: 0,
        }
    }

    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(append_log(&self.log))
            .stderr(append_log(&self.log))
            .process_group(0)
            .kill_on_drop(true);
        self.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", self.name)),
        );
        self.starts += 1;
    }

    pub fn signal(&self, signal: Signal) {
        if let Some(child) = &self.child {
            signal_group(child, signal);
        }
    }

    /// SIGKILL to the whole process group, and reap the process.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(&child, Signal::SIGKILL);
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
    }

    /// SIGTERM to the process; SIGKILL to its group if it has not exited
    /// within `within`. Returns whether it exited by itself with status 0.
    pub async fn stop(&mut self, within: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        if let Some(pid) = child.id() {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        // A stopped process cannot act on SIGTERM.
        signal_group(&child, Signal::SIGCONT);
        match tokio::time::timeout(within, child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => {
                signal_group(&child, Signal::SIGKILL);
                let _ = child.wait().await;
                false
            }
        }
    }

    /// Whether the process has exited (and reaps it).
    pub fn exited(&mut self) -> bool {
        match &mut self.child {
            None => true,
            Some(child) => !matches!(child.try_wait(), Ok(None)),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let text = self.log_text();
        let start = text.len().saturating_sub(3000);
        let start = (start..text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(0);
        text[start..].to_string()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal_group(child, Signal::SIGCONT);
            signal_group(child, Signal::SIGKILL);
        }
    }
}

/// `intray serve` on a fixed port of 127.0.0.1, restartable on that port.
pub struct Server {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Server {
    /// Starts `intray serve` on `db` with short leases and a fast reaper
    /// (`extra` flags last, so they win) and waits until it answers.
    pub async fn start(db: &Db, name: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut server = Server::launch(db, name, extra, env);
        server.wait_answering().await;
        server
    }

    /// Starts it as [`Server::start`] does, without waiting.
    pub fn launch(db: &Db, name: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let mut args: Vec<String> = [
            "serve",
            "--database-url",
            &db.url,
            "--grpc-addr",
            &addr.to_string(),
            "--lease-duration",
            LEASE,
            "--reaper-interval",
            REAPER,
            "--fallback-poll",
            "200ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut vars: Vec<(String, String)> = vec![
            (
                "RUST_LOG".into(),
                "info,h2=warn,hyper=warn,tower=warn,sqlx=warn".into(),
            ),
            // The metrics port (where the build has one) must not collide
            // between the servers of parallel tests.
            ("INTRAY_HTTP_ADDR".into(), "127.0.0.1:0".into()),
        ];
        vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let log = db.path(&format!("{name}.log"));
        let mut server = Server {
            proc: Proc::new(name, BIN, args, vars, log),
            addr,
        };
        server.proc.spawn();
        server
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Waits until the server answers a health check; panics if it exits
    /// or takes longer than a loaded machine would.
    pub async fn wait_answering(&mut self) {
        let started = Instant::now();
        loop {
            if self.proc.exited() {
                panic!(
                    "{} exited during startup; log tail:\n{}",
                    self.proc.name,
                    self.proc.log_tail()
                );
            }
            if let Ok(ch) = channel(&self.url()).await {
                let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
                let probe = health.check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                });
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), probe).await {
                    return;
                }
            }
            assert!(
                started.elapsed() < STARTUP,
                "{} did not answer within {STARTUP:?}; log tail:\n{}",
                self.proc.name,
                self.proc.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL the server's process group.
    pub async fn kill(&mut self) {
        self.proc.kill().await;
    }

    /// Starts it again on the same port and waits until it answers.
    pub async fn restart(&mut self) {
        self.proc.spawn();
        self.wait_answering().await;
    }

    pub async fn stop(mut self) {
        self.proc.stop(Duration::from_secs(30)).await;
    }

    pub async fn jobs(&self) -> JobsClient {
        JobServiceClient::with_interceptor(
            channel(&self.url()).await.expect("connect"),
            Tenant::named(TENANT),
        )
    }

    pub async fn workers(&self) -> WorkersClient {
        WorkerServiceClient::with_interceptor(
            channel(&self.url()).await.expect("connect"),
            Tenant::named(TENANT),
        )
    }
}

pub type JobsClient = crate::common::JobsClient;
pub type WorkersClient = crate::common::WorkersClient;

pub async fn channel(url: &str) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(url.to_string())
        .expect("endpoint URL")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(20))
        .connect()
        .await
}

/// An `intray work` process running [`SCRIPT`] on queue `queue`, recording
/// its effects in the scenario's effect log.
pub fn worker(
    db: &Db,
    server_url: &str,
    name: &str,
    queue: &str,
    concurrency: usize,
    lease: &str,
) -> Proc {
    let script = db.path("job.sh");
    let args: Vec<String> = [
        "work",
        "--addr",
        server_url,
        "--tenant",
        TENANT,
        "--queue",
        queue,
        "--worker-id",
        name,
        "--concurrency",
        &concurrency.to_string(),
        "--lease-duration",
        lease,
        "--grace",
        "1s",
        "--kill-after",
        "1s",
        "--",
        "sh",
        &script.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = vec![
        ("RUST_LOG".into(), "info".into()),
        (
            "EFFECTS".into(),
            db.path("effects.log").display().to_string(),
        ),
        ("WORKER_NAME".into(), name.into()),
    ];
    Proc::new(name, BIN, args, env, db.path(&format!("{name}.log")))
}

// ---------------------------------------------------------------------------
// Producing
// ---------------------------------------------------------------------------

pub fn job_req(
    queue: &str,
    key: &str,
    payload: serde_json::Value,
    max_attempts: u32,
) -> pb::SubmitRequest {
    pb::SubmitRequest {
        queue: queue.into(),
        kind: "effect".into(),
        payload: Some(crate::common::json_to_value(payload)),
        idempotency_key: key.into(),
        max_attempts: Some(max_attempts),
        ..Default::default()
    }
}

/// Submits `reqs` in batches of 100 through the servers at `urls` in turn.
/// A batch that fails as a whole (server down, connection cut, database
/// unavailable) is sent again, to the next server, with the same
/// idempotency keys, so an ambiguous failure never makes a second job.
/// Returns the ids of the accepted jobs (each key once).
pub async fn submit_all(
    urls: &[String],
    reqs: Vec<pb::SubmitRequest>,
    limit: Duration,
) -> Vec<String> {
    let start = Instant::now();
    let mut ids = Vec::with_capacity(reqs.len());
    let mut turn = 0usize;
    for chunk in reqs.chunks(100) {
        loop {
            assert!(start.elapsed() < limit, "could not submit within {limit:?}");
            let url = &urls[turn % urls.len()];
            turn += 1;
            let Ok(ch) = channel(url).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut client = JobServiceClient::with_interceptor(ch, Tenant::named(TENANT));
            let res = client
                .submit_batch(pb::SubmitBatchRequest {
                    jobs: chunk.to_vec(),
                })
                .await;
            let results = match res {
                Ok(r) => r.into_inner().results,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Items fail alone: an item refused for a transient reason goes again.
            let all_ok = results
                .iter()
                .all(|r| matches!(r.result, Some(pb::submit_batch_result::Result::Ok(_))));
            if !all_ok {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            for r in results {
                if let Some(pb::submit_batch_result::Result::Ok(ok)) = r.result {
                    ids.push(ok.job.expect("SubmitResponse.job").id);
                }
            }
            break;
        }
    }
    ids
}

// ---------------------------------------------------------------------------
// Analysis
// ---------------------------------------------------------------------------

pub const TERMINAL: [&str; 4] = ["succeeded", "failed", "cancelled", "expired"];

/// What the database and the effect log say about a run.
#[derive(Debug, Default)]
pub struct Analysis {
    pub jobs: usize,
    /// Accepted jobs missing, not terminal, or not in an allowed final state.
    pub lost: Vec<String>,
    /// Jobs with more than one accepted outcome (terminal event), or whose
    /// SUCCEEDED event does not belong to the job's final attempt.
    pub duplicated: Vec<String>,
    /// Jobs whose event sequence is not 1..=n or goes on after a terminal event.
    pub broken_history: Vec<String>,
    /// Jobs whose recorded success has no effect line for that attempt.
    pub outcome_without_effect: Vec<String>,
    /// Jobs whose command ran to its effect more than once (allowed: at least once).
    pub effects_repeated: usize,
    pub effect_lines: usize,
    pub slowest_to_terminal: Duration,
    pub final_states: BTreeMap<String, usize>,
    pub events: HashMap<String, Vec<Event>>,
    pub rows: HashMap<String, JobRow>,
}

impl Analysis {
    pub async fn run(db: &Db, accepted: &[String], allowed_final: &[&str]) -> Analysis {
        let (rows, events) = db.snapshot().await;
        let rows: HashMap<String, JobRow> = rows.into_iter().map(|r| (r.id.clone(), r)).collect();
        let mut a = Analysis {
            jobs: rows.len(),
            ..Default::default()
        };
        let accepted: HashSet<&String> = accepted.iter().collect();
        for id in &accepted {
            match rows.get(*id) {
                Some(row) if allowed_final.contains(&row.state.as_str()) => {}
                _ => a.lost.push((*id).clone()),
            }
        }
        for (id, row) in &rows {
            *a.final_states.entry(row.state.clone()).or_default() += 1;
            if !accepted.contains(id) && !allowed_final.contains(&row.state.as_str()) {
                // A job made by a call whose answer was lost still counts.
                a.lost.push(id.clone());
            }
            if let Some(ms) = row.to_terminal_ms {
                a.slowest_to_terminal = a
                    .slowest_to_terminal
                    .max(Duration::from_millis(ms.max(0) as u64));
            }
            let evs = events.get(id).map(Vec::as_slice).unwrap_or_default();
            let sequences_ok = evs
                .iter()
                .enumerate()
                .all(|(i, e)| e.sequence == i as i64 + 1);
            let terminal_at: Vec<usize> = evs
                .iter()
                .enumerate()
                .filter(|(_, e)| TERMINAL.contains(&e.kind.as_str()))
                .map(|(i, _)| i)
                .collect();
            // No replay happens in the battery: one terminal event, last.
            let ends_once =
                terminal_at.len() <= 1 && terminal_at.first().is_none_or(|i| *i + 1 == evs.len());
            if !sequences_ok || !ends_once {
                a.broken_history.push(id.clone());
            }
            let succeeded: Vec<&Event> = evs.iter().filter(|e| e.kind == "succeeded").collect();
            if terminal_at.len() > 1
                || succeeded.len() > 1
                || succeeded
                    .first()
                    .is_some_and(|e| e.attempt != row.attempt || row.state != "succeeded")
            {
                a.duplicated.push(id.clone());
            }
        }
        a.events = events;
        a.rows = rows;
        a
    }

    /// Reads the effect log: jobs whose command ran to its effect more than
    /// once, and successes recorded for an attempt that left no effect.
    pub fn effects(&mut self, db: &Db) {
        let text = std::fs::read_to_string(db.path("effects.log")).unwrap_or_default();
        let mut per_job: HashMap<&str, HashSet<i64>> = HashMap::new();
        let mut lines_per_job: HashMap<&str, usize> = HashMap::new();
        for line in text.lines() {
            let mut parts = line.split_whitespace();
            let (Some(id), Some(attempt)) = (parts.next(), parts.next()) else {
                continue;
            };
            self.effect_lines += 1;
            *lines_per_job.entry(id).or_default() += 1;
            per_job
                .entry(id)
                .or_default()
                .insert(attempt.parse().unwrap_or(-1));
        }
        self.effects_repeated = lines_per_job.values().filter(|n| **n > 1).count();
        for (id, row) in &self.rows {
            if row.state == "succeeded"
                && !per_job
                    .get(id.as_str())
                    .is_some_and(|a| a.contains(&row.attempt))
            {
                self.outcome_without_effect.push(id.clone());
            }
        }
    }

    /// Events of one type across all jobs.
    pub fn count_events(&self, kind: &str) -> usize {
        self.events
            .values()
            .flatten()
            .filter(|e| e.kind == kind)
            .count()
    }

    /// Prints the scenario's figures and asserts nothing was lost, completed
    /// twice, or written out of order.
    pub fn report_and_assert(&self, scenario: &str, faults: &str, run_time: Duration) {
        println!(
            "FAULTS {scenario}: jobs {}, faults injected: {faults}, lost {}, duplicated {}, \
             broken histories {}, outcomes without effect {}, jobs with repeated effects {} \
             ({} effect lines), slowest time to terminal {:?}, run time {:?}, final states {:?}",
            self.jobs,
            self.lost.len(),
            self.duplicated.len(),
            self.broken_history.len(),
            self.outcome_without_effect.len(),
            self.effects_repeated,
            self.effect_lines,
            self.slowest_to_terminal,
            run_time,
            self.final_states,
        );
        let sample = |v: &Vec<String>| -> Vec<(String, Option<String>, Vec<String>)> {
            v.iter()
                .take(5)
                .map(|id| {
                    (
                        id.clone(),
                        self.rows
                            .get(id)
                            .map(|r| format!("{} attempt {}", r.state, r.attempt)),
                        self.events
                            .get(id)
                            .map(|es| {
                                es.iter()
                                    .map(|e| {
                                        format!(
                                            "{}:{}@{}/{:?}",
                                            e.sequence, e.kind, e.attempt, e.worker_id
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                    )
                })
                .collect()
        };
        assert!(
            self.lost.is_empty(),
            "{scenario}: {} jobs lost: {:?}",
            self.lost.len(),
            sample(&self.lost)
        );
        assert!(
            self.duplicated.is_empty(),
            "{scenario}: {} jobs with a duplicated outcome: {:?}",
            self.duplicated.len(),
            sample(&self.duplicated)
        );
        assert!(
            self.broken_history.is_empty(),
            "{scenario}: {} jobs with a broken event history: {:?}",
            self.broken_history.len(),
            sample(&self.broken_history)
        );
        assert!(
            self.outcome_without_effect.is_empty(),
            "{scenario}: {} successes recorded for an attempt whose command never ran to its effect: {:?}",
            self.outcome_without_effect.len(),
            sample(&self.outcome_without_effect)
        );
    }
}
