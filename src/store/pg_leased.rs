//! Jobs this replica has just leased, kept so that their `Complete` need
//! not read them back.
//!
//! `Complete` reads each job (state, attempt, lease token, row version)
//! before the state machine decides, then writes the outcome guarded by that
//! row version. For a job this replica handed out, the claim (or the
//! hand-off) has just returned all of that, with the row version it wrote.
//! Kept here, it saves `Complete` its read: one statement and one round trip
//! per shared transaction (e2e ran 7.5 % faster, docs/performance-log.md).
//!
//! Nothing kept here is trusted beyond that. The write still requires the
//! row to be exactly the version the lease produced, so a job changed since
//! (a heartbeat, a cancel request, the reaper, another replica) is skipped
//! by the write and done again from the database. A refusal decided from a
//! kept job (its lease run out, another token) is decided again from the
//! row too: the lease may have been extended, or granted again, through
//! another replica. A kept job only ever spares a read whose answer it
//! already holds.
//!
//! What a lease does not return is the database's time at the `Complete`,
//! which the state machine needs (finish times, retry times, whether the
//! lease has run out). It is the lease's own time (`leased_at`, the
//! database's `now()` when it was granted) plus the time passed since, on
//! this process's monotonic clock: no wall-clock skew between this replica
//! and the database enters it, only the lease's round trip, by which it can
//! run late (never early).
//!
//! A heartbeat through this replica brings the kept job up to date: it
//! returns the columns heartbeats change and the row version it wrote, and
//! every other change adds an event, so the copy is whole again if the
//! event sequence the heartbeat found is the kept one. Otherwise the job is
//! let go. Jobs that run long heartbeat; without this, every such job's
//! `Complete` read its row back.
//!
//! Memory is bounded: by a count and by the payloads' stored size. When full,
//! the jobs whose lease has run out are let go (their `Complete` would
//! fail anyway, or they went to another worker); if that is not enough, a
//! new lease is not kept and its `Complete` reads as before.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, TimeDelta, Utc};
use uuid::Uuid;

use crate::domain::Job;

/// Most jobs kept at once.
const MAX_JOBS: usize = 16_384;
/// Most payload bytes kept at once, as PostgreSQL stores them.
const MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;
/// When full, expired leases are looked for at most this often: the look
/// goes over every kept job, and a table full of live leases would
/// otherwise be gone over again for every new one.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A leased job as its lease left it.
pub struct Kept {
    pub job: Job,
    /// The row version (`xmin`) the lease wrote.
    pub version: String,
    /// The database's time now, estimated from the lease (see the module
    /// documentation).
    pub now: DateTime<Utc>,
}

/// What a heartbeat through this replica wrote to a job's row: the columns
/// heartbeats change, as it returned them.
pub struct Beat {
    /// The row version it wrote.
    pub version: String,
    /// The job's event sequence before it (it adds one event at most).
    pub event_seq_before: u64,
    /// The job's event sequence after it.
    pub event_seq: u64,
    /// The lease's end after it.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The progress after it.
    pub progress: f64,
    /// The row's change time after it.
    pub updated_at: DateTime<Utc>,
}

struct Entry {
    job: Job,
    version: String,
    /// `leased_at`: the database's time when the lease was granted.
    granted: DateTime<Utc>,
    /// This process's time when the lease's answer arrived.
    arrived: Instant,
    payload_bytes: usize,
}

impl Entry {
    /// The database's time estimated from this process's clock, in whole
    /// microseconds as PostgreSQL keeps them: the job a `Complete` returns
    /// (and the event its watchers get) must read as it is stored.
    fn now(&self, at: Instant) -> DateTime<Utc> {
        let passed = TimeDelta::from_std(at.saturating_duration_since(self.arrived))
            .unwrap_or(TimeDelta::MAX);
        let now = self
            .granted
            .checked_add_signed(passed)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        now.trunc_subsecs(6)
    }

    fn expired(&self, at: Instant) -> bool {
        self.job
            .lease_expires_at
            .is_none_or(|expires| self.now(at) >= expires)
    }
}

#[derive(Default)]
struct Table {
    jobs: HashMap<Uuid, Entry>,
    payload_bytes: usize,
    /// No look for expired leases before this.
    next_sweep: Option<Instant>,
}

impl Table {
    fn remove(&mut self, id: &Uuid) -> Option<Entry> {
        let entry = self.jobs.remove(id)?;
        self.payload_bytes -= entry.payload_bytes;
        Some(entry)
    }

    fn fits(&self, payload_bytes: usize) -> bool {
        self.jobs.len() < MAX_JOBS
            && self.payload_bytes.saturating_add(payload_bytes) <= MAX_PAYLOAD_BYTES
    }

