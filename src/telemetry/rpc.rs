//! A tower layer around every gRPC call: a server span continuing the
//! caller's W3C `traceparent`, and the RPC latency and status metrics.
//!
//! It sits outside authentication and the call limits, so refused and timed
//! out calls are counted and traced too.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use opentelemetry::context::FutureExt as _;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use prost::Message as _;
use prost_types::FileDescriptorSet;
use tonic::Code;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tower::{Layer, Service};

use super::metrics::Metrics;
use super::otlp::Tracing;
use super::traceparent::TraceParent;

/// The trace context a call runs in, put in the request's extensions:
/// the server span's when tracing is on, else the caller's own. `Submit`
/// stores it with the job so that attempts join the submitter's trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTrace(pub Option<TraceParent>);

/// Reads a gRPC call's metadata (HTTP/2 headers) for the propagator.
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Wraps services in [`Observed`].
#[derive(Clone, Debug)]
pub struct RpcLayer {
    tracing: Tracing,
    metrics: Arc<Metrics>,
}

impl RpcLayer {
    /// Spans go to `tracing` (when on), figures to `metrics`.
    pub fn new(tracing: Tracing, metrics: Arc<Metrics>) -> RpcLayer {
        RpcLayer { tracing, metrics }
    }
}

impl<S> Layer<S> for RpcLayer {
    type Service = Observed<S>;

    fn layer(&self, inner: S) -> Observed<S> {
        Observed {
            inner,
            tracing: self.tracing.clone(),
            metrics: Arc::clone(&self.metrics),
        }
    }
}

/// One server span and one latency/status sample per call.
#[derive(Clone, Debug)]
pub struct Observed<S> {
    inner: S,
    tracing: Tracing,
    metrics: Arc<Metrics>,
}

/// The future of a traced call.
pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A server span for a call whose headers are `headers`, in the caller's
/// W3C trace context when it sent one; `None` when tracing is off. `named`
/// gives the span's name and attributes, and is called only when tracing
/// is on (so that calls pay nothing for them otherwise). The returned
/// context holds the span.
pub fn server_span(
    tracing: &Tracing,
    headers: &HeaderMap,
    named: impl FnOnce() -> (String, Vec<KeyValue>),
) -> Option<Context> {
    let tracer = tracing.tracer()?;
    let (name, attributes) = named();
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    Some(parent.with_span(span))
}

/// The `traceparent` of the span in `cx`.
pub fn span_traceparent(cx: &Context) -> Option<TraceParent> {
    let sc = cx.span().span_context().clone();
    TraceParent::parse(&format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    ))
}

/// `INVALID_ARGUMENT` from `InvalidArgument`: the names operators know.
pub fn code_name(code: Code) -> String {
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Codes that are the server's fault (OpenTelemetry's rule for server spans).
fn server_fault(code: Code) -> bool {
    matches!(
        code,
        Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss
    )
}

