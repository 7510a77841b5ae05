//! Authentication, authorization and the protection layers, through real
//! gRPC on both backends: tokens from a file, roles per RPC, tenants from
//! the token, reload, rate limit, per-call timeout.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use intray::config::{RateLimit, Settings};
use intray::pb::job_service_client::JobServiceClient;
use intray::pb::worker_service_client::WorkerServiceClient;
use intray::pb::{self, JobState};
use serde_json::json;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

backend_tests!(
    missing_or_unknown_token_is_unauthenticated,
    roles_decide_what_a_token_may_call,
    tenants_are_isolated_by_token,
    tenant_header_is_ignored_for_non_admins,
    admin_acts_for_any_tenant,
    tokens_rotate_by_rewriting_the_file,
    a_revoked_token_ends_its_open_watch_and_long_poll,
    rate_limit_answers_resource_exhausted_with_retry_info,
    long_poll_outlives_the_call_timeout,
    oversized_request_is_refused_and_nothing_written,
    only_admins_lease_across_tenants,
);

const ACME_PRODUCER: &str = "acme-producer-0123456789";
const ACME_WORKER: &str = "acme-worker-0123456789ab";
const GLOBEX_PRODUCER: &str = "globex-producer-01234567";
const GLOBEX_WORKER: &str = "globex-worker-0123456789";
const ADMIN: &str = "ops-admin-0123456789abcd";
const SCRAPER: &str = "ops-scraper-0123456789ab";

fn token_file_text() -> String {
    // The admin is written hashed, the others plain: both forms work.
    let admin_digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(ADMIN.as_bytes()));
    format!(
        "# test tokens\n\
         {ACME_PRODUCER} acme producer\n\
         {ACME_WORKER} acme worker\n\
         {GLOBEX_PRODUCER} globex producer\n\
         {GLOBEX_WORKER} globex worker\n\
         sha256:{admin_digest} ops admin\n\
         {SCRAPER} ops metrics\n"
    )
}

/// A server with authentication on; the returned directory holds the token
/// file and must outlive the server.
async fn start(
    backend: Backend,
    tweak: impl FnOnce(&mut Settings),
) -> (TestServer, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokens");
    std::fs::write(&path, token_file_text()).expect("write token file");
    let file = path.clone();
    let server = TestServer::start_with(backend, move |s| {
        s.auth_file = Some(file);
        tweak(s);
    })
    .await;
    (server, dir, path)
}

/// Adds `authorization: Bearer <token>` and, when given, `x-intray-tenant`.
#[derive(Clone)]
struct Bearer {
    token: Option<String>,
    tenant: Option<String>,
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(token) = &self.token {
            let value = MetadataValue::try_from(format!("Bearer {token}"))
                .map_err(|_| Status::internal("token is not ASCII"))?;
            req.metadata_mut().insert("authorization", value);
        }
        if let Some(tenant) = &self.tenant {
            let value = MetadataValue::try_from(tenant.as_str())
                .map_err(|_| Status::internal("tenant is not ASCII"))?;
            req.metadata_mut().insert(TENANT_HEADER, value);
        }
        Ok(req)
    }
}

type AuthJobs = JobServiceClient<InterceptedService<Channel, Bearer>>;
type AuthWorkers = WorkerServiceClient<InterceptedService<Channel, Bearer>>;

fn bearer(token: Option<&str>, tenant: Option<&str>) -> Bearer {
    Bearer {
        token: token.map(str::to_owned),
        tenant: tenant.map(str::to_owned),
    }
}

fn jobs(server: &TestServer, token: Option<&str>, tenant: Option<&str>) -> AuthJobs {
    JobServiceClient::with_interceptor(server.channel(), bearer(token, tenant))
}

fn workers(server: &TestServer, token: Option<&str>, tenant: Option<&str>) -> AuthWorkers {
    WorkerServiceClient::with_interceptor(server.channel(), bearer(token, tenant))
}

async fn submit_as(client: &mut AuthJobs, queue: &str) -> pb::Job {
    client
        .submit(submit_req(queue, "k", json!({"n": 1})))
        .await
        .expect("submit")
        .into_inner()
        .job
        .expect("job")
}

async fn lease_as(client: &mut AuthWorkers, queue: &str) -> Vec<pb::LeasedJob> {
    client
        .lease(lease_req("w", queue, 10, Duration::ZERO))
        .await
        .expect("lease")
        .into_inner()
        .jobs
}