    fn let_go_expired(&mut self, at: Instant) {
        if self.next_sweep.is_some_and(|next| at < next) {
            return;
        }
        self.next_sweep = Some(at + SWEEP_EVERY);
        self.jobs.retain(|_, entry| !entry.expired(at));
        self.payload_bytes = self.jobs.values().map(|e| e.payload_bytes).sum();
    }
}

/// The jobs leased by this replica and not yet completed through it.
#[derive(Default)]
pub struct Leased {
    kept: Mutex<Table>,
}

impl Leased {
    /// Keeps `job`, just leased (running, with `leased_at` set) and written
    /// as row version `version`; `payload_bytes` is its payload's stored
    /// size. Returns whether it was kept.
    pub fn keep(&self, job: Job, version: String, payload_bytes: usize) -> bool {
        self.keep_at(job, version, payload_bytes, Instant::now())
    }

    fn keep_at(&self, job: Job, version: String, payload_bytes: usize, at: Instant) -> bool {
        let Some(granted) = job.leased_at else {
            return false;
        };
        if job.lease_token.is_none() {
            return false;
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        // A job leased again (after its lease ran out) replaces its old lease.
        kept.remove(&job.id);
        if !kept.fits(payload_bytes) {
            kept.let_go_expired(at);
            if !kept.fits(payload_bytes) {
                return false;
            }
        }
        kept.payload_bytes += payload_bytes;
        kept.jobs.insert(
            job.id,
            Entry {
                job,
                version,
                granted,
                arrived: at,
                payload_bytes,
            },
        );
        true
    }

    /// Takes the job `id` of `tenant` out, if it is kept. A job of another
    /// tenant stays: the call is not its lease holder's.
    pub fn take(&self, tenant: &str, id: Uuid) -> Option<Kept> {
        self.take_at(tenant, id, Instant::now())
    }

    fn take_at(&self, tenant: &str, id: Uuid, at: Instant) -> Option<Kept> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.jobs.get(&id)?.job.tenant != tenant {
            return None;
        }
        let entry = kept.remove(&id)?;
        Some(Kept {
            now: entry.now(at),
            job: entry.job,
            version: entry.version,
        })
    }

