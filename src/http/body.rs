//! Request and response bodies in the proto3 JSON mapping (the pbjson serde
//! impls of the generated types).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::HttpError;
use crate::domain::validate::ValidationError;

/// Largest request body: the gRPC port's message limit.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// The body, or why it could not be read.
pub fn bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, HttpError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            HttpError::TooLarge {
                limit: MAX_BODY_BYTES,
            }
        } else {
            ValidationError::new("body", "could not be read").into()
        }
    })
}

/// Reads a message from its JSON; an empty body is the message with every
/// field unset, as an empty protobuf message is.
pub fn parse<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, HttpError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        ValidationError::new("body", format!("not valid proto3 JSON for this call: {e}")).into()
    })
}

/// A JSON answer.
pub fn json<T: Serialize>(status: StatusCode, message: &T) -> Response {
    match serde_json::to_vec(message) {
        Ok(bytes) => (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(err) => {
            tracing::error!(error = %err, "cannot encode a response as JSON");
            HttpError::Rpc(tonic::Status::internal("internal error")).into_response()
        }
    }
}
