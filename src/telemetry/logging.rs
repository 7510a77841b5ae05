//! Logs on stderr as text or JSON lines, filtered by `RUST_LOG` (default
//! `info`), and, when tracing is on, `tracing` spans bridged to OpenTelemetry.

use std::str::FromStr;

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use super::otlp::Tracing;

/// Default filter: our logs at info, the chatty transport crates quieter.
const DEFAULT_FILTER: &str = "info,h2=warn,hyper=warn,tower=warn,sqlx=warn";
/// What the OpenTelemetry bridge exports: never the transport crates, whose
/// spans would include the exporter's own traffic and feed back into it.
const EXPORT_FILTER: &str = "info,h2=off,hyper=off,hyper_util=off,tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?}: use text or json")),
        }
    }
}

/// Text logs without trace export (client commands, `migrate`).
pub fn init_logging() {
    init(LogFormat::Text, &Tracing::off());
}

/// The filter `RUST_LOG` asks for, else the default. Set but empty (as
/// `RUST_LOG=` or an empty Kubernetes value leaves it), it is unset: taken
/// as written, it showed errors only, not even the start-up lines.
fn log_filter(rust_log: Option<String>) -> EnvFilter {
    rust_log
        .filter(|directives| !directives.trim().is_empty())
        .and_then(|directives| EnvFilter::try_new(directives).ok())
        .unwrap_or_else(|| EnvFilter::new(DEFAULT_FILTER))
}

/// Installs the global subscriber; a second call is a no-op. With tracing
/// on, the spans of `#[instrument]`ed code (store calls) are exported too,
/// nested under the call's server span.
pub fn init(format: LogFormat, tracing: &Tracing) {
    let filter = log_filter(std::env::var("RUST_LOG").ok());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let otel = tracing.provider().map(|provider| {
        use opentelemetry::trace::TracerProvider as _;
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("intray"))
            .with_filter(EnvFilter::new(EXPORT_FILTER))
    });
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_rust_log_is_the_default() {
        let default = EnvFilter::new(DEFAULT_FILTER).to_string();
        assert_eq!(log_filter(None).to_string(), default);
        assert_eq!(log_filter(Some(String::new())).to_string(), default);
        assert_eq!(log_filter(Some("  ".into())).to_string(), default);
        assert_eq!(log_filter(Some("debug".into())).to_string(), "debug");
    }
}
