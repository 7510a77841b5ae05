//! `POST /hooks/{source}`: a provider's webhook becomes a job.
//!
//! The order of the checks is the contract: an unknown source is `404`, a
//! body over the limit `413` (before it is read when its declared length
//! says so), `503` while [`INGRESS_READS`] bodies are being read, `408` for
//! a body that does not arrive in time, a bad or stale Standard Webhooks
//! signature `401` (checked over the raw body bytes before anything parses
//! them), malformed JSON after a valid signature `400`. Then the body is submitted
//! as the payload of a job of the source's queue and kind, keyed by the
//! source and the `webhook-id` ([`idempotency_key`]), so that a repeated
//! delivery finds the first job (`200`, nothing created). The handler only verifies and
//! submits: the work happens in a worker. Sources are those of the webhooks
//! file as it is when the request arrives (it is reloaded while the server
//! runs).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tonic::{Code, Request};

use super::body;
use super::error::HttpError;
use crate::api::{FromIngress, JobsApi};
use crate::auth::{Identity, Role};
use crate::config::webhook_source::WebhookKeysSource;
use crate::config::webhooks::IngressSource;
use crate::domain::validate::INGRESS_KEY_PREFIX;
use crate::domain::webhook::VerifyError;
use crate::pb;
use crate::pb::job_service_server::JobService;
use crate::telemetry::Metrics;

/// Most webhook bodies read at once per replica; more are answered `503`
/// with `Retry-After`, which providers retry.
pub const INGRESS_READS: usize = 256;

/// What the ingress route needs.
pub struct Ingress {
    keys: Arc<WebhookKeysSource>,
    max_body_bytes: usize,
    jobs: Arc<JobsApi>,
    metrics: Arc<Metrics>,
    reading: Arc<Semaphore>,
}

impl Ingress {
    /// An ingress for the sources in `keys`, submitting into `jobs`.
    pub fn new(
        keys: Arc<WebhookKeysSource>,
        max_body_bytes: usize,
        jobs: Arc<JobsApi>,
        metrics: Arc<Metrics>,
    ) -> Ingress {
        Ingress {
            keys,
            max_body_bytes,
            jobs,
            metrics,
            reading: Arc::new(Semaphore::new(INGRESS_READS)),
        }
    }
}

