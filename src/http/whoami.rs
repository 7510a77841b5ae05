//! `GET /api/v1/whoami`: the caller's tenant, roles and the methods of
//! this API it may call, so that a client (the dashboard) offers only the
//! acts its token may make instead of failing them with 403.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Serialize;

use super::body::json;
use super::error::HttpError;
use super::gateway::Gateway;
use super::query;
use crate::auth::Role;

/// Where the caller's identity is served.
pub const PATH: &str = "/api/v1/whoami";

/// The answer: who the caller acts as, and what it may call.
#[derive(Serialize)]
struct Whoami {
    /// The tenant its calls act for (an admin's `x-intray-tenant`).
    tenant: String,
    /// Its roles by name; every role in open mode.
    roles: Vec<&'static str>,
    /// The `JobService` methods its roles allow, by name (`Retry`).
    methods: Vec<&'static str>,
}

/// `GET /api/v1/whoami`: any known token (anyone in open mode).
pub async fn serve(
    State(gateway): State<Arc<Gateway>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Result<Response, HttpError> {
    let (identity, methods) = gateway.identify(&headers)?;
    query::none(raw.as_deref())?;
    let answer = Whoami {
        tenant: identity.tenant,
        roles: Role::ALL
            .into_iter()
            .filter(|r| identity.roles.contains(*r))
            .map(Role::name)
            .collect(),
        methods: methods.into_iter().map(|m| m.name()).collect(),
    };
    Ok(json(StatusCode::OK, &answer))
}
