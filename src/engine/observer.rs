//! Turns what the store did into telemetry: one log line per state
//! transition, the attempt's `job.attempt` span when an attempt ends (on
//! whichever replica ends it), and the job metrics. The store only returns
//! what happened; nothing here touches the database.

use std::sync::Arc;
use std::time::Duration;

use crate::domain::{EventType, Job, JobEvent, JobState, RetryFilter};
use crate::store::{Ended, StoreResult};
use crate::telemetry::attempt::{self, AttemptSummary};
use crate::telemetry::{Metrics, Tracing};

/// Where a server's telemetry goes.
#[derive(Debug)]
pub struct Observer {
    tracing: Tracing,
    metrics: Arc<Metrics>,
    /// Attempts longer than this log a warning.
    slow_attempt: Duration,
}

impl Observer {
    /// An observer exporting spans to `tracing` (when on) and figures to
    /// `metrics`.
    pub fn new(tracing: Tracing, metrics: Arc<Metrics>, slow_attempt: Duration) -> Observer {
        Observer {
            tracing,
            metrics,
            slow_attempt,
        }
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The server's trace pipeline.
    pub fn tracing(&self) -> &Tracing {
        &self.tracing
    }

    /// A job was created by `Submit`.
    pub fn submitted(&self, job: &Job) {
        tracing::info!(
            job_id = %job.id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
            attempt = job.attempt, from = "-", to = %job.state, "job transition"
        );
    }

    /// Jobs were leased: queued → running.
    pub fn leased(&self, jobs: &[Job]) {
        for job in jobs {
            let wait = job
                .leased_at
                .map(|l| (l - job.run_at).to_std().unwrap_or_default());
            if let Some(wait) = wait {
                self.metrics.leased(&job.queue, wait);
            }
            tracing::info!(
                job_id = %job.id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
                attempt = job.attempt, from = %JobState::Queued, to = %job.state,
                worker_id = job.lease_owner.as_deref().unwrap_or(""),
                queue_wait_ms = wait.map(|w| w.as_millis() as u64),
                "job transition"
            );
        }
    }

    /// [`Self::ended`] for each outcome stored of a batch.
    pub fn ended_all(&self, ended: &[StoreResult<Ended>]) {
        for ended in ended.iter().flatten() {
            self.ended(ended);
        }
    }

    /// An attempt ended (`Complete`, or the reaper reclaiming its lease):
    /// its span, its metrics, its log line, and a warning when it was slow.
    pub fn ended(&self, ended: &Ended) {
        let summary = AttemptSummary::of(ended);
        let job = &ended.job;
        if let Some(tracer) = self.tracing.tracer() {
            attempt::emit_span(tracer, ended, &summary);
        }
        let class = summary.error_class.as_deref().unwrap_or("");
        self.metrics.attempt_ended(
            &job.queue,
            &job.kind,
            summary.outcome,
            class,
            summary.duration,
        );
        if summary.dead {
            let dead_class = job.error.as_ref().map_or("", |e| e.class.as_str());
            self.metrics
                .dead_set_arrival(&job.queue, &job.kind, dead_class);
        }
        let duration_ms = summary.duration.map(|d| d.as_millis() as u64);
        let worker_id = ended.attempt.worker_id.as_deref().unwrap_or("");
        tracing::info!(
            job_id = %job.id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
            attempt = ended.attempt.number, from = %JobState::Running, to = %job.state,
            outcome = summary.outcome, error_class = class, worker_id, duration_ms,
            "job transition"
        );
        if let Some(duration) = summary.duration
            && duration > self.slow_attempt
        {
            tracing::warn!(
                job_id = %job.id, kind = %job.kind, queue = %job.queue,
                attempt = ended.attempt.number, worker_id, duration_ms,
                threshold_ms = self.slow_attempt.as_millis() as u64,
                "slow attempt"
            );
        }
    }

    /// The reaper reclaimed an attempt whose lease ran out (requeued, or
    /// failed, cancelled or expired).
    pub fn reclaimed(&self, ended: &Ended) {
        // Only a lease that ran out on its worker (the job queued again, or
        // failed for it): a cancel past its grace or a deadline passed
        // while running end the job on purpose, and say nothing of workers
        // dying or hanging.
        if matches!(
            ended.event.kind,
            EventType::LeaseExpired | EventType::Failed
        ) {
            self.metrics.lease_expired(&ended.job.queue);
        }
        self.ended(ended);
    }

    /// A producer cancelled a job (a running one only gets the request).
    pub fn cancelled(&self, job: &Job) {
        // A cancel ends only a queued job; a running one is asked to stop
        // and stays running.
        let (from, message) = if job.state == JobState::Running {
            (JobState::Running, "job cancel requested")
        } else {
            (JobState::Queued, "job transition")
        };
        tracing::info!(
            job_id = %job.id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
            attempt = job.attempt, from = %from, to = %job.state, message
        );
    }

    /// A failed, cancelled or expired job was replayed.
    pub fn replayed(&self, job: &Job) {
        tracing::info!(
            job_id = %job.id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
            attempt = job.attempt, to = %job.state, "job replayed"
        );
    }

    /// A bulk `Retry` replayed `retried` of the `matched` jobs of a filter
    /// (one line for the call: a filter may replay thousands).
    pub fn replayed_in_bulk(
        &self,
        tenant: &str,
        filter: &RetryFilter,
        matched: u64,
        retried: usize,
    ) {
        tracing::info!(
            tenant,
            queue = filter.queue.as_deref().unwrap_or("*"),
            kind = filter.kind.as_deref().unwrap_or("*"),
            error_class = filter.error_class.as_deref().unwrap_or("*"),
            matched,
            retried,
            "jobs replayed in bulk"
        );
    }

    /// The reaper expired a queued job past its deadline.
    pub fn deadline_passed(&self, job: &Job, event: &JobEvent) {
        tracing::info!(
            job_id = %event.job_id, kind = %job.kind, queue = %job.queue, tenant = %job.tenant,
            attempt = event.attempt, from = %JobState::Queued, to = %event.state,
            error_class = "deadline_exceeded", "job transition"
        );
    }
}