    /// Lets the job `id` of `tenant` go: its row may have changed in a way
    /// this replica cannot follow (a heartbeat that failed).
    pub fn forget(&self, tenant: &str, id: Uuid) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept
            .jobs
            .get(&id)
            .is_some_and(|entry| entry.job.tenant == tenant)
        {
            kept.remove(&id);
        }
    }

    /// Brings the kept job `id` of `tenant` up to a heartbeat through this
    /// replica. A heartbeat returns only the columns heartbeats change, so
    /// the copy is whole again only if nothing else changed the row since
    /// its lease: every other change adds an event, so the event sequence
    /// the heartbeat found must be the kept one. Otherwise the job is let
    /// go, and its `Complete` reads the row.
    pub fn beat(&self, tenant: &str, id: Uuid, beat: Beat) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = kept.jobs.get_mut(&id) else {
            return;
        };
        if entry.job.tenant != tenant {
            return;
        }
        if entry.job.event_seq != beat.event_seq_before {
            kept.remove(&id);
            return;
        }
        entry.version = beat.version;
        entry.job.event_seq = beat.event_seq;
        entry.job.lease_expires_at = beat.lease_expires_at;
        entry.job.progress = beat.progress;
        entry.job.updated_at = beat.updated_at;
    }

    /// Jobs kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .jobs
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::fixtures::running;

    /// A job of `tenant` leased for `lease` from its `leased_at`.
    fn leased(tenant: &str, lease: Duration) -> Job {
        let mut job = running(1, 3);
        job.tenant = tenant.into();
        job.lease_expires_at = job
            .leased_at
            .map(|at| at + TimeDelta::from_std(lease).expect("a short lease"));
        job
    }

    #[test]
    fn a_kept_job_is_taken_once_with_its_version_and_the_time_passed() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let (id, granted) = (job.id, job.leased_at.unwrap());
        let at = Instant::now();
        assert!(leased_.keep_at(job, "123".into(), 10, at));
        let kept = leased_
            .take_at("t1", id, at + Duration::from_millis(250))
            .unwrap();
        assert_eq!(kept.job.id, id);
        assert_eq!(kept.version, "123");
        assert_eq!(kept.now, granted + TimeDelta::milliseconds(250));
        assert!(leased_.take_at("t1", id, at).is_none());
    }

    #[test]
    fn another_tenant_neither_takes_the_job_nor_makes_it_go() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        assert!(leased_.keep(job, "1".into(), 10));
        assert!(leased_.take("t2", id).is_none());
        assert!(leased_.take("t1", id).is_some());
    }

    /// What a heartbeat with an event wrote on top of `job`.
    fn beat_on(job: &Job, version: &str) -> Beat {
        Beat {
            version: version.into(),
            event_seq_before: job.event_seq,
            event_seq: job.event_seq + 1,
            lease_expires_at: job.lease_expires_at.map(|at| at + TimeDelta::seconds(30)),
            progress: 0.5,
            updated_at: job.updated_at + TimeDelta::seconds(1),
        }
    }

    #[test]
    fn a_heartbeat_on_the_kept_row_brings_the_job_up_to_it() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        let beat = beat_on(&job, "2");
        let (seq, expires, updated) = (beat.event_seq, beat.lease_expires_at, beat.updated_at);
        assert!(leased_.keep(job.clone(), "1".into(), 10));
        leased_.beat("t1", id, beat);
        let kept = leased_.take("t1", id).unwrap();
        assert_eq!(kept.version, "2");
        assert_eq!(kept.job.event_seq, seq);
        assert_eq!(kept.job.lease_expires_at, expires);
        assert_eq!(kept.job.progress, 0.5);
        assert_eq!(kept.job.updated_at, updated);
        assert_eq!(kept.job.lease_token, job.lease_token);
    }

    #[test]
    fn a_heartbeat_after_another_change_lets_the_job_go() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        let mut beat = beat_on(&job, "3");
        // A cancel request (one event) came between the lease and the beat.
        beat.event_seq_before += 1;
        beat.event_seq += 1;
        assert!(leased_.keep(job, "1".into(), 10));
        leased_.beat("t1", id, beat);
        assert!(leased_.take("t1", id).is_none());
    }

    #[test]
    fn a_failed_heartbeat_forgets_the_job_and_another_tenants_does_nothing() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        let beat = beat_on(&job, "2");
        assert!(leased_.keep(job, "1".into(), 10));
        leased_.beat("t2", id, beat);
        leased_.forget("t2", id);
        assert_eq!(leased_.take("t1", id).unwrap().version, "1");
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        assert!(leased_.keep(job, "1".into(), 10));
        leased_.forget("t1", id);
        assert!(leased_.take("t1", id).is_none());
    }

    #[test]
    fn a_job_without_a_lease_is_not_kept() {
        let leased_ = Leased::default();
        let mut job = leased("t1", Duration::from_secs(60));
        job.leased_at = None;
        assert!(!leased_.keep(job, "1".into(), 10));
        let mut job = leased("t1", Duration::from_secs(60));
        job.lease_token = None;
        assert!(!leased_.keep(job, "1".into(), 10));
    }

    #[test]
    fn when_full_expired_leases_make_room_and_live_ones_do_not() {
        let leased_ = Leased::default();
        let at = Instant::now();
        let half = MAX_PAYLOAD_BYTES / 2;
        assert!(leased_.keep_at(leased("t1", Duration::from_secs(1)), "1".into(), half, at));
        let live = leased("t1", Duration::from_secs(3600));
        let live_id = live.id;
        assert!(leased_.keep_at(live, "2".into(), half, at));
        // Full: the first lease has not run out yet, so nothing makes room.
        assert!(!leased_.keep_at(leased("t1", Duration::from_secs(60)), "3".into(), 1, at));
        assert_eq!(leased_.len(), 2);
        // Two seconds on, it has, and goes; the live one stays.
        let later = at + Duration::from_secs(2);
        assert!(leased_.keep_at(leased("t1", Duration::from_secs(60)), "4".into(), 1, later));
        assert_eq!(leased_.len(), 2);
        assert!(leased_.take_at("t1", live_id, later).is_some());
    }

    #[test]
    fn a_full_table_is_looked_over_at_most_once_a_second() {
        let leased_ = Leased::default();
        let at = Instant::now();
        let all = MAX_PAYLOAD_BYTES;
        assert!(leased_.keep_at(
            leased("t1", Duration::from_millis(100)),
            "1".into(),
            all,
            at
        ));
        assert!(!leased_.keep_at(leased("t1", Duration::from_secs(60)), "2".into(), 1, at));
        // The first lease has run out, but the table was looked over just now.
        let soon = at + Duration::from_millis(500);
        assert!(!leased_.keep_at(leased("t1", Duration::from_secs(60)), "3".into(), 1, soon));
        let later = at + SWEEP_EVERY;
        assert!(leased_.keep_at(leased("t1", Duration::from_secs(60)), "4".into(), 1, later));
        assert_eq!(leased_.len(), 1);
    }

    #[test]
    fn a_job_leased_again_replaces_its_old_lease() {
        let leased_ = Leased::default();
        let job = leased("t1", Duration::from_secs(60));
        let id = job.id;
        assert!(leased_.keep(job.clone(), "1".into(), MAX_PAYLOAD_BYTES));
        assert!(leased_.keep(job, "2".into(), MAX_PAYLOAD_BYTES));
        assert_eq!(leased_.len(), 1);
        assert_eq!(leased_.take("t1", id).unwrap().version, "2");
    }
}
