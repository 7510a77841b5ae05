//! All server wiring in one place.

use std::future::Future;

use tokio::net::TcpListener;

use crate::config::Settings;

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("not implemented yet")]
    NotYet,
}

/// Serves the gRPC API on `listener` until `shutdown` completes.
pub async fn run(
    _settings: Settings,
    _listener: TcpListener,
    _shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    Err(ServerError::NotYet)
}
