//! Store errors, and the one place where database errors are classified.

use std::sync::Arc;

use crate::domain::transition::TransitionError;

/// Why a store call failed. Messages never carry SQL or row data of other
/// tenants; the database's own text stays in the logs.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// No such job for this tenant.
    #[error("job not found")]
    NotFound,
    /// The lease token is not the job's current one.
    #[error("lease lost: the job is no longer held with this lease token")]
    LeaseLost,
    /// The idempotency key was used before with other input.
    #[error("idempotency key already used with different input")]
    IdempotencyConflict,
    /// The job's state does not allow the transition.
    #[error("{0}")]
    IllegalTransition(String),
    /// The database cannot be reached (or the pool is exhausted); retry later.
    #[error("database unavailable")]
    Unavailable(#[source] Arc<sqlx::Error>),
    /// A bad database URL or similar.
    #[error("{0}")]
    Config(String),
    /// Anything else: a bug or a corrupt row.
    #[error("internal store error: {0}")]
    Internal(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        match &err {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Protocol(_) => StoreError::Unavailable(Arc::new(err)),
            // SQLite's codes, by their primary code (the low byte of an
            // extended one): the file busy or locked, read-only (a volume
            // remounted so after disk errors, a file moved away), an I/O
            // error, the disk full or the file gone are the database being
            // unavailable, as a lost PostgreSQL is, and not a bug to
            // report as internal.
            sqlx::Error::Database(db)
                if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
                    && db
                        .code()
                        .and_then(|code| code.parse::<i32>().ok())
                        .is_some_and(|code| matches!(code & 0xff, 5 | 6 | 8 | 10 | 13 | 14)) =>
            {
                StoreError::Unavailable(Arc::new(err))
            }
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some(code) if pg_unavailable(code) => StoreError::Unavailable(Arc::new(err)),
                _ => StoreError::Internal(err.to_string()),
            },
            sqlx::Error::Configuration(e) => StoreError::Config(e.to_string()),
            _ => StoreError::Internal(err.to_string()),
        }
    }
}

/// Whether a PostgreSQL SQLSTATE says the database cannot serve now, so a
/// caller should retry (`UNAVAILABLE`), rather than that a statement is
/// wrong: a serialization failure or deadlock; any connection exception
/// (class 08); a shutdown, a crash or a dropped database (57P0x); a
/// statement timeout (57014); a lock not had within `lock_timeout` (55P03:
/// another replica holds it, stopped, until its session ends); a session
/// ended for idling in a transaction (25P03); a read-only transaction (25006: a hot
/// standby, or a primary just failed over and not yet promoted); a
/// database that is gone or refuses this login after a reconnect (3D000,
/// 28000, 28P01: dropped, or its credentials rotated); a database not
/// accepting connections (55000); too many connections, disk full, out of
/// memory; an I/O error.
fn pg_unavailable(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("57P")
        || matches!(
            code,
            "40001"
                | "40P01"
                | "57014"
                | "55P03"
                | "25P03"
                | "25006"
                | "3D000"
                | "28000"
                | "28P01"
                | "55000"
                | "53300"
                | "53100"
                | "53200"
                | "58030"
        )
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        match err {
            sqlx::migrate::MigrateError::Execute(e) => e.into(),
            other => StoreError::Internal(other.to_string()),
        }
    }
}

impl From<TransitionError> for StoreError {
    fn from(err: TransitionError) -> Self {
        match err {
            TransitionError::LeaseLost => StoreError::LeaseLost,
            TransitionError::Illegal(msg) => StoreError::IllegalTransition(msg),
        }
    }
}
