//! The worker's gRPC client: one lazily connected channel, and the metadata
//! (tenant, credentials) every call carries.

use std::time::Duration;

use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use super::error::WorkerError;
use crate::pb::worker_service_client::WorkerServiceClient;

/// Metadata key of the tenant.
pub const TENANT_METADATA: &str = "x-intray-tenant";

/// The client every part of the worker shares (clones share the channel).
pub(crate) type Client = WorkerServiceClient<InterceptedService<Channel, CallMetadata>>;

/// A leased batch can hold up to 100 payloads of 1 MiB each.
const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;
/// A result may be 1 MiB of JSON; leave room for the protobuf encoding.
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// Adds the tenant and the bearer token to every request.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallMetadata {
    tenant: Option<AsciiMetadataValue>,
    authorization: Option<AsciiMetadataValue>,
}

impl CallMetadata {
    pub(crate) fn new(tenant: Option<&str>, token: Option<&str>) -> Result<Self, WorkerError> {
        let ascii = |what: &str, text: &str| {
            // Bytes past ASCII pass HTTP but the server cannot read them as text.
            if !text.chars().all(|c| c.is_ascii_graphic() || c == ' ') {
                return Err(WorkerError::Config(format!(
                    "{what} must be visible ASCII characters"
                )));
            }
            AsciiMetadataValue::try_from(text)
                .map_err(|_| WorkerError::Config(format!("{what} cannot be sent as metadata")))
        };
        let tenant = match tenant.map(str::trim).filter(|t| !t.is_empty()) {
            Some(t) => Some(ascii("tenant", t)?),
            None => None,
        };
        let authorization = match token.map(str::trim).filter(|t| !t.is_empty()) {
            Some(t) => {
                let mut value = ascii("auth token", &format!("Bearer {t}"))?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(CallMetadata {
            tenant,
            authorization,
        })
    }
}

impl Interceptor for CallMetadata {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(tenant) = &self.tenant {
            request
                .metadata_mut()
                .insert(TENANT_METADATA, tenant.clone());
        }
        if let Some(auth) = &self.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        Ok(request)
    }
}

/// `host:port` is what people type; tonic needs a URI with a scheme. An
/// `http://` or `https://` address is taken as it is; another scheme is
/// refused, since it would go as plaintext (a mistyped `https` included).
/// The CLI reads `--addr` with this too.
pub(crate) fn server_uri(addr: &str) -> Result<String, String> {
    let addr = addr.trim();
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let lower = uri.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        Ok(uri)
    } else {
        Err(format!(
            "{uri:?}: give host:port, http://host:port or https://host:port"
        ))
    }
}

/// The server's endpoint at `addr` (see [`server_uri`]); an `https://` one
/// verifies the server against the system's roots. Without TLS set, tonic
/// fails every call to it as unavailable, and the worker would retry that
/// for ever.
pub(crate) fn endpoint(addr: &str) -> Result<Endpoint, WorkerError> {
    let uri =
        server_uri(addr).map_err(|e| WorkerError::Config(format!("invalid server address {e}")))?;
    let endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| WorkerError::Config(format!("invalid server address {uri:?}: {e}")))?;
    if !uri.to_ascii_lowercase().starts_with("https://") {
        return Ok(endpoint);
    }
    endpoint
        .tls_config(ClientTlsConfig::new().with_native_roots())
        .map_err(|e| WorkerError::Config(format!("TLS for {uri:?}: {e}")))
}

/// How often an HTTP/2 PING checks the connection, busy or idle.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// A PING unanswered this long closes the connection.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// `endpoint` with HTTP/2 keepalive: a connection that died silently
/// (a half-open one, behind a NAT or load balancer that dropped it) would
/// otherwise hang a long-poll or a stream forever; with it, the call fails
/// within half a minute. The CLI's connections use it too.
pub(crate) fn with_keep_alive(endpoint: Endpoint) -> Endpoint {
    endpoint
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
}

/// A client on a lazily connected channel: nothing is dialled until the
/// first call, and a broken connection is re-dialled on the next call, so a
/// worker started before its server, or outliving a restart, just works (its
/// calls fail with `UNAVAILABLE` meanwhile and the loops back off).
pub(crate) fn client(endpoint: Endpoint, metadata: CallMetadata) -> Client {
    let channel = with_keep_alive(endpoint)
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    WorkerServiceClient::with_interceptor(channel, metadata)
        .max_decoding_message_size(MAX_RESPONSE_BYTES)
        .max_encoding_message_size(MAX_REQUEST_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_of_another_scheme_is_refused() {
        assert!(matches!(
            endpoint("htps://example.com:443"),
            Err(WorkerError::Config(_))
        ));
        assert!(endpoint("127.0.0.1:50051").is_ok());
        assert!(endpoint("https://example.com").is_ok());
    }

    #[test]
    fn metadata_carries_tenant_and_bearer_token() {
        let mut md = CallMetadata::new(Some("acme"), Some("s3cret")).unwrap_or_default();
        let request = md.call(tonic::Request::new(()));
        let Ok(request) = request else {
            panic!("interceptor refused")
        };
        let get = |k| request.metadata().get(k).and_then(|v| v.to_str().ok());
        assert_eq!(get(TENANT_METADATA), Some("acme"));
        assert_eq!(get("authorization"), Some("Bearer s3cret"));
    }

    #[test]
    fn empty_values_send_nothing_and_non_ascii_is_refused() {
        let mut md = CallMetadata::new(Some(" "), None).unwrap_or_default();
        let request = md.call(tonic::Request::new(()));
        assert!(request.is_ok_and(|r| r.metadata().is_empty()));
        assert!(CallMetadata::new(Some("ä"), None).is_err());
        assert!(CallMetadata::new(None, Some("t\u{f6}k")).is_err());
    }

    #[test]
    fn bare_addresses_get_a_scheme() {
        let e = endpoint("127.0.0.1:50051");
        assert!(e.is_ok_and(|e| *e.uri() == "http://127.0.0.1:50051/"));
        assert!(endpoint("http://[::1]:1").is_ok());
        assert!(endpoint("not a uri").is_err());
    }
}
