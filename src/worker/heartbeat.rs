//! Keeping a lease alive while its handler runs, and learning from the
//! answers that the job was cancelled or the lease is gone.

use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;

use super::backoff::Backoff;
use super::context::{CancelReason, JobContext};
use super::runner::Shared;
use crate::pb;

/// Progress reports closer together than this share one heartbeat.
const MIN_SPACING: Duration = Duration::from_millis(200);
/// A single heartbeat call may take this long, and no longer than the
/// lease has left.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The last retry of a failing heartbeat comes this long (or a tenth of the
/// lease, if less) before the lease ends.
const LAST_TRY_BEFORE: Duration = Duration::from_secs(1);

/// Heartbeats every `heartbeat_interval` (and at once when progress is
/// reported) until the lease is lost, then fires the context's token with
/// [`CancelReason::LeaseLost`] and returns. A cancel request fires the token
/// too, but heartbeating goes on: the server answers `ABORTED` once it has
/// revoked the lease, which ends the loop.
///
/// The lease also counts as lost when no heartbeat has succeeded for a whole
/// lease, counted from `received` (when the job arrived) or from the last
/// heartbeat that got through: the server may have handed the job to
/// someone else by then. No heartbeat call outlasts that, so a hung one
/// cannot keep the handler running past the lease.
pub(crate) async fn keep_alive(
    shared: &Shared,
    leased: &pb::LeasedJob,
    received: Instant,
    ctx: &JobContext,
) {
    let config = &shared.config;
    let mut held_until = received + config.lease_duration;
    ctx.set_held_until(held_until);
    // From the job's arrival: a next job that waited for its outcome's
    // retries has less of its lease left than a fresh one.
    let mut next = received + config.heartbeat_interval;
    let mut last_sent = Instant::now();
    let mut retry = Backoff::new(Duration::from_millis(200), config.heartbeat_interval);
    // After a failed heartbeat, not before its retry is due: a handler
    // reporting progress per token would otherwise call a server that is
    // down (or limiting its rate) five times a second per job.
    let mut backoff_until = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = ctx.progress_reported() => {
                tokio::time::sleep_until((last_sent + MIN_SPACING).max(backoff_until)).await;
            }
        }
        let progress = ctx.take_progress();
        let mut request = tonic::Request::new(pb::HeartbeatRequest {
            job_id: leased.job_id.clone(),
            lease_token: leased.lease_token.clone(),
            extend_by: None,
            progress: progress.as_ref().map(|(p, _)| *p),
            message: progress.clone().map(|(_, m)| m).unwrap_or_default(),
        });
        let sent_at = Instant::now();
        let left = held_until.saturating_duration_since(sent_at);
        if left.is_zero() {
            tracing::warn!(job_id = %leased.job_id, "no heartbeat got through for a whole lease; treating it as lost");
            ctx.cancel(CancelReason::LeaseLost);
            return;
        }
        request.set_timeout(left.min(CALL_TIMEOUT));
        last_sent = sent_at;
        let mut client = shared.client.clone();
        match client.heartbeat(request).await {
            Ok(response) => {
                retry.reset();
                next = Instant::now() + config.heartbeat_interval;
                let response = response.into_inner();
                // After a cancel the server no longer extends the lease: it
                // ends when it would have, or sooner, at the end of the
                // cancel's grace, which the answer's expiry tells.
                if response.cancel_requested {
                    if let Some(cut) = response
                        .lease_expires_at
                        .and_then(|at| ends_in(at, sent_at))
                    {
                        held_until = held_until.min(cut);
                        ctx.set_held_until(held_until);
                    }
                    if !ctx.is_cancelled() {
                        tracing::info!(job_id = %leased.job_id, "job cancelled; stopping its handler");
                        ctx.cancel(CancelReason::CancelRequested);
                    }
                } else {
                    held_until = sent_at + config.lease_duration;
                    ctx.set_held_until(held_until);
                }
            }
            // FAILED_PRECONDITION: the job is no longer running (it ended
            // or was cancelled meanwhile); retrying cannot change that.
            Err(status)
                if matches!(
                    status.code(),
                    Code::Aborted | Code::NotFound | Code::FailedPrecondition
                ) =>
            {
                tracing::warn!(job_id = %leased.job_id, message = status.message(), "lease lost; stopping its handler");
                ctx.cancel(CancelReason::LeaseLost);
                return;
            }
            Err(status) => {
                if let Some(progress) = progress {
                    ctx.restore_progress(progress);
                }
                let now = Instant::now();
                let delay = retry.next_delay_after(&status);
                tracing::warn!(job_id = %leased.job_id, code = ?status.code(), message = status.message(), retry_in = ?delay, "heartbeat failed");
                // The last try leaves a tenth of the lease for its answer;
                // after it, only the lease's end is left to wait for (then
                // the lease counts as lost, above).
                let last_try = held_until - (config.lease_duration / 10).min(LAST_TRY_BEFORE);
                next = if now >= last_try {
                    held_until
                } else {
                    (now + delay).min(last_try)
                };
                backoff_until = next;
            }
        }
    }
}

/// When a lease the server says ends at `at` ends on this worker's clock,
/// counted from when the heartbeat that was told so was sent (the server
/// read its time after that). The wall clocks of worker and server may
/// differ: a worker whose clock is ahead gives up on its handler early,
/// which costs only the handler's last moments, never the report; one
/// whose clock is behind, late, as if it had not been told.
fn ends_in(at: pbjson_types::Timestamp, sent_at: Instant) -> Option<Instant> {
    let at = chrono::DateTime::from_timestamp(at.seconds, u32::try_from(at.nanos).ok()?)?;
    let left = (at - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO);
    Some(sent_at + left)
}