async fn missing_or_unknown_token_is_unauthenticated(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let req = || submit_req("q", "k", json!({}));

    let res = jobs(&server, None, Some("acme")).submit(req()).await;
    expect_code(res, Code::Unauthenticated, "no token");
    let res = jobs(&server, Some("not-a-configured-token"), None)
        .submit(req())
        .await;
    expect_code(res, Code::Unauthenticated, "unknown token");
    let res = jobs(&server, Some(&ACME_PRODUCER[..10]), None)
        .submit(req())
        .await;
    expect_code(res, Code::Unauthenticated, "a prefix of a token");
    let res = workers(&server, None, None)
        .lease(lease_req("w", "q", 1, Duration::ZERO))
        .await;
    expect_code(res, Code::Unauthenticated, "no token on WorkerService");

    // Paths are the caller's to choose, and refused before any routing:
    // they must not become metric labels, each kept for the process's life.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Empty {}
    for i in 0..5 {
        let mut grpc = tonic::client::Grpc::new(server.channel());
        grpc.ready().await.expect("ready");
        let path = format!("/nope.Svc/M{i}")
            .parse::<tonic::codegen::http::uri::PathAndQuery>()
            .expect("a path");
        let res = grpc
            .unary(
                tonic::Request::new(Empty {}),
                path,
                tonic_prost::ProstCodec::<Empty, Empty>::default(),
            )
            .await;
        expect_code(res, Code::Unauthenticated, "no token on a made-up method");
    }
    // The labels name every tenant: a scrape needs the metrics role.
    let addr = server.http_addr;
    let scrape_as = |token: Option<&str>| {
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request =
            format!("GET /metrics HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n");
        async move { http_exchange(addr, &request).await }
    };
    let (head, _) = scrape_as(None).await;
    assert!(head.starts_with("HTTP/1.1 401"), "no token: {head}");
    let (head, _) = scrape_as(Some(ACME_PRODUCER)).await;
    assert!(head.starts_with("HTTP/1.1 403"), "a producer: {head}");
    let (head, _) = scrape_as(Some(ADMIN)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "an admin: {head}");
    let (head, metrics) = scrape_as(Some(SCRAPER)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "the metrics role: {head}");
    assert!(!metrics.contains("nope.Svc"), "{metrics}");
    assert_eq!(
        parse(&metrics)
            .get(r#"intray_rpc_responses_total{method="unknown",code="UNAUTHENTICATED"}"#),
        Some(&5.0),
        "{metrics}"
    );

    // Kubernetes probes carry no token: health stays public.
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel());
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "intray.v1.JobService".into(),
        })
        .await
        .expect("health needs no token");
    server.stop().await;
}

async fn roles_decide_what_a_token_may_call(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut producer = jobs(&server, Some(ACME_PRODUCER), None);
    let mut producer_as_worker = workers(&server, Some(ACME_PRODUCER), None);
    let mut worker = workers(&server, Some(ACME_WORKER), None);
    let mut worker_as_producer = jobs(&server, Some(ACME_WORKER), None);

    let res = producer_as_worker
        .lease(lease_req("w", "q", 1, Duration::ZERO))
        .await;
    let status = expect_code(res, Code::PermissionDenied, "producer calling Lease");
    assert!(status.message().contains("Lease"), "{status:?}");
    let res = worker_as_producer
        .submit(submit_req("q", "k", json!({})))
        .await;
    expect_code(res, Code::PermissionDenied, "worker calling Submit");

    let job = submit_as(&mut producer, "q").await;
    let leased = lease_as(&mut worker, "q").await;
    assert_eq!(leased.len(), 1);
    let res = producer_as_worker
        .complete(success_req(&leased[0], json!({})))
        .await;
    expect_code(res, Code::PermissionDenied, "producer calling Complete");
    let res = worker_as_producer
        .get(pb::GetJobRequest { id: job.id.clone() })
        .await;
    expect_code(res, Code::PermissionDenied, "worker calling Get");
    let res = producer
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Id(job.id.clone())),
            ..Default::default()
        })
        .await;
    expect_code(
        res,
        Code::PermissionDenied,
        "producer calling Retry (admin only)",
    );

    worker
        .complete(success_req(&leased[0], json!({"ok": true})))
        .await
        .expect("the worker completes");
    let done = producer
        .get(pb::GetJobRequest { id: job.id })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(state(&done), JobState::Succeeded);
    server.stop().await;
}

