//! A request body must arrive within a time of its headers
//! (`--http-body-timeout`). The port faces webhook providers and anyone
//! else: a client that sends part of a body and stops would otherwise hold
//! its connection, and the part read so far, for ever (the header timeout
//! of [`super::listener`] ends at the headers).

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};
use tokio::time::Sleep;

/// Gives the request's body a deadline `limit` after now.
pub async fn read_within(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let body = Body::new(Deadline {
        inner: body,
        limit,
        expiry: Box::pin(tokio::time::sleep(limit)),
    });
    next.run(Request::from_parts(parts, body)).await
}

/// The limit a body missed, if reading it failed because its deadline
/// passed.
pub fn timed_out(err: &(dyn Error + 'static)) -> Option<Duration> {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(BodyTimedOut(limit)) = e.downcast_ref::<BodyTimedOut>() {
            return Some(*limit);
        }
        cause = e.source();
    }
    None
}

/// The error of a body whose deadline passed, and the limit.
#[derive(Debug)]
struct BodyTimedOut(Duration);

impl fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request body did not arrive within {}",
            humantime::format_duration(self.0)
        )
    }
}

impl Error for BodyTimedOut {}

/// A body that fails once `expiry` (`limit` after its headers) has passed.
struct Deadline {
    inner: Body,
    limit: Duration,
    expiry: Pin<Box<Sleep>>,
}

impl HttpBody for Deadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match this.expiry.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(BodyTimedOut(this.limit).into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use http_body_util::BodyExt;

    use super::*;

    const LIMIT: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_fails_at_its_deadline() {
        let part = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"part"))]);
        let body = Deadline {
            inner: Body::from_stream(part.chain(futures::stream::pending())),
            limit: LIMIT,
            expiry: Box::pin(tokio::time::sleep(LIMIT)),
        };
        let started = tokio::time::Instant::now();
        let err = body.collect().await.expect_err("the rest never comes");
        assert_eq!(timed_out(err.as_ref()), Some(LIMIT), "{err}");
        assert_eq!(started.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_whole_body_is_read() {
        let body = Deadline {
            inner: Body::from("whole"),
            limit: LIMIT,
            expiry: Box::pin(tokio::time::sleep(LIMIT)),
        };
        let read = body.collect().await.expect("read").to_bytes();
        assert_eq!(read, Bytes::from_static(b"whole"));
    }
}
