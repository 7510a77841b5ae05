//! A tower layer around the HTTP API's calls: a server span continuing the
//! caller's W3C `traceparent`, named after the route.
//!
//! The span's own `traceparent` then replaces the caller's in the request,
//! so that the gateway, which takes the trace context from the headers,
//! stores it with a submitted job: the job's attempts nest under the HTTP
//! call as they do under a gRPC `Submit`. The layer sits on matched routes
//! only (the route is the span's name, and unknown paths would make the set
//! of names unbounded).

use std::task::{Context as TaskContext, Poll};

use axum::extract::MatchedPath;
use axum::http::{HeaderValue, Request, Response};
use opentelemetry::KeyValue;
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{Status, TraceContextExt};
use tower::{Layer, Service};

use super::otlp::Tracing;
use super::rpc::{BoxFuture, server_span, span_traceparent};

/// Wraps routes in [`HttpTraced`].
#[derive(Clone, Debug)]
pub struct HttpTraceLayer {
    tracing: Tracing,
}

impl HttpTraceLayer {
    /// Spans go to `tracing` (when on).
    pub fn new(tracing: Tracing) -> HttpTraceLayer {
        HttpTraceLayer { tracing }
    }
}

impl<S> Layer<S> for HttpTraceLayer {
    type Service = HttpTraced<S>;

    fn layer(&self, inner: S) -> HttpTraced<S> {
        HttpTraced {
            inner,
            tracing: self.tracing.clone(),
        }
    }
}

/// One server span per HTTP call.
#[derive(Clone, Debug)]
pub struct HttpTraced<S> {
    inner: S,
    tracing: Tracing,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for HttpTraced<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let cx = server_span(&self.tracing, req.headers(), || {
            let method = req.method().as_str();
            let path = req.uri().path();
            let matched = req
                .extensions()
                .get::<MatchedPath>()
                .map_or(path, MatchedPath::as_str);
            let route = with_action(matched, path);
            (
                format!("{method} {route}"),
                vec![
                    KeyValue::new("http.request.method", method.to_owned()),
                    KeyValue::new("http.route", route.clone()),
                    KeyValue::new("url.path", path.to_owned()),
                ],
            )
        });
        let Some(cx) = cx else {
            return Box::pin(self.inner.call(req));
        };
        if let Some(value) =
            span_traceparent(&cx).and_then(|tp| HeaderValue::from_str(&tp.to_string()).ok())
        {
            req.headers_mut().insert("traceparent", value);
        }
        // Inside the call the span is the current OpenTelemetry context, so
        // `tracing` spans bridged to OpenTelemetry nest under it.
        let call = self.inner.call(req).with_context(cx.clone());
        Box::pin(async move {
            let answer = call.await;
            let span = cx.span();
            if let Ok(response) = &answer {
                let status = response.status();
                span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status.as_u16()),
                ));
                // OpenTelemetry's rule for server spans: only 5xx is the
                // server's fault.
                if status.is_server_error() {
                    span.set_status(Status::error(status.as_str().to_owned()));
                }
            }
            span.end();
            answer
        })
    }
}

/// The custom methods on a resource (`POST /api/v1/jobs/{id}:cancel`),
/// which axum matches as the whole last segment.
const ACTIONS: [&str; 3] = ["cancel", "pause", "resume"];

/// `route` with the action `path` names, so that a cancel and a pause do
/// not share a span name with every other `POST` to their resource. Only
/// the known actions are added: a name may hold `:` itself (queue
/// `tenant:a`), and what follows it must not make the set of span names
/// unbounded.
fn with_action(route: &str, path: &str) -> String {
    let action = route
        .ends_with('}')
        .then(|| path.rsplit('/').next())
        .flatten()
        .and_then(|segment| segment.rsplit_once(':'))
        .map(|(_, action)| action)
        .filter(|action| ACTIONS.contains(action));
    match action {
        Some(action) => format!("{route}:{action}"),
        None => route.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_are_part_of_the_route() {
        let job = "/api/v1/jobs/{id}";
        let queue = "/api/v1/queues/{queue}";
        assert_eq!(
            with_action(job, "/api/v1/jobs/0190c3c6:cancel"),
            "/api/v1/jobs/{id}:cancel"
        );
        assert_eq!(
            with_action(queue, "/api/v1/queues/tenant:a:pause"),
            "/api/v1/queues/{queue}:pause"
        );
        assert_eq!(
            with_action(queue, "/api/v1/queues/q:resume"),
            "/api/v1/queues/{queue}:resume"
        );
        assert_eq!(with_action(job, "/api/v1/jobs/0190c3c6"), job);
        assert_eq!(
            with_action(queue, "/api/v1/queues/a:b"),
            queue,
            "not an action"
        );
        assert_eq!(
            with_action("/api/v1/jobs:retry", "/api/v1/jobs:retry"),
            "/api/v1/jobs:retry",
            "a route that names its action already"
        );
    }
}
