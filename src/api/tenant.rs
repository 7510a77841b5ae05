//! Which tenant a call acts for. Until authentication exists it is the
//! `x-intray-tenant` metadata, or `default`.

use tonic::Request;

use super::status::ApiError;
use crate::domain::validate::{self, ValidationError};

/// The metadata key naming the tenant.
pub const TENANT_HEADER: &str = "x-intray-tenant";

/// The tenant of a request, validated like a queue name.
pub fn tenant_of<T>(request: &Request<T>) -> Result<String, ApiError> {
    match request.metadata().get(TENANT_HEADER) {
        None => Ok("default".to_owned()),
        Some(value) => {
            let text = value
                .to_str()
                .map_err(|_| ValidationError::new(TENANT_HEADER, "must be ASCII"))?;
            Ok(validate::queue(TENANT_HEADER, text)?)
        }
    }
}
