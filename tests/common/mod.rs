//! Test harness: starts the real intray server on a fresh database (SQLite file
//! or a new PostgreSQL database), hands out tenant-aware clients, and has small
//! helpers for the calls every behavioural test makes.
//!
//! `backend_tests!(a, b, ...)` turns each `async fn a(backend: Backend)` into one
//! `#[tokio::test]` per backend, so the same suite runs on SQLite and PostgreSQL.
#![allow(dead_code)]

pub mod proxy;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use intray::config::Settings;
use intray::pb::job_service_client::JobServiceClient;
use intray::pb::worker_service_client::WorkerServiceClient;
use intray::pb::{self, JobEventType, JobState};
use sqlx::Connection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// Metadata key carrying the tenant of a call.
pub const TENANT_HEADER: &str = "x-intray-tenant";

/// Admin URL used to create and drop the per-test PostgreSQL databases.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// How long a server may take to start (migrations included).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to stop.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Defines one `#[tokio::test]` per backend for each listed
/// `async fn name(backend: Backend)`, in modules `sqlite` and `postgres`.
/// (Suites about one backend only, such as tests/outage.rs, do not use it.)
#[allow(unused_macros)]
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::common::Backend::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::common::Backend::Postgres).await
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use backend_tests;

// ---------------------------------------------------------------------------
// Databases
// ---------------------------------------------------------------------------

/// A database created for one test; shared by the server and its replicas.
struct TestDb {
    url: String,
    /// Keeps the SQLite file alive.
    _dir: Option<tempfile::TempDir>,
    /// Admin URL and name of a PostgreSQL database to drop at the end.
    pg: Option<(String, String)>,
}

impl TestDb {
    async fn create(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::Builder::new()
                    .prefix("intray-test-")
                    .tempdir()
                    .expect("create a temporary directory for the SQLite database");
                let path = dir.path().join("intray.db");
                TestDb {
                    url: format!("sqlite://{}", path.display()),
                    _dir: Some(dir),
                    pg: None,
                }
            }
            Backend::Postgres => {
                let admin =
                    std::env::var("INTRAY_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_PG_URL.into());
                let name = format!("intray_test_{:016x}", rand::random::<u64>());
                let mut conn = pg_admin(&admin).await;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("CREATE DATABASE {name} on {admin}: {e}"));
                let _ = conn.close().await;
                TestDb {
                    url: replace_db_name(&admin, &name),
                    _dir: None,
                    pg: Some((admin, name)),
                }
            }
        }
    }

    async fn drop_pg(admin: &str, name: &str) {
        let mut conn = pg_admin(admin).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("DROP DATABASE {name} on {admin}: {e}"));
        let _ = conn.close().await;
    }
}

impl Drop for TestDb {
    /// Drops the PostgreSQL database even when a test panicked before `stop`.
    fn drop(&mut self) {
        if let Some((admin, name)) = self.pg.take() {
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("build a runtime to drop the test database");
                rt.block_on(async move {
                    let fut = TestDb::drop_pg(&admin, &name);
                    let _ = tokio::time::timeout(Duration::from_secs(20), fut).await;
                });
            })
            .join();
        }
    }
}

async fn pg_admin(admin: &str) -> sqlx::PgConnection {
    match tokio::time::timeout(Duration::from_secs(10), sqlx::PgConnection::connect(admin)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => panic!(
            "PostgreSQL is unreachable at {admin} (set INTRAY_TEST_PG_URL to an admin URL): {e}"
        ),
        Err(_) => panic!(
            "PostgreSQL at {admin} did not answer within 10 s (set INTRAY_TEST_PG_URL to an admin URL)"
        ),
    }
}

/// Runs `sql` directly on a test database, behind the server's back, and
/// returns the first row's columns as integers (NULL as 0): how tests check
/// what the server wrote (or did not). `binds` are bound as text to `$1`,
/// `$2`, ..., which both backends accept; compare a UUID column as
/// `CAST(col AS TEXT)`.
pub async fn db_integers(backend: Backend, url: &str, sql: &str, binds: &[&str]) -> Vec<i64> {
    use sqlx::Row;
    macro_rules! read {
        ($conn:ty) => {{
            let mut c = <$conn>::connect(url)
                .await
                .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for value in binds {
                query = query.bind(*value);
            }
            let row = query
                .fetch_one(&mut c)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            (0..row.len())
                .map(|i| row.get::<Option<i64>, _>(i).unwrap_or(0))
                .collect()
        }};
    }
    match backend {
        Backend::Postgres => read!(sqlx::PgConnection),
        Backend::Sqlite => read!(sqlx::SqliteConnection),
    }
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

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// One running intray server on a test database.
pub struct TestServer {
    pub addr: SocketAddr,
    /// The HTTP port (`GET /metrics`).
    pub http_addr: SocketAddr,
    pub backend: Backend,
    pub settings: Settings,
    channel: Channel,
    shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), intray::server::ServerError>>>,
    db: Arc<TestDb>,
}

