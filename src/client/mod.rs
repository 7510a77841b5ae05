//! The `intray` command-line client: `submit`, `get`, `cancel`, `watch`,
//! `list`, `retry` and `stats` against a running server.
//!
//! # Wiring it into `main.rs`
//!
//! Every [`ClientOpts`] flag is `global`, so the options are flattened once
//! at the top level and the commands are flattened next to the server's own
//! subcommands:
//!
//! ```ignore
//! use clap::{Parser, Subcommand};
//! use intray::client::{ClientCommand, ClientOpts};
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     client: ClientOpts,
//!     #[command(subcommand)]
//!     command: Command,
//! }
//!
//! #[derive(Subcommand)]
//! enum Command {
//!     Serve(ServeArgs),
//!     Migrate(MigrateArgs),
//!     #[command(flatten)]
//!     Client(ClientCommand),
//! }
//!
//! // in an async main:
//! match cli.command {
//!     Command::Client(cmd) => {
//!         if let Err(e) = intray::client::run(cli.client, cmd).await {
//!             eprintln!("error: {e}");
//!             std::process::exit(e.exit_code());
//!         }
//!     }
//!     // ...
//! }
//! ```
//!
//! Because they are global, `--addr`, `--tenant`, `--token`, `--tls-ca`,
//! `--client-cert`, `--client-key` and `--json` are also accepted (and
//! ignored) by `serve` and `migrate`, and those commands must not define
//! flags of the same long names or the ids `client_addr`, `client_tenant`,
//! `client_token`, `client_tls_ca`, `client_cert`, `client_key`,
//! `client_json` (clap panics on duplicates in debug builds). That is why
//! the client's certificate flags are not `--tls-cert`/`--tls-key`: those
//! are `serve`'s.

mod args;
mod closed_output;
mod commands;
mod error;
mod print;
mod work;

pub use args::{
    CancelArgs, ClientCommand, ClientOpts, GetArgs, ListArgs, RetryArgs, RetryStateArg, StateArg,
    StatsArgs, SubmitArgs, WatchArgs,
};
pub use commands::{TENANT_METADATA, run};
// The connection of `intray bench`: the same address, TLS, tenant and token handling.
pub(crate) use commands::{authorization, endpoint, tenant_metadata};
pub use error::ClientError;
pub use work::{GuardArgs, WorkArgs, guard as work_guard};
