//! Accepting TLS connections: TCP accepts in one task, each handshake in a
//! task of its own, so a slow or silent client cannot hold up the others.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use super::{Port, TlsState};

/// Longest a client may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (e.g. out of file descriptors), so the loop
/// does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Established TLS connections on the gRPC port, for
/// `serve_with_incoming_shutdown`. Stops accepting when `stop` is cancelled
/// or the server drops the stream.
pub fn incoming(
    tcp: TcpIncoming,
    tls: Arc<TlsState>,
    stop: CancellationToken,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    incoming_for(Port::Grpc, tcp, tls, stop)
}

/// [`incoming`] for either port: the handshakes use `port`'s ALPN.
pub fn incoming_for(
    port: Port,
    mut tcp: TcpIncoming,
    tls: Arc<TlsState>,
    stop: CancellationToken,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => break,
                () = tx.closed() => break,
                next = tcp.next() => next,
            };
            let stream = match next {
                None => break,
                Some(Ok(stream)) => stream,
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let acceptor = tls.acceptor_for(port);
            let tx = tx.clone();
            tokio::spawn(async move {
                let peer = stream.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(conn)) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    // A refused client (no certificate, plaintext, wrong CA)
                    // is the client's problem: debug, not an error.
                    Ok(Err(err)) => {
                        tracing::debug!(?port, ?peer, error = %err, "tls handshake failed")
                    }
                    Err(_) => tracing::debug!(?port, ?peer, "tls handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
