//! TLS and mTLS on the gRPC and HTTP ports, with certificates made at test
//! time. TLS does not depend on the store, so these run on SQLite only;
//! the last tests are of TLS to PostgreSQL, through a TLS front made here.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use intray::config::{Settings, TlsFiles};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// A CA that signs server and client certificates.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
struct Pem {
    cert: String,
    key: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("CA key");
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).expect("self-signed CA"),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    fn issue(&self, names: &[&str]) -> Pem {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let params = CertificateParams::new(names).expect("leaf params");
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed leaf");
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write PEM");
    path
}

struct TlsServer {
    addr: std::net::SocketAddr,
    http_addr: std::net::SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<Result<(), intray::server::ServerError>>,
    _dir: tempfile::TempDir,
}

impl TlsServer {
    async fn start(dir: tempfile::TempDir, tls: TlsFiles) -> TlsServer {
        let mut settings = Settings::new(format!(
            "sqlite://{}",
            dir.path().join("intray.db").display()
        ));
        settings.tls = Some(tls);
        settings.reload_interval = Duration::from_millis(100);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind http");
        let http_addr = http.local_addr().expect("http address");
        let stop = CancellationToken::new();
        let task = tokio::spawn(intray::server::run_with(
            settings,
            listener,
            Some(http),
            stop.clone().cancelled_owned(),
        ));
        TlsServer {
            addr,
            http_addr,
            stop,
            task,
            _dir: dir,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        let res = tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("server stops");
        res.expect("server task").expect("server ran cleanly");
    }
}

/// A health check over a fresh connection with `tls` (or plaintext).
async fn check(addr: std::net::SocketAddr, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel: Channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .map(|_| ())
        .map_err(|s| format!("call: {s:?}"))
}

/// Waits until a client with `tls` gets an answer (the server starts and
/// migrates in the background).
async fn until_up(addr: std::net::SocketAddr, tls: &ClientTlsConfig) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match check(addr, Some(tls.clone())).await {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("TLS server never answered: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `GET /metrics` over a fresh connection, by hand: over TLS trusting `ca`
/// (with `identity` as client certificate) when given, else plaintext.
/// The response head and body, or why there was none.
async fn get_metrics(
    addr: std::net::SocketAddr,
    ca: Option<&Ca>,
    identity: Option<&Pem>,
) -> Result<String, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let Some(ca) = ca else {
        return http_get(tcp).await;
    };
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).expect("CA PEM"))
        .expect("CA root");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(pem) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(pem.cert.as_bytes()).expect("cert PEM")],
                PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).expect("key PEM"),
            )
            .expect("client identity"),
        None => builder.with_no_client_auth(),
    };
    // What Prometheus offers.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let name = ServerName::try_from("localhost").expect("server name");
    let tls = TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    http_get(tls).await
}

async fn http_get(mut io: impl AsyncRead + AsyncWrite + Unpin) -> Result<String, String> {
    let exchange = async {
        io.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await?;
        io.flush().await?;
        let mut response = Vec::new();
        io.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&response).into_owned())
    };
    let response = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| format!("exchange: {e}"))?;
    if response.starts_with("HTTP/1.1 200") {
        Ok(response)
    } else {
        Err(format!("not a 200: {response:?}"))
    }
}