impl TestServer {
    /// A server with default settings on a fresh database.
    pub async fn start(backend: Backend) -> TestServer {
        Self::start_with(backend, |_| {}).await
    }

    /// A server on a fresh database, with `tweak` applied to its settings.
    pub async fn start_with(backend: Backend, tweak: impl FnOnce(&mut Settings)) -> TestServer {
        let db = Arc::new(TestDb::create(backend).await);
        let mut settings = Settings::new(db.url.clone());
        tweak(&mut settings);
        Self::launch(backend, settings, db).await
    }

    /// A server whose reaper runs every 100 ms: a lease that runs out is
    /// taken back (and its job handed on) at once.
    pub async fn start_reaping_fast(backend: Backend) -> TestServer {
        Self::start_with(backend, |s| s.reaper_interval = Duration::from_millis(100)).await
    }

    /// A second server (replica) on the same database with the same settings.
    pub async fn start_replica(&self) -> TestServer {
        Self::launch(self.backend, self.settings.clone(), self.db.clone()).await
    }

    /// A replica on the same database, with `tweak` applied to a copy of
    /// this server's settings.
    pub async fn start_replica_with(&self, tweak: impl FnOnce(&mut Settings)) -> TestServer {
        let mut settings = self.settings.clone();
        tweak(&mut settings);
        Self::launch(self.backend, settings, self.db.clone()).await
    }

    async fn launch(backend: Backend, settings: Settings, db: Arc<TestDb>) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("listener address");
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let http_addr = http.local_addr().expect("listener address");
        let shutdown = CancellationToken::new();
        let mut task = tokio::spawn(intray::server::run_with(
            settings.clone(),
            listener,
            Some(http),
            shutdown.clone().cancelled_owned(),
        ));

        let url = format!("http://{addr}");
        let started = Instant::now();
        let channel = loop {
            if task.is_finished() {
                let res = (&mut task).await;
                panic!("intray server on {url} ({backend:?}) exited during startup: {res:?}");
            }
            if started.elapsed() > STARTUP_TIMEOUT {
                panic!(
                    "intray server on {url} ({backend:?}) did not come up within {STARTUP_TIMEOUT:?}"
                );
            }
            if let Ok(ch) = connect(&url).await {
                // A connection is not proof of service: wait for an answer.
                let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
                let probe = health.check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                });
                tokio::select! {
                    res = &mut task => panic!(
                        "intray server on {url} ({backend:?}) exited during startup: {res:?}"
                    ),
                    res = tokio::time::timeout(Duration::from_secs(5), probe) => match res {
                        Ok(Ok(_)) => break ch,
                        // Any gRPC answer other than a transport failure means it serves.
                        Ok(Err(s)) if s.code() != Code::Unavailable && s.code() != Code::Unknown => break ch,
                        _ => {}
                    },
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };

        TestServer {
            addr,
            http_addr,
            backend,
            settings,
            channel,
            shutdown,
            task: Some(task),
            db,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The channel shared by this server's clients.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// A new, separate HTTP/2 connection to this server.
    pub async fn new_channel(&self) -> Channel {
        connect(&self.url())
            .await
            .expect("connect to the test server")
    }

    pub fn jobs_client(&self, tenant: &str) -> JobsClient {
        JobServiceClient::with_interceptor(self.channel(), Tenant::named(tenant))
            .max_decoding_message_size(16 * 1024 * 1024)
            .max_encoding_message_size(16 * 1024 * 1024)
    }

    /// A JobService client that sends no tenant metadata ("default").
    pub fn jobs_client_no_tenant(&self) -> JobsClient {
        JobServiceClient::with_interceptor(self.channel(), Tenant(None))
            .max_decoding_message_size(16 * 1024 * 1024)
            .max_encoding_message_size(16 * 1024 * 1024)
    }

    /// A WorkerService client on its own HTTP/2 connection.
    pub async fn workers_client_own_conn(&self, tenant: &str) -> WorkersClient {
        WorkerServiceClient::with_interceptor(self.new_channel().await, Tenant::named(tenant))
    }

    pub fn workers_client(&self, tenant: &str) -> WorkersClient {
        WorkerServiceClient::with_interceptor(self.channel(), Tenant::named(tenant))
            .max_decoding_message_size(16 * 1024 * 1024)
            .max_encoding_message_size(16 * 1024 * 1024)
    }

    /// Sends the server its shutdown signal without waiting ([`Self::stop`]
    /// waits).
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Stops the server, waits for it, and (for the primary) drops the database
    /// once no replica uses it any more.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(SHUTDOWN_TIMEOUT, task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => panic!("intray server stopped with an error: {e:?}"),
                Ok(Err(e)) => panic!("intray server task panicked: {e:?}"),
                Err(_) => panic!("intray server did not stop within {SHUTDOWN_TIMEOUT:?}"),
            }
        }
        // Dropping the last Arc<TestDb> drops the PostgreSQL database; do it
        // here explicitly when this is the last user so errors surface.
        let db = std::mem::replace(&mut self.db, Arc::new(TestDb::none()));
        if let Ok(mut db) = Arc::try_unwrap(db)
            && let Some((admin, name)) = db.pg.take()
        {
            TestDb::drop_pg(&admin, &name).await;
        }
    }
}

impl TestDb {
    fn none() -> TestDb {
        TestDb {
            url: String::new(),
            _dir: None,
            pg: None,
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // A test that panicked before `stop`: at least tell the server to go.
        self.shutdown.cancel();
    }
}

/// A new connection to `url` (not a server's shared channel).
pub async fn connect(url: &str) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(url.to_string())
        .expect("valid endpoint URL")
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
}

// ---------------------------------------------------------------------------
// Tenant metadata
// ---------------------------------------------------------------------------

/// Adds `x-intray-tenant` to every request that does not name a tenant
/// itself (nothing when `None`).
#[derive(Clone)]
pub struct Tenant(Option<AsciiMetadataValue>);

impl Tenant {
    pub fn named(tenant: &str) -> Tenant {
        Tenant(Some(
            MetadataValue::try_from(tenant).expect("tenant is valid ASCII metadata"),
        ))
    }
}

impl Interceptor for Tenant {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(t) = &self.0
            && !req.metadata().contains_key(TENANT_HEADER)
        {
            req.metadata_mut().insert(TENANT_HEADER, t.clone());
        }
        Ok(req)
    }
}

pub type JobsClient = JobServiceClient<InterceptedService<Channel, Tenant>>;
pub type WorkersClient = WorkerServiceClient<InterceptedService<Channel, Tenant>>;

/// A request carrying the tenant metadata, for clients without the interceptor.
pub fn req<T>(tenant: &str, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert(
        TENANT_HEADER,
        MetadataValue::try_from(tenant).expect("tenant is valid ASCII metadata"),
    );
    r
}

// ---------------------------------------------------------------------------
// Values, times, states
// ---------------------------------------------------------------------------

/// JSON as a `google.protobuf.Value` the way protobuf clients send it (a
/// kind at every level, `null` as `NullValue`), which is also how the
/// server answers.
pub fn json_to_value(v: serde_json::Value) -> pbjson_types::Value {
    intray::api::convert::value(&v)
}

pub fn value_to_json(v: &pbjson_types::Value) -> serde_json::Value {
    serde_json::to_value(v).expect("google.protobuf.Value converts to JSON")
}

pub fn ms(n: u64) -> pbjson_types::Duration {
    Duration::from_millis(n).into()
}

pub fn secs(n: u64) -> pbjson_types::Duration {
    Duration::from_secs(n).into()
}

pub fn ts(t: DateTime<Utc>) -> pbjson_types::Timestamp {
    t.into()
}

/// A timestamp field that must be set, as chrono.
pub fn time(t: &Option<pbjson_types::Timestamp>, what: &str) -> DateTime<Utc> {
    let t = t.unwrap_or_else(|| panic!("{what} is not set"));
    DateTime::<Utc>::try_from(t).unwrap_or_else(|e| panic!("{what} is not a valid time: {e:?}"))
}

pub fn to_std(d: &pbjson_types::Duration) -> Duration {
    Duration::try_from(*d).expect("non-negative duration")
}

pub fn state(job: &pb::Job) -> JobState {
    JobState::try_from(job.state).unwrap_or(JobState::Unspecified)
}

