//! The way from an HTTP call into the gRPC service code. Each call is
//! authorized as the `JobService` method it stands for, by the same token
//! table and role table as gRPC ([`crate::auth::layer::authorize`]), takes
//! from the same rate-limit bucket and concurrency slots, runs under the
//! same timeout, and reaches the same [`JobsApi`] as a `tonic::Request`
//! carrying the caller's [`Identity`](crate::auth::Identity) and trace
//! context, so that no rule is implemented twice. It is counted in the RPC
//! metrics under its gRPC method, as a gRPC call would be.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use tokio::sync::Semaphore;
use tonic::{Code, Request, Response, Status};

use crate::api::JobsApi;
use crate::auth::Identity;
use crate::auth::TokenSource;
use crate::auth::layer::{authenticate, authorize, identify};
use crate::auth::role::{METRICS_SCRAPE, access_for};
use crate::pb::job_service_server::JobService;
use crate::protect::{ProtectError, RateLimiter};
use crate::telemetry::rpc::{CallRecord, CallTrace};
use crate::telemetry::{Metrics, TraceParent};

/// The `JobService` methods the HTTP face calls; each is authorized as its
/// gRPC path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Submit,
    SubmitBatch,
    Get,
    Cancel,
    WatchJob,
    List,
    Retry,
    Stats,
    PauseQueue,
    ResumeQueue,
}

impl Method {
    /// Every method, in the order `GET /api/v1/whoami` lists them.
    pub const ALL: [Method; 10] = [
        Method::Submit,
        Method::SubmitBatch,
        Method::Get,
        Method::Cancel,
        Method::WatchJob,
        Method::List,
        Method::Retry,
        Method::Stats,
        Method::PauseQueue,
        Method::ResumeQueue,
    ];

    /// The method's name, the last segment of its path.
    pub fn name(self) -> &'static str {
        let path = self.path();
        path.rsplit_once('/').map_or(path, |(_, name)| name)
    }

    /// The gRPC method path, the key of the role table.
    pub fn path(self) -> &'static str {
        match self {
            Method::Submit => "/intray.v1.JobService/Submit",
            Method::SubmitBatch => "/intray.v1.JobService/SubmitBatch",
            Method::Get => "/intray.v1.JobService/Get",
            Method::Cancel => "/intray.v1.JobService/Cancel",
            Method::WatchJob => "/intray.v1.JobService/WatchJob",
            Method::List => "/intray.v1.JobService/List",
            Method::Retry => "/intray.v1.JobService/Retry",
            Method::Stats => "/intray.v1.JobService/Stats",
            Method::PauseQueue => "/intray.v1.JobService/PauseQueue",
            Method::ResumeQueue => "/intray.v1.JobService/ResumeQueue",
        }
    }
}

/// The gRPC port's protections, shared with the HTTP face.
pub struct Limits {
    /// Per-caller rate limit, if any.
    pub rate: Option<Arc<RateLimiter>>,
    /// The concurrency limit's slots.
    pub slots: Arc<Semaphore>,
    /// Longest a call may take.
    pub timeout: Duration,
}

/// What the HTTP handlers share: the service, the tokens, the protections
/// and the metrics of the gRPC port.
pub struct Gateway {
    jobs: Arc<JobsApi>,
    tokens: Arc<TokenSource>,
    limits: Limits,
    metrics: Arc<Metrics>,
}

/// The message `call` answers, or `DEADLINE_EXCEEDED` once `limit` (the
/// call timeout) has passed.
async fn within_limit<R>(
    limit: Duration,
    call: impl Future<Output = Result<Response<R>, Status>>,
) -> Result<R, Status> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer.map(Response::into_inner),
        Err(_) => Err(ProtectError::Timeout { limit }.into()),
    }
}

impl Gateway {
    /// A gateway into `jobs`, checking callers against `tokens` and
    /// `limits`, counting calls in `metrics`.
    pub fn new(
        jobs: Arc<JobsApi>,
        tokens: Arc<TokenSource>,
        limits: Limits,
        metrics: Arc<Metrics>,
    ) -> Gateway {
        Gateway {
            jobs,
            tokens,
            limits,
            metrics,
        }
    }

    /// Who the caller of `headers` is and which methods its roles allow;
    /// a reload may change either before its next call.
    pub fn identify(&self, headers: &HeaderMap) -> Result<(Identity, Vec<Method>), Status> {
        let identity = identify(&self.tokens, headers)?;
        let allowed = Method::ALL
            .into_iter()
            .filter(|m| identity.roles.allow(access_for(m.path())))
            .collect();
        Ok((identity, allowed))
    }

