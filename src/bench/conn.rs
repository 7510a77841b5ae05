//! Connections to the server under test: the CLI's address, TLS, tenant and
//! token handling, one HTTP/2 connection per producer, worker or group of
//! watchers, as separate client processes would have.

use std::time::Duration;

use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::error::BenchError;
use crate::client::{ClientOpts, TENANT_METADATA, authorization, endpoint, tenant_metadata};
use crate::pb::job_service_client::JobServiceClient;
use crate::pb::worker_service_client::WorkerServiceClient;

/// How long to wait for a connection before giving up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A producer's client.
pub type Jobs = JobServiceClient<InterceptedService<Channel, Metadata>>;
/// A worker's client.
pub type Workers = WorkerServiceClient<InterceptedService<Channel, Metadata>>;

/// Adds the tenant and the bearer token to every call.
#[derive(Clone)]
pub struct Metadata {
    tenant: Option<AsciiMetadataValue>,
    authorization: Option<AsciiMetadataValue>,
}

impl Interceptor for Metadata {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(tenant) = &self.tenant {
            request
                .metadata_mut()
                .insert(TENANT_METADATA, tenant.clone());
        }
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        Ok(request)
    }
}

/// Where the server is and how to talk to it; opens new connections.
#[derive(Clone)]
pub struct Conn {
    addr: String,
    endpoint: Endpoint,
    metadata: Metadata,
}

impl Conn {
    /// From the CLI's client options.
    pub fn new(opts: &ClientOpts) -> Result<Conn, BenchError> {
        let (addr, endpoint) = endpoint(opts)?;
        Ok(Conn {
            addr,
            endpoint: endpoint.tcp_nodelay(true).connect_timeout(CONNECT_TIMEOUT),
            metadata: Metadata {
                tenant: tenant_metadata(opts.tenant.as_deref())?,
                authorization: authorization(opts.token.as_deref())?,
            },
        })
    }

    /// The address as given, for messages.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A new HTTP/2 connection.
    pub async fn channel(&self) -> Result<Channel, BenchError> {
        self.endpoint
            .connect()
            .await
            .map_err(|source| BenchError::Connect {
                addr: self.addr.clone(),
                source,
            })
    }

    /// A producer client on `channel`.
    pub fn jobs(&self, channel: Channel) -> Jobs {
        JobServiceClient::with_interceptor(channel, self.metadata.clone())
    }

    /// A worker client on `channel`.
    pub fn workers(&self, channel: Channel) -> Workers {
        WorkerServiceClient::with_interceptor(channel, self.metadata.clone())
    }

    /// A producer client on a connection of its own.
    pub async fn new_jobs(&self) -> Result<Jobs, BenchError> {
        Ok(self.jobs(self.channel().await?))
    }

    /// A worker client on a connection of its own.
    pub async fn new_workers(&self) -> Result<Workers, BenchError> {
        Ok(self.workers(self.channel().await?))
    }
}
