//! Serving the HTTP port, over TLS when the gRPC port has it (same
//! certificate, client CA and reload).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use futures::StreamExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::tls::{Port, TlsState};

/// Serves `app` on `listener` until `stop` is cancelled, over TLS when
/// `tls` is given.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<TlsState>>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let shutdown = stop.clone().cancelled_owned();
    match tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Some(tls) => {
            let listener = TlsListener::new(listener, tls, stop)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// The HTTP port's connections after their TLS handshake, made by the same
/// accept loop as the gRPC port's ([`crate::tls::incoming`]).
struct TlsListener {
    local: SocketAddr,
    conns: ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>>,
}

impl TlsListener {
    fn new(
        listener: TcpListener,
        tls: Arc<TlsState>,
        stop: CancellationToken,
    ) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let tcp = TcpIncoming::from(listener).with_nodelay(Some(true));
        let conns = crate::tls::incoming::incoming_for(Port::Http, tcp, tls, stop);
        Ok(TlsListener { local, conns })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.conns.next().await {
                Some(Ok(conn)) => {
                    let peer = conn.get_ref().0.peer_addr().unwrap_or(self.local);
                    return (conn, peer);
                }
                // The accept loop logs and retries its own errors.
                Some(Err(_)) => continue,
                // The loop ends only on shutdown, which ends `serve` too.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