    /// Whether `headers` carry a known token (anyone in open mode): checked
    /// before a body is read; the method's roles are checked by the call.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<(), Status> {
        authenticate(&self.tokens, headers)?;
        Ok(())
    }

    /// Whether the caller of `headers` may make `method` at all, asked
    /// before its input is read, as the gRPC port asks before a message is
    /// decoded: a caller without the role is told `PERMISSION_DENIED`
    /// whatever it sent. A refusal is counted as the call; the call itself
    /// authorizes again, since a reload may come in between.
    pub fn permit(&self, method: Method, headers: &HeaderMap) -> Result<(), Status> {
        authorize(&self.tokens, method.path(), headers)
            .map(drop)
            .map_err(|err| {
                let status = Status::from(err);
                CallRecord::start(
                    Arc::clone(&self.metrics),
                    method.path().to_owned(),
                    None,
                    None,
                )
                .finish(status.code());
                status
            })
    }

    /// Whether `headers` carry a token that may scrape `GET /metrics` (the
    /// metrics or admin role; anyone in open mode).
    pub fn may_scrape(&self, headers: &HeaderMap) -> Result<(), Status> {
        authorize(&self.tokens, METRICS_SCRAPE, headers)?;
        Ok(())
    }

    /// The request the service sees for `message` sent with `headers`, or
    /// why the caller may not make it (`UNAUTHENTICATED`,
    /// `PERMISSION_DENIED`, `RESOURCE_EXHAUSTED` when over its rate, if
    /// the call is `rated`).
    fn request<T>(
        &self,
        method: Method,
        headers: &HeaderMap,
        message: T,
        rated: bool,
    ) -> Result<Request<T>, Status> {
        let identity = authorize(&self.tokens, method.path(), headers)?;
        let mut request = Request::new(message);
        // Submit stores it with the job, so attempts join the caller's trace.
        let trace = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(TraceParent::parse);
        request.extensions_mut().insert(CallTrace(trace));
        if let Some(identity) = identity {
            if rated
                && let Some(limiter) = &self.limits.rate
                && let Err(retry_after) = limiter.check(&identity.principal, Instant::now())
            {
                return Err(ProtectError::RateLimited { retry_after }.into());
            }
            request.extensions_mut().insert(identity);
        }
        Ok(request)
    }

    /// Makes one call: authorizes it, runs `call` on the service in a
    /// concurrency slot under the call timeout, counts it, and returns the
    /// response message.
    pub async fn call<T, R, F>(
        &self,
        method: Method,
        headers: &HeaderMap,
        message: T,
        call: impl FnOnce(Arc<JobsApi>, Request<T>) -> F,
    ) -> Result<R, Status>
    where
        F: Future<Output = Result<Response<R>, Status>>,
    {
        // HTTP has no deadline header to tell `DEADLINE_EXCEEDED` by: a
        // call dropped unanswered counts as `CANCELLED`.
        let mut record = CallRecord::start(
            Arc::clone(&self.metrics),
            method.path().to_owned(),
            None,
            None,
        );
        let answer = self.bounded(method, headers, message, call).await;
        record.finish(answer.as_ref().map_or_else(Status::code, |_| Code::Ok));
        answer
    }

    async fn bounded<T, R, F>(
        &self,
        method: Method,
        headers: &HeaderMap,
        message: T,
        call: impl FnOnce(Arc<JobsApi>, Request<T>) -> F,
    ) -> Result<R, Status>
    where
        F: Future<Output = Result<Response<R>, Status>>,
    {
        let request = self.request(method, headers, message, true)?;
        let limit = self.limits.timeout;
        let slots = Arc::clone(&self.limits.slots);
        let jobs = Arc::clone(&self.jobs);
        let work = async move {
            // The semaphore is never closed; were it closed, serving without
            // a slot beats refusing (as on the gRPC port).
            let _slot = slots.acquire_owned().await.ok();
            call(jobs, request).await
        };
        within_limit(limit, work).await
    }

    /// A read the HTTP face makes on its own behalf while serving a route
    /// (the event stream's check whether a resumed job has ended):
    /// authorized as `method` for the caller and under the call timeout, but
    /// neither drawn from the caller's rate limit nor counted, since the
    /// caller made one call, the route's. Drawn and counted, it spent a
    /// second token of every reconnect: under a burst of one, each was
    /// refused.
    pub async fn look_up<T, R, F>(
        &self,
        method: Method,
        headers: &HeaderMap,
        message: T,
        call: impl FnOnce(Arc<JobsApi>, Request<T>) -> F,
    ) -> Result<R, Status>
    where
        F: Future<Output = Result<Response<R>, Status>>,
    {
        let request = self.request(method, headers, message, false)?;
        within_limit(self.limits.timeout, call(Arc::clone(&self.jobs), request)).await
    }

    /// Starts a `WatchJob` stream. Its setup runs under the call timeout;
    /// the stream itself is not cut, as on the gRPC port.
    pub async fn watch(
        &self,
        headers: &HeaderMap,
        message: crate::pb::WatchJobRequest,
    ) -> Result<<JobsApi as JobService>::WatchJobStream, Status> {
        self.call(
            Method::WatchJob,
            headers,
            message,
            |jobs, request| async move { jobs.watch_job(request).await },
        )
        .await
    }
}
