//! The HTTP port: `GET /metrics` in the Prometheus text format.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use super::metrics::Metrics;

/// Content type of the text exposition format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn metrics(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, TEXT_FORMAT)], metrics.render())
}

/// Serves the HTTP port on `listener` until `shutdown` completes. A scrape
/// only renders what is in memory: the database gauges are refreshed on a
/// timer, so scrapes cost the database nothing.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(self::metrics))
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
