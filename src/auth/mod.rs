//! Authentication and authorization of gRPC calls.
//!
//! Bearer tokens come from a token file (see [`file`] for the format), are
//! kept in memory only as sha256 digests ([`tokens`]), and are found by a
//! constant-time comparison. Each token maps to one tenant and a set of
//! roles ([`role`]); which role each RPC needs is one table
//! ([`role::access_for`]). The tower layer in [`layer`] authenticates every
//! call, checks the table, and puts an [`Identity`] into the request
//! extensions, where the services read the tenant from. [`source`] holds the
//! current tokens and reloads them on SIGHUP or when the file changes; a
//! call that stays open (a watch, a long-poll) holds a [`Grant`], which ends
//! it when a reload takes its token away.
//!
//! Without a token file the server is in open development mode: every call
//! may do everything, for the tenant named by `x-intray-tenant`.

pub mod file;
pub mod grant;
pub mod identity;
pub mod layer;
pub mod role;
pub mod source;
pub mod tokens;

pub use grant::Grant;
pub use identity::{Identity, TENANT_HEADER};
pub use layer::AuthLayer;
pub use role::{Access, Role, Roles};
pub use source::TokenSource;

/// Why a call was refused before it reached a service.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `authorization: Bearer ...` metadata.
    #[error("missing bearer token in the authorization metadata")]
    MissingToken,
    /// A token that no entry of the token file has (or a malformed header).
    #[error("unknown or malformed bearer token")]
    UnknownToken,
    /// The token is valid but its roles do not allow this method.
    #[error("the token's roles ({roles}) do not allow {method}")]
    Forbidden {
        /// The gRPC method path, e.g. `/intray.v1.WorkerService/Lease`.
        method: String,
        /// The roles the token has.
        roles: Roles,
    },
    /// The `x-intray-tenant` metadata is not a valid tenant name.
    #[error(transparent)]
    BadTenant(#[from] crate::domain::validate::ValidationError),
    /// A reload took away what an open call's token was granted (the token,
    /// its tenant or one of its roles) while the call was waiting.
    #[error(
        "the token was revoked or changed while the call was open; call again with a valid token"
    )]
    Revoked,
}
