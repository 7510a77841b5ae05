//! TLS on the gRPC and HTTP ports with rustls, with a certificate that can be
//! swapped while the server runs.
//!
//! tonic's own `ServerTlsConfig` fixes the certificate when the server is
//! built, so the server does the handshakes itself ([`incoming`]): each new
//! connection is accepted with the configuration in force at that moment,
//! and [`TlsState::reload`] replaces it when the files change. Existing
//! connections keep the certificate they were opened with. Both ports share
//! one [`TlsState`]: same certificate, same client CA, same reload; they
//! differ only in the ALPN protocol they offer ([`Port`]).

pub mod incoming;

use std::path::Path;
use std::sync::{Arc, RwLock};

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

use crate::config::TlsFiles;

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Pem { path: String, reason: String },
    #[error("tls configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client CA: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn pem_error(path: &Path, reason: impl ToString) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(pem_error(path, "no PEM certificate found"));
    }
    Ok(certs)
}

/// Which port a connection is accepted for: decides the ALPN protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Port {
    /// The gRPC port: HTTP/2 (gRPC needs it).
    Grpc,
    /// The HTTP port (`/metrics`): HTTP/1.1, all it serves.
    Http,
}

impl Port {
    fn alpn(self) -> Vec<Vec<u8>> {
        match self {
            Port::Grpc => vec![b"h2".to_vec()],
            Port::Http => vec![b"http/1.1".to_vec()],
        }
    }
}

/// The configurations of both ports, built from the same files.
#[derive(Debug)]
struct Configs {
    grpc: Arc<ServerConfig>,
    http: Arc<ServerConfig>,
}

impl Configs {
    fn build(files: &TlsFiles) -> Result<Configs, TlsError> {
        let base = server_config(files)?;
        let mut http = (*base).clone();
        http.alpn_protocols = Port::Http.alpn();
        Ok(Configs {
            grpc: base,
            http: Arc::new(http),
        })
    }
}

/// Builds the rustls configuration the files describe for the gRPC port:
/// HTTP/2 by ALPN (gRPC needs it), TLS 1.2 and 1.3, and client certificates
/// required when a client CA is given.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = certificates(&files.cert)?;
    let key_pem = read(&files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| pem_error(&files.key, e))?;
    // An explicit provider: the process-wide default is ambiguous when a
    // dependency enables a second one.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates(ca)? {
                roots.add(cert)?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key)?;
    config.alpn_protocols = Port::Grpc.alpn();
    Ok(Arc::new(config))
}

/// The TLS configuration in force, and where it comes from.
#[derive(Debug)]
pub struct TlsState {
    files: TlsFiles,
    configs: RwLock<Configs>,
}

impl TlsState {
    /// Loads the files, which must be valid now.
    pub fn load(files: TlsFiles) -> Result<TlsState, TlsError> {
        let configs = Configs::build(&files)?;
        Ok(TlsState {
            files,
            configs: RwLock::new(configs),
        })
    }

    /// The files, for the change watch.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// An acceptor for the gRPC port with the configuration in force.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor_for(Port::Grpc)
    }

    /// An acceptor for `port` with the configuration in force.
    pub fn acceptor_for(&self, port: Port) -> TlsAcceptor {
        let configs = self.configs.read().unwrap_or_else(|e| e.into_inner());
        let config = match port {
            Port::Grpc => &configs.grpc,
            Port::Http => &configs.http,
        };
        TlsAcceptor::from(Arc::clone(config))
    }

    /// Re-reads the files; on failure the old configuration stays (a
    /// half-written certificate during a rotation must not take the port
    /// down).
    pub fn reload(&self) -> Result<(), TlsError> {
        let configs = Configs::build(&self.files)?;
        *self.configs.write().unwrap_or_else(|e| e.into_inner()) = configs;
        Ok(())
    }

    /// [`reload`](Self::reload), logging the outcome.
    pub fn reload_and_log(&self) {
        match self.reload() {
            Ok(()) => tracing::info!(cert = %self.files.cert.display(), "tls certificate reloaded"),
            Err(err) => {
                tracing::error!(error = %err, "tls reload failed; keeping the previous certificate")
            }
        }
    }
}
