//! The tower layer that authenticates and authorizes every gRPC call before
//! it reaches a service, so that no service can forget to.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::Status;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tower::{Layer, Service};

use super::AuthError;
use super::identity::{Identity, tenant_header};
use super::role::{Access, Role, Roles, access_for};
use super::source::TokenSource;

/// Tenant of calls that name none in open mode.
const DEFAULT_TENANT: &str = "default";

/// Wraps services in [`AuthService`].
#[derive(Clone, Debug)]
pub struct AuthLayer {
    source: Arc<TokenSource>,
}

impl AuthLayer {
    /// Checks calls against the tokens of `source`.
    pub fn new(source: Arc<TokenSource>) -> AuthLayer {
        AuthLayer { source }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            source: Arc::clone(&self.source),
        }
    }
}

/// Refuses calls without a fitting token; puts the caller's [`Identity`]
/// into the extensions of those it lets through (none for public methods).
#[derive(Clone, Debug)]
pub struct AuthService<S> {
    inner: S,
    source: Arc<TokenSource>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for AuthService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Default,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response<ResBody>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        match authorize(&self.source, req.uri().path(), req.headers()) {
            Ok(Some(identity)) => {
                req.extensions_mut().insert(identity);
            }
            Ok(None) => {}
            Err(err) => {
                tracing::debug!(method = req.uri().path(), error = %err, "call refused");
                return Either::Left(ready(Ok(Status::from(err).into_http())));
            }
        }
        Either::Right(self.inner.call(req))
    }
}

/// The decision for one call: `None` for a public method, the caller's
/// identity when allowed, or why not.
pub fn authorize(
    source: &TokenSource,
    path: &str,
    headers: &HeaderMap,
) -> Result<Option<Identity>, AuthError> {
    let access = access_for(path);
    if access == Access::Public {
        return Ok(None);
    }
    let identity = identify(source, headers)?;
    if !identity.roles.allow(access) {
        return Err(AuthError::Forbidden {
            // Cut: the path is the caller's, and the error goes back in the
            // trailers, which clients take 16 KiB of at most.
            method: path.trim_start_matches('/').chars().take(128).collect(),
            roles: identity.roles,
        });
    }
    Ok(Some(identity))
}

/// Who the caller of `headers` is, whatever it means to call: every role
/// in open mode, else its token's.
pub fn identify(source: &TokenSource, headers: &HeaderMap) -> Result<Identity, AuthError> {
    if source.is_open() {
        let tenant = tenant_header(headers)?.unwrap_or_else(|| DEFAULT_TENANT.to_owned());
        return Ok(Identity {
            principal: format!("open:{tenant}"),
            tenant,
            roles: Roles::all(),
            token: None,
        });
    }
    let token = bearer(headers)?;
    let table = source.current();
    let entry = table.find(token).ok_or(AuthError::UnknownToken)?;
    // Only an admin may pick the tenant; for anyone else the header is
    // ignored (not refused), so a client that always sends it still works.
    let tenant = if entry.roles.contains(Role::Admin) {
        tenant_header(headers)?.unwrap_or_else(|| entry.tenant.clone())
    } else {
        entry.tenant.clone()
    };
    Ok(Identity {
        tenant,
        roles: entry.roles,
        principal: format!("token:{}", entry.digest.short()),
        token: Some(entry.digest),
    })
}

/// Whether `headers` carry a known token (anyone in open mode), whatever
/// its roles: the check that can run before a request's body is read, so
/// that an unknown caller costs no parsing. [`authorize`] still decides the
/// method.
pub fn authenticate(source: &TokenSource, headers: &HeaderMap) -> Result<(), AuthError> {
    if source.is_open() {
        return Ok(());
    }
    let token = bearer(headers)?;
    source
        .current()
        .find(token)
        .map(|_| ())
        .ok_or(AuthError::UnknownToken)
}

/// The token of `authorization: Bearer <token>` (scheme case-insensitive,
/// as RFC 6750 has it).
fn bearer(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = headers
        .get("authorization")
        .ok_or(AuthError::MissingToken)?;
    let text = value.to_str().map_err(|_| AuthError::UnknownToken)?;
    let (scheme, token) = text.split_once(' ').ok_or(AuthError::UnknownToken)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::UnknownToken);
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(AuthError::MissingToken);
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::codegen::http::HeaderValue;

    fn source(text: &str) -> TokenSource {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokens");
        std::fs::write(&path, text).expect("write");
        TokenSource::from_file(&path).expect("valid")
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("ascii"));
        }
        h
    }

    const SUBMIT: &str = "/intray.v1.JobService/Submit";

    #[test]
    fn bearer_forms() {
        let s = source("producer-token-0123456 acme producer\n");
        for form in [
            "Bearer producer-token-0123456",
            "bearer  producer-token-0123456",
        ] {
            let id = authorize(&s, SUBMIT, &headers(&[("authorization", form)]))
                .expect("allowed")
                .expect("identity");
            assert_eq!(id.tenant, "acme");
        }
        for (form, missing) in [
            ("Basic producer-token-0123456", false),
            ("Bearer ", true),
            ("producer-token-0123456", false),
        ] {
            let err = authorize(&s, SUBMIT, &headers(&[("authorization", form)])).expect_err(form);
            assert_eq!(
                matches!(err, AuthError::MissingToken),
                missing,
                "{form}: {err}"
            );
        }
    }

    #[test]
    fn tenant_header_only_for_admins() {
        let s = source("producer-token-0123456 acme producer\nadmin-token-0123456789 ops admin\n");
        let h = |token: &str| {
            headers(&[
                ("authorization", &format!("Bearer {token}")),
                ("x-intray-tenant", "other"),
            ])
        };
        let p = authorize(&s, SUBMIT, &h("producer-token-0123456"))
            .expect("ok")
            .expect("id");
        assert_eq!(p.tenant, "acme");
        let a = authorize(&s, SUBMIT, &h("admin-token-0123456789"))
            .expect("ok")
            .expect("id");
        assert_eq!(a.tenant, "other");
        let own = authorize(
            &s,
            SUBMIT,
            &headers(&[("authorization", "Bearer admin-token-0123456789")]),
        )
        .expect("ok")
        .expect("id");
        assert_eq!(own.tenant, "ops");
    }

    #[test]
    fn public_methods_need_nothing_and_open_mode_allows_all() {
        let s = source("producer-token-0123456 acme producer\n");
        assert_eq!(
            authorize(&s, "/grpc.health.v1.Health/Check", &HeaderMap::new()).expect("public"),
            None
        );
        let open = TokenSource::open();
        let id = authorize(
            &open,
            "/intray.v1.JobService/Retry",
            &headers(&[("x-intray-tenant", "t")]),
        )
        .expect("open")
        .expect("id");
        assert_eq!((id.tenant.as_str(), id.roles), ("t", Roles::all()));
        assert!(matches!(
            authorize(
                &open,
                SUBMIT,
                &headers(&[("x-intray-tenant", "bad tenant")])
            ),
            Err(AuthError::BadTenant(_))
        ));
    }
}
