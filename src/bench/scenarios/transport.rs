//! Unary calls that do no work: the gRPC health check, from many callers at
//! once, each on its own connection. It passes the server's layers (limits,
//! authentication, telemetry) and HTTP/2 on both sides like any call, but
//! touches no database, so its rate is what the transport alone allows on
//! this machine: a scenario that makes k calls per job cannot go above a
//! k-th of it.

use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::super::conn::Conn;
use super::super::error::BenchError;
use super::timed::{self, Caller, Timed};

impl Caller for HealthClient<Channel> {
    async fn call(&mut self, _n: u64) -> Result<(), BenchError> {
        self.check(HealthCheckRequest::default())
            .await
            .map_err(|s| BenchError::rpc("Health/Check", s))?;
        Ok(())
    }
}

/// Makes `calls` health checks from `callers` concurrent callers.
pub async fn run(conn: &Conn, callers: usize, calls: u64) -> Result<Timed, BenchError> {
    let mut clients = Vec::new();
    for _ in 0..callers.max(1) {
        clients.push(HealthClient::new(conn.channel().await?));
    }
    timed::run(clients, calls).await
}
