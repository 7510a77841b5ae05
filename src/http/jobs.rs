//! The unary routes of `/api/v1`: each reads its HTTP input into the gRPC
//! request message, makes the call through the [`Gateway`], and writes the
//! response message as JSON.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tonic::Status;

use super::body::{self, json};
use super::error::HttpError;
use super::gateway::{Gateway, Method};
use super::query;
use crate::domain::validate::{MAX_BATCH, ValidationError};
use crate::pb;
use crate::pb::job_service_server::JobService;

/// The header carrying a submit's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

type Shared = State<Arc<Gateway>>;
type Body = Result<Bytes, BytesRejection>;

/// Where a job is served.
pub fn location(id: &str) -> String {
    format!("/api/v1/jobs/{id}")
}

/// What a route that takes no query asks before it reads its input: that
/// the caller may make `method` at all, then that no query was sent.
fn admit(
    gateway: &Gateway,
    method: Method,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<(), HttpError> {
    gateway.permit(method, headers)?;
    query::none(query)?;
    Ok(())
}

/// `POST /api/v1/jobs`: `202` with a new job, `200` with the original one
/// when the idempotency key and input match an earlier submit.
pub async fn submit(
    State(gateway): Shared,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    raw: Body,
) -> Result<Response, HttpError> {
    admit(&gateway, Method::Submit, &headers, query.as_deref())?;
    let mut request: pb::SubmitRequest = body::parse(&body::bytes(raw)?)?;
    if let Some(key) = headers.get(IDEMPOTENCY_KEY) {
        let key = key
            .to_str()
            .map_err(|_| ValidationError::new("Idempotency-Key", "must be ASCII"))?;
        // Sent and empty is a mistake, not "no key": each retry would make
        // a job.
        if key.trim().is_empty() {
            return Err(ValidationError::new("Idempotency-Key", "must not be empty").into());
        }
        if !request.idempotency_key.is_empty() && request.idempotency_key != key {
            return Err(ValidationError::new(
                "Idempotency-Key",
                "differs from the body's idempotency_key",
            )
            .into());
        }
        key.clone_into(&mut request.idempotency_key);
    }
    let answer = gateway
        .call(Method::Submit, &headers, request, |jobs, r| async move {
            jobs.submit(r).await
        })
        .await?;
    let job = answer
        .job
        .ok_or_else(|| Status::internal("internal error"))?;
    let status = if answer.created {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    let mut response = json(status, &job);
    if let Ok(value) = location(&job.id).parse() {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

/// `POST /api/v1/jobs:batch` with a `SubmitBatchRequest`: `200` with one
/// result per item, each accepted or refused on its own as by `Submit`.
pub async fn submit_batch(
    State(gateway): Shared,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    raw: Body,
) -> Result<Response, HttpError> {
    admit(&gateway, Method::SubmitBatch, &headers, query.as_deref())?;
    let raw = body::bytes(raw)?;
    body::at_most(&raw, "jobs", MAX_BATCH)?;
    let request: pb::SubmitBatchRequest = body::parse(&raw)?;
    let answer = gateway
        .call(
            Method::SubmitBatch,
            &headers,
            request,
            |jobs, r| async move { jobs.submit_batch(r).await },
        )
        .await?;
    Ok(json(StatusCode::OK, &answer))
}

/// `GET /api/v1/jobs/{id}`.
pub async fn get(
    State(gateway): Shared,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    // The path of a custom method is served, with POST.
    if id.ends_with(":cancel") {
        return Err(HttpError::NoMethod {
            method: "GET".into(),
            path: location(&id),
            allow: Some("POST"),
        });
    }
    admit(&gateway, Method::Get, &headers, query.as_deref())?;
    let job = gateway
        .call(
            Method::Get,
            &headers,
            pb::GetJobRequest { id },
            |jobs, r| async move { jobs.get(r).await },
        )
        .await?;
    Ok(json(StatusCode::OK, &job))
}

/// `GET /api/v1/jobs/{id}/deliveries`: the job's completion callbacks,
/// authorized as `Get`.
pub async fn deliveries(
    State(gateway): Shared,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    admit(&gateway, Method::Get, &headers, query.as_deref())?;
    let listing = gateway
        .call(
            Method::Get,
            &headers,
            pb::GetJobRequest { id },
            |jobs, r| async move { jobs.deliveries(r).await },
        )
        .await?;
    Ok(json(StatusCode::OK, &listing))
}

/// `GET /api/v1/dead-set?...`: the jobs of a replay filter grouped by
/// error class and queue (see [`query::dead_set`]), authorized as `List`.
pub async fn dead_set(
    State(gateway): Shared,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    gateway.permit(Method::List, &headers)?;
    let request = query::dead_set(raw.as_deref())?;
    let grouped = gateway
        .call(Method::List, &headers, request, |jobs, r| async move {
            jobs.dead_set(r).await
        })
        .await?;
    Ok(json(StatusCode::OK, &grouped))
}

/// `GET /api/v1/jobs?...`: one page, newest first (see [`query::list`]).
pub async fn list(
    State(gateway): Shared,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    gateway.permit(Method::List, &headers)?;
    let request = query::list(raw.as_deref())?;
    let page = gateway
        .call(Method::List, &headers, request, |jobs, r| async move {
            jobs.list(r).await
        })
        .await?;
    Ok(json(StatusCode::OK, &page))
}

/// `POST /api/v1/jobs/{id}:cancel` with an optional `{"reason": ...}`.
/// Custom methods share the job's path segment, so the handler splits it.
pub async fn post_on_job(
    State(gateway): Shared,
    Path(segment): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    raw: Body,
) -> Result<Response, HttpError> {
    let Some(id) = segment.strip_suffix(":cancel") else {
        // The job itself is served, with GET; another custom method is not.
        return Err(if segment.contains(':') {
            HttpError::NoRoute(format!("POST {}", location(&segment)))
        } else {
            HttpError::NoMethod {
                method: "POST".into(),
                path: location(&segment),
                allow: Some("GET,HEAD"),
            }
        });
    };
    admit(&gateway, Method::Cancel, &headers, query.as_deref())?;
    let mut request: pb::CancelJobRequest = body::parse(&body::bytes(raw)?)?;
    if !request.id.is_empty() && request.id != id {
        return Err(ValidationError::new("id", "differs from the id in the path").into());
    }
    id.clone_into(&mut request.id);
    let job = gateway
        .call(Method::Cancel, &headers, request, |jobs, r| async move {
            jobs.cancel(r).await
        })
        .await?;
    Ok(json(StatusCode::OK, &job))
}

/// `POST /api/v1/jobs:retry` with a `RetryJobRequest` (`{"id": ...}` or
/// `{"filter": {...}, "dryRun": true, "limit": n}`).
pub async fn retry(
    State(gateway): Shared,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    raw: Body,
) -> Result<Response, HttpError> {
    admit(&gateway, Method::Retry, &headers, query.as_deref())?;
    let request: pb::RetryJobRequest = body::parse(&body::bytes(raw)?)?;
    let answer = gateway
        .call(Method::Retry, &headers, request, |jobs, r| async move {
            jobs.retry(r).await
        })
        .await?;
    Ok(json(StatusCode::OK, &answer))
}

/// `GET /api/v1/stats?queue=`.
pub async fn stats(
    State(gateway): Shared,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    gateway.permit(Method::Stats, &headers)?;
    let request = query::stats(raw.as_deref())?;
    let stats = gateway
        .call(Method::Stats, &headers, request, |jobs, r| async move {
            jobs.stats(r).await
        })
        .await?;
    Ok(json(StatusCode::OK, &stats))
}

/// `POST /api/v1/queues/{queue}:pause` and `:resume`, with an optional
/// body whose queue, if given, must be the path's. Queue names may hold
/// `:` themselves, so the verb is what follows the last one.
pub async fn post_on_queue(
    State(gateway): Shared,
    Path(segment): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    raw: Body,
) -> Result<Response, HttpError> {
    let no_route = || HttpError::NoRoute(format!("POST /api/v1/queues/{segment}"));
    let (queue, verb) = segment.rsplit_once(':').ok_or_else(no_route)?;
    let method = match verb {
        "pause" => Method::PauseQueue,
        "resume" => Method::ResumeQueue,
        _ => return Err(no_route()),
    };
    admit(&gateway, method, &headers, query.as_deref())?;
    // Pause and resume carry the same message.
    let named: pb::PauseQueueRequest = body::parse(&body::bytes(raw)?)?;
    if !named.queue.is_empty() && named.queue != queue {
        return Err(ValidationError::new("queue", "differs from the queue in the path").into());
    }
    let queue = queue.to_owned();
    match method {
        Method::PauseQueue => {
            let answer = gateway
                .call(
                    Method::PauseQueue,
                    &headers,
                    pb::PauseQueueRequest { queue },
                    |jobs, r| async move { jobs.pause_queue(r).await },
                )
                .await?;
            Ok(json(StatusCode::OK, &answer))
        }
        _ => {
            let answer = gateway
                .call(
                    Method::ResumeQueue,
                    &headers,
                    pb::ResumeQueueRequest { queue },
                    |jobs, r| async move { jobs.resume_queue(r).await },
                )
                .await?;
            Ok(json(StatusCode::OK, &answer))
        }
    }
}

/// Anything else under `/api/v1`: a JSON 404 rather than an empty one.
pub async fn no_route(uri: axum::http::Uri) -> impl IntoResponse {
    HttpError::NoRoute(uri.path().to_owned())
}

/// A served path with another method: a JSON 405 rather than an empty one.
pub async fn no_method(method: axum::http::Method, uri: axum::http::Uri) -> impl IntoResponse {
    HttpError::NoMethod {
        method: method.to_string(),
        path: uri.path().to_owned(),
        allow: None,
    }
}
