//! All server wiring in one place: store, background tasks, services,
//! health, reflection, limits, and a clean shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::api::{Context, JobsApi, WorkersApi};
use crate::config::Settings;
use crate::engine::{notifier::Notifier, reaper};
use crate::pb::job_service_server::JobServiceServer;
use crate::pb::worker_service_server::WorkerServiceServer;
use crate::store::{self, StoreError};

/// Largest request a service accepts: a full `SubmitBatch` of typical jobs.
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
/// Largest response: a `List` page of 1,000 jobs with their payloads.
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot open the database: {0}")]
    Store(#[from] StoreError),
    #[error("invalid settings: {0}")]
    Settings(String),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the gRPC API on `listener` until `shutdown` completes: opens and
/// migrates the database, runs the reaper, and on shutdown reports
/// NOT_SERVING, ends long-polls and watch streams, and lets in-flight calls
/// finish.
pub async fn run(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let notifier = Arc::new(Notifier::new());
    let store = store::open(&settings, Arc::clone(&notifier)).await?;
    let stop = CancellationToken::new();
    let reaper_interval = settings.reaper_interval;
    let retention = settings.retention;
    let ctx = Context::new(Arc::clone(&store), notifier, settings, stop.clone())
        .map_err(|e| ServerError::Settings(e.to_string()))?;

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<JobServiceServer<JobsApi>>().await;
    health
        .set_serving::<WorkerServiceServer<WorkersApi>>()
        .await;

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    // grpcurl 1.8 only speaks v1alpha.
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let jobs = JobServiceServer::new(JobsApi::new(ctx.clone()))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);
    let workers = WorkerServiceServer::new(WorkersApi::new(ctx))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);

    let reaper_task = tokio::spawn(reaper::run(
        Arc::clone(&store),
        reaper_interval,
        retention,
        stop.clone(),
    ));

    let signal = {
        let stop = stop.clone();
        let health = health.clone();
        async move {
            shutdown.await;
            health.set_not_serving::<JobServiceServer<JobsApi>>().await;
            health
                .set_not_serving::<WorkerServiceServer<WorkersApi>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            // Ends long-polls and watch streams so that draining is quick.
            stop.cancel();
        }
    };

    // Setting nodelay explicitly: an incoming built from a listener does not,
    // and delayed ACKs then add ~40 ms to small request/response pairs.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let served = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(jobs)
        .add_service(workers)
        .serve_with_incoming_shutdown(incoming, signal)
        .await;

    stop.cancel();
    if let Err(err) = reaper_task.await {
        tracing::error!(error = %err, "reaper task failed");
    }
    served?;
    Ok(())
}
