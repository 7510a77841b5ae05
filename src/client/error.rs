//! Errors of the client commands, and how they read on a terminal.

use std::fmt::Write as _;

use tonic::Code;
use tonic_types::StatusExt;

/// Why a client command failed.
///
/// `Display` gives the whole story on one or more lines (without a leading
/// "error:"), so `main` only has to print it and exit with [`Self::exit_code`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An argument is malformed or cannot be read (payload file, JSON).
    #[error("{0}")]
    BadArgument(String),

    /// The server could not be reached.
    // Transport errors put the useful part ("Connection refused") several
    // causes down.
    #[error("cannot connect to {addr}: {}", crate::report::with_causes(source))]
    Connect {
        /// The address as it was tried.
        addr: String,
        /// What the transport said.
        #[source]
        source: tonic::transport::Error,
    },

    /// The server answered with an error status.
    // Boxed because a Status is a few hundred bytes and would make every
    // `Result<_, ClientError>` that large.
    #[error("{}", describe_status(.0))]
    Status(Box<tonic::Status>),

    /// A response could not be written as JSON.
    #[error("cannot encode the response as JSON: {0}")]
    Json(#[from] serde_json::Error),

    /// Standard output could not be written.
    #[error("cannot write the output: {0}")]
    Output(#[source] std::io::Error),

    /// `watch` saw the job end in this state, not `succeeded`.
    #[error("the job ended {0}")]
    NotSucceeded(String),
}

impl ClientError {
    /// The process exit code for this error, so that a script can tell
    /// "no such job" from "server down": 2 when the input was wrong
    /// (including a server `INVALID_ARGUMENT`), as clap does for usage
    /// errors; 3 when a watched job ended other than `succeeded`; 4 for
    /// `NOT_FOUND`; 75 (`EX_TEMPFAIL`, what `intray work` takes from a
    /// command as "retry it") when trying again later may succeed: the
    /// server unreachable (but not a TLS handshake that failed: a
    /// certificate will not be trusted later either), the connection lost
    /// during the call, `UNAVAILABLE`, or `RESOURCE_EXHAUSTED` that says
    /// when to come back (a full queue, a rate limit; a request too large
    /// says nothing, and would be refused again); 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::BadArgument(_) => 2,
            ClientError::NotSucceeded(_) => 3,
            ClientError::Connect { source, .. } if !is_tls_failure(source) => 75,
            ClientError::Status(status) => match status.code() {
                Code::InvalidArgument => 2,
                Code::NotFound => 4,
                Code::Unavailable => 75,
                Code::ResourceExhausted if status.get_details_retry_info().is_some() => 75,
                Code::Unknown if connection_lost(status) => 75,
                _ => 1,
            },
            _ => 1,
        }
    }

    /// The gRPC status, when the server answered with an error.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            ClientError::Status(status) => Some(status),
            _ => None,
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(status: tonic::Status) -> Self {
        ClientError::Status(Box::new(status))
    }
}

/// The canonical name of a gRPC code, as grpcurl and the specs write it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `CODE: message`, then the rich details a user can act on: the fields a
/// `BadRequest` names and the delay a `RetryInfo` asks for.
fn describe_status(status: &tonic::Status) -> String {
    let mut text = format!("{}: {}", code_name(status.code()), status.message());
    let details = status.get_error_details();
    if let Some(bad_request) = details.bad_request() {
        for violation in &bad_request.field_violations {
            let line = format!("{}: {}", violation.field, violation.description);
            // Servers often put the first violation in the message too.
            if line != status.message() {
                let _ = write!(text, "\n  {line}");
            }
        }
    }
    if let Some(delay) = details.retry_info().and_then(|info| info.retry_delay) {
        let _ = write!(
            text,
            "\n  retry after {}",
            super::print::format_duration(delay)
        );
    }
    // A transport failure arrives as a Status whose message hides the cause
    // ("transport error"); the source chain says what actually went wrong.
    if let Some(source) = std::error::Error::source(status) {
        let _ = write!(text, " ({})", crate::report::with_causes(source));
    }
    text
}

