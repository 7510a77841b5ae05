//! `GET /healthz` and `GET /readyz`: probes for a kubelet that cannot use
//! the gRPC health service, which it speaks only in plaintext. Over TLS an
//! `httpGet` probe with `scheme: HTTPS` can use these (the kubelet does not
//! verify the certificate). They need no token and answer any host name
//! (a kubelet probes the pod's IP), and say nothing but their status.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

/// The probe routes. `/readyz` answers `503` once `draining` fires (at
/// SIGTERM, for the shutdown delay in which the port still takes calls),
/// like the gRPC health service's `NOT_SERVING`; `/healthz` answers `200`
/// while the port serves.
pub fn router(draining: CancellationToken) -> Router {
    Router::new()
        .route("/healthz", get(|| async { (StatusCode::OK, "serving\n") }))
        .route(
            "/readyz",
            get(move || {
                let draining = draining.is_cancelled();
                async move {
                    if draining {
                        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                    } else {
                        (StatusCode::OK, "ready\n")
                    }
                }
            }),
        )
}