async fn tenants_are_isolated_by_token(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut acme = jobs(&server, Some(ACME_PRODUCER), None);
    let mut globex = jobs(&server, Some(GLOBEX_PRODUCER), None);
    let job = submit_as(&mut acme, "shared-queue-name").await;
    assert_eq!(job.tenant, "acme");

    let res = globex.get(pb::GetJobRequest { id: job.id.clone() }).await;
    let status = expect_code(res, Code::NotFound, "another tenant's job id");
    assert!(!status.message().contains("acme"), "{status:?}");
    let res = globex
        .cancel(pb::CancelJobRequest {
            id: job.id.clone(),
            ..Default::default()
        })
        .await;
    expect_code(res, Code::NotFound, "cancelling another tenant's job");

    // A worker of another tenant cannot lease it, even on the same queue name.
    let mut globex_worker = workers(&server, Some(GLOBEX_WORKER), None);
    assert!(
        lease_as(&mut globex_worker, "shared-queue-name")
            .await
            .is_empty()
    );
    let mut acme_worker = workers(&server, Some(ACME_WORKER), None);
    let leased = lease_as(&mut acme_worker, "shared-queue-name").await;
    assert_eq!(leased.len(), 1);
    // Nor complete or heartbeat it with a stolen lease token.
    let res = globex_worker
        .complete(success_req(&leased[0], json!({})))
        .await;
    assert!(
        matches!(
            res.as_ref().map_err(Status::code),
            Err(Code::NotFound | Code::Aborted)
        ),
        "completing another tenant's job: {res:?}"
    );
    let now = acme
        .get(pb::GetJobRequest { id: job.id })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(
        state(&now),
        JobState::Running,
        "the foreign Complete did nothing"
    );
    server.stop().await;
}

async fn tenant_header_is_ignored_for_non_admins(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut acme_claiming_globex = jobs(&server, Some(ACME_PRODUCER), Some("globex"));
    let job = submit_as(&mut acme_claiming_globex, "q").await;
    assert_eq!(
        job.tenant, "acme",
        "the token's tenant wins over the header"
    );

    let mut globex = jobs(&server, Some(GLOBEX_PRODUCER), None);
    let res = globex.get(pb::GetJobRequest { id: job.id.clone() }).await;
    expect_code(res, Code::NotFound, "the job is not globex's");

    // A worker naming another tenant still leases only its own tenant's jobs.
    let mut acme_worker_claiming_globex = workers(&server, Some(ACME_WORKER), Some("globex"));
    let leased = lease_as(&mut acme_worker_claiming_globex, "q").await;
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, job.id);
    server.stop().await;
}

async fn admin_acts_for_any_tenant(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut globex = jobs(&server, Some(GLOBEX_PRODUCER), None);
    let mut globex_worker = workers(&server, Some(GLOBEX_WORKER), None);
    let job = submit_as(&mut globex, "q").await;
    let leased = lease_as(&mut globex_worker, "q").await;
    globex_worker
        .complete(failure_req(&leased[0], "boom", Some(false), None))
        .await
        .expect("fail the job");

    let mut admin_for_globex = jobs(&server, Some(ADMIN), Some("globex"));
    let seen = admin_for_globex
        .get(pb::GetJobRequest { id: job.id.clone() })
        .await
        .expect("admin reads another tenant's job")
        .into_inner();
    assert_eq!(state(&seen), JobState::Failed);
    admin_for_globex
        .retry(pb::RetryJobRequest {
            target: Some(pb::retry_job_request::Target::Id(job.id.clone())),
            ..Default::default()
        })
        .await
        .expect("admin replays it");
    let mut admin_worker_for_globex = workers(&server, Some(ADMIN), Some("globex"));
    assert_eq!(
        lease_as(&mut admin_worker_for_globex, "q").await.len(),
        1,
        "admin may lease too"
    );

    // Without the header the admin acts for its own tenant.
    let mut admin_own = jobs(&server, Some(ADMIN), None);
    let res = admin_own.get(pb::GetJobRequest { id: job.id }).await;
    expect_code(res, Code::NotFound, "admin without header is in tenant ops");
    assert_eq!(submit_as(&mut admin_own, "q").await.tenant, "ops");

    // A malformed tenant header from an admin is bad input, not a tenant.
    let mut admin_bad = jobs(&server, Some(ADMIN), Some("not a tenant"));
    let res = admin_bad.submit(submit_req("q", "k", json!({}))).await;
    expect_invalid(res, &["x-intray-tenant"], "bad tenant header");
    server.stop().await;
}

