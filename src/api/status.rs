//! The one place where errors become gRPC statuses. Messages never carry SQL
//! or database text; those go to the log.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::convert;
use crate::auth::AuthError;
use crate::domain::validate::ValidationError;
use crate::pb;
use crate::protect::ProtectError;
use crate::store::StoreError;

/// Why an RPC failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The queue holds its bound of queued jobs.
    #[error("queue {queue} holds {bound} queued jobs, its bound; retry later")]
    QueueFull {
        queue: String,
        bound: u64,
        retry_after: std::time::Duration,
    },
}

/// The `ErrorInfo` reason that marks a `WatchJob` stream ended by shutdown,
/// so a client can tell it from a database outage (also `UNAVAILABLE`)
/// without reading the message.
pub const WATCH_INTERRUPTED: &str = "WATCH_INTERRUPTED";

/// `ErrorInfo.domain` of the reasons intray sets.
const DOMAIN: &str = "intray";

/// How a `WatchJob` stream that shutdown interrupts before its job's
/// terminal event ends. Not OK, which a client would take for "the job has
/// ended": the job goes on, and so must the watch, elsewhere.
pub fn watch_interrupted() -> Status {
    Status::with_error_details(
        Code::Unavailable,
        "the server is shutting down; watch again from the last sequence",
        ErrorDetails::with_error_info(WATCH_INTERRUPTED, DOMAIN, []),
    )
}

/// Whether `status` ends a `WatchJob` stream that shutdown interrupted. The
/// HTTP face ends its event stream quietly then, as an `EventSource`
/// reconnects with `Last-Event-ID` by itself, rather than report an error.
pub fn is_watch_interrupted(status: &Status) -> bool {
    status.code() == Code::Unavailable
        && status
            .get_details_error_info()
            .is_some_and(|info| info.reason == WATCH_INTERRUPTED && info.domain == DOMAIN)
}

fn code_and_message(err: &ApiError) -> (Code, String) {
    match err {
        ApiError::Invalid(v) => (Code::InvalidArgument, v.to_string()),
        ApiError::QueueFull { .. } => (Code::ResourceExhausted, err.to_string()),
        ApiError::Store(e) => match e {
            StoreError::NotFound => (Code::NotFound, e.to_string()),
            StoreError::LeaseLost => (Code::Aborted, e.to_string()),
            StoreError::IdempotencyConflict => (Code::AlreadyExists, e.to_string()),
            StoreError::IllegalTransition(msg) => (Code::FailedPrecondition, msg.clone()),
            StoreError::Unavailable(source) => {
                tracing::warn!(error = %source, "database unavailable");
                (
                    Code::Unavailable,
                    "database unavailable; retry later".into(),
                )
            }
            StoreError::Config(_) | StoreError::Internal(_) => {
                tracing::error!(error = %e, "internal error");
                (Code::Internal, "internal error".into())
            }
        },
    }
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Status {
        let (code, message) = code_and_message(&err);
        match &err {
            ApiError::Invalid(v) => Status::with_error_details(
                code,
                message,
                ErrorDetails::with_bad_request_violation(v.field.clone(), v.reason.clone()),
            ),
            ApiError::QueueFull { retry_after, .. } => Status::with_error_details(
                code,
                message,
                ErrorDetails::with_retry_info(Some(*retry_after)),
            ),
            ApiError::Store(_) => Status::new(code, message),
        }
    }
}

impl From<ValidationError> for Status {
    fn from(err: ValidationError) -> Status {
        ApiError::from(err).into()
    }
}

impl From<StoreError> for Status {
    fn from(err: StoreError) -> Status {
        ApiError::from(err).into()
    }
}

/// Refusals of the auth layer: who you are is `UNAUTHENTICATED`, what you
/// may do is `PERMISSION_DENIED`. The messages never say whether a token
/// exists for some other tenant.
impl From<AuthError> for Status {
    fn from(err: AuthError) -> Status {
        match err {
            AuthError::MissingToken | AuthError::UnknownToken | AuthError::Revoked => {
                Status::unauthenticated(err.to_string())
            }
            AuthError::Forbidden { .. } => Status::permission_denied(err.to_string()),
            AuthError::BadTenant(v) => v.into(),
        }
    }
}

/// Protection layers: a rate limit tells when to come back (`RetryInfo`),
/// a timeout is the server's deadline.
impl From<ProtectError> for Status {
    fn from(err: ProtectError) -> Status {
        match err {
            ProtectError::RateLimited { retry_after } => Status::with_error_details(
                Code::ResourceExhausted,
                err.to_string(),
                ErrorDetails::with_retry_info(Some(retry_after)),
            ),
            ProtectError::Timeout { .. } => Status::deadline_exceeded(err.to_string()),
        }
    }
}

/// The per-item error of a batch response.
pub fn item_error(err: impl Into<ApiError>) -> pb::ItemError {
    let err = err.into();
    let (code, message) = code_and_message(&err);
    let (field, retry_delay) = match &err {
        ApiError::Invalid(v) => (v.field.clone(), None),
        ApiError::QueueFull { retry_after, .. } => (String::new(), Some(*retry_after)),
        ApiError::Store(_) => (String::new(), None),
    };
    pb::ItemError {
        code: code as i32,
        message,
        field,
        retry_delay: retry_delay.map(convert::duration),
    }
}