fn client(ca: &Ca) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("localhost")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_with_the_ca_connects_and_plaintext_fails() {
    let ca = Ca::new("intray test CA");
    let server_pem = ca.issue(&["localhost"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = TlsFiles {
        cert: write(dir.path(), "server.crt", &server_pem.cert),
        key: write(dir.path(), "server.key", &server_pem.key),
        client_ca: None,
    };
    let server = TlsServer::start(dir, tls).await;
    until_up(server.addr, &client(&ca)).await;

    let plain = check(server.addr, None).await;
    assert!(plain.is_err(), "a plaintext client must fail: {plain:?}");
    let other_ca = Ca::new("someone else");
    let untrusted = check(server.addr, Some(client(&other_ca))).await;
    assert!(
        untrusted.is_err(),
        "a client not trusting the CA fails: {untrusted:?}"
    );
    check(server.addr, Some(client(&ca)))
        .await
        .expect("still serving after refused clients");

    // The HTTP port: same certificate, plaintext refused.
    let metrics = get_metrics(server.http_addr, Some(&ca), None)
        .await
        .expect("HTTPS GET /metrics with the CA");
    assert!(
        metrics.contains("intray_"),
        "metrics in the body: {metrics}"
    );
    let plain = get_metrics(server.http_addr, None, None).await;
    assert!(plain.is_err(), "plaintext HTTP must fail: {plain:?}");
    let untrusted = get_metrics(server.http_addr, Some(&other_ca), None).await;
    assert!(
        untrusted.is_err(),
        "a client not trusting the CA fails: {untrusted:?}"
    );
    get_metrics(server.http_addr, Some(&ca), None)
        .await
        .expect("the HTTP port still serves after refused clients");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_clients_without_a_certificate_from_the_client_ca() {
    let ca = Ca::new("intray test CA");
    let client_ca = Ca::new("intray client CA");
    let server_pem = ca.issue(&["localhost"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = TlsFiles {
        cert: write(dir.path(), "server.crt", &server_pem.cert),
        key: write(dir.path(), "server.key", &server_pem.key),
        client_ca: Some(write(dir.path(), "client-ca.crt", &client_ca.pem())),
    };
    let server = TlsServer::start(dir, tls).await;
    let worker = client_ca.issue(&["worker-1"]);
    let with_cert = client(&ca).identity(Identity::from_pem(&worker.cert, &worker.key));
    until_up(server.addr, &with_cert).await;

    let without = check(server.addr, Some(client(&ca))).await;
    assert!(
        without.is_err(),
        "no client certificate must be refused: {without:?}"
    );
    let stranger = Ca::new("not the client CA").issue(&["worker-2"]);
    let wrong = check(
        server.addr,
        Some(client(&ca).identity(Identity::from_pem(&stranger.cert, &stranger.key))),
    )
    .await;
    assert!(
        wrong.is_err(),
        "a certificate from another CA must be refused: {wrong:?}"
    );
    check(server.addr, Some(with_cert))
        .await
        .expect("the good client still works");

    // The HTTP port asks for the same client certificates.
    let without = get_metrics(server.http_addr, Some(&ca), None).await;
    assert!(
        without.is_err(),
        "HTTP without a client certificate must be refused: {without:?}"
    );
    let wrong = get_metrics(server.http_addr, Some(&ca), Some(&stranger)).await;
    assert!(
        wrong.is_err(),
        "HTTP with another CA's certificate must be refused: {wrong:?}"
    );
    get_metrics(server.http_addr, Some(&ca), Some(&worker))
        .await
        .expect("HTTPS with the client certificate");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_certificate_is_used_for_new_connections() {
    let first_ca = Ca::new("first CA");
    let first = first_ca.issue(&["localhost"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let cert = write(dir.path(), "server.crt", &first.cert);
    let key = write(dir.path(), "server.key", &first.key);
    let tls = TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: None,
    };
    let server = TlsServer::start(dir, tls).await;
    until_up(server.addr, &client(&first_ca)).await;

    // A broken write (key missing) keeps the old certificate.
    std::fs::write(&key, "not a key").expect("write");
    tokio::time::sleep(Duration::from_millis(400)).await;
    check(server.addr, Some(client(&first_ca)))
        .await
        .expect("a bad rotation keeps the old certificate");

    let second_ca = Ca::new("second CA");
    let second = second_ca.issue(&["localhost"]);
    std::fs::write(&cert, &second.cert).expect("write");
    std::fs::write(&key, &second.key).expect("write");
    let deadline = Instant::now() + Duration::from_secs(10);
    while check(server.addr, Some(client(&second_ca))).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let old = check(server.addr, Some(client(&first_ca))).await;
    assert!(
        old.is_err(),
        "new connections get the new certificate: {old:?}"
    );
    // The HTTP port reloads with it.
    get_metrics(server.http_addr, Some(&second_ca), None)
        .await
        .expect("the HTTP port serves the new certificate");
    let old = get_metrics(server.http_addr, Some(&first_ca), None).await;
    assert!(
        old.is_err(),
        "the HTTP port no longer serves the old one: {old:?}"
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// TLS to PostgreSQL
// ---------------------------------------------------------------------------

/// PostgreSQL's request to start TLS: its length (8) and code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 4, 210, 22, 47];

/// A TLS front for PostgreSQL: it answers a client's `SSLRequest` with
/// `S`, ends TLS with `pem`, and relays the connection to `upstream` in
/// the clear. A client that does not ask for TLS is dropped, so whatever
/// works through the front was encrypted. Returns its address and the
/// count of TLS sessions it relayed.
async fn pg_tls_front(pem: &Pem, upstream: String) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(pem.cert.as_bytes()).expect("cert PEM")],
            PrivateKeyDer::from_pem_slice(pem.key.as_bytes()).expect("key PEM"),
        )
        .expect("server identity");
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let sessions = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&sessions);
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let upstream = upstream.clone();
            let counted = Arc::clone(&counted);
            tokio::spawn(async move {
                let mut request = [0u8; 8];
                if tcp.read_exact(&mut request).await.is_err() || request != SSL_REQUEST {
                    return;
                }
                if tcp.write_all(b"S").await.is_err() {
                    return;
                }
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut database) = TcpStream::connect(&upstream).await else {
                    return;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut database).await;
            });
        }
    });
    (addr, sessions)
}

/// `url` (a test database's) through `front` with TLS `params`: the host
/// becomes `localhost`, the name the front's certificate is for.
fn through_front(url: &str, front: std::net::SocketAddr, params: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_once('/').expect("a database name");
    let user = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    format!(
        "{scheme}://{user}localhost:{}/{path}?{params}",
        front.port()
    )
}

/// Where the test database's server listens, as `host:port`.
fn upstream_of(url: &str) -> String {
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    format!("{}:{}", options.get_host(), options.get_port())
}

/// A server on a fresh PostgreSQL database, and that database's URL
/// through a TLS front whose certificate `issuer` signed, checked with
/// `sslmode=verify-full` against `trusted`'s certificate, with the count of
/// sessions the front relayed. The directory holds the root certificate.
async fn behind_a_tls_front(
    issuer: &Ca,
    trusted: &Ca,
) -> (
    common::TestServer,
    String,
    Arc<AtomicUsize>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = write(dir.path(), "root.crt", &trusted.pem());
    let server = common::TestServer::start(common::Backend::Postgres).await;
    let (front, sessions) = pg_tls_front(
        &issuer.issue(&["localhost"]),
        upstream_of(&server.settings.database_url),
    )
    .await;
    let url = through_front(
        &server.settings.database_url,
        front,
        &format!("sslmode=verify-full&sslrootcert={}", root.display()),
    );
    (server, url, sessions, dir)
}

/// The server reaches PostgreSQL over TLS when its URL asks for it, with
/// the certificate checked against `sslrootcert`: a managed database
/// refuses anything else. The build had no TLS for sqlx, and every such
/// URL ended the server at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_reaches_postgres_over_verified_tls() {
    let ca = Ca::new("database CA");
    let (server, url, sessions, _dir) = behind_a_tls_front(&ca, &ca).await;
    let over_tls = server
        .start_replica_with(|settings| settings.database_url = url)
        .await;
    let mut jobs = over_tls.jobs_client("t");
    let job = common::submit(&mut jobs, "q", "k", serde_json::json!({"n": 1})).await;
    let read = common::get(&mut server.jobs_client("t"), &job.id).await;
    assert_eq!(read.id, job.id, "stored in the database behind the front");
    assert!(
        sessions.load(Ordering::SeqCst) >= 1,
        "the replica's connections went through TLS"
    );
    over_tls.stop().await;
    server.stop().await;
}

/// A certificate the server cannot verify stops it at start, saying why,
/// rather than sending the database's password to whoever answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverifiable_database_certificate_stops_the_server() {
    let impostor = Ca::new("someone else");
    let (server, url, sessions, _dir) =
        behind_a_tls_front(&impostor, &Ca::new("database CA")).await;
    let refused = intray::store::migrate(&url, false)
        .await
        .expect_err("an impostor's certificate is refused");
    let said = intray::report::with_causes(&refused);
    assert!(
        said.to_ascii_lowercase().contains("certificate"),
        "the error names the certificate: {said}"
    );
    assert_eq!(sessions.load(Ordering::SeqCst), 0, "nothing was relayed");
    server.stop().await;
}
