//! A token bucket per caller (per token with authentication, per tenant
//! without), answering `RESOURCE_EXHAUSTED` with a `RetryInfo` when empty.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::{Either, Ready, ready};
use tonic::Status;
use tonic::codegen::http::{Request, Response};
use tower::{Layer, Service};

use super::ProtectError;
use crate::auth::Identity;
use crate::config::RateLimit;

/// Above this many callers, buckets that are full again (idle callers) are
/// dropped, so that open mode's caller-chosen tenant names cannot grow the
/// map without bound.
const PRUNE_ABOVE: usize = 10_000;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The buckets of every caller.
#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// A limiter with `limit` for each caller.
    pub fn new(limit: RateLimit) -> RateLimiter {
        RateLimiter {
            limit,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn refill(&self, bucket: &mut Bucket, now: Instant) {
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens =
            (bucket.tokens + elapsed * self.limit.per_second).min(f64::from(self.limit.burst));
        bucket.at = now;
    }

    /// Takes one call from `key`'s bucket at `now`, or says how long until
    /// one is there.
    pub fn check(&self, key: &str, now: Instant) -> Result<(), Duration> {
        let burst = f64::from(self.limit.burst);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() > PRUNE_ABOVE {
            buckets.retain(|_, b| {
                let idle = now.saturating_duration_since(b.at).as_secs_f64();
                b.tokens + idle * self.limit.per_second < burst
            });
        }
        let bucket = buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        self.refill(bucket, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            let missing = 1.0 - bucket.tokens;
            Err(Duration::from_secs_f64(missing / self.limit.per_second))
        }
    }
}

/// Wraps services in [`RateLimitService`]; `None` limits nothing.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    limiter: Option<Arc<RateLimiter>>,
}

impl RateLimitLayer {
    /// A layer taking calls from `limiter`'s buckets, or limiting nothing.
    /// The HTTP face shares the limiter, so a caller has one budget
    /// whichever port it calls.
    pub fn new(limiter: Option<Arc<RateLimiter>>) -> RateLimitLayer {
        RateLimitLayer { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> RateLimitService<S> {
        RateLimitService {
            inner,
            limiter: self.limiter.clone(),
        }
    }
}

/// Refuses a caller's calls beyond its rate. Needs the [`Identity`] the auth
/// layer puts into the extensions: calls without one (health, reflection)
/// are not limited.
#[derive(Clone, Debug)]
pub struct RateLimitService<S> {
    inner: S,
    limiter: Option<Arc<RateLimiter>>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Default,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response<ResBody>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if let (Some(limiter), Some(identity)) = (&self.limiter, req.extensions().get::<Identity>())
            && let Err(retry_after) = limiter.check(&identity.principal, Instant::now())
        {
            tracing::debug!(principal = %identity.principal, "rate limited");
            let err = ProtectError::RateLimited { retry_after };
            return Either::Left(ready(Ok(Status::from(err).into_http())));
        }
        Either::Right(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_burst_then_refills() {
        let limiter = RateLimiter::new(RateLimit {
            per_second: 10.0,
            burst: 3,
        });
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(limiter.check("a", t0).is_ok());
        }
        let wait = limiter.check("a", t0).expect_err("bucket empty");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(100),
            "{wait:?}"
        );
        assert!(limiter.check("b", t0).is_ok(), "callers are separate");
        assert!(
            limiter.check("a", t0 + Duration::from_millis(100)).is_ok(),
            "one refilled"
        );
        assert!(limiter.check("a", t0 + Duration::from_millis(100)).is_err());
        for _ in 0..3 {
            assert!(
                limiter.check("a", t0 + Duration::from_secs(10)).is_ok(),
                "refill caps at burst"
            );
        }
        assert!(limiter.check("a", t0 + Duration::from_secs(10)).is_err());
    }
}
