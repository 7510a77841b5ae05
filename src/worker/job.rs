//! The job as a handler sees it, built from a `LeasedJob`.

use chrono::{DateTime, Utc};

use super::error::JobError;
use crate::domain::json::whole_numbers_as_integers;
use crate::pb;

/// One leased job: what to do and with what.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The job's id (UUID text); key side effects by it, since a job may run
    /// more than once (a retry, or a lease lost while its work succeeded).
    pub id: String,
    /// The queue it was leased from.
    pub queue: String,
    /// What to do.
    pub kind: String,
    /// The submitter's payload.
    pub payload: serde_json::Value,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// Attempts the job has in all.
    pub max_attempts: u32,
    /// When the job expires, if it has a deadline.
    pub deadline: Option<DateTime<Utc>>,
    /// When the lease ends unless extended (the worker's heartbeats extend it).
    pub lease_expires_at: Option<DateTime<Utc>>,
}

impl Job {
    /// The handler's view of a leased job; a payload that is not JSON (it
    /// always is, coming from intray) is a final failure of the attempt.
    pub(crate) fn from_leased(leased: &pb::LeasedJob) -> Result<Job, JobError> {
        let mut payload = match &leased.payload {
            Some(value) => serde_json::to_value(value)
                .map_err(|e| JobError::fatal("bad_payload", format!("payload is not JSON: {e}")))?,
            None => serde_json::Value::Null,
        };
        whole_numbers_as_integers(&mut payload);
        Ok(Job {
            id: leased.job_id.clone(),
            queue: leased.queue.clone(),
            kind: leased.kind.clone(),
            payload,
            attempt: leased.attempt,
            max_attempts: leased.max_attempts,
            deadline: leased.deadline.as_ref().and_then(time),
            lease_expires_at: leased.lease_expires_at.as_ref().and_then(time),
        })
    }
}

fn time(t: &pbjson_types::Timestamp) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_and_times_convert() {
        let payload: pbjson_types::Value =
            serde_json::from_value(serde_json::json!({"a": [1, "b", null]})).unwrap_or_default();
        let leased = pb::LeasedJob {
            job_id: "id".into(),
            kind: "k".into(),
            payload: Some(payload),
            attempt: 2,
            max_attempts: 3,
            deadline: Some(pbjson_types::Timestamp {
                seconds: 1_900_000_000,
                nanos: 5,
            }),
            ..Default::default()
        };
        let job = Job::from_leased(&leased);
        let Ok(job) = job else { panic!("{job:?}") };
        assert_eq!(job.payload, serde_json::json!({"a": [1, "b", null]}));
        assert_eq!(
            job.payload["a"][0].as_u64(),
            Some(1),
            "a whole number as an integer"
        );
        assert_eq!(job.deadline.map(|d| d.timestamp()), Some(1_900_000_000));
        assert_eq!(job.lease_expires_at, None);
        let empty = Job::from_leased(&pb::LeasedJob::default());
        assert!(empty.is_ok_and(|j| j.payload.is_null()));
    }
}
