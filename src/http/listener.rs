//! Serving the HTTP port, over TLS when the gRPC port has it (same
//! certificate, client CA and reload).
//!
//! The port faces webhook providers, so a client that stalls must not hold
//! a connection for ever: its headers must arrive within a time
//! (`--http-header-timeout`), and the routes bound the time to read a body
//! ([`super::deadline`]). `axum::serve` has no such timeout (hyper's needs a
//! timer that it does not give), hence this loop.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use futures::StreamExt;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::tls::{Port, TlsState};

/// Serves `app` on `listener` until `stop` is cancelled, over TLS when
/// `tls` is given, closing connections whose request headers take longer
/// than `header_timeout`; then waits for the connections to finish what
/// they were answering.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<TlsState>>,
    header_timeout: Duration,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    match tls {
        None => serve_on(PlainListener(listener), app, builder, stop).await,
        Some(tls) => {
            let listener = TlsListener::new(listener, tls, stop.clone());
            serve_on(listener, app, builder, stop).await
        }
    }
}

async fn serve_on<L: Accept>(
    mut listener: L,
    app: Router,
    builder: http1::Builder,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    loop {
        let io = tokio::select! {
            io = listener.accept() => io,
            () = stop.cancelled() => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(io), service));
        tokio::spawn(async move {
            if let Err(err) = conn.await {
                tracing::trace!(error = %err, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Where the HTTP port's connections come from.
trait Accept: Send {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// The next connection; errors are retried (and logged) inside.
    fn accept(&mut self) -> impl Future<Output = Self::Io> + Send;
}

/// Connections in the clear.
struct PlainListener(TcpListener);

impl Accept for PlainListener {
    type Io = TcpStream;

    async fn accept(&mut self) -> TcpStream {
        loop {
            match self.0.accept().await {
                Ok((conn, _)) => {
                    // Answers are small and written whole: no Nagle wait.
                    let _ = conn.set_nodelay(true);
                    return conn;
                }
                Err(err) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %err, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// The HTTP port's connections after their TLS handshake, made by the same
/// accept loop as the gRPC port's ([`crate::tls::incoming`]).
struct TlsListener {
    conns: ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>>,
}

impl TlsListener {
    fn new(listener: TcpListener, tls: Arc<TlsState>, stop: CancellationToken) -> TlsListener {
        let tcp = TcpIncoming::from(listener).with_nodelay(Some(true));
        let conns = crate::tls::incoming::incoming_for(Port::Http, tcp, tls, stop);
        TlsListener { conns }
    }
}

impl Accept for TlsListener {
    type Io = TlsStream<TcpStream>;

    async fn accept(&mut self) -> TlsStream<TcpStream> {
        loop {
            match self.conns.next().await {
                Some(Ok(conn)) => return conn,
                // The accept loop logs and retries its own errors.
                Some(Err(_)) => continue,
                // The loop ends only on shutdown, which ends `serve` too.
                None => std::future::pending::<()>().await,
            }
        }
    }
}