pub fn event_type(e: &pb::JobEvent) -> JobEventType {
    JobEventType::try_from(e.r#type).unwrap_or(JobEventType::Unspecified)
}

pub fn event_types(events: &[pb::JobEvent]) -> Vec<JobEventType> {
    events.iter().map(event_type).collect()
}

/// Whether `events` hold a RETRY_SCHEDULED whose detail mentions `text`
/// (an error class, say).
pub fn has_retry_mentioning(events: &[pb::JobEvent], text: &str) -> bool {
    events.iter().any(|e| {
        e.r#type == JobEventType::RetryScheduled as i32
            && e.detail
                .as_ref()
                .map(|d| serde_json::to_string(d).unwrap_or_default())
                .is_some_and(|d| d.contains(text))
    })
}

pub fn sequences(events: &[pb::JobEvent]) -> Vec<u64> {
    events.iter().map(|e| e.sequence).collect()
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

pub fn submit_req(queue: &str, kind: &str, payload: serde_json::Value) -> pb::SubmitRequest {
    pb::SubmitRequest {
        queue: queue.into(),
        kind: kind.into(),
        payload: Some(json_to_value(payload)),
        ..Default::default()
    }
}

pub fn lease_req(worker: &str, queue: &str, max_jobs: u32, wait: Duration) -> pb::LeaseRequest {
    pb::LeaseRequest {
        worker_id: worker.into(),
        queues: vec![queue.into()],
        max_jobs: Some(max_jobs),
        wait: Some(wait.into()),
        ..Default::default()
    }
}

/// A `lease_req` whose lease runs out after one second, for tests of what
/// happens to a job its worker abandons.
pub fn short_lease_req(
    worker: &str,
    queue: &str,
    max_jobs: u32,
    wait: Duration,
) -> pb::LeaseRequest {
    pb::LeaseRequest {
        lease_duration: Some(secs(1)),
        ..lease_req(worker, queue, max_jobs, wait)
    }
}

pub fn success_req(leased: &pb::LeasedJob, result: serde_json::Value) -> pb::CompleteRequest {
    pb::CompleteRequest {
        job_id: leased.job_id.clone(),
        lease_token: leased.lease_token.clone(),
        outcome: Some(pb::complete_request::Outcome::Success(
            pb::complete_request::Success {
                result: Some(json_to_value(result)),
            },
        )),
        cost_cents: 0,
    }
}

pub fn failure_req(
    leased: &pb::LeasedJob,
    class: &str,
    retryable: Option<bool>,
    retry_after: Option<Duration>,
) -> pb::CompleteRequest {
    pb::CompleteRequest {
        job_id: leased.job_id.clone(),
        lease_token: leased.lease_token.clone(),
        outcome: Some(pb::complete_request::Outcome::Failure(
            pb::complete_request::Failure {
                error_class: class.into(),
                message: format!("{class} happened"),
                retryable,
                retry_after: retry_after.map(Into::into),
            },
        )),
        cost_cents: 0,
    }
}

pub fn list_req() -> pb::ListJobsRequest {
    pb::ListJobsRequest::default()
}

// ---------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------

/// Submits and returns the job (expects success).
pub async fn submit(
    jobs: &mut JobsClient,
    queue: &str,
    kind: &str,
    payload: serde_json::Value,
) -> pb::Job {
    submit_with(jobs, submit_req(queue, kind, payload)).await
}

pub async fn submit_with(jobs: &mut JobsClient, r: pb::SubmitRequest) -> pb::Job {
    jobs.submit(r)
        .await
        .expect("Submit succeeds")
        .into_inner()
        .job
        .expect("SubmitResponse.job is set")
}

pub async fn get(jobs: &mut JobsClient, id: &str) -> pb::Job {
    jobs.get(pb::GetJobRequest { id: id.into() })
        .await
        .unwrap_or_else(|s| panic!("Get {id}: {s:?}"))
        .into_inner()
}

/// Leases exactly one job from `queue`, waiting up to 5 s for it.
pub async fn lease_one(workers: &mut WorkersClient, worker: &str, queue: &str) -> pb::LeasedJob {
    let mut jobs = workers
        .lease(lease_req(worker, queue, 1, Duration::from_secs(5)))
        .await
        .expect("Lease succeeds")
        .into_inner()
        .jobs;
    assert_eq!(
        jobs.len(),
        1,
        "Lease on {queue} returned {} jobs, expected 1",
        jobs.len()
    );
    jobs.remove(0)
}

/// Leases with `wait` 0 and returns whatever came back.
pub async fn lease_now(
    workers: &mut WorkersClient,
    worker: &str,
    queue: &str,
) -> Vec<pb::LeasedJob> {
    workers
        .lease(lease_req(worker, queue, 10, Duration::ZERO))
        .await
        .expect("Lease succeeds")
        .into_inner()
        .jobs
}

pub async fn complete_ok(workers: &mut WorkersClient, leased: &pb::LeasedJob) -> pb::Job {
    workers
        .complete(success_req(leased, serde_json::json!({"done": true})))
        .await
        .unwrap_or_else(|s| panic!("Complete {}: {s:?}", leased.job_id))
        .into_inner()
        .job
        .expect("CompleteResponse.job is set")
}

/// Submits a job to `queue`, leases it and fails it for good with `class`.
/// The queue must hold no other runnable job.
pub async fn make_failed(
    jobs: &mut JobsClient,
    workers: &mut WorkersClient,
    queue: &str,
    class: &str,
) -> pb::Job {
    let job = submit(jobs, queue, "fail", serde_json::json!({"q": queue})).await;
    let leased = lease_one(workers, "failer", queue).await;
    assert_eq!(
        leased.job_id, job.id,
        "leased the job just submitted to {queue}"
    );
    let done = workers
        .complete(failure_req(&leased, class, Some(false), None))
        .await
        .expect("Complete(failure) succeeds")
        .into_inner()
        .job
        .expect("CompleteResponse.job is set");
    assert_eq!(
        state(&done),
        JobState::Failed,
        "non-retryable failure is final"
    );
    done
}

/// Opens a `WatchJob` stream of a job's events after `after`.
pub async fn open_watch(
    jobs: &mut JobsClient,
    id: &str,
    after: u64,
) -> tonic::Streaming<pb::JobEvent> {
    jobs.watch_job(pb::WatchJobRequest {
        id: id.into(),
        after_sequence: after,
    })
    .await
    .unwrap_or_else(|s| panic!("WatchJob {id}: {s:?}"))
    .into_inner()
}

/// The next event of a watch stream, which must come within `within`.
pub async fn next_event(
    stream: &mut tonic::Streaming<pb::JobEvent>,
    within: Duration,
    what: &str,
) -> pb::JobEvent {
    tokio::time::timeout(within, stream.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: no event within {within:?}"))
        .unwrap_or_else(|| panic!("{what}: the stream ended"))
        .unwrap_or_else(|s| panic!("{what}: stream error {s:?}"))
}

/// Every event of a job after `after`, up to the end of the stream, which
/// must come within `within`.
pub async fn watch_all(
    jobs: &mut JobsClient,
    id: &str,
    after: u64,
    within: Duration,
) -> Vec<pb::JobEvent> {
    let fut = async {
        let mut stream = open_watch(jobs, id, after).await;
        let mut events = Vec::new();
        while let Some(item) = stream.next().await {
            events.push(item.unwrap_or_else(|s| panic!("WatchJob {id} stream error: {s:?}")));
        }
        events
    };
    tokio::time::timeout(within, fut)
        .await
        .unwrap_or_else(|_| panic!("WatchJob {id} did not end within {within:?}"))
}

/// Runs a setup command (a virtualenv, a pip install); on failure the
/// panic says what was run and why.
pub fn run_setup(cmd: &mut std::process::Command, what: &str) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        output.status.success(),
        "{what}: {cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Polls Get until the job is in `want`, or panics after `within`.
pub async fn wait_for_state(
    jobs: &mut JobsClient,
    id: &str,
    want: JobState,
    within: Duration,
) -> pb::Job {
    let deadline = Instant::now() + within;
    loop {
        let job = get(jobs, id).await;
        if state(&job) == want {
            return job;
        }
        if Instant::now() > deadline {
            panic!(
                "job {id} did not reach {want:?} within {within:?}; it is {:?}",
                state(&job)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every job matching `filter`, across all pages.
pub async fn list_all(jobs: &mut JobsClient, mut filter: pb::ListJobsRequest) -> Vec<pb::Job> {
    let mut out = Vec::new();
    filter.page_size = Some(1000);
    filter.page_token.clear();
    loop {
        let page = jobs
            .list(filter.clone())
            .await
            .expect("List succeeds")
            .into_inner();
        out.extend(page.jobs);
        if page.next_page_token.is_empty() {
            return out;
        }
        filter.page_token = page.next_page_token;
    }
}

pub fn ids(jobs: &[pb::Job]) -> HashSet<String> {
    jobs.iter().map(|j| j.id.clone()).collect()
}

// ---------------------------------------------------------------------------
// Status assertions
// ---------------------------------------------------------------------------

/// The call failed with `code`; returns the status.
#[track_caller]
pub fn expect_code<T: std::fmt::Debug>(res: Result<T, Status>, code: Code, what: &str) -> Status {
    match res {
        Ok(v) => panic!("{what}: expected {code:?}, got OK: {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: wrong status code ({s:?})");
            s
        }
    }
}

/// The fields named by the `google.rpc.BadRequest` detail of a status.
pub fn bad_request_fields(status: &Status) -> Vec<String> {
    status
        .get_error_details()
        .bad_request()
        .map(|b| b.field_violations.iter().map(|v| v.field.clone()).collect())
        .unwrap_or_default()
}

/// Whether a reported violation path names `field` (itself, or a sub-path of
/// it such as `labels[Bad]`, `labels.Bad` or `backoff.initial`).
pub fn names_field(reported: &str, field: &str) -> bool {
    reported == field
        || reported
            .strip_prefix(field)
            .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
}

/// The call failed with INVALID_ARGUMENT and a BadRequest naming one of `fields`.
#[track_caller]
pub fn expect_invalid<T: std::fmt::Debug>(res: Result<T, Status>, fields: &[&str], what: &str) {
    let status = expect_code(res, Code::InvalidArgument, what);
    let reported = bad_request_fields(&status);
    assert!(
        reported
            .iter()
            .any(|r| fields.iter().any(|f| names_field(r, f))),
        "{what}: BadRequest should name {fields:?}, it names {reported:?} (status {status:?})"
    );
}

/// Runs `fut` with a timeout, naming it in the panic.
pub async fn within<T>(d: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(d, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {d:?}"))
}

/// `GET /metrics` over a plain HTTP/1.1 connection.
pub async fn scrape(addr: SocketAddr) -> String {
    let (head, body) = http_exchange(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body
}

/// Sends `request`, a whole HTTP/1.1 request that asks to close the
/// connection, to the HTTP port at `addr`: the answer's head and body.
pub async fn http_exchange(addr: SocketAddr, request: &str) -> (String, String) {
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP port");
    conn.write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut response = String::new();
    conn.read_to_string(&mut response)
        .await
        .expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    (head.to_owned(), body.to_owned())
}

/// How many calls of `WorkerService/{method}` the server at `addr` has
/// answered OK, from its RPC metrics.
pub async fn worker_calls_ok(addr: SocketAddr, method: &str) -> f64 {
    parse(&scrape(addr).await)
        .get(&format!(
            "intray_rpc_responses_total{{method=\"/intray.v1.WorkerService/{method}\",code=\"OK\"}}"
        ))
        .copied()
        .unwrap_or(0.0)
}

/// [`worker_calls_ok`] once it has stopped moving: the server counts a call
/// when it answers it, a moment after the commit a test sees, so a count
/// read right after a state change may still lack the call that made it.
pub async fn settled_worker_calls_ok(addr: SocketAddr, method: &str) -> f64 {
    let mut last = worker_calls_ok(addr, method).await;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = worker_calls_ok(addr, method).await;
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// `name{labels} value` lines as a map from `name{labels}` to the value.
pub fn parse(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("series and value");
            (series.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

/// How many sessions of `conn`'s database wait for a lock now (PostgreSQL).
pub async fn lock_waiters(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(conn)
    .await
    .expect("read pg_stat_activity")
}

/// Opens a transaction on `holder` that gives job `id` the idempotency key
/// `taken`: an insert with that key waits for the transaction's outcome.
pub async fn take_key(holder: &mut sqlx::PgConnection, id: &str) {
    sqlx::raw_sql("BEGIN")
        .execute(&mut *holder)
        .await
        .expect("BEGIN");
    sqlx::query("UPDATE jobs SET idempotency_key = 'taken' WHERE id = $1::uuid")
        .bind(id)
        .execute(&mut *holder)
        .await
        .expect("take the key");
}

/// Returns once a statement of the database waits on a lock.
pub async fn waits_on_a_lock(watcher: &mut sqlx::PgConnection, what: &str) {
    within(Duration::from_secs(10), what, async {
        while lock_waiters(watcher).await == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}
