//! The `intray` binary's credentials against real servers: `--token`
//! (`INTRAY_TOKEN`) on every call, and TLS with `--tls-ca` (and an mTLS
//! client certificate with `--client-cert`/`--client-key`). SQLite only:
//! nothing here depends on the store.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::*;
use intray::config::{Settings, TlsFiles};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::process::Command;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const PRODUCER: &str = "acme-producer-0123456789";

fn token_file(dir: &Path) -> PathBuf {
    let path = dir.join("tokens");
    std::fs::write(&path, format!("{PRODUCER} acme producer\n")).expect("write token file");
    path
}

/// Runs `intray ARGS` with no `INTRAY_*` settings from the environment
/// except `env`.
async fn intray(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_intray"));
    for (key, _) in std::env::vars() {
        if key.starts_with("INTRAY_") {
            command.env_remove(key);
        }
    }
    command
        .args(args)
        .envs(env.iter().copied())
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(30), command.output())
        .await
        .expect("the CLI finishes")
        .expect("run the CLI")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

const SUBMIT: [&str; 7] = [
    "submit",
    "--queue",
    "cli",
    "--kind",
    "k",
    "--payload",
    "{\"n\":1}",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_sends_the_token_and_fails_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = token_file(dir.path());
    let server = TestServer::start_with(Backend::Sqlite, move |s| s.auth_file = Some(file)).await;
    let url = server.url();

    let mut args = vec!["--addr", &url, "--token", PRODUCER];
    args.extend(SUBMIT);
    let ok = intray(&args, &[]).await;
    assert!(
        ok.status.success(),
        "submit with the token: {}",
        stderr(&ok)
    );

    // From the environment, with --json after the subcommand.
    let mut args = vec!["--addr", url.as_str()];
    args.extend(SUBMIT);
    args.push("--json");
    let ok = intray(&args, &[("INTRAY_TOKEN", PRODUCER)]).await;
    assert!(ok.status.success(), "INTRAY_TOKEN: {}", stderr(&ok));
    let job: serde_json::Value = serde_json::from_slice(&ok.stdout).expect("JSON output");
    assert_eq!(job["job"]["tenant"], "acme", "the token's tenant: {job}");

    let mut args = vec!["--addr", url.as_str()];
    args.extend(SUBMIT);
    let refused = intray(&args, &[]).await;
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("UNAUTHENTICATED"),
        "stderr names the code: {}",
        stderr(&refused)
    );

    let wrong = "wrong-token-not-printed-98765";
    let mut args = vec!["--addr", url.as_str(), "--token", wrong];
    args.extend(SUBMIT);
    let refused = intray(&args, &[]).await;
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    let out = format!(
        "{}{}",
        stderr(&refused),
        String::from_utf8_lossy(&refused.stdout)
    );
    assert!(out.contains("UNAUTHENTICATED"), "{out}");
    assert!(!out.contains(wrong), "the token is never printed: {out}");
    server.stop().await;
}

// ---------------------------------------------------------------------------
// TLS
// ---------------------------------------------------------------------------

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
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

    /// Writes the CA as `NAME.crt`, and a leaf for `names` as `LEAF.crt`
    /// and `LEAF.key`, in `dir`.
    fn write(&self, dir: &Path, name: &str, leaf: &str, names: &[&str]) {
        std::fs::write(dir.join(format!("{name}.crt")), self.issuer.pem()).expect("write CA");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let key = KeyPair::generate().expect("leaf key");
        let cert = CertificateParams::new(names)
            .expect("leaf params")
            .signed_by(&key, &self.issuer)
            .expect("signed leaf");
        std::fs::write(dir.join(format!("{leaf}.crt")), cert.pem()).expect("write leaf");
        std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).expect("write key");
    }
}

struct TlsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<Result<(), intray::server::ServerError>>,
}

/// A TLS server with authentication on, its files in `dir` (`ca.crt`, and
/// `client-ca.crt` when `mtls`).
async fn start_tls(dir: &Path, mtls: bool) -> TlsServer {
    Ca::new("server CA").write(dir, "ca", "server", &["localhost"]);
    let client_ca = mtls.then(|| {
        Ca::new("client CA").write(dir, "client-ca", "client", &["worker-1"]);
        dir.join("client-ca.crt")
    });
    let mut settings = Settings::new(format!("sqlite://{}", dir.join("intray.db").display()));
    settings.auth_file = Some(token_file(dir));
    settings.tls = Some(TlsFiles {
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
        client_ca,
    });
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
    TlsServer { addr, stop, task }
}

