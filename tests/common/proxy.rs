//! A worker-facing server in front of the real one that injects a fault at
//! an exact moment: what the clients' retry rules are for, and what no
//! real server does on cue. Every call it does not fault goes through to
//! the real server, so the jobs' states are still the store's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use intray::pb;
use intray::pb::worker_service_server::{WorkerService, WorkerServiceServer};
use tonic::{Code, Request, Response, Status};

use super::{TestServer, WorkersClient};

/// What the proxy does to the calls it faults.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// A server as it was before `CompleteAndLease`: that call is answered
    /// `UNIMPLEMENTED`, as tonic answers a method it does not know.
    OlderServer,
    /// The first `CompleteAndLease` leases the next job but answers its
    /// outcome `UNAVAILABLE`, and so is every `Complete` of that attempt
    /// after: the outcome cannot be reported, the next job is running.
    OutcomeUnavailable,
    /// The first `n` heartbeats are answered `UNAVAILABLE` (a blip), and
    /// the proxy counts every heartbeat.
    HeartbeatsUnavailable(usize),
    /// Every heartbeat is left unanswered (a stalled server or network),
    /// until its caller gives up on it.
    HeartbeatsHang,
    /// Every `CompleteAndLease` is refused as a whole, `INVALID_ARGUMENT`
    /// naming its claim, as the server refuses a claim it cannot take (a
    /// lease over its `--max-lease-duration`, say); nothing is written.
    ClaimRefused,
}

/// The proxy's count of calls, by method.
#[derive(Debug, Default)]
pub struct Calls {
    chained: AtomicUsize,
    heartbeats: AtomicUsize,
}

impl Calls {
    /// `CompleteAndLease` calls so far.
    pub fn chained(&self) -> usize {
        self.chained.load(Ordering::SeqCst)
    }

    /// `Heartbeat` calls so far.
    pub fn heartbeats(&self) -> usize {
        self.heartbeats.load(Ordering::SeqCst)
    }
}

struct Proxy {
    upstream: WorkersClient,
    fault: Fault,
    calls: Arc<Calls>,
    /// The lease token whose outcomes are refused (`OutcomeUnavailable`).
    refused: Mutex<Option<String>>,
}

fn unavailable() -> Status {
    Status::unavailable("injected by the test proxy")
}

impl Proxy {
    fn refuses(&self, token: &str) -> bool {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_deref()
            .is_some_and(|refused| refused == token)
    }

    /// The first `CompleteAndLease` of `OutcomeUnavailable`: the claim goes
    /// through as a `Lease`, the outcome is not reported.
    async fn lease_without_the_outcome(
        &self,
        request: pb::CompleteAndLeaseRequest,
    ) -> Result<Response<pb::CompleteAndLeaseResponse>, Status> {
        // A failed expectation answers INTERNAL, which the test then sees
        // in the worker's log rather than as a reset connection.
        let [item] = request.items.as_slice() else {
            return Err(Status::internal("the proxy expects one outcome per call"));
        };
        *self.refused.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(item.lease_token.clone());
        let Some(lease) = request.lease else {
            return Err(Status::internal("the proxy expects a claim"));
        };
        let leased = self.upstream.clone().lease(lease).await?.into_inner();
        let refused = pb::ItemError {
            code: Code::Unavailable as i32,
            message: unavailable().message().to_owned(),
            field: String::new(),
            retry_delay: None,
        };
        Ok(Response::new(pb::CompleteAndLeaseResponse {
            results: vec![pb::CompleteBatchResult {
                result: Some(pb::complete_batch_result::Result::Error(refused)),
            }],
            jobs: leased.jobs,
        }))
    }
}

#[tonic::async_trait]
impl WorkerService for Proxy {
    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        self.upstream.clone().lease(request.into_inner()).await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let seen = self.calls.heartbeats.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::HeartbeatsUnavailable(n) if seen < n => return Err(unavailable()),
            Fault::HeartbeatsHang => std::future::pending::<()>().await,
            _ => {}
        }
        self.upstream.clone().heartbeat(request.into_inner()).await
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        if self.refuses(&request.get_ref().lease_token) {
            return Err(unavailable());
        }
        self.upstream.clone().complete(request.into_inner()).await
    }

    async fn complete_batch(
        &self,
        request: Request<pb::CompleteBatchRequest>,
    ) -> Result<Response<pb::CompleteBatchResponse>, Status> {
        self.upstream
            .clone()
            .complete_batch(request.into_inner())
            .await
    }

    async fn complete_and_lease(
        &self,
        request: Request<pb::CompleteAndLeaseRequest>,
    ) -> Result<Response<pb::CompleteAndLeaseResponse>, Status> {
        let first = self.calls.chained.fetch_add(1, Ordering::SeqCst) == 0;
        match self.fault {
            Fault::OlderServer => Err(Status::unimplemented("unknown method CompleteAndLease")),
            Fault::ClaimRefused => Err(Status::invalid_argument(
                "lease.lease_duration: must be between 1s and 1h (injected by the test proxy)",
            )),
            Fault::OutcomeUnavailable if first => {
                self.lease_without_the_outcome(request.into_inner()).await
            }
            _ => {
                self.upstream
                    .clone()
                    .complete_and_lease(request.into_inner())
                    .await
            }
        }
    }
}

/// Starts a proxy with `fault` in front of `server`, calling it as
/// `tenant`: its address (`host:port`) and its count of calls.
pub async fn start(server: &TestServer, tenant: &str, fault: Fault) -> (String, Arc<Calls>) {
    let calls = Arc::new(Calls::default());
    let proxy = Proxy {
        upstream: server.workers_client(tenant),
        fault,
        calls: Arc::clone(&calls),
        refused: Mutex::new(None),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the proxy");
    let addr = listener.local_addr().expect("its address").to_string();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServiceServer::new(proxy))
            .serve_with_incoming(incoming),
    );
    (addr, calls)
}
