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
mod jobs;
mod listener;
mod openapi;
mod query;
mod sse;

pub use gateway::{Gateway, Limits};
pub use hooks::Ingress;
pub use listener::serve;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{get, post};

use crate::telemetry::http::HttpTraceLayer;
use crate::telemetry::{Metrics, Tracing};

/// Content type of the Prometheus text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every route of the port. `{id}:cancel` and `{queue}:pause` are custom
/// methods on a resource: the router matches the whole segment and the
/// handler splits off the verb. A scrape of `/metrics` only renders what is
/// in memory (the database gauges are refreshed on a timer).
pub fn router(
    gateway: Arc<Gateway>,
    ingress: Arc<Ingress>,
    metrics: Arc<Metrics>,
    tracing: Tracing,
) -> Router {
    let api = Router::new()
        .route("/api/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/api/v1/jobs:retry", post(jobs::retry))
        .route("/api/v1/jobs:batch", post(jobs::submit_batch))
        .route("/api/v1/jobs/{id}", get(jobs::get).post(jobs::post_on_job))
        .route("/api/v1/jobs/{id}/events", get(sse::events))
        .route("/api/v1/jobs/{id}/deliveries", get(jobs::deliveries))
        .route("/api/v1/stats", get(jobs::stats))
        .route("/api/v1/queues/{queue}", post(jobs::post_on_queue))
        .route("/api/v1/openapi.json", get(openapi::serve))
        .route("/api/v1/{*rest}", axum::routing::any(jobs::no_route))
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .route_layer(HttpTraceLayer::new(tracing))
        .with_state(gateway);
    // The ingress reads its body itself, with its own limit, after the
    // source is known (an unknown source is 404 whatever the body).
    let hooks = Router::new()
        .route("/hooks/{source}", post(hooks::receive))
        .layer(DefaultBodyLimit::disable())
        .with_state(ingress);
    api.merge(hooks).merge(dashboard::router()).route(
        "/metrics",
        get(move || {
            let metrics = Arc::clone(&metrics);
            async move { ([(header::CONTENT_TYPE, TEXT_FORMAT)], metrics.render()).into_response() }
        }),
    )
}