impl TlsServer {
    fn url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    /// Runs `intray` with `args` (before `stats`) until it succeeds: the
    /// server migrates in the background.
    async fn until_up(&self, args: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut all = args.to_vec();
            all.push("stats");
            let out = intray(&all, &[]).await;
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the CLI never got through: {}",
                stderr(&out)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("server stops")
            .expect("server task")
            .expect("server ran cleanly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_over_tls_with_the_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start_tls(dir.path(), false).await;
    let url = server.url();
    let ca = dir.path().join("ca.crt");
    let ca = ca.to_str().expect("UTF-8 path");
    server
        .until_up(&["--addr", &url, "--tls-ca", ca, "--token", PRODUCER])
        .await;

    let mut args = vec!["--addr", url.as_str(), "--tls-ca", ca];
    args.extend(SUBMIT);
    let ok = intray(&args, &[("INTRAY_TOKEN", PRODUCER)]).await;
    assert!(ok.status.success(), "submit over TLS: {}", stderr(&ok));

    // From the environment too.
    let mut args = vec!["--addr", url.as_str()];
    args.extend(SUBMIT);
    let ok = intray(&args, &[("INTRAY_TOKEN", PRODUCER), ("INTRAY_TLS_CA", ca)]).await;
    assert!(ok.status.success(), "INTRAY_TLS_CA: {}", stderr(&ok));

    // Without the CA the server is not trusted.
    let mut args = vec!["--addr", url.as_str(), "--token", PRODUCER];
    args.extend(SUBMIT);
    let untrusted = intray(&args, &[]).await;
    assert_eq!(untrusted.status.code(), Some(1), "{}", stderr(&untrusted));
    // Without --tls-ca the system's roots are used: SSL_CERT_FILE stands in
    // for a system bundle that holds the CA, as a public CA's would be.
    let trusted = intray(&args, &[("SSL_CERT_FILE", ca)]).await;
    assert!(
        trusted.status.success(),
        "the system roots: {}",
        stderr(&trusted)
    );
    // A CA with a plaintext address is a mistake, not a silent downgrade.
    let plain = format!("http://{}", server.addr);
    let mut args = vec!["--addr", plain.as_str(), "--tls-ca", ca];
    args.extend(SUBMIT);
    let mixed = intray(&args, &[("INTRAY_TOKEN", PRODUCER)]).await;
    assert_eq!(mixed.status.code(), Some(2), "{}", stderr(&mixed));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_presents_a_client_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start_tls(dir.path(), true).await;
    let url = server.url();
    let path = |name: &str| dir.path().join(name).to_str().expect("UTF-8").to_owned();
    let (ca, cert, key) = (path("ca.crt"), path("client.crt"), path("client.key"));
    let base = [
        "--addr",
        url.as_str(),
        "--tls-ca",
        ca.as_str(),
        "--token",
        PRODUCER,
    ];
    let mut with_cert = base.to_vec();
    with_cert.extend(["--client-cert", cert.as_str(), "--client-key", key.as_str()]);
    server.until_up(&with_cert).await;

    with_cert.extend(SUBMIT);
    let ok = intray(&with_cert, &[]).await;
    assert!(ok.status.success(), "submit with mTLS: {}", stderr(&ok));

    let mut without = base.to_vec();
    without.extend(SUBMIT);
    let refused = intray(&without, &[]).await;
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    server.stop().await;
}

/// A bad token file, certificate or host list stops `intray serve` before
/// it touches the database: it used to migrate first, and left a database
/// behind for a typo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_stops_at_a_bad_file_before_the_database_is_made() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let bad_tokens = dir.path().join("bad-tokens");
    std::fs::write(&bad_tokens, "short acme producer\n").expect("write the token file");
    let missing_cert = dir.path().join("none.crt");
    let cases: [(&str, Vec<String>, i32); 4] = [
        (
            "a webhook CA file that is not there",
            vec![
                "--webhook-ca-file".into(),
                missing_cert.display().to_string(),
            ],
            1,
        ),
        (
            "a token too short",
            vec!["--auth-file".into(), bad_tokens.display().to_string()],
            1,
        ),
        (
            "a certificate that is not there",
            vec![
                "--tls-cert".into(),
                missing_cert.display().to_string(),
                "--tls-key".into(),
                missing_cert.display().to_string(),
            ],
            1,
        ),
        (
            "a host with a port",
            vec![
                "--auth-file".into(),
                token_file(dir.path()).display().to_string(),
                "--http-allowed-hosts".into(),
                "intray:8080".into(),
            ],
            2,
        ),
    ];
    for (what, flags, code) in cases {
        let db = dir.path().join("never.db");
        let url = format!("sqlite://{}", db.display());
        let mut args = vec![
            "serve",
            "--database-url",
            &url,
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ];
        args.extend(flags.iter().map(String::as_str));
        let output = intray(&args, &[]).await;
        assert_eq!(
            output.status.code(),
            Some(code),
            "{what}: {}",
            stderr(&output)
        );
        assert!(!db.exists(), "{what}: the database was made");
    }
}

/// A token sent over plaintext to another machine is warned about; to this
/// one it is not (nothing crosses a network).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_in_cleartext_to_another_machine_is_warned_about() {
    let id = "01a25092-6ee1-7000-8000-000000000000";
    // 0.0.0.0 is not loopback, and reaches this machine's closed port at once.
    let far = intray(
        &["--addr", "http://0.0.0.0:9", "--token", PRODUCER, "get", id],
        &[],
    )
    .await;
    assert!(stderr(&far).contains("cleartext"), "{}", stderr(&far));
    let near = intray(
        &[
            "--addr",
            "http://127.0.0.1:9",
            "--token",
            PRODUCER,
            "get",
            id,
        ],
        &[],
    )
    .await;
    assert!(!stderr(&near).contains("cleartext"), "{}", stderr(&near));
}
