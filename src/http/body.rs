//! Request and response bodies in the proto3 JSON mapping (the pbjson serde
//! impls of the generated types).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess,
    SeqAccess, Visitor,
};

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
        } else if let Some(limit) = super::deadline::timed_out(&rejection) {
            HttpError::BodyTimedOut { limit }
        } else {
            ValidationError::new("body", "could not be read").into()
        }
    })
}

/// Reads a message from its JSON; an empty body is the message with every
/// field unset, as an empty protobuf message is, and a message field that
/// is `null` is one left out, as proto3 JSON reads it (see
/// [`super::nulls`], tried only for a body the plain decoder refuses, so
/// that a body without nulls is read once). A body refused both ways is
/// answered with the lenient reading's reason, naming the field whose
/// value was wrong: the plain one may be a `null` that is allowed.
pub fn parse<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, HttpError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .or_else(|_| super::nulls::from_slice(body))
        .map_err(|refused| {
            // pbjson reads a number as "a number or a string" with serde's
            // untagged enum, whose error says nothing of numbers.
            let reason = crate::domain::json::payload_reason(&refused.error.to_string()).replace(
                "data did not match any variant of untagged enum Content",
                "not a number this field can hold",
            );
            let field = refused.field.as_deref().unwrap_or("body");
            ValidationError::new(
                field,
                format!("not valid proto3 JSON for this call: {reason}"),
            )
            .into()
        })
}

/// Refuses a body whose top-level array `field` holds more than `max`
/// items, before any item is built: a 16 MiB body of empty items (`{},`)
/// would decode into millions of messages, gigabytes of memory, before the
/// call's own count check. A body that is not an object passes, for
/// [`parse`] to refuse.
pub fn at_most(body: &[u8], field: &'static str, max: usize) -> Result<(), HttpError> {
    let mut reader = serde_json::Deserializer::from_slice(body);
    match serde::Deserializer::deserialize_any(&mut reader, Counting { field, max }) {
        Err(e) if e.is_data() && e.to_string().starts_with(TOO_MANY) => {
            Err(ValidationError::new(field, format!("send at most {max} items")).into())
        }
        _ => Ok(()),
    }
}

/// The start of [`Counting`]'s error, which tells it from JSON errors.
const TOO_MANY: &str = "too many items";

/// Walks an object, skipping every value but `field`'s array, whose items
/// it counts (skipped too) up to `max`.
struct Counting {
    field: &'static str,
    max: usize,
}

impl<'de> Visitor<'de> for Counting {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == self.field {
                map.next_value_seed(CountingItems(self.max))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Counts an array's items up to a limit; anything else is skipped.
struct CountingItems(usize);

impl<'de> DeserializeSeed<'de> for CountingItems {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CountingItems {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut n = 0;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            n += 1;
            if n > self.0 {
                return Err(A::Error::custom(TOO_MANY));
            }
        }
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// A JSON answer, whole numbers as integers (a payload's `5`, held as a
/// double by `google.protobuf.Value`, not `5.0`).
pub fn json<T: Serialize>(status: StatusCode, message: &T) -> Response {
    json_within(status, message, crate::server::MAX_RESPONSE_BYTES)
}

/// [`json`], refused `OUT_OF_RANGE` past `limit` bytes, as the gRPC port
/// refuses a message past the same limit (a `List` page of large payloads).
fn json_within<T: Serialize>(status: StatusCode, message: &T, limit: usize) -> Response {
    match crate::domain::json::to_vec_whole(message) {
        Ok(bytes) if bytes.len() > limit => HttpError::Rpc(tonic::Status::out_of_range(format!(
            "the answer is {} bytes, over the {limit} bytes a response may have; ask for a smaller page",
            bytes.len()
        )))
        .into_response(),
        Ok(bytes) => (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(err) => {
            tracing::error!(error = %err, "cannot encode a response as JSON");
            HttpError::Rpc(tonic::Status::internal("internal error")).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer past the limit is refused, as the gRPC port refuses a
    /// message past it, not sent whole.
    #[test]
    fn an_answer_past_the_limit_is_refused() {
        let page = serde_json::json!({"jobs": ["x".repeat(100)]});
        let fits = json_within(StatusCode::OK, &page, 1000);
        assert_eq!(fits.status(), StatusCode::OK);
        let over = json_within(StatusCode::OK, &page, 50);
        assert_eq!(over.status(), StatusCode::BAD_REQUEST, "OUT_OF_RANGE");
    }
}
