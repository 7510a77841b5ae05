//! Who a call is from, as the services see it.

use tonic::codegen::http::HeaderMap;

use super::role::Roles;
use super::tokens::TokenDigest;
use crate::domain::validate::{self, ValidationError};

/// The metadata key naming the tenant: honoured in open mode and for
/// admins, ignored for every other token.
pub const TENANT_HEADER: &str = "x-intray-tenant";

/// The authenticated caller, put into the request extensions by
/// [`AuthLayer`](super::AuthLayer) for every call it lets through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The tenant the call acts for.
    pub tenant: String,
    /// What the caller may do.
    pub roles: Roles,
    /// A stable, non-secret name of the caller, the key of its rate limit:
    /// `token:<first 8 bytes of the digest>`, or `open:<tenant>` without
    /// authentication.
    pub principal: String,
    /// The digest of the caller's token; none in open mode and for callers
    /// the server vouches for itself (the webhook ingress).
    pub token: Option<TokenDigest>,
}

/// The tenant named by `x-intray-tenant`, if any, validated like a queue name.
pub fn tenant_header(headers: &HeaderMap) -> Result<Option<String>, ValidationError> {
    match headers.get(TENANT_HEADER) {
        None => Ok(None),
        Some(value) => {
            let text = value
                .to_str()
                .map_err(|_| ValidationError::new(TENANT_HEADER, "must be ASCII"))?;
            Ok(Some(validate::queue(TENANT_HEADER, text)?))
        }
    }
}
