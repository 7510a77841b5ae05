//! TLS and mTLS on the gRPC port, with certificates made at test time.
//! TLS does not depend on the store, so these run on SQLite only.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use intray::config::{Settings, TlsFiles};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::task::JoinHandle;
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
        let stop = CancellationToken::new();
        let task = tokio::spawn(intray::server::run(
            settings,
            listener,
            stop.clone().cancelled_owned(),
        ));
        TlsServer {
            addr,
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
    server.stop().await;
}
