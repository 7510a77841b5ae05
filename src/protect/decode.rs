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

use tonic::Status;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tower::{Layer, Service};

use crate::domain::validate::ValidationError;

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
        Some("13") if message.starts_with(UNDECODABLE) => {
            undecodable_field(message).map_or_else(
                || Status::invalid_argument(UNDECODABLE_TEXT),
                // As every other bad field is refused: with a BadRequest
                // naming it.
                |field| ValidationError::new(field, UNDECODABLE_TEXT).into(),
            )
        }
        Some("11") if message.contains(TOO_LARGE) => {
            Status::resource_exhausted("the request is larger than the server accepts")
        }
        _ => return,
    };
    if let Err(err) = replacement.add_header(headers) {
        tracing::warn!(error = %err, "could not rewrite an undecodable request's status");
    }
}

const UNDECODABLE_TEXT: &str = "the request is not a valid message (bad UTF-8 or nested too deep)";

/// The request's field that could not be decoded, from prost's error as
/// tonic sends it (`failed to decode Protobuf message: Value.kind:
/// SubmitRequest.payload: recursion limit reached`, percent-encoded): each
/// `Message.field: ` names a step, the innermost first, so the last step is
/// the request's own field.
fn undecodable_field(message: &str) -> Option<String> {
    message
        .split("%20")
        .skip_while(|word| *word != "message:")
        .skip(1)
        .map_while(|word| {
            let (_, field) = word.strip_suffix(':')?.split_once('.')?;
            let named =
                !field.is_empty() && field.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            named.then(|| field.to_owned())
        })
        .last()
}

#[cfg(test)]
mod tests {
    use tonic::codegen::http::HeaderValue;
    use tonic_types::StatusExt;

    use super::*;

    fn headers(status: &'static str, message: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static(status));
        h.insert("grpc-message", HeaderValue::from_static(message));
        h
    }

    fn field_violations(h: &HeaderMap) -> Vec<String> {
        Status::from_header_map(h)
            .expect("a status")
            .get_details_bad_request()
            .map(|b| b.field_violations.into_iter().map(|v| v.field).collect())
            .unwrap_or_default()
    }

    #[test]
    fn decode_failures_become_caller_errors() {
        let mut h = headers(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20invalid%20string",
        );
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "3");
        assert!(field_violations(&h).is_empty(), "no field to name");
        let mut h = headers(
            "11",
            "Error,%20decoded%20message%20length%20too%20large:%20found%2020%20bytes",
        );
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "8");
    }

    #[test]
    fn an_undecodable_field_is_named() {
        let mut h = headers(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20SubmitRequest.queue:%20invalid%20string%20value:%20data%20is%20not%20UTF-8%20encoded",
        );
        rewrite(&mut h);
        assert_eq!(h["grpc-status"], "3");
        assert_eq!(field_violations(&h), ["queue"]);
        // Nested: the request's own field is the last step.
        let mut h = headers(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20Value.kind:%20ListValue.values:%20SubmitRequest.payload:%20recursion%20limit%20reached",
        );
        rewrite(&mut h);
        assert_eq!(field_violations(&h), ["payload"]);
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
