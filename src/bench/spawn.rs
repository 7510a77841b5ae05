//! `--spawn`: an `intray serve` child process on an empty database and free
//! loopback ports, started before the scenarios and stopped after them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::sqlite::SqliteConnectOptions;
use tokio::process::{Child, Command};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::error::BenchError;

/// How long the server may take to start (migrations on an empty database included).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long it may take to stop after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The database behind the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `sqlite:`.
    Sqlite,
}

impl Backend {
    /// The backend a database URL names.
    pub fn of(url: &str) -> Option<Backend> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else {
            None
        }
    }

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

fn db_error(what: impl Into<String>) -> impl FnOnce(sqlx::Error) -> BenchError {
    let what = what.into();
    move |source| BenchError::Database { what, source }
}

/// Makes the database empty: drops and recreates the PostgreSQL database the
/// URL names, or deletes the SQLite file (with its WAL).
pub async fn reset_database(url: &str) -> Result<(), BenchError> {
    match Backend::of(url) {
        Some(Backend::Postgres) => reset_postgres(url).await,
        Some(Backend::Sqlite) => reset_sqlite(url),
        None => Err(BenchError::BadArgument(format!(
            "--database-url must start with postgres:// or sqlite:, not {url:?}"
        ))),
    }
}

async fn reset_postgres(url: &str) -> Result<(), BenchError> {
    let options = PgConnectOptions::from_str(url).map_err(db_error("URL"))?;
    let name = options
        .get_database()
        .ok_or_else(|| {
            BenchError::BadArgument(
                "--database-url must name the database --spawn drops and recreates".into(),
            )
        })?
        .to_owned();
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        || ["postgres", "template0", "template1"].contains(&name.as_str())
    {
        return Err(BenchError::BadArgument(format!(
            "--spawn drops and recreates the database {name:?}; name one of its own \
             (letters, digits, _), not postgres or a template, e.g. .../intray_bench"
        )));
    }
    let admin = options.database("postgres");
    let mut conn = PgConnection::connect_with(&admin).await.map_err(db_error(
        "connect to the postgres database to recreate the bench database",
    ))?;
    for sql in [
        format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
        format!("CREATE DATABASE \"{name}\""),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut conn)
            .await
            .map_err(db_error(sql))?;
    }
    conn.close().await.map_err(db_error("close"))
}

fn reset_sqlite(url: &str) -> Result<(), BenchError> {
    let options = SqliteConnectOptions::from_str(url).map_err(db_error("URL"))?;
    let file = options.get_filename();
    for suffix in ["", "-wal", "-shm"] {
        let mut path = file.as_os_str().to_owned();
        path.push(suffix);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(BenchError::Spawn(format!(
                    "cannot remove {}: {e}",
                    Path::new(&path).display()
                )));
            }
        }
    }
    Ok(())
}

/// A free loopback port (the listener is closed again at once; the server
/// binds it a moment later).
fn free_port() -> Result<u16, BenchError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| BenchError::Spawn(format!("cannot find a free port: {e}")))
}

/// A running `intray serve` child.
pub struct Spawned {
    child: Child,
    pid: u32,
    addr: String,
    log: PathBuf,
}

impl Spawned {
    /// Starts `intray serve` (this same executable) on `url` and waits until
    /// its health check answers SERVING. `serve_args` are added to its command
    /// line; `INTRAY_*` variables are not passed on, so only these flags
    /// configure it.
    pub async fn start(
        url: &str,
        serve_args: &[String],
        log: &Path,
    ) -> Result<Spawned, BenchError> {
        let exe = std::env::current_exe()
            .map_err(|e| BenchError::Spawn(format!("cannot find the intray executable: {e}")))?;
        let grpc = format!("127.0.0.1:{}", free_port()?);
        let http = format!("127.0.0.1:{}", free_port()?);
        let log_file = std::fs::File::create(log)
            .map_err(|e| BenchError::Spawn(format!("cannot create {}: {e}", log.display())))?;
        let log_err = log_file
            .try_clone()
            .map_err(|e| BenchError::Spawn(format!("cannot open {}: {e}", log.display())))?;
        let mut command = Command::new(&exe);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("INTRAY_") {
                command.env_remove(key);
            }
        }
        // The hot path, not log formatting: one info line per transition
        // would cost the server as much as some of the work measured.
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        command
            .args(["serve", "--grpc-addr", &grpc, "--http-addr", &http])
            .args(["--database-url", url])
            .args(serve_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(true);
        let child = command
            .spawn()
            .map_err(|e| BenchError::Spawn(format!("cannot start {}: {e}", exe.display())))?;
        let pid = child
            .id()
            .ok_or_else(|| BenchError::Spawn("the server exited at once".into()))?;
        let mut spawned = Spawned {
            child,
            pid,
            addr: format!("http://{grpc}"),
            log: log.to_owned(),
        };
        spawned.wait_ready().await?;
        Ok(spawned)
    }

    /// The server's gRPC address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Where its output goes.
    pub fn log(&self) -> &Path {
        &self.log
    }

    async fn wait_ready(&mut self) -> Result<(), BenchError> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(BenchError::Spawn(format!(
                    "the server exited during start-up ({status}); its log: {}",
                    self.log.display()
                )));
            }
            if self.serving().await {
                return Ok(());
            }
            if started.elapsed() > STARTUP_TIMEOUT {
                return Err(BenchError::Spawn(format!(
                    "the server did not report SERVING within {STARTUP_TIMEOUT:?}; its log: {}",
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn serving(&self) -> bool {
        let Ok(endpoint) = tonic::transport::Endpoint::from_shared(self.addr.clone()) else {
            return false;
        };
        let Ok(channel) = endpoint.connect().await else {
            return false;
        };
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        matches!(answer, Ok(r) if r.get_ref().status == ServingStatus::Serving as i32)
    }

    /// SIGTERM, then SIGKILL if it has not stopped in time.
    pub async fn stop(mut self) -> Result<(), BenchError> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid).unwrap_or(i32::MAX));
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_ok()
            && let Ok(waited) = tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await
        {
            return waited
                .map(drop)
                .map_err(|e| BenchError::Spawn(format!("waiting for the server: {e}")));
        }
        self.child
            .kill()
            .await
            .map_err(|e| BenchError::Spawn(format!("cannot kill the server: {e}")))
    }
}
