//! All server wiring in one place: store, background tasks, services,
//! health, reflection, authentication, TLS, limits, and a clean shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::api::{Context, JobsApi, WorkersApi};
use crate::auth::file::TokenFileError;
use crate::auth::{AuthLayer, TokenSource};
use crate::config::Settings;
use crate::engine::observer::Observer;
use crate::engine::{gauges, notifier::Notifier, reaper};
use crate::pb::job_service_server::JobServiceServer;
use crate::pb::worker_service_server::WorkerServiceServer;
use crate::protect::{
    BatchCountLayer, CallLimitLayer, DecodeErrorsLayer, RateLimitLayer, RateLimiter,
};
use crate::store::{self, StoreError};
use crate::telemetry::Metrics;
use crate::telemetry::rpc::RpcLayer;
use crate::tls::{TlsError, TlsState};

/// Largest request a service accepts: a full `SubmitBatch` of typical jobs.
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
/// Largest response: a `List` page of 1,000 jobs with their payloads (the
/// HTTP face holds its JSON answers to it too).
pub(crate) const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// TCP keepalive on accepted connections: finds peers that vanished without
/// a FIN (a node gone) even when HTTP/2 pings are answered by a proxy.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

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
    #[error("{0}")]
    Auth(#[from] TokenFileError),
    #[error("tls: {0}")]
    Tls(#[from] TlsError),
    #[error("http port: {0}")]
    Http(#[from] std::io::Error),
    #[error("webhook CA file {path}: {reason}")]
    WebhookCa {
        /// The configured `--webhook-ca-file`.
        path: std::path::PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
}

/// The tokens of the configured file (`read`, from [`read_files`]), or
/// open mode with a warning that cannot be missed.
fn token_source(settings: &Settings, read: Option<TokenSource>) -> TokenSource {
    match (&settings.auth_file, read) {
        (Some(path), Some(source)) => {
            let tokens = source.current().len();
            tracing::info!(file = %path.display(), tokens, "authentication on");
            if tokens == 0 {
                tracing::warn!(file = %path.display(), "the token file has no tokens: every call will be refused");
            }
            if settings.webhooks.keys.default_secret.is_some() {
                tracing::warn!(
                    "the webhooks file's default_secret signs the callbacks of every tenant \
                     without a secret of its own: each such tenant's receivers can check (and \
                     forge) the others' callbacks. With several tenants, give each its own in \
                     tenant_secrets."
                );
            }
            source
        }
        _ => {
            tracing::warn!(
                "AUTHENTICATION IS OFF: no --auth-file, so every caller may do everything \
                 for any tenant (x-intray-tenant). Development only; never expose this port."
            );
            TokenSource::open()
        }
    }
}

/// What the settings name besides the database, read and checked.
struct Files {
    /// The token file's tokens; none in open mode.
    tokens: Option<TokenSource>,
    hosts: crate::http::AllowedHosts,
    tls: Option<TlsState>,
}

/// Reads the token file and the TLS files, and checks the allowed hosts
/// and the webhook CA file.
fn read_files(settings: &Settings) -> Result<Files, ServerError> {
    let tokens = settings
        .auth_file
        .as_ref()
        .map(TokenSource::from_file)
        .transpose()?;
    let hosts = crate::http::AllowedHosts::new(
        settings.http_allowed_hosts.as_deref(),
        settings.auth_file.is_none(),
    )
    .map_err(ServerError::Settings)?;
    let tls = settings
        .tls
        .as_ref()
        .map(|files| TlsState::load(files.clone()))
        .transpose()?;
    if let Some(path) = &settings.webhooks.ca_file {
        crate::engine::webhooks::check_roots(path).map_err(|reason| ServerError::WebhookCa {
            path: path.clone(),
            reason,
        })?;
    }
    Ok(Files { tokens, hosts, tls })
}

/// [`read_files`], keeping nothing: `intray serve` runs it before
/// migrating, so that a bad file or flag stops the server before it touches
/// the database. [`run_with`] reads them again for use.
pub fn preflight(settings: &Settings) -> Result<(), ServerError> {
    read_files(settings).map(drop)
}

/// Serves the gRPC API on `listener` until `shutdown` completes, without
/// the HTTP port: see [`run_with`].
pub async fn run(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    run_with(settings, listener, None, shutdown).await
}

/// Serves the gRPC API on `listener`, and on `http` when given the HTTP
/// port (JSON API, dashboard, `GET /metrics`), until `shutdown` completes: opens and migrates the database, runs
/// the reaper and the metrics timer, and on shutdown reports NOT_SERVING,
/// ends long-polls and watch streams, and lets in-flight calls finish.
pub async fn run_with(
    settings: Settings,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    // Files first: a bad token file or certificate fails before the store
    // opens (`intray serve` has checked them before migrating: `preflight`).
    let files = read_files(&settings)?;
    let tokens = Arc::new(token_source(&settings, files.tokens));
    let hosts = files.hosts;
    let tls = files.tls.map(Arc::new);
    let notifier = Arc::new(Notifier::new());
    let store = store::open(&settings, Arc::clone(&notifier)).await?;
    let stop = CancellationToken::new();
    let reaper_interval = settings.reaper_interval;
    let shutdown_grace = settings.shutdown_grace;
    let shutdown_delay = settings.shutdown_delay;
    let reload_interval = settings.reload_interval;
    let metrics = Arc::new(Metrics::new());
    let observer = Arc::new(Observer::new(
        settings.tracing.clone(),
        Arc::clone(&metrics),
        settings.slow_attempt,
    ));
    let metrics_refresh = settings.metrics_refresh;
    // One bucket per caller and one concurrency limit for both ports.
    let limiter = settings.rate_limit.map(|l| Arc::new(RateLimiter::new(l)));
    let call_limit = CallLimitLayer::new(settings.rpc_timeout, settings.concurrency_limit);
    let http_limits = crate::http::Limits {
        rate: limiter.clone(),
        slots: call_limit.slots(),
        timeout: settings.rpc_timeout,
    };
    // Outermost: refused and timed-out calls are traced and counted too.
    let layers = tower::ServiceBuilder::new()
        .layer(RpcLayer::new(
            settings.tracing.clone(),
            Arc::clone(&metrics),
        ))
        .layer(AuthLayer::new(Arc::clone(&tokens)))
        .layer(RateLimitLayer::new(limiter))
        .layer(call_limit)
        .layer(DecodeErrorsLayer)
        .layer(BatchCountLayer {
            max_message: MAX_REQUEST_BYTES,
        });
    let keepalive = (
        settings.http2_keepalive_interval,
        settings.http2_keepalive_timeout,
    );
    let retention = settings.retention;
    let webhooks = settings.webhooks.clone();
    let http_tracing = settings.tracing.clone();
    let http_timeouts = settings.http_read_timeouts;
    let (reap_at, reap_wakes) = reaper::ReapAt::new();
    let ctx = Context::new(
        Arc::clone(&store),
        notifier,
        Arc::clone(&observer),
        settings,
        Arc::clone(&tokens),
        reap_at,
        stop.clone(),
    )
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

    // One service behind both ports: the HTTP face calls the same instance.
    let jobs_api = Arc::new(JobsApi::new(ctx.clone()));
    let jobs = JobServiceServer::from_arc(Arc::clone(&jobs_api))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);
    let webhook_keys = Arc::clone(&ctx.webhook_keys);
    let workers = WorkerServiceServer::new(WorkersApi::new(ctx))
        .max_decoding_message_size(MAX_REQUEST_BYTES)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);

    let reaper_task = tokio::spawn(reaper::run(
        Arc::clone(&store),
        reaper_interval,
        retention,
        observer,
        reap_wakes,
        stop.clone(),
    ));
    let gauges_task = tokio::spawn(gauges::run(
        Arc::clone(&store),
        Arc::clone(&metrics),
        metrics_refresh,
        stop.clone(),
    ));
    let dispatcher = Arc::new(crate::engine::webhooks::Dispatcher::new(
        Arc::clone(&store),
        Arc::new(crate::api::job_json),
        &webhooks,
        Arc::clone(&webhook_keys),
        Arc::clone(&metrics),
    ));
    let dispatcher_task = tokio::spawn(dispatcher.run(stop.clone()));
    // Fires at SIGTERM, when the health service turns NOT_SERVING: the
    // HTTP port's `/readyz` follows it.
    let draining = CancellationToken::new();
    let http_task = http.map(|listener| {
        let ingress = crate::http::Ingress::new(
            Arc::clone(&webhook_keys),
            webhooks.max_body_bytes,
            Arc::clone(&jobs_api),
            Arc::clone(&metrics),
        );
        let gateway = crate::http::Gateway::new(
            jobs_api,
            Arc::clone(&tokens),
            http_limits,
            Arc::clone(&metrics),
        );
        let app = crate::http::router(
            Arc::new(gateway),
            Arc::new(ingress),
            metrics,
            http_tracing,
            hosts,
            draining.clone(),
            http_timeouts.body,
        );
        tokio::spawn(crate::http::serve(
            listener,
            app,
            tls.clone(),
            http_timeouts.header,
            stop.clone(),
        ))
    });
    let mut watchers = Vec::new();
    if let Some(path) = tokens.path() {
        let tokens = Arc::clone(&tokens);
        watchers.push(tokio::spawn(crate::reload::watch(
            "token file",
            vec![path.to_owned()],
            reload_interval,
            stop.clone(),
            move || tokens.reload_and_log(),
        )));
    }
    if let Some(path) = webhook_keys.file() {
        let keys = Arc::clone(&webhook_keys);
        watchers.push(tokio::spawn(crate::reload::watch(
            "webhooks file",
            vec![path.to_owned()],
            reload_interval,
            stop.clone(),
            move || keys.reload_and_log(),
        )));
    }
    if let Some(tls) = &tls {
        let files = tls.files();
        let paths = [
            Some(&files.cert),
            Some(&files.key),
            files.client_ca.as_ref(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        let tls = Arc::clone(tls);
        watchers.push(tokio::spawn(crate::reload::watch(
            "tls",
            paths,
            reload_interval,
            stop.clone(),
            move || tls.reload_and_log(),
        )));
    }

    let signal = {
        let stop = stop.clone();
        let health = health.clone();
        async move {
            shutdown.await;
            draining.cancel();
            health.set_not_serving::<JobServiceServer<JobsApi>>().await;
            health
                .set_not_serving::<WorkerServiceServer<WorkersApi>>()
                .await;
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            // Serving on, reported as not serving, until the load balancer
            // has stopped sending calls here: closed now, its late ones
            // would be refused.
            if !shutdown_delay.is_zero() {
                tracing::info!(delay = ?shutdown_delay, "not serving; taking calls a while longer");
                tokio::time::sleep(shutdown_delay).await;
            }
            // Ends long-polls and watch streams so that draining is quick.
            stop.cancel();
        }
    };

    // Setting nodelay explicitly: an incoming built from a listener does not,
    // and delayed ACKs then add ~40 ms to small request/response pairs.
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(TCP_KEEPALIVE));
    // Layers see every call, health and reflection included: auth decides
    // which of them need no token.
    let router = Server::builder()
        .http2_keepalive_interval(Some(keepalive.0))
        .http2_keepalive_timeout(Some(keepalive.1))
        .layer(layers)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(jobs)
        .add_service(workers);
    let serve = async {
        match tls {
            Some(tls) => {
                let incoming = crate::tls::incoming::incoming(incoming, tls, stop.clone());
                router.serve_with_incoming_shutdown(incoming, signal).await
            }
            None => router.serve_with_incoming_shutdown(incoming, signal).await,
        }
    };
    // Once shutdown starts, in-flight calls on both ports get
    // `shutdown_grace` to finish; then they are dropped (their open
    // transactions roll back, so nothing half-done is kept) and the process
    // may exit.
    let grace_over = CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        let grace_over = grace_over.clone();
        async move {
            stop.cancelled().await;
            tokio::time::sleep(shutdown_grace).await;
            grace_over.cancel();
        }
    });
    let served = tokio::select! {
        served = serve => served,
        () = grace_over.cancelled() => {
            tracing::warn!(grace = ?shutdown_grace, "calls still running after the shutdown grace were dropped");
            Ok(())
        }
    };

    stop.cancel();
    if let Err(err) = reaper_task.await {
        tracing::error!(error = %err, "reaper task failed");
    }
    if let Err(err) = dispatcher_task.await {
        tracing::error!(error = %err, "webhook dispatcher task failed");
    }
    if let Err(err) = gauges_task.await {
        tracing::error!(error = %err, "metrics timer task failed");
    }
    let http_served = match http_task {
        // A request that never finishes (a client stalled mid-body) would
        // otherwise hold the graceful shutdown of its connection forever.
        // The aborted server leaves such a connection's task to the
        // runtime's end.
        Some(mut task) => tokio::select! {
            joined = &mut task => match joined {
                Ok(result) => result,
                Err(err) => {
                    tracing::error!(error = %err, "http task failed");
                    Ok(())
                }
            },
            () = grace_over.cancelled() => {
                task.abort();
                tracing::warn!(grace = ?shutdown_grace, "HTTP requests still running after the shutdown grace were dropped");
                Ok(())
            }
        },
        None => Ok(()),
    };
    for watcher in watchers {
        if let Err(err) = watcher.await {
            tracing::error!(error = %err, "file watch task failed");
        }
    }
    store.close().await;
    served?;
    http_served?;
    Ok(())
}
