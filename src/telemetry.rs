//! Logging setup: structured logs on stderr, filtered by `RUST_LOG`
//! (default `info`).

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; a second call is a no-op.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn,sqlx=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
