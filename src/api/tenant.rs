//! Which tenant a call acts for: the one the auth layer decided (from the
//! token; from `x-intray-tenant` for admins and in open mode).

use std::sync::Arc;

use tonic::{Request, Status};

use crate::auth::{AuthError, Grant, Identity, Role, TokenSource};

/// The tenant of a request, from the [`Identity`] the auth layer attached.
/// A request without one did not pass through the layer (a wiring mistake),
/// and is refused rather than served for some default tenant.
pub fn tenant_of<T>(request: &Request<T>) -> Result<String, Status> {
    match request.extensions().get::<Identity>() {
        Some(identity) => Ok(identity.tenant.clone()),
        None => Err(AuthError::MissingToken.into()),
    }
}

/// What a call that stays open (a watch, a long-poll) holds of its
/// caller's token: it ends the call once a reload takes the token away.
pub fn grant_of<T>(tokens: &Arc<TokenSource>, request: &Request<T>) -> Grant {
    tokens.grant(request.extensions().get::<Identity>())
}

/// Refuses a call that reaches across tenants (`method` names it) to anyone
/// but an admin. Open mode makes every caller an admin.
pub fn require_admin<T>(request: &Request<T>, method: &str) -> Result<(), Status> {
    match request.extensions().get::<Identity>() {
        Some(identity) if identity.roles.contains(Role::Admin) => Ok(()),
        Some(identity) => Err(AuthError::Forbidden {
            method: method.to_owned(),
            roles: identity.roles,
        }
        .into()),
        None => Err(AuthError::MissingToken.into()),
    }
}
