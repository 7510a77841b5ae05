//! Which tenant a call acts for: the one the auth layer decided (from the
//! token; from `x-intray-tenant` for admins and in open mode).

use tonic::{Request, Status};

use crate::auth::{AuthError, Identity};

/// The tenant of a request, from the [`Identity`] the auth layer attached.
/// A request without one did not pass through the layer (a wiring mistake),
/// and is refused rather than served for some default tenant.
pub fn tenant_of<T>(request: &Request<T>) -> Result<String, Status> {
    match request.extensions().get::<Identity>() {
        Some(identity) => Ok(identity.tenant.clone()),
        None => Err(AuthError::MissingToken.into()),
    }
}
