//! Observability: logs, OTLP traces and Prometheus metrics.
//!
//! # Layout
//! - `logging`: the `tracing` subscriber (`--log-format`, `RUST_LOG`).
//! - `otlp`: the OTLP trace pipeline from the `OTEL_*` variables, a handle
//!   per server.
//! - `traceparent`: W3C trace context values and attempt span ids (pure).
//! - `rpc`: the tower layer giving every call a server span and metrics.
//! - `http`: the tower layer giving every HTTP API call a server span.
//! - `attempt`: an ended attempt's summary and its `job.attempt` span.
//! - `metrics`: the metrics and their text exposition (served by `crate::http`).

pub mod attempt;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod otlp;
pub mod rpc;
pub mod traceparent;

pub use logging::{LogFormat, init, init_logging};
pub use metrics::Metrics;
pub use otlp::Tracing;
pub use traceparent::TraceParent;
