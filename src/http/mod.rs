//! The HTTP port: the JSON API under `/api/v1`, the operator dashboard at
//! `/`, `GET /metrics`, and the probes `GET /healthz` and `GET /readyz`.
//!
//! # Layout
//! - `gateway`: authorizes an HTTP call as its gRPC method and calls the
//!   same `JobsApi` the gRPC port serves (no second implementation).
//! - `jobs`: the unary routes; `sse`: the event stream of a job.
//! - `body`, `query`: proto3 JSON bodies and query strings.
//! - `error`: the one mapping from a failed call to an HTTP status and a
//!   `{code, message, details}` body.
//! - `hooks`: `POST /hooks/{source}`, provider webhooks that become jobs.
//! - `health`: the probe routes.
//! - `host`: the host names the port answers to (DNS rebinding).
//! - `openapi`: the OpenAPI document; `dashboard`: the embedded static page.
//! - `listener`: serving the port, over TLS when configured.
//!
//! The proto types are the HTTP face's bodies too (their proto3 JSON
//! mapping), so like `api` this module uses them; nothing below it does.

mod body;
mod dashboard;
mod deadline;
mod error;
mod gateway;
mod health;
mod hooks;
mod host;
mod jobs;
mod listener;
mod nulls;
mod openapi;
mod query;
mod sse;
mod whoami;

pub use gateway::{Gateway, Limits};
pub use hooks::Ingress;
pub use host::AllowedHosts;
pub use listener::serve;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;
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
/// providers. Every route but the ingress and the probes answers only to
/// `hosts`; `/readyz` fails once `draining` fires.
pub fn router(
    gateway: Arc<Gateway>,
    ingress: Arc<Ingress>,
    metrics: Arc<Metrics>,
    tracing: Tracing,
    hosts: AllowedHosts,
    draining: CancellationToken,
    body_timeout: Duration,
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
        .route(whoami::PATH, get(whoami::serve))
        .route(openapi::PATH, get(openapi::serve))
        .route("/api/v1/{*rest}", axum::routing::any(jobs::no_route))
        // The API's own prefix, and other versions of it, answer like any
        // unknown API path: JSON, not the dashboard's empty 404.
        .route("/api", axum::routing::any(jobs::no_route))
        .route("/api/", axum::routing::any(jobs::no_route))
        .route("/api/{*rest}", axum::routing::any(jobs::no_route))
        .method_not_allowed_fallback(jobs::no_method)
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            body_timeout,
            deadline::read_within,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&gateway),
            refuse_unknown_caller,
        ))
        .layer(axum::middleware::from_fn(refuse_cross_site))
        .route_layer(HttpTraceLayer::new(tracing))
        .with_state(gateway);
    // The ingress reads its body itself, with its own limit, after the
    // source is known (an unknown source is 404 whatever the body).
    let hooks = Router::new()
        .route("/hooks/{source}", post(hooks::receive))
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(
            body_timeout,
            deadline::read_within,
        ))
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
        .merge(health::router(draining))
}

/// Refuses a caller without a known token before its body or query is
/// read: an anonymous request costs no parsing (a 16 MiB batch of empty
/// items would otherwise be decoded first), and is told `401` whatever it
/// sent. The API's description stays public.
async fn refuse_unknown_caller(
    State(gateway): State<Arc<Gateway>>,
    request: Request,
    next: Next,
) -> Response {
    if request.uri().path() != openapi::PATH
        && let Err(status) = gateway.authenticate(request.headers())
    {
        return HttpError::Rpc(status).into_response();
    }
    next.run(request).await
}

/// Refuses a request to the JSON API that changes something and that a
/// browser sent for another site's page. An open server lets anyone act,
/// and a page the operator visits could otherwise post to
/// `localhost:8080` (pause queues, replay the dead set): a form post or a
/// `text/plain` fetch needs no preflight. Browsers say where a request
/// comes from in `Sec-Fetch-Site`, but only to trustworthy addresses
/// (`https`, `localhost`); to a plain `http` address such as
/// `http://192.168.1.5:8080` they send none, and then the `Origin` (sent
/// with every cross-origin POST) must name the host the request is for. The
/// dashboard's own requests are `same-origin`, and API clients send
/// neither header. A request with a bearer token passes: no page can attach
/// one to a request for another site without a preflight this server never
/// answers (unlike a cookie or Basic credentials, which browsers add by
/// themselves). The dashboard sends one when the server has a token file,
/// and behind a proxy that rewrites `Host` its `Origin` names the proxy.
async fn refuse_cross_site(request: Request, next: Next) -> Response {
    let changes = !matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    // Sec-Fetch-Site, where a browser sends it, is the better witness: a
    // proxy that rewrites Host does not make the dashboard's own foreign.
    let from_elsewhere = match headers.get("sec-fetch-site") {
        Some(site) => !matches!(site.as_bytes(), b"same-origin" | b"none"),
        None => headers
            .get(header::ORIGIN)
            .is_some_and(|origin| !origin_is_host(origin.as_bytes(), host)),
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().get(..7))
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case(b"bearer "));
    if changes && from_elsewhere && !bearer {
        return HttpError::Rpc(Status::permission_denied(
            "a browser's request from another site's page is refused (Sec-Fetch-Site, Origin)",
        ))
        .into_response();
    }
    next.run(request).await
}

/// Whether an `Origin` (`scheme://host[:port]`) names `host` (the request's
/// `Host`). `null` (a sandboxed page, a file) names none.
fn origin_is_host(origin: &[u8], host: Option<&str>) -> bool {
    let Some(host) = host else {
        return false;
    };
    let Ok(origin) = std::str::from_utf8(origin) else {
        return false;
    };
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host))
}