async fn tokens_rotate_by_rewriting_the_file(backend: Backend) {
    let (server, _dir, path) = start(backend, |s| {
        s.reload_interval = Duration::from_millis(100);
    })
    .await;
    let mut old = jobs(&server, Some(ACME_PRODUCER), None);
    submit_as(&mut old, "q").await;

    const NEW_TOKEN: &str = "acme-producer-rotated-0001";
    // Written beside and renamed into place, as a Secret volume does.
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, format!("{NEW_TOKEN} acme producer\n")).expect("write");
    std::fs::rename(&tmp, &path).expect("rename");

    let mut new = jobs(&server, Some(NEW_TOKEN), None);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let revoked = old.submit(submit_req("q", "k", json!({}))).await;
        let added = new.submit(submit_req("q", "k", json!({}))).await;
        match (revoked, added) {
            (Err(s), Ok(_)) if s.code() == Code::Unauthenticated => break,
            other if Instant::now() > deadline => {
                panic!("the rewritten token file was not picked up: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }

    // A file that does not parse keeps the tokens in force.
    std::fs::write(&path, "this is not a token file\n").expect("write");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let res = new.submit(submit_req("q", "k", json!({}))).await;
    assert!(
        res.is_ok(),
        "a bad reload keeps the previous tokens: {res:?}"
    );
    server.stop().await;
}

/// A reload that takes a token away ends the calls it holds open: a
/// `WatchJob` stream ends `UNAUTHENTICATED` (it went on until the job
/// ended, however long), and so does a parked `Lease` (it waited out its
/// `wait`, and a job handed to it then could only sit out its lease). A
/// token the reload keeps goes on waiting.
async fn a_revoked_token_ends_its_open_watch_and_long_poll(backend: Backend) {
    let (server, _dir, path) = start(backend, |s| {
        s.reload_interval = Duration::from_millis(100);
    })
    .await;
    let mut producer = jobs(&server, Some(ACME_PRODUCER), None);
    let job = submit_as(&mut producer, "q").await;
    let mut stream = producer
        .watch_job(pb::WatchJobRequest {
            id: job.id.clone(),
            after_sequence: 0,
        })
        .await
        .expect("watch")
        .into_inner();
    let first = stream.message().await.expect("the first event");
    assert!(first.is_some(), "the job's submitted event");

    let park = |token: &'static str| {
        let mut worker = workers(&server, Some(token), None);
        tokio::spawn(async move {
            let started = Instant::now();
            let answer = worker
                .lease(lease_req("w", "empty", 1, Duration::from_secs(20)))
                .await;
            (answer.map(|r| r.into_inner().jobs.len()), started.elapsed())
        })
    };
    let revoked_worker = park(ACME_WORKER);
    let kept_worker = park(GLOBEX_WORKER);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Written beside and renamed into place, as a Secret volume does.
    let kept: String = token_file_text()
        .lines()
        .filter(|line| !line.starts_with(ACME_PRODUCER) && !line.starts_with(ACME_WORKER))
        .map(|line| format!("{line}\n"))
        .collect();
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, kept).expect("write");
    std::fs::rename(&tmp, &path).expect("rename");

    let ended = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the watch ends once the token is gone");
    assert!(
        matches!(&ended, Err(s) if s.code() == Code::Unauthenticated),
        "{ended:?}"
    );
    let (answer, waited) = tokio::time::timeout(Duration::from_secs(10), revoked_worker)
        .await
        .expect("the long-poll ends once the token is gone")
        .expect("the task");
    assert!(
        matches!(&answer, Err(s) if s.code() == Code::Unauthenticated),
        "{answer:?}"
    );
    assert!(
        waited < Duration::from_secs(15),
        "not its whole wait: {waited:?}"
    );
    assert!(!kept_worker.is_finished(), "a kept token goes on waiting");
    kept_worker.abort();
    server.stop().await;
}

