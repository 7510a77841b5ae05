//! Why a benchmark run stopped.

use crate::client::ClientError;

/// A failed benchmark run. Every variant says what was being done, so the
/// message alone tells which scenario step broke.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The flags do not make sense together.
    #[error("{0}")]
    BadArgument(String),

    /// Address, TLS, tenant or token could not be turned into a connection.
    #[error(transparent)]
    Client(#[from] ClientError),

    /// The server could not be reached.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address tried.
        addr: String,
        /// What the transport said.
        #[source]
        source: tonic::transport::Error,
    },

    /// A call the scenario depends on failed.
    #[error("{call} failed: {code:?}: {message}")]
    Rpc {
        /// Which call.
        call: &'static str,
        /// Its status code.
        code: tonic::Code,
        /// Its status message.
        message: String,
    },

    /// One item of a batch call was rejected; the benchmark only sends valid items.
    #[error("{call} rejected an item: code {code}: {message}")]
    Item {
        /// Which call.
        call: &'static str,
        /// The item's google.rpc code.
        code: i32,
        /// The item's message.
        message: String,
    },

    /// A batched completion answered a different number of results than it
    /// was sent items: some outcomes were dropped or made up.
    #[error("{call} answered {answered} results for {sent} items")]
    Answer {
        /// Which call.
        call: &'static str,
        /// Items sent.
        sent: usize,
        /// Results in the answer.
        answered: usize,
    },

    /// After a scenario the server does not count as SUCCEEDED exactly the
    /// jobs the run completed, so its figures counted work that did not
    /// happen as reported.
    #[error(
        "{scenario}: the server counts {counted} jobs of queue {queue} as SUCCEEDED, \
         expected {expected} ({what}); a job was lost, failed or completed twice"
    )]
    Unaccounted {
        /// The scenario that ran the jobs.
        scenario: &'static str,
        /// Their queue.
        queue: String,
        /// The server's count.
        counted: u64,
        /// The jobs the run completed.
        expected: u64,
        /// What `expected` is made of.
        what: String,
    },

    /// The run did not make progress in time (a lost job, a dead server).
    #[error("{0}")]
    Stalled(String),

    /// Starting, watching or stopping the spawned server failed.
    #[error("{0}")]
    Spawn(String),

    /// Resetting the database or counting its connections failed.
    #[error("database {what}: {source}")]
    Database {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// A load task panicked or was cancelled.
    #[error("a load task failed: {0}")]
    Task(#[from] tokio::task::JoinError),

    /// A report could not be written.
    #[error("cannot write the report: {0}")]
    Output(#[from] std::io::Error),
}

impl BenchError {
    /// A failed call, keeping its code and message.
    pub fn rpc(call: &'static str, status: tonic::Status) -> BenchError {
        BenchError::Rpc {
            call,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }

    /// The process exit code: 2 for bad flags (as clap does), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            BenchError::BadArgument(_) => 2,
            BenchError::Client(e) => u8::try_from(e.exit_code()).unwrap_or(1),
            _ => 1,
        }
    }
}
