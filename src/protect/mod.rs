//! Protecting the server from its callers: a per-caller rate limit, a
//! per-call timeout and concurrency limit that spare long-polls and
//! streams, and a count of a batch's items before it is decoded. (Message
//! size limits are set per service in `server.rs`.)

pub mod batch;
pub mod decode;
pub mod limit;
pub mod rate;

pub use batch::BatchCountLayer;
pub use decode::DecodeErrorsLayer;
pub use limit::CallLimitLayer;
pub use rate::{RateLimitLayer, RateLimiter};

use std::time::Duration;

/// Why a call was cut short by a protection layer.
#[derive(Debug, thiserror::Error)]
pub enum ProtectError {
    /// The caller's token bucket is empty.
    #[error("rate limit exceeded; retry in {}ms", retry_after.as_millis())]
    RateLimited {
        /// When the next call will be allowed.
        retry_after: Duration,
    },
    /// The call ran longer than the server allows.
    #[error("the call exceeded the server's {}s limit", limit.as_secs_f64())]
    Timeout {
        /// The limit that applied to this method.
        limit: Duration,
    },
}