/// Whether `error` or one of its sources is a TLS failure (rustls's, which
/// the transport wraps in an I/O error).
/// Whether `status` was made here from a connection the server reset or
/// closed during the call (a server that crashed): its source chain ends
/// in such an I/O error. A broken pipe is not counted: a TLS 1.3 server
/// refusing a client without a certificate, which trying again cannot
/// mend, ends the connection that way too.
fn connection_lost(status: &tonic::Status) -> bool {
    use std::io::ErrorKind;
    let mut next = std::error::Error::source(status);
    while let Some(error) = next {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        next = error.source();
    }
    false
}

fn is_tls_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        let inner = error
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|inner| inner as &(dyn std::error::Error + 'static));
        if error.is::<tokio_rustls::rustls::Error>()
            || inner.is_some_and(|inner| inner.is::<tokio_rustls::rustls::Error>())
        {
            return true;
        }
        next = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic_types::{ErrorDetails, FieldViolation};

    use super::*;

    #[test]
    fn invalid_argument_lists_the_field_violations() {
        let details = ErrorDetails::with_bad_request(vec![
            FieldViolation::new("queue", "must not be empty"),
            FieldViolation::new("max_attempts", "must be 1..=100"),
        ]);
        let status =
            tonic::Status::with_error_details(Code::InvalidArgument, "invalid job", details);
        let error = ClientError::from(status);
        assert_eq!(
            error.to_string(),
            "INVALID_ARGUMENT: invalid job\n  queue: must not be empty\n  max_attempts: must be 1..=100"
        );
        assert_eq!(error.exit_code(), 2);

        let details = ErrorDetails::with_bad_request_violation("queue", "must not be empty");
        let status = tonic::Status::with_error_details(
            Code::InvalidArgument,
            "queue: must not be empty",
            details,
        );
        assert_eq!(
            ClientError::from(status).to_string(),
            "INVALID_ARGUMENT: queue: must not be empty"
        );
    }

    #[test]
    fn exit_codes_tell_a_missing_job_from_a_server_away() {
        let code = |code| ClientError::from(tonic::Status::new(code, "x")).exit_code();
        assert_eq!(code(Code::NotFound), 4);
        assert_eq!(code(Code::Unavailable), 75);
        assert_eq!(code(Code::PermissionDenied), 1);
        assert_eq!(code(Code::FailedPrecondition), 1);
    }

    #[test]
    fn resource_exhausted_says_when_to_retry() {
        let details = ErrorDetails::with_retry_info(Some(Duration::from_secs(5)));
        let status =
            tonic::Status::with_error_details(Code::ResourceExhausted, "queue is full", details);
        let error = ClientError::from(status);
        assert_eq!(
            error.to_string(),
            "RESOURCE_EXHAUSTED: queue is full\n  retry after 5s"
        );
        assert_eq!(error.exit_code(), 75, "worth trying again later");
        let too_large = ClientError::from(tonic::Status::resource_exhausted(
            "the request is larger than the server accepts",
        ));
        assert_eq!(
            too_large.exit_code(),
            1,
            "the same request cannot pass later"
        );
    }

    #[test]
    fn a_connection_lost_mid_call_is_worth_trying_again() {
        let lost = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset",
        )));
        assert_eq!(lost.code(), Code::Unknown);
        assert_eq!(ClientError::from(lost).exit_code(), 75);
        let refused = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "stream closed because of a broken pipe",
        )));
        assert_eq!(
            ClientError::from(refused).exit_code(),
            1,
            "as a TLS alert comes"
        );
        let sent = tonic::Status::unknown("the server's own");
        assert_eq!(ClientError::from(sent).exit_code(), 1);
    }

    #[test]
    fn plain_status_is_code_and_message() {
        let error = ClientError::from(tonic::Status::not_found("job not found"));
        assert_eq!(error.to_string(), "NOT_FOUND: job not found");
        assert_eq!(error.exit_code(), 4);
        assert_eq!(ClientError::BadArgument("x".into()).exit_code(), 2);
    }
}
