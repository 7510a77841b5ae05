//! `GET /api/v1/jobs/{id}/events`: a job's events as server-sent events,
//! fed by the same `WatchJob` code as the gRPC stream.
//!
//! Each event's `id:` is its sequence, so the `Last-Event-ID` a browser
//! sends when it reconnects is exactly `WatchJob`'s `after_sequence`: the
//! stream resumes with no gap and no duplicate. The stream ends after the
//! terminal event, or earlier when the server shuts down (with no error
//! event: the client reconnects as after a lost connection), or with a
//! `stream-error` event when a reload revokes the caller's token (its
//! reconnect is then refused `401`). A reconnect after the terminal event
//! gets `204 No Content`, which tells an `EventSource` to stop
//! reconnecting.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::error::HttpError;
use super::gateway::{Gateway, Method};
use super::query;
use crate::pb;
use crate::pb::job_service_server::JobService;

/// The header a reconnecting `EventSource` sends.
const LAST_EVENT_ID: &str = "last-event-id";
/// The event name of a failure after the stream started.
const ERROR_EVENT: &str = "stream-error";

/// Where the stream starts: after `Last-Event-ID` when sent, else after
/// `?after_sequence=`, else from the first event.
fn resume_point(headers: &HeaderMap, raw: Option<&str>) -> Result<u64, HttpError> {
    let from_query = query::after_sequence(raw)?;
    match headers.get(LAST_EVENT_ID) {
        Some(value) => {
            let text = value.to_str().unwrap_or_default();
            Ok(query::sequence("Last-Event-ID", text)?)
        }
        None => Ok(from_query.unwrap_or(0)),
    }
}

/// One event as SSE: `id:` its sequence, `data:` the `JobEvent` JSON.
fn to_sse(item: Result<pb::JobEvent, tonic::Status>) -> Event {
    let item = item.map_err(HttpError::from).and_then(|event| {
        crate::domain::json::to_string_whole(&event)
            .map(|data| (event.sequence, data))
            .map_err(|_| HttpError::Rpc(tonic::Status::internal("internal error")))
    });
    match item {
        Ok((sequence, data)) => Event::default().id(sequence.to_string()).data(data),
        Err(err) => Event::default()
            .event(ERROR_EVENT)
            .data(err.body().0.to_string()),
    }
}

/// Whether `item` ends a stream that shutdown interrupted. Such a stream
/// just closes, with no error event: an `EventSource` reconnects by itself
/// with `Last-Event-ID`, and the dashboard's reader after a second.
fn interrupted(item: &Result<pb::JobEvent, tonic::Status>) -> bool {
    matches!(item, Err(status) if crate::api::is_watch_interrupted(status))
}

/// Opens the stream; an unknown job or a refused caller is answered as any
/// other call, before the stream starts.
pub async fn events(
    State(gateway): State<Arc<Gateway>>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    gateway.permit(Method::WatchJob, &headers)?;
    let after_sequence = resume_point(&headers, raw.as_deref())?;
    // The watch first: it draws the caller's token, and a caller over its
    // rate gets no read of the job.
    let mut stream = gateway
        .watch(
            &headers,
            pb::WatchJobRequest {
                id: id.clone(),
                after_sequence,
            },
        )
        .await?;
    let finished = after_sequence > 0 && is_finished(&gateway, &headers, &id).await?;
    // A finished job's stream ends as soon as its stored events are read,
    // so waiting for the first one is short.
    let first = if finished {
        match stream.next().await {
            None => return Ok(StatusCode::NO_CONTENT.into_response()),
            Some(item) => Some(item),
        }
    } else {
        None
    };
    let events = futures::stream::iter(first)
        .chain(stream)
        .take_while(|item| futures::future::ready(!interrupted(item)))
        .map(|item| Ok::<_, Infallible>(to_sse(item)));
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// Whether the job is in a terminal state: only then can a resumed stream
/// be empty. Asked on reconnects only; a first connection always has the
/// job's first event to send.
async fn is_finished(gateway: &Gateway, headers: &HeaderMap, id: &str) -> Result<bool, HttpError> {
    let request = pb::GetJobRequest { id: id.to_owned() };
    let job = gateway
        .look_up(Method::Get, headers, request, |jobs, r| async move {
            jobs.get(r).await
        })
        .await?;
    Ok(matches!(
        job.state(),
        pb::JobState::Succeeded
            | pb::JobState::Failed
            | pb::JobState::Cancelled
            | pb::JobState::Expired
    ))
}
