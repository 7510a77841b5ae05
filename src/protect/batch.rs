//! Counts a batch call's items before tonic decodes them. An empty item
//! is two bytes of protobuf, so a 16 MiB `SubmitBatch` of them decodes into
//! some eight million messages, gigabytes of memory, before the call's own
//! check of 1..=1000 items refuses it. This layer reads the encoded
//! message's top-level fields (no item is decoded) and refuses more than
//! [`MAX_BATCH`] items with `INVALID_ARGUMENT`. The message is buffered
//! whole first, as tonic would buffer it for a unary call anyway.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tower::{Layer, Service};

use crate::domain::validate::{MAX_BATCH, ValidationError};

/// The batch methods and the field number of their repeated items.
const COUNTED: &[(&str, u64, &str)] = &[
    ("/intray.v1.JobService/SubmitBatch", 1, "jobs"),
    ("/intray.v1.WorkerService/CompleteBatch", 1, "items"),
    ("/intray.v1.WorkerService/CompleteAndLease", 1, "items"),
];

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// Adds [`BatchCount`] to a service.
#[derive(Clone, Copy, Debug)]
pub struct BatchCountLayer {
    /// Largest message tonic decodes; a longer body is left to it.
    pub max_message: usize,
}

impl<S> Layer<S> for BatchCountLayer {
    type Service = BatchCount<S>;

    fn layer(&self, inner: S) -> BatchCount<S> {
        BatchCount {
            inner,
            max_message: self.max_message,
        }
    }
}

/// Refuses batch calls with too many items before they are decoded.
#[derive(Clone, Debug)]
pub struct BatchCount<S> {
    inner: S,
    max_message: usize,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ResBody> Service<Request<Body>> for BatchCount<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let counted = COUNTED
            .iter()
            .find(|(path, _, _)| *path == request.uri().path());
        let Some(&(_, field, name)) = counted else {
            return Box::pin(self.inner.call(request));
        };
        // The service polled ready serves this call; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limit = self.max_message.saturating_add(PREFIX);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = match Limited::new(body, limit).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => {
                    let refused =
                        Status::resource_exhausted("the request is larger than the server accepts");
                    return Ok(refused.into_http());
                }
                Err(_) => return Ok(Status::cancelled("the request was cut off").into_http()),
            };
            if message_items(&bytes, field).is_some_and(|n| n > MAX_BATCH) {
                let refused = ValidationError::new(name, "send 1..=1000 items");
                return Ok(Status::from(refused).into_http());
            }
            inner
                .call(Request::from_parts(parts, Body::new(Full::new(bytes))))
                .await
        })
    }
}

/// The occurrences of `field` among the top-level fields of the first
/// message of a gRPC body; `None` when the body is compressed or does not
/// parse (tonic then answers it).
fn message_items(body: &[u8], field: u64) -> Option<usize> {
    let (&compressed, rest) = body.split_first()?;
    if compressed != 0 {
        return None;
    }
    let length = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    let mut message = rest.get(4..)?.get(..usize::try_from(length).ok()?)?;
    let mut count = 0;
    while !message.is_empty() {
        let key = varint(&mut message)?;
        match key & 7 {
            0 => {
                varint(&mut message)?;
            }
            1 => message = message.get(8..)?,
            2 => {
                let len = usize::try_from(varint(&mut message)?).ok()?;
                message = message.get(len..)?;
                if key >> 3 == field {
                    count += 1;
                }
            }
            5 => message = message.get(4..)?,
            _ => return None,
        }
    }
    Some(count)
}

/// Reads a base-128 varint off the front of `bytes`.
fn varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            *bytes = &bytes[i + 1..];
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::pb;

    fn framed(message: &impl Message) -> Vec<u8> {
        let encoded = message.encode_to_vec();
        let mut body = vec![0];
        body.extend(u32::try_from(encoded.len()).expect("small").to_be_bytes());
        body.extend(encoded);
        body
    }

    #[test]
    fn items_are_counted_without_decoding_them() {
        let batch = pb::SubmitBatchRequest {
            jobs: vec![
                pb::SubmitRequest {
                    queue: "q".into(),
                    kind: "k".into(),
                    priority: -5,
                    ..Default::default()
                };
                3
            ],
        };
        assert_eq!(message_items(&framed(&batch), 1), Some(3));
        let empty = pb::SubmitBatchRequest {
            jobs: vec![pb::SubmitRequest::default(); 1001],
        };
        assert_eq!(message_items(&framed(&empty), 1), Some(1001));
        let outcomes = pb::CompleteAndLeaseRequest {
            items: vec![pb::CompleteRequest::default(); 2],
            lease: Some(pb::LeaseRequest {
                max_jobs: Some(7),
                ..Default::default()
            }),
        };
        assert_eq!(message_items(&framed(&outcomes), 1), Some(2));
    }

    #[test]
    fn what_does_not_parse_is_left_to_tonic() {
        let body = framed(&pb::SubmitBatchRequest {
            jobs: vec![pb::SubmitRequest::default(); 2],
        });
        assert_eq!(message_items(&body[..body.len() - 1], 1), None, "cut short");
        let mut compressed = body.clone();
        compressed[0] = 1;
        assert_eq!(message_items(&compressed, 1), None);
        assert_eq!(message_items(&[], 1), None);
    }
}
