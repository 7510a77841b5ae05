//! Bounds on calls in time and number: a per-call timeout that gives a
//! long-polling `Lease` its longest wait on top, and a limit on the calls
//! served at once. Long-polls take no slot: an idle worker waits in one
//! for up to a minute, and a fleet of idle workers would otherwise hold
//! every slot while submits queued behind them (their claims are bounded
//! by the coalescer instead). Streams (`WatchJob`, health `Watch`) are not
//! cut and do not hold a slot while they stream: their handlers return the
//! stream at once and the bounds cover only that. Health checks take no
//! slot either: they read a flag in memory, and a probe queued behind
//! calls that wait on a slow database timed out, so Kubernetes took a
//! busy replica for a dead one and restarted it, moving its load onto the
//! others.
//!
//! The slot is taken inside the call's future, under its timeout, so a call
//! waiting for a slot times out like any other (tower's
//! `ConcurrencyLimit` waits in `poll_ready`, outside any timeout).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Semaphore;

use tonic::Status;
use tonic::codegen::http::{Request, Response};
use tower::{Layer, Service};

use super::ProtectError;
use crate::domain::validate::MAX_WAIT;

/// Methods that may legitimately wait for up to [`MAX_WAIT`] before answering.
const LONG_POLLS: &[&str] = &[
    "/intray.v1.WorkerService/Lease",
    "/intray.v1.WorkerService/CompleteAndLease",
];

fn is_long_poll(path: &str) -> bool {
    LONG_POLLS.contains(&path)
}

/// Calls served without a slot: long-polls and health checks.
fn takes_no_slot(path: &str) -> bool {
    is_long_poll(path) || path.starts_with("/grpc.health.v1.Health/")
}

/// The limit for a method: `base`, plus [`MAX_WAIT`] for long-polls.
pub fn limit_for(path: &str, base: Duration) -> Duration {
    if is_long_poll(path) {
        base + MAX_WAIT
    } else {
        base
    }
}

/// Wraps services in [`CallLimit`].
#[derive(Clone, Debug)]
pub struct CallLimitLayer {
    base: Duration,
    slots: Arc<Semaphore>,
}

impl CallLimitLayer {
    /// Calls end after `base` (long-polls after `base` plus their longest
    /// wait); at most `concurrency` run at once, the others wait.
    pub fn new(base: Duration, concurrency: usize) -> CallLimitLayer {
        CallLimitLayer {
            base,
            slots: Arc::new(Semaphore::new(concurrency.max(1))),
        }
    }

    /// The slots of the limit, for the HTTP face to take from too: one
    /// limit for both ports.
    pub fn slots(&self) -> Arc<Semaphore> {
        Arc::clone(&self.slots)
    }
}

impl<S> Layer<S> for CallLimitLayer {
    type Service = CallLimit<S>;

    fn layer(&self, inner: S) -> CallLimit<S> {
        CallLimit {
            inner,
            base: self.base,
            slots: Arc::clone(&self.slots),
        }
    }
}

/// Answers `DEADLINE_EXCEEDED` when a call (its wait for a slot included)
/// takes longer than its limit; dropping the handler's future rolls back
/// its open transaction.
#[derive(Clone, Debug)]
pub struct CallLimit<S> {
    inner: S,
    base: Duration,
    slots: Arc<Semaphore>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for CallLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Default,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let limit = limit_for(req.uri().path(), self.base);
        let slots = (!takes_no_slot(req.uri().path())).then(|| Arc::clone(&self.slots));
        // tonic's handlers do their work when polled, so holding the
        // future until a slot is free is what limits the work.
        let call = self.inner.call(req);
        Box::pin(async move {
            let bounded = async move {
                // The semaphore is never closed, so this cannot fail; were
                // it closed, serving without a slot beats refusing.
                let _slot = match slots {
                    Some(slots) => slots.acquire_owned().await.ok(),
                    None => None,
                };
                call.await
            };
            match tokio::time::timeout(limit, bounded).await {
                Ok(answer) => answer,
                Err(_) => Ok(Status::from(ProtectError::Timeout { limit }).into_http()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_polls_get_their_wait_on_top() {
        let base = Duration::from_secs(30);
        for long_poll in ["Lease", "CompleteAndLease"] {
            assert_eq!(
                limit_for(&format!("/intray.v1.WorkerService/{long_poll}"), base),
                base + MAX_WAIT
            );
        }
        assert_eq!(limit_for("/intray.v1.JobService/Submit", base), base);
    }

    /// A service that answers at once, except calls to `held`, which wait
    /// for the sender to be used or dropped; and the sender.
    fn holding(
        held: &'static str,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tower::util::BoxService<Request<()>, Response<()>, std::convert::Infallible>,
    ) {
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let released = Arc::new(tokio::sync::Mutex::new(Some(released)));
        let inner = tower::service_fn(move |req: Request<()>| {
            let released = Arc::clone(&released);
            async move {
                if req.uri().path() == held {
                    let wait = released.lock().await.take();
                    if let Some(wait) = wait {
                        let _ = wait.await;
                    }
                }
                Ok::<_, std::convert::Infallible>(Response::new(()))
            }
        });
        (release, tower::util::BoxService::new(inner))
    }

    fn call(path: &str) -> Request<()> {
        Request::builder().uri(path).body(()).expect("request")
    }

    #[tokio::test]
    async fn a_waiting_long_poll_holds_no_slot() {
        let (release, inner) = holding("/intray.v1.WorkerService/Lease");
        let layer = CallLimitLayer::new(Duration::from_secs(5), 1);
        let mut service = layer.layer(inner);
        let lease = tokio::spawn(service.call(call("/intray.v1.WorkerService/Lease")));
        tokio::task::yield_now().await;
        // The one slot is free for a submit while the lease waits.
        let submit = service.call(call("/intray.v1.JobService/Submit"));
        tokio::time::timeout(Duration::from_secs(1), submit)
            .await
            .expect("the submit is not held behind the long-poll")
            .expect("answered");
        assert_eq!(layer.slots().available_permits(), 1);
        assert!(!lease.is_finished());
        let _ = release.send(());
        lease.await.expect("joined").expect("answered");
    }

    #[tokio::test]
    async fn a_health_check_is_answered_while_every_slot_is_held() {
        let (release, inner) = holding("/intray.v1.JobService/Submit");
        let layer = CallLimitLayer::new(Duration::from_secs(5), 1);
        let mut service = layer.layer(inner);
        let submit = tokio::spawn(service.call(call("/intray.v1.JobService/Submit")));
        tokio::task::yield_now().await;
        assert_eq!(layer.slots().available_permits(), 0, "the submit holds it");
        let probe = service.call(call("/grpc.health.v1.Health/Check"));
        tokio::time::timeout(Duration::from_secs(1), probe)
            .await
            .expect("the probe is not held behind the submit")
            .expect("answered");
        let _ = release.send(());
        submit.await.expect("joined").expect("answered");
    }
}
