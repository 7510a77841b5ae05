//! Requests that tonic cannot even decode are the caller's fault, so they
//! get the caller-error statuses of SPEC section 4 rather than tonic's own:
//! an undecodable message (invalid UTF-8 in a string, nesting beyond the
//! protobuf decoder's limit) becomes `INVALID_ARGUMENT` instead of
//! `INTERNAL`, a message over the size limit `RESOURCE_EXHAUSTED` instead of
//! `OUT_OF_RANGE`. tonic answers these before any handler runs, as a
//! trailers-only response, so the status is in the response headers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::http::{HeaderMap, HeaderValue, Request, Response};
use tower::{Layer, Service};

/// Adds [`DecodeErrors`] to a service.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeErrorsLayer;

impl<S> Layer<S> for DecodeErrorsLayer {
    type Service = DecodeErrors<S>;

    fn layer(&self, inner: S) -> DecodeErrors<S> {
        DecodeErrors { inner }
    }
}

/// Rewrites tonic's statuses for requests it could not decode.
#[derive(Clone, Debug)]
pub struct DecodeErrors<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for DecodeErrors<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            rewrite(response.headers_mut());
            Ok(response)
        })
    }
}

/// tonic percent-encodes `grpc-message`; these are its texts for the two
/// decode failures.
const UNDECODABLE: &str = "failed%20to%20decode";
const TOO_LARGE: &str = "message%20length%20too%20large";

fn rewrite(headers: &mut HeaderMap) {
    let status = headers.get("grpc-status").and_then(|v| v.to_str().ok());
    let message = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let replacement = match status {
        Some("13") if message.starts_with(UNDECODABLE) => Some((
            "3",
            "the%20request%20is%20not%20a%20valid%20message%20(bad%20UTF-8%20or%20nested%20too%20deep)",
        )),
        Some("11") if message.contains(TOO_LARGE) => Some((
            "8",
            "the%20request%20is%20larger%20than%20the%20server%20accepts",
        )),
        _ => None,
    };
    if let Some((code, text)) = replacement {
        headers.insert("grpc-status", HeaderValue::from_static(code));
        headers.insert("grpc-message", HeaderValue::from_static(text));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(status: &'static str, message: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static(status));
        h.insert("grpc-message", HeaderValue::from_static(message));
        h
    }

    #[test]
    fn decode_failures_become_caller_errors() {
        let mut h = headers(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20invalid%20string",
        );
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "3");
        let mut h = headers(
            "11",
            "Error,%20decoded%20message%20length%20too%20large:%20found%2020%20bytes",
        );
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "8");
    }

    #[test]
    fn other_statuses_are_left_alone() {
        let mut h = headers("13", "internal%20error");
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "13");
        let mut h = headers("11", "something%20else");
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "11");
    }
}
