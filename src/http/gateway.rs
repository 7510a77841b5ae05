//! The way from an HTTP call into the gRPC service code. Each call is
//! authorized as the `JobService` method it stands for, by the same token
//! table and role table as gRPC ([`crate::auth::layer::authorize`]), takes
//! from the same rate-limit bucket, and reaches the same [`JobsApi`] as a
//! `tonic::Request` carrying the caller's [`Identity`](crate::auth::Identity),
//! so that no rule is implemented twice.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use tonic::{Request, Response, Status};

use crate::api::JobsApi;
use crate::auth::TokenSource;
use crate::auth::layer::authorize;
use crate::pb::job_service_server::JobService;
use crate::protect::{ProtectError, RateLimiter};

/// The `JobService` methods the HTTP face calls; each is authorized as its
/// gRPC path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Submit,
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
    /// The gRPC method path, the key of the role table.
    pub fn path(self) -> &'static str {
        match self {
            Method::Submit => "/intray.v1.JobService/Submit",
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

/// What the HTTP handlers share: the service, the tokens, the rate limiter
/// and the call timeout of the gRPC port.
pub struct Gateway {
    jobs: Arc<JobsApi>,
    tokens: Arc<TokenSource>,
    limiter: Option<Arc<RateLimiter>>,
    timeout: Duration,
}

impl Gateway {
    /// A gateway into `jobs`, checking callers against `tokens` and
    /// `limiter`; unary calls end after `timeout` like gRPC calls do.
    pub fn new(
        jobs: Arc<JobsApi>,
        tokens: Arc<TokenSource>,
        limiter: Option<Arc<RateLimiter>>,
        timeout: Duration,
    ) -> Gateway {
        Gateway {
            jobs,
            tokens,
            limiter,
            timeout,
        }
    }

    /// The request the service sees for `message` sent with `headers`, or
    /// why the caller may not make it (`UNAUTHENTICATED`,
    /// `PERMISSION_DENIED`, `RESOURCE_EXHAUSTED` when over its rate).
    fn request<T>(
        &self,
        method: Method,
        headers: &HeaderMap,
        message: T,
    ) -> Result<Request<T>, Status> {
        let identity = authorize(&self.tokens, method.path(), headers)?;
        let mut request = Request::new(message);
        if let Some(identity) = identity {
            if let Some(limiter) = &self.limiter
                && let Err(retry_after) = limiter.check(&identity.principal, Instant::now())
            {
                return Err(ProtectError::RateLimited { retry_after }.into());
            }
            request.extensions_mut().insert(identity);
        }
        Ok(request)
    }

    /// Makes one call: authorizes it, runs `call` on the service under the
    /// call timeout, and returns the response message.
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
        let request = self.request(method, headers, message)?;
        let limit = self.timeout;
        match tokio::time::timeout(limit, call(Arc::clone(&self.jobs), request)).await {
            Ok(answer) => answer.map(Response::into_inner),
            Err(_) => Err(ProtectError::Timeout { limit }.into()),
        }
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
