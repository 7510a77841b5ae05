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
                // Worth retrying: serialization failure, deadlock, connection
                // exceptions (class 08), admin/crash shutdown, cannot connect
                // now, database not accepting connections, too many
                // connections, disk full, out of memory, an I/O error.
                Some(
                    "40001" | "40P01" | "08000" | "08001" | "08003" | "08004" | "08006" | "57P01"
                    | "57P02" | "57P03" | "55000" | "53300" | "53100" | "53200" | "58030",
                ) => StoreError::Unavailable(Arc::new(err)),
                _ => StoreError::Internal(err.to_string()),
            },
            sqlx::Error::Configuration(e) => StoreError::Config(e.to_string()),
            _ => StoreError::Internal(err.to_string()),
        }
    }
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