async fn rate_limit_answers_resource_exhausted_with_retry_info(backend: Backend) {
    let (server, _dir, _) = start(backend, |s| {
        s.rate_limit = Some(RateLimit {
            per_second: 0.5,
            burst: 3,
        });
    })
    .await;
    let mut acme = jobs(&server, Some(ACME_PRODUCER), None);
    for _ in 0..3 {
        submit_as(&mut acme, "q").await;
    }
    let res = acme.submit(submit_req("q", "k", json!({}))).await;
    let status = expect_code(res, Code::ResourceExhausted, "fourth call within the burst");
    let retry = status
        .get_error_details()
        .retry_info()
        .cloned()
        .expect("a RetryInfo detail");
    let delay = retry.retry_delay.expect("a retry delay");
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(2),
        "one call refills in 2 s: {delay:?}"
    );
    // The bucket is per token: another caller is not affected, nor health.
    let mut globex = jobs(&server, Some(GLOBEX_PRODUCER), None);
    submit_as(&mut globex, "q").await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel());
    for _ in 0..5 {
        health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect("health is not rate limited");
    }
    server.stop().await;
}

async fn long_poll_outlives_the_call_timeout(backend: Backend) {
    let (server, _dir, _) = start(backend, |s| {
        s.rpc_timeout = Duration::from_millis(300);
    })
    .await;
    let mut worker = workers(&server, Some(ACME_WORKER), None);
    let started = Instant::now();
    let jobs = worker
        .lease(lease_req("w", "empty", 1, Duration::from_millis(1500)))
        .await
        .expect("a Lease waiting past the call timeout is not cut")
        .into_inner()
        .jobs;
    assert!(jobs.is_empty());
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "it waited"
    );
    server.stop().await;
}

async fn oversized_request_is_refused_and_nothing_written(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut acme = jobs(&server, Some(ACME_PRODUCER), None);
    // 17 items of 1 MiB: over the 16 MiB message limit, though each payload
    // alone is within --max-payload-bytes.
    let blob = "x".repeat(1024 * 1024 - 64);
    let items = (0..17)
        .map(|i| submit_req("q", "k", json!({ "i": i, "blob": blob })))
        .collect();
    let res = acme
        .submit_batch(pb::SubmitBatchRequest { jobs: items })
        .await;
    expect_code(
        res,
        Code::ResourceExhausted,
        "a request over the 16 MiB limit",
    );
    let listed = acme.list(list_req()).await.expect("list").into_inner();
    assert!(listed.jobs.is_empty(), "nothing was written");
    server.stop().await;
}

/// `Lease` with `all_tenants` reaches into every tenant: admins only.
async fn only_admins_lease_across_tenants(backend: Backend) {
    let (server, _dir, _) = start(backend, |_| {}).await;
    let mut acme = jobs(&server, Some(ACME_PRODUCER), None);
    let mut globex = jobs(&server, Some(GLOBEX_PRODUCER), None);
    let acme_job = submit_as(&mut acme, "shared").await;
    let globex_job = submit_as(&mut globex, "shared").await;
    let shared = |token| pb::LeaseRequest {
        all_tenants: true,
        ..lease_req(token, "shared", 10, Duration::ZERO)
    };

    let mut acme_worker = workers(&server, Some(ACME_WORKER), None);
    let res = acme_worker.lease(shared("w")).await;
    expect_code(
        res,
        Code::PermissionDenied,
        "a worker token leasing across tenants",
    );

    let mut fleet = workers(&server, Some(ADMIN), None);
    let leased = fleet
        .lease(shared("fleet"))
        .await
        .expect("admin leases across tenants")
        .into_inner()
        .jobs;
    let mut got: Vec<(String, String)> = leased
        .iter()
        .map(|j| (j.tenant.clone(), j.job_id.clone()))
        .collect();
    got.sort();
    let mut want = vec![
        ("acme".to_string(), acme_job.id.clone()),
        ("globex".to_string(), globex_job.id.clone()),
    ];
    want.sort();
    assert_eq!(got, want);
    for job in &leased {
        fleet
            .complete(req(&job.tenant, success_req(job, json!(null))))
            .await
            .expect("complete with the job's tenant");
    }
    let done = acme
        .get(pb::GetJobRequest { id: acme_job.id })
        .await
        .expect("Get")
        .into_inner();
    assert_eq!(state(&done), JobState::Succeeded);
    server.stop().await;
}