/// Whether reading a body failed on its size limit, rather than on a
/// broken upload (a malformed chunk, a cut connection), which is not the
/// provider's body being too large.
fn over_limit(err: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// A plain `{error}` answer: the sender is a provider, not an intray client.
fn refuse(status: StatusCode, error: &str) -> Response {
    body::json(status, &json!({ "error": error }))
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, VerifyError> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .ok_or(VerifyError::Headers)
}

/// `POST /hooks/{source}`.
pub async fn receive(
    State(ingress): State<Arc<Ingress>>,
    Path(source): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let keys = ingress.keys.current();
    let known = keys.sources.get(&source);
    let response = handle(&ingress, known, &source, &headers, body).await;
    // Unknown names are not labels: a scanner must not grow the metric.
    let label = if known.is_some() { source.as_str() } else { "" };
    ingress
        .metrics
        .webhook_ingress(label, response.status().as_u16());
    response
}

async fn handle(
    ingress: &Ingress,
    source: Option<&IngressSource>,
    name: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let Some(source) = source else {
        return refuse(StatusCode::NOT_FOUND, "unknown webhook source");
    };
    // A declared length over the limit is refused before anything is read.
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > ingress.max_body_bytes as u64) {
        return HttpError::TooLarge {
            limit: ingress.max_body_bytes,
        }
        .into_response();
    }
    // Bodies being read are held in memory: a bounded number at once, so
    // that clients stalling mid-upload cannot pile them up.
    let Ok(_reading) = ingress.reading.clone().try_acquire_owned() else {
        let mut busy = refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many webhooks being received; retry shortly",
        );
        busy.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
        return busy;
    };
    let body = match axum::body::to_bytes(body, ingress.max_body_bytes).await {
        Ok(body) => body,
        Err(err) if over_limit(&err) => {
            return HttpError::TooLarge {
                limit: ingress.max_body_bytes,
            }
            .into_response();
        }
        Err(err) if let Some(limit) = super::deadline::timed_out(&err) => {
            return HttpError::BodyTimedOut { limit }.into_response();
        }
        Err(_) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "the request body could not be read",
            );
        }
    };
    let verified = (|| {
        let id = header(headers, "webhook-id")?;
        let timestamp = header(headers, "webhook-timestamp")?;
        let signatures = header(headers, "webhook-signature")?;
        let now = chrono::Utc::now().timestamp();
        source
            .secret
            .verify(id, timestamp, signatures, &body, now)
            .map(|()| id)
    })();
    let id = match verified {
        Ok(id) => id.to_owned(),
        Err(err) => {
            tracing::info!(source = name, error = %err, "webhook refused");
            return refuse(StatusCode::UNAUTHORIZED, "invalid webhook signature");
        }
    };
    let payload: pbjson_types::Value = match serde_json::from_slice(&body) {
        Ok(payload) => payload,
        Err(err) => {
            // A payload's numbers are doubles (google.protobuf.Value): an
            // integer literal from 2^53 to the 64-bit range would not
            // survive, and is refused, not rounded. Said apart from
            // malformed JSON, so that the sender knows what to change.
            let why = if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok() {
                format!(
                    "the body is JSON that a job payload cannot hold: {}",
                    crate::domain::json::payload_reason(&err.to_string())
                )
            } else {
                "the body is not valid JSON".to_owned()
            };
            return refuse(StatusCode::BAD_REQUEST, &why);
        }
    };
    let key = idempotency_key(name, &id);
    let mut request = Request::new(pb::SubmitRequest {
        queue: source.queue.clone(),
        kind: source.kind.clone(),
        payload: Some(payload.clone()),
        idempotency_key: key.clone(),
        ..Default::default()
    });
    request.extensions_mut().insert(FromIngress);
    request.extensions_mut().insert(Identity {
        tenant: source.tenant.clone(),
        roles: [Role::Producer].into_iter().collect(),
        principal: format!("hook:{name}"),
        token: None,
    });
    match ingress.jobs.submit(request).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            let job_id = answer.job.map(|j| j.id).unwrap_or_default();
            body::json(
                StatusCode::OK,
                &json!({ "job_id": job_id, "created": answer.created }),
            )
        }
        // The same webhook-id with another body is not a repeat; with the
        // same body it is, though the source's queue or kind changed since.
        Err(status) if status.code() == Code::AlreadyExists => {
            match ingress
                .jobs
                .ingress_original(&source.tenant, &key, payload)
                .await
            {
                Ok(Some(original)) => body::json(
                    StatusCode::OK,
                    &json!({ "job_id": original.id, "created": false }),
                ),
                Ok(None) => refuse(
                    StatusCode::CONFLICT,
                    "this webhook-id was already received with another body",
                ),
                Err(status) => HttpError::Rpc(status).into_response(),
            }
        }
        Err(status) => HttpError::Rpc(status).into_response(),
    }
}

/// What starts the key of a message whose id is stored as its hash.
const HASHED: &str = "sha256:";

/// The idempotency key of a message: its `webhook-id` within its source.
/// A provider sends one message to each endpoint under one id, so two
/// sources of a tenant each make their job, a repeat to either is a repeat,
/// and the ids do not meet the tenant's own keys. `/` cannot occur in a
/// source's name, so the key names one source and one id. An id too long
/// for the key's 256 characters goes in as its SHA-256, as
/// `sha256:{hex}`; so does an id that starts with `sha256:` itself, which
/// would otherwise meet the hashed form of another, longer id.
fn idempotency_key(source: &str, id: &str) -> String {
    let key = format!("{INGRESS_KEY_PREFIX}{source}/{id}");
    if key.chars().count() <= 256 && !id.starts_with(HASHED) {
        key
    } else {
        format!(
            "{INGRESS_KEY_PREFIX}{source}/{HASHED}{}",
            hex::encode(Sha256::digest(id.as_bytes()))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_the_source_and_fit_the_limit() {
        assert_eq!(idempotency_key("orders", "msg_1"), "hook/orders/msg_1");
        assert_ne!(
            idempotency_key("a:b", "c"),
            idempotency_key("a", "b:c"),
            "the separator cannot occur in a source's name"
        );
        let long = "x".repeat(300);
        let key = idempotency_key(&"s".repeat(128), &long);
        assert!(key.chars().count() <= 256, "{key}");
        assert_ne!(key, idempotency_key(&"s".repeat(128), &"y".repeat(300)));
        let long = "i".repeat(300);
        let hashed = idempotency_key("s", &long);
        let literal = hashed.trim_start_matches("hook/s/");
        assert!(literal.starts_with(HASHED), "{hashed}");
        assert_ne!(
            idempotency_key("s", literal),
            hashed,
            "an id that spells another's hash is not that id"
        );
    }
}
