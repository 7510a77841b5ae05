//! The HTTP port: the JSON API under `/api/v1`, the operator dashboard at
//! `/`, and `GET /metrics`.
//!
//! # Layout
//! - `gateway`: authorizes an HTTP call as its gRPC method and calls the
//!   same `JobsApi` the gRPC port serves (no second implementation).
//! - `jobs`: the unary routes; `sse`: the event stream of a job.
//! - `body`, `query`: proto3 JSON bodies and query strings.
//! - `error`: the one mapping from a failed call to an HTTP status and a
//!   `{code, message, details}` body.
//! - `hooks`: `POST /hooks/{source}`, provider webhooks that become jobs.
//! - `host`: the host names the port answers to (DNS rebinding).
//! - `openapi`: the OpenAPI document; `dashboard`: the embedded static page.
//! - `listener`: serving the port, over TLS when configured.
//!
//! The proto types are the HTTP face's bodies too (their proto3 JSON
//! mapping), so like `api` this module uses them; nothing below it does.

mod body;
mod dashboard;
mod error;
mod gateway;
mod hooks;
mod host;
mod jobs;
mod listener;
mod openapi;
mod query;
mod sse;

pub use gateway::{Gateway, Limits};
pub use hooks::Ingress;
pub use host::AllowedHosts;
pub use listener::serve;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::Request;
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tonic::Status;

use crate::telemetry::http::HttpTraceLayer;
use crate::telemetry::{Metrics, Tracing};
use error::HttpError;

/// Content type of the Prometheus text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every route of the port. `{id}:cancel` and `{queue}:pause` are custom
/// methods on a resource: the router matches the whole segment and the
/// handler splits off the verb. A scrape of `/metrics` only renders what is
/// in memory (the database gauges are refreshed on a timer); with a token
/// file it needs a token of the metrics or admin role, since the labels
/// name every tenant, queue and kind, and the port is reachable by webhook
/// providers. Every route but the ingress answers only to `hosts`.
pub fn router(
    gateway: Arc<Gateway>,
    ingress: Arc<Ingress>,
    metrics: Arc<Metrics>,
    tracing: Tracing,
    hosts: AllowedHosts,
) -> Router {
    let scrape_gate = Arc::clone(&gateway);
    let api = Router::new()
        .route("/api/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/api/v1/jobs:retry", post(jobs::retry))
        .route("/api/v1/jobs:batch", post(jobs::submit_batch))
        .route("/api/v1/jobs/{id}", get(jobs::get).post(jobs::post_on_job))
        .route("/api/v1/jobs/{id}/events", get(sse::events))
        .route("/api/v1/jobs/{id}/deliveries", get(jobs::deliveries))
        .route("/api/v1/stats", get(jobs::stats))
        .route("/api/v1/dead-set", get(jobs::dead_set))
        .route("/api/v1/queues/{queue}", post(jobs::post_on_queue))
        .route("/api/v1/openapi.json", get(openapi::serve))
        .route("/api/v1/{*rest}", axum::routing::any(jobs::no_route))
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(refuse_cross_site))
        .route_layer(HttpTraceLayer::new(tracing))
        .with_state(gateway);
    // The ingress reads its body itself, with its own limit, after the
    // source is known (an unknown source is 404 whatever the body).
    let hooks = Router::new()
        .route("/hooks/{source}", post(hooks::receive))
        .layer(DefaultBodyLimit::disable())
        .with_state(ingress);
    api.merge(dashboard::router())
        .route(
            "/metrics",
            get(move |headers: HeaderMap| {
                let metrics = Arc::clone(&metrics);
                let gate = Arc::clone(&scrape_gate);
                async move {
                    if let Err(status) = gate.may_scrape(&headers) {
                        return HttpError::Rpc(status).into_response();
                    }
                    ([(header::CONTENT_TYPE, TEXT_FORMAT)], metrics.render()).into_response()
                }
            }),
        )
        .layer(axum::middleware::from_fn_with_state(
            hosts,
            host::refuse_unknown_host,
        ))
        .merge(hooks)
}

/// Refuses a request to the JSON API that changes something and that a
/// browser sent for another site's page. An open server lets anyone act,
/// and a page the operator visits could otherwise post to
/// `localhost:8080` (pause queues, replay the dead set): a form post or a
/// `text/plain` fetch needs no preflight. Browsers say where a request
/// comes from in `Sec-Fetch-Site`; the dashboard's own are `same-origin`,
/// and API clients send none.
async fn refuse_cross_site(request: Request, next: Next) -> Response {
    let changes = !matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    let from_elsewhere = request
        .headers()
        .get("sec-fetch-site")
        .is_some_and(|site| !matches!(site.as_bytes(), b"same-origin" | b"none"));
    if changes && from_elsewhere {
        return HttpError::Rpc(Status::permission_denied(
            "a browser's request from another site's page is refused (Sec-Fetch-Site)",
        ))
        .into_response();
    }
    next.run(request).await
}
