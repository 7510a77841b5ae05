//! The gRPC face: tonic services, conversions between proto and domain
//! types, and the one mapping from errors to `tonic::Status`. Proto types do
//! not leave this module (`convert` is public for the micro-benchmarks).

mod backpressure;
pub mod convert;
mod jobs;
mod status;
mod tenant;
mod workers;

pub use jobs::{FromIngress, JobsApi};
pub use status::{WATCH_INTERRUPTED, is_watch_interrupted};

/// A job as the API shows it (the proto3 JSON mapping of `Job`), for the
/// bodies of completion callbacks.
pub fn job_json(job: &crate::domain::Job) -> serde_json::Value {
    serde_json::to_value(convert::job(job)).unwrap_or(serde_json::Value::Null)
}
pub use workers::WorkersApi;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::auth::TokenSource;
use crate::config::Settings;
use crate::config::webhook_source::WebhookKeysSource;
use crate::domain::Backoff;
use crate::domain::validate::Limits;
use crate::engine::batchers::Batchers;
use crate::engine::notifier::Notifier;
use crate::engine::observer::Observer;
use crate::engine::reaper::ReapAt;
use crate::store::Store;

/// What every service needs: the store and its coalescers, the notifier, the observer
/// (logs, spans, metrics), the settings, the webhook keys and bearer tokens
/// in force, and a token that ends long-polls and streams at shutdown.
#[derive(Clone)]
pub struct Context {
    pub store: Arc<dyn Store>,
    /// Shared transactions for concurrent unary Submit, Lease and Complete.
    pub batchers: Arc<Batchers>,
    pub notifier: Arc<Notifier>,
    pub observer: Arc<Observer>,
    pub settings: Arc<Settings>,
    pub limits: Limits,
    /// Secrets, callback allow-list and ingress sources; reloaded from the
    /// webhooks file while the server runs.
    pub webhook_keys: Arc<WebhookKeysSource>,
    /// The bearer tokens in force: a watch or long-poll ends when a reload
    /// takes its caller's away.
    pub tokens: Arc<TokenSource>,
    /// Asks this replica's reaper for a pass when a cancel's grace ends.
    pub reap_at: ReapAt,
    pub shutdown: CancellationToken,
}

impl Context {
    /// Builds the context; fails when the configured default backoff is invalid.
    pub fn new(
        store: Arc<dyn Store>,
        notifier: Arc<Notifier>,
        observer: Arc<Observer>,
        settings: Settings,
        tokens: Arc<TokenSource>,
        reap_at: ReapAt,
        shutdown: CancellationToken,
    ) -> Result<Context, crate::domain::backoff::BackoffError> {
        let limits = Limits {
            default_max_attempts: settings.default_max_attempts,
            default_backoff: Backoff::try_new(settings.backoff_initial, settings.backoff_max)?,
            max_payload_bytes: settings.max_payload_bytes,
            default_lease: settings.default_lease,
            max_lease: settings.max_lease,
        };
        let webhook_keys = Arc::new(WebhookKeysSource::new(
            settings.webhooks.keys.clone(),
            settings.webhooks.file.clone(),
        ));
        Ok(Context {
            batchers: Arc::new(Batchers::start(
                Arc::clone(&store),
                Arc::clone(&observer),
                settings.submit_in_flight,
                settings.coalesce_in_flight,
            )),
            store,
            notifier,
            observer,
            settings: Arc::new(settings),
            limits,
            webhook_keys,
            tokens,
            reap_at,
            shutdown,
        })
    }
}
