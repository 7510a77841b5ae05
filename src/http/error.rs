//! The one place where a failed HTTP call becomes an answer: the status
//! follows the gRPC code, the body is `{code, message, details}` with the
//! code's name and the `google.rpc` details of the status (field violations,
//! retry delay) in their JSON form, and a retry delay is also sent as
//! `Retry-After`.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::domain::validate::ValidationError;
use crate::telemetry::rpc::code_name;

/// Why an HTTP call failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Refused or failed by the service, or by the authentication and
    /// protection rules in front of it; also malformed HTTP input, which is
    /// refused as the service refuses a bad field.
    #[error("{}", .0.message())]
    Rpc(#[from] Status),
    /// The request body is over the size limit.
    #[error("the request body is larger than the server accepts ({limit} bytes)")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request body did not arrive within `--http-body-timeout`.
    #[error("the request body did not arrive within {}", humantime::format_duration(*.limit))]
    BodyTimedOut {
        /// The limit it missed.
        limit: Duration,
    },
    /// Nothing is served at this path.
    #[error("no route for {0}")]
    NoRoute(String),
    /// The path is served, but not with this method.
    #[error("{method} is not served at {path}")]
    NoMethod {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
        /// The methods the path is served with, for the `Allow` header a
        /// 405 must carry; `None` where the router adds it itself.
        allow: Option<&'static str>,
    },
}

impl From<ValidationError> for HttpError {
    fn from(err: ValidationError) -> HttpError {
        HttpError::Rpc(err.into())
    }
}

impl HttpError {
    /// The gRPC code the answer carries.
    fn code(&self) -> Code {
        match self {
            HttpError::Rpc(status) => status.code(),
            HttpError::TooLarge { .. } => Code::ResourceExhausted,
            HttpError::BodyTimedOut { .. } => Code::DeadlineExceeded,
            HttpError::NoRoute(_) => Code::NotFound,
            HttpError::NoMethod { .. } => Code::Unimplemented,
        }
    }

    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            HttpError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            HttpError::BodyTimedOut { .. } => StatusCode::REQUEST_TIMEOUT,
            HttpError::NoMethod { .. } => StatusCode::METHOD_NOT_ALLOWED,
            _ => status_for(self.code()),
        }
    }
}

/// The HTTP status for a gRPC code: google.rpc.Code's own table, except
/// that a refused transition (`FAILED_PRECONDITION`) is 412 and a stale lease
/// (`ABORTED`) is 409.
pub fn status_for(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        // nginx's "client closed request", which google.rpc.Code uses too.
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The details the server attaches, in the proto3 JSON form of
/// `google.rpc.Status.details`, and the retry delay if there is one.
fn details(status: &Status) -> (Vec<Value>, Option<Duration>) {
    let rich = status.get_error_details();
    let mut out = Vec::new();
    if let Some(bad) = rich.bad_request() {
        let violations: Vec<Value> = bad
            .field_violations
            .iter()
            .map(|v| json!({"field": v.field, "description": v.description}))
            .collect();
        out.push(json!({
            "@type": "type.googleapis.com/google.rpc.BadRequest",
            "fieldViolations": violations,
        }));
    }
    let delay = rich.retry_info().and_then(|r| r.retry_delay);
    if let Some(delay) = delay {
        out.push(json!({
            "@type": "type.googleapis.com/google.rpc.RetryInfo",
            "retryDelay": format!("{:.3}s", delay.as_secs_f64()),
        }));
    }
    (out, delay)
}

/// The message and details the client sees.
fn message_and_details(err: &HttpError) -> (String, Vec<Value>, Option<Duration>) {
    match err {
        HttpError::Rpc(status) => {
            let (details, delay) = details(status);
            (status.message().to_owned(), details, delay)
        }
        other => (other.to_string(), Vec::new(), None),
    }
}

impl HttpError {
    /// The `{code, message, details}` body, and the retry delay if any.
    pub fn body(&self) -> (Value, Option<Duration>) {
        let (message, details, delay) = message_and_details(self);
        let body = json!({"code": code_name(self.code()), "message": message, "details": details});
        (body, delay)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = self.status();
        let code = self.code();
        let allow = match &self {
            HttpError::NoMethod { allow, .. } => *allow,
            _ => None,
        };
        let (body, delay) = self.body();
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
        let headers = response.headers_mut();
        if let Some(delay) = delay {
            // Whole seconds, rounded up: coming back early only fails again.
            let secs = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        if code == Code::Unauthenticated {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(allow) = allow {
            headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::ErrorDetails;

    #[test]
    fn codes_map_to_their_statuses() {
        let expected = [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::NotFound, 404),
            (Code::AlreadyExists, 409),
            (Code::Aborted, 409),
            (Code::FailedPrecondition, 412),
            (Code::ResourceExhausted, 429),
            (Code::Internal, 500),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
            (Code::Cancelled, 499),
        ];
        for (code, http) in expected {
            assert_eq!(status_for(code).as_u16(), http, "{code:?}");
        }
    }

    #[test]
    fn retry_info_becomes_retry_after_rounded_up() {
        let status = Status::with_error_details(
            Code::ResourceExhausted,
            "slow down",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(1500))),
        );
        let response = HttpError::from(status).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn field_violations_are_listed() {
        let err = HttpError::from(ValidationError::new("queue", "must not be empty"));
        let (message, details, delay) = message_and_details(&err);
        assert!(message.contains("queue"), "{message}");
        assert_eq!(details[0]["fieldViolations"][0]["field"], "queue");
        assert!(delay.is_none());
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }
}