/// The request paths (`/package.Service/Method`) of the methods this server
/// serves. A path is the caller's to choose, even one refused before routing
/// (by authentication), and every metric label is kept for the process's
/// life: only these paths become labels and span names.
static METHODS: LazyLock<HashSet<String>> = LazyLock::new(|| {
    let mut methods: HashSet<String> = [
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    for encoded in [
        crate::pb::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ] {
        // Both sets are compiled in; one that did not decode would only
        // leave its methods labelled "unknown".
        let Ok(set) = FileDescriptorSet::decode(encoded) else {
            continue;
        };
        for file in &set.file {
            for service in &file.service {
                for method in &service.method {
                    methods.insert(format!(
                        "/{}.{}/{}",
                        file.package(),
                        service.name(),
                        method.name()
                    ));
                }
            }
        }
    }
    methods
});

/// `path` if it is a method this server serves, else `"unknown"`.
fn method_label(path: &str) -> &str {
    if METHODS.contains(path) {
        path
    } else {
        "unknown"
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Observed<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let started = Instant::now();
        let path = method_label(req.uri().path()).to_owned();
        // A probe every few seconds from each kubelet and load balancer
        // would be most of the traces; health checks are counted only.
        let untraced = Tracing::off();
        let tracing = if path.starts_with(HEALTH_PREFIX) {
            &untraced
        } else {
            &self.tracing
        };
        let cx = server_span(tracing, req.headers(), || {
            let (service, method) = path
                .trim_start_matches('/')
                .split_once('/')
                .unwrap_or((path.as_str(), ""));
            (
                path.trim_start_matches('/').to_owned(),
                vec![
                    KeyValue::new("rpc.system", "grpc"),
                    KeyValue::new("rpc.service", service.to_owned()),
                    KeyValue::new("rpc.method", method.to_owned()),
                ],
            )
        });
        let span_on = cx.is_some();
        let call_trace = match &cx {
            Some(cx) => span_traceparent(cx),
            None => req
                .headers()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .and_then(TraceParent::parse),
        };
        let cx = cx.unwrap_or_default();
        req.extensions_mut().insert(CallTrace(call_trace));
        let mut record = CallRecord {
            metrics: Arc::clone(&self.metrics),
            deadline: req.headers().get("grpc-timeout").and_then(grpc_timeout),
            path,
            started,
            span: span_on.then(|| cx.clone()),
            done: false,
        };
        // Inside the call, the server span is the current OpenTelemetry
        // context, so `tracing` spans bridged to OpenTelemetry nest under it.
        let call = self.inner.call(req).with_context(cx);
        Box::pin(async move {
            let answer = call.await;
            // A unary error is a trailers-only response with the status in
            // the headers; a success carries it in trailers, after this
            // layer is done: no header means OK. (Streams count when they
            // start.)
            let code = match &answer {
                Ok(response) => response
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map_or(Code::Ok, Code::from_i32),
                Err(_) => Code::Unknown,
            };
            record.finish(code);
            answer
        })
    }
}

/// The gRPC health service's methods, which get no span.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Counts a call and ends its span, once: when it answers, or when it is
/// dropped unanswered (tonic drops the call when the client's deadline
/// passes or the client resets the stream; the HTTP server drops it when
/// its client closes the connection), then as `DEADLINE_EXCEEDED` past the
/// client's timeout, else `CANCELLED`. Without this, such calls were never
/// counted and their spans ended with no status.
pub struct CallRecord {
    metrics: Arc<Metrics>,
    path: String,
    started: Instant,
    /// The client's `grpc-timeout`.
    deadline: Option<Duration>,
    /// The server span, when tracing is on.
    span: Option<Context>,
    done: bool,
}

impl CallRecord {
    /// A call to `path` started now, with the client's timeout if it sent
    /// one, and the call's server span when tracing is on.
    pub fn start(
        metrics: Arc<Metrics>,
        path: String,
        deadline: Option<Duration>,
        span: Option<Context>,
    ) -> CallRecord {
        CallRecord {
            metrics,
            path,
            started: Instant::now(),
            deadline,
            span,
            done: false,
        }
    }

    /// Counts the call with its answer's `code`; only the first count
    /// stands.
    pub fn finish(&mut self, code: Code) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        self.metrics
            .rpc(&self.path, &code_name(code), self.started.elapsed());
        if let Some(cx) = &self.span {
            let span = cx.span();
            span.set_attribute(KeyValue::new("rpc.grpc.status_code", code as i64));
            if server_fault(code) {
                span.set_status(Status::error(code_name(code)));
            }
            span.end();
        }
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        let past_deadline = self
            .deadline
            .is_some_and(|deadline| self.started.elapsed() >= deadline);
        self.finish(if past_deadline {
            Code::DeadlineExceeded
        } else {
            Code::Cancelled
        });
    }
}

/// A `grpc-timeout` header: up to eight digits and a unit (`H`, `M`, `S`,
/// `m`, `u`, `n`).
fn grpc_timeout(value: &tonic::codegen::http::HeaderValue) -> Option<Duration> {
    let value = value.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_in_their_units() {
        use tonic::codegen::http::HeaderValue;
        let read = |v: &'static str| grpc_timeout(&HeaderValue::from_static(v));
        assert_eq!(read("200m"), Some(Duration::from_millis(200)));
        assert_eq!(read("5S"), Some(Duration::from_secs(5)));
        assert_eq!(read("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(read("999999999S"), None, "nine digits");
        assert_eq!(read("S"), None);
        assert_eq!(read("5x"), None);
    }

    #[test]
    fn code_names_are_the_canonical_ones() {
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
    }

    #[test]
    fn only_served_methods_become_labels() {
        for served in [
            "/intray.v1.JobService/Submit",
            "/intray.v1.WorkerService/CompleteAndLease",
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ] {
            assert_eq!(method_label(served), served);
        }
        for other in [
            "/intray.v1.JobService/Nope",
            "/nope.Svc/M1",
            "/intray.v1.JobService/Submit/extra",
            "",
        ] {
            assert_eq!(method_label(other), "unknown", "{other}");
        }
    }
}
