//! The callback dispatcher: every replica runs one. It claims due rows of
//! the webhook outbox (`SKIP LOCKED` on PostgreSQL, the single writer on
//! SQLite), signs each event as Standard Webhooks asks, POSTs it, and
//! records the attempt: delivered on a 2xx, else retried with full-jitter
//! backoff until the retry window is used up. Nothing here runs inside a
//! worker's call: `Complete` only wrote the outbox row.
//!
//! Delivery is at least once: a replica that dies after the POST and
//! before recording it leaves the row to be claimed again, and the receiver
//! dedupes by `webhook-id`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use http_body_util::Full;
use hyper::Request;
use hyper::body::Bytes;
use hyper::http::header;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tokio_util::sync::CancellationToken;

use crate::config::webhook_source::WebhookKeysSource;
use crate::config::webhooks::WebhookSettings;
use crate::domain::webhook::{self, AddressPolicy, AfterFailure, Target};
use crate::domain::{Backoff, Job};
use crate::store::outbox::{Attempted, Claimed, Delivery, Outbox, ReceiverLoad};
use crate::store::{Store, StoreError};
use crate::telemetry::Metrics;

/// Deliveries in flight at a time, per replica.
pub const IN_FLIGHT: usize = 32;
/// Delivery rows the backfill writes per poll.
const BACKFILL_BATCH: u32 = 500;
/// CA bundle of `https` callbacks when neither the settings nor
/// `SSL_CERT_FILE` name one.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Turns a job into the JSON the API shows for it (the proto3 JSON mapping
/// of `Job`), supplied by the API layer so that proto types stay there.
pub type RenderJob = Arc<dyn Fn(&Job) -> serde_json::Value + Send + Sync>;

/// Why an attempt did not get an answer, or got one that was not 2xx.
#[derive(Debug, thiserror::Error)]
enum SendError {
    /// Never worth retrying: the configuration or the URL is the problem.
    #[error("{0}")]
    Permanent(String),
    /// Worth retrying; the kind shown to the tenant, and the whole text.
    #[error("{1}")]
    Transient(Failure, String),
    #[error("receiver answered {0}")]
    Status(u16),
}

/// The kind of a failed attempt that may pass later.
#[derive(Clone, Copy, Debug)]
enum Failure {
    Timeout,
    /// No connection, or no HTTP answer on it.
    Unreachable,
    Tls,
    /// The host's addresses are not allowed, or it does not resolve.
    Address,
    NoSecret,
    NoCaBundle,
    Store,
}

impl SendError {
    /// What the job's tenant is shown in its deliveries listing: the kind
    /// of failure, not the dispatcher's own text, which told any producer
    /// which internal names resolve and which ports within the `allow`
    /// list answer what. The whole text is logged.
    fn shown(&self) -> String {
        let text = match self {
            SendError::Permanent(text) => return text.clone(),
            SendError::Status(code) => return format!("receiver answered {code}"),
            SendError::Transient(failure, _) => match failure {
                Failure::Timeout => "no answer within the webhook timeout",
                Failure::Unreachable => {
                    "the receiver could not be reached, or did not answer in HTTP/1.1"
                }
                Failure::Tls => "the TLS handshake with the receiver failed",
                Failure::Address => "the host does not resolve to an allowed address",
                Failure::NoSecret => "no webhook secret is configured for the tenant",
                Failure::NoCaBundle => "the server has no CA bundle for https",
                Failure::Store => "the server could not read the job",
            },
        };
        text.to_owned()
    }
}

impl From<StoreError> for SendError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::NotFound => SendError::Permanent("the job no longer exists".into()),
            other => SendError::Transient(Failure::Store, format!("store: {other}")),
        }
    }
}

/// The delivery timings of [`WebhookSettings`]; its keys are read from the
/// [`WebhookKeysSource`], which reloads them.
struct Timings {
    timeout: Duration,
    retry_window: Duration,
    backoff: Backoff,
    poll: Duration,
    per_receiver: u32,
}

/// The dispatcher of one replica.
pub struct Dispatcher {
    store: Arc<dyn Store>,
    outbox: Arc<dyn Outbox>,
    render: RenderJob,
    timings: Timings,
    /// Secrets and allow-list, read once per attempt: a rotated secret
    /// signs the next attempt, and one attempt never mixes two files.
    keys: Arc<WebhookKeysSource>,
    metrics: Arc<Metrics>,
    tls: Option<TlsConnector>,
}

impl Dispatcher {
    /// A dispatcher over `store`'s outbox. `https` callbacks are checked
    /// against the configured CA file, else `SSL_CERT_FILE`, else the
    /// system bundle; without one they fail (logged here once).
    pub fn new(
        store: Arc<dyn Store>,
        render: RenderJob,
        settings: &WebhookSettings,
        keys: Arc<WebhookKeysSource>,
        metrics: Arc<Metrics>,
    ) -> Dispatcher {
        let roots = settings
            .ca_file
            .clone()
            .or_else(|| std::env::var_os("SSL_CERT_FILE").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(SYSTEM_ROOTS));
        let tls = match tls_connector(&roots) {
            Ok(tls) => Some(tls),
            Err(err) => {
                tracing::warn!(roots = %roots.display(), error = %err, "no CA bundle: https callbacks will fail");
                None
            }
        };
        Dispatcher {
            outbox: store.outbox(),
            store,
            render,
            timings: Timings {
                timeout: settings.timeout,
                retry_window: settings.retry_window,
                backoff: settings.backoff,
                poll: settings.poll,
                per_receiver: u32::try_from(settings.per_receiver).unwrap_or(u32::MAX),
            },
            keys,
            metrics,
            tls,
        }
    }

    /// Delivers until `stop` fires, then waits for the attempts in flight
    /// (each at most `timeout`). Up to [`IN_FLIGHT`] attempts run at once,
    /// each on its own, and at most `per_receiver` of them at one receiver
    /// (`host:port`): while more rows are due, the free slots are filled
    /// once half of them are free (one claim per few deliveries, not one
    /// each), and at every `poll`. So receivers that never answer hold
    /// only their own slots for their timeout, never everyone's callbacks.
    /// A claim cut short by a receiver's limit is followed by another (which
    /// skips the receivers now full) at once, or at the next `poll` while
    /// such claims find nothing; and an attempt that frees a slot at a
    /// receiver that was full is followed by a claim: a receiver that
    /// answers fast is held to `per_receiver` at a time, not per `poll`,
    /// and its backlog hides the others' rows for at most a `poll`.
    /// Delivery rows missing for jobs that ended before the outbox existed
    /// are written from the start, a batch per poll, until none are left.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut ticker = tokio::time::interval(self.timings.poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Jobs that ended before the outbox existed have no delivery row
        // (every later one is written in its job's own transaction): they
        // are written from the start, a batch per poll, until a pass writes
        // none. A sweep every minute read every callback job of the retry
        // window each time, on SQLite inside the one writer.
        let mut backfilling = true;
        // A claimed row comes back after this if this replica dies mid-send.
        let hold = self.timings.timeout + Duration::from_secs(30);
        let mut in_flight = JoinSet::new();
        // Each attempt's receiver, by its task: the count is given back
        // even by an attempt that panicked.
        let mut receiver_of: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut at_receiver: HashMap<String, u32> = HashMap::new();
        // Whether more rows may be due: the last claim took some, or left
        // rows of receivers at their limit.
        let mut more_due = false;
        // Whether the last claim made after one cut short by a receiver's
        // limit found rows of other receivers. Such a claim steps over the
        // due rows of the receivers it skips, so while it finds none it is
        // made once per poll, not after every attempt.
        let mut others_found = true;
        loop {
            let (ticked, limit_freed) = tokio::select! {
                // First: once stopping, nothing more is claimed.
                biased;
                () = stop.cancelled() => break,
                _ = ticker.tick() => (true, false),
                Some(done) = in_flight.join_next_with_id(), if !in_flight.is_empty() => {
                    let id = match done {
                        Ok((id, ())) => id,
                        Err(err) => err.id(),
                    };
                    // A receiver that was at its limit has room again: worth
                    // a claim even with few slots free (the others may be
                    // held by receivers that do not answer).
                    let mut was_full = false;
                    if let Some(receiver) = receiver_of.remove(&id) {
                        was_full = at_receiver
                            .get(&receiver)
                            .is_some_and(|n| *n >= self.timings.per_receiver);
                        release(&mut at_receiver, &receiver);
                    }
                    (false, was_full)
                }
            };
            more_due |= ticked;
            if backfilling && ticked {
                match self
                    .outbox
                    .reconcile(self.timings.retry_window, BACKFILL_BATCH)
                    .await
                {
                    Ok(written) => {
                        if written > 0 {
                            tracing::info!(
                                rows = written,
                                "webhook backfill wrote missing deliveries"
                            );
                        }
                        // Until a pass writes nothing: replicas backfilling
                        // at once each write only part of a pass.
                        backfilling = written > 0;
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "webhook backfill failed; trying again next poll")
                    }
                }
            }
            let free = IN_FLIGHT.saturating_sub(in_flight.len());
            if !more_due || free == 0 || (!ticked && !limit_freed && free < IN_FLIGHT / 2) {
                continue;
            }
            more_due = false;
            let mut follow_up = false;
            loop {
                let free = IN_FLIGHT.saturating_sub(in_flight.len());
                if free == 0 {
                    more_due = true;
                    break;
                }
                let claimed = u32::try_from(free).unwrap_or(u32::MAX);
                let load = ReceiverLoad {
                    per_receiver: self.timings.per_receiver,
                    in_flight: &at_receiver,
                };
                let due = match self.outbox.claim_due(claimed, hold, load).await {
                    Ok(due) => due,
                    Err(err) => {
                        tracing::warn!(error = %err, "claiming webhook deliveries failed; retrying next interval");
                        break;
                    }
                };
                if follow_up {
                    others_found = !due.is_empty();
                }
                if due.is_empty() {
                    // Rows of receivers at their limit may be due: a slot
                    // they free is worth a claim.
                    more_due |= at_receiver
                        .values()
                        .any(|n| *n >= self.timings.per_receiver);
                    break;
                }
                more_due = true;
                let cut_short = due.len() < free;
                for delivery in due {
                    *at_receiver.entry(delivery.receiver.clone()).or_default() += 1;
                    let receiver = delivery.receiver.clone();
                    let this = Arc::clone(&self);
                    let task = in_flight.spawn(async move { this.deliver(delivery).await });
                    receiver_of.insert(task.id(), receiver);
                }
                if !cut_short || !(ticked || others_found) {
                    break;
                }
                follow_up = true;
            }
        }
        while in_flight.join_next().await.is_some() {}
    }

    /// One attempt of one delivery, recorded.
    async fn deliver(&self, claimed: Claimed) {
        let delivery = &claimed.delivery;
        let answer = tokio::time::timeout(self.timings.timeout, self.send(delivery))
            .await
            .unwrap_or_else(|_| {
                Err(SendError::Transient(
                    Failure::Timeout,
                    format!("no answer within {:?}", self.timings.timeout),
                ))
            });
        let attempt = delivery.attempts + 1;
        let step = match answer {
            Ok(status) => Attempted::Delivered { status },
            Err(SendError::Permanent(error)) => {
                tracing::warn!(webhook_id = %delivery.webhook_id, job_id = %delivery.job_id, attempt, %error, "webhook delivery failed for good");
                Attempted::Failed {
                    status: None,
                    error,
                }
            }
            Err(err) => {
                let status = match &err {
                    SendError::Status(code) => Some(*code),
                    _ => None,
                };
                let age = (Utc::now() - delivery.created_at)
                    .to_std()
                    .unwrap_or_default();
                match webhook::after_failure(
                    &self.timings.backoff,
                    attempt,
                    age,
                    self.timings.retry_window,
                    rand::random::<f64>(),
                ) {
                    AfterFailure::Retry(delay) => {
                        tracing::info!(webhook_id = %delivery.webhook_id, attempt, error = %err, ?delay, "webhook attempt failed; will retry");
                        Attempted::Retry {
                            status,
                            error: err.shown(),
                            delay,
                        }
                    }
                    AfterFailure::GiveUp => {
                        tracing::warn!(webhook_id = %delivery.webhook_id, job_id = %delivery.job_id, attempt, error = %err, "webhook delivery failed for good");
                        Attempted::Failed {
                            status,
                            error: err.shown(),
                        }
                    }
                }
            }
        };
        let outcome = match &step {
            Attempted::Delivered { .. } => "delivered",
            Attempted::Retry { .. } => "retry",
            Attempted::Failed { .. } => "failed",
        };
        self.metrics.webhook_attempt(outcome);
        if let Attempted::Delivered { .. } = &step {
            tracing::debug!(webhook_id = %delivery.webhook_id, attempt, "webhook delivered");
        }
        match self.outbox.record(&claimed, &step).await {
            Ok(true) => {}
            // Recorded too late: the hold ran out and another pass (here or
            // on another replica) took the row over, and records its own.
            Ok(false) => {
                tracing::info!(webhook_id = %delivery.webhook_id, "webhook attempt recorded after its claim lapsed; the later claim's record stands");
            }
            // The row comes back when its hold runs out: sent again, which
            // the receiver's dedupe by webhook-id absorbs.
            Err(err) => {
                tracing::warn!(webhook_id = %delivery.webhook_id, error = %err, "recording a webhook attempt failed");
            }
        }
    }

    /// Signs and POSTs the event; `Ok` with a 2xx status.
    async fn send(&self, delivery: &Delivery) -> Result<u16, SendError> {
        let keys = self.keys.current();
        // Submit refuses a callback without a secret; one gone since (a
        // webhooks file edited) is retried, as an address the allow-list
        // dropped is, so that the edit can be mended without a loss.
        let secret = keys.secrets_for(&delivery.tenant).ok_or_else(|| {
            SendError::Transient(
                Failure::NoSecret,
                format!(
                    "no webhook secret configured for tenant {:?}",
                    delivery.tenant
                ),
            )
        })?;
        let target = Target::parse(&delivery.url)
            .ok_or_else(|| SendError::Permanent("the callback URL is not valid".into()))?;
        let job = self.store.get(&delivery.tenant, delivery.job_id).await?;
        let body = serde_json::json!({
            "type": webhook::callback_type(&delivery.event_type),
            "sequence": delivery.sequence,
            "job": (self.render)(&job),
        });
        let body = Bytes::from(
            crate::domain::json::to_vec_whole(&body)
                .map_err(|e| SendError::Permanent(format!("cannot encode the body: {e}")))?,
        );
        let timestamp = Utc::now().timestamp();
        let signature = secret.sign(&delivery.webhook_id, timestamp, &body);
        let addr = Self::resolve(&target, &keys.allow).await?;
        let host = if target.host.contains(':') {
            format!("[{}]:{}", target.host, target.port)
        } else {
            format!("{}:{}", target.host, target.port)
        };
        let request = Request::post(target.path.as_str())
            .header(header::HOST, host)
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::USER_AGENT,
                concat!("intray/", env!("CARGO_PKG_VERSION")),
            )
            .header("webhook-id", delivery.webhook_id.as_str())
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(Full::new(body))
            .map_err(|e| SendError::Permanent(format!("cannot build the request: {e}")))?;
        let tcp = TcpStream::connect(addr).await.map_err(|e| {
            SendError::Transient(Failure::Unreachable, format!("connect {addr}: {e}"))
        })?;
        // Small requests: without nodelay, delayed ACKs add ~40 ms each.
        tcp.set_nodelay(true).map_err(|e| {
            SendError::Transient(Failure::Unreachable, format!("connect {addr}: {e}"))
        })?;
        let status = if target.tls {
            let tls = self.tls.as_ref().ok_or_else(|| {
                SendError::Transient(Failure::NoCaBundle, "no CA bundle for https".into())
            })?;
            let name = ServerName::try_from(target.host.clone()).map_err(|_| {
                SendError::Permanent("the callback host is not a valid TLS name".into())
            })?;
            let stream = tls
                .connect(name, tcp)
                .await
                .map_err(|e| SendError::Transient(Failure::Tls, format!("tls: {e}")))?;
            post(stream, request).await?
        } else {
            post(tcp, request).await?
        };
        if (200..300).contains(&status) {
            Ok(status)
        } else {
            Err(SendError::Status(status))
        }
    }

    /// The address to connect to, checked against the SSRF policy after
    /// resolution (so a name that starts resolving to a private address,
    /// DNS rebinding, is refused at the next attempt). A refusal is
    /// retried like a refused connection: an allow-list edited by mistake,
    /// or a name that points elsewhere for a while, must not fail every
    /// callback due meanwhile for good; none is sent while it lasts.
    async fn resolve(target: &Target, allow: &AddressPolicy) -> Result<SocketAddr, SendError> {
        if let Some(ip) = target.literal_ip() {
            return if allow.allows_ip(ip) {
                Ok(SocketAddr::new(ip, target.port))
            } else {
                Err(SendError::Transient(
                    Failure::Address,
                    format!("address {ip} is not allowed"),
                ))
            };
        }
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
            .await
            .map_err(|e| {
                SendError::Transient(Failure::Address, format!("resolve {}: {e}", target.host))
            })?
            .collect();
        let named = allow.allows_host(&target.host);
        addrs
            .iter()
            .copied()
            .find(|a| named || allow.allows_ip(a.ip()))
            .ok_or_else(|| {
                SendError::Transient(
                    Failure::Address,
                    format!("{} resolves to no allowed address", target.host),
                )
            })
    }
}

/// One attempt at `receiver` has ended.
fn release(at_receiver: &mut HashMap<String, u32>, receiver: &str) {
    if let Some(n) = at_receiver.get_mut(receiver) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            at_receiver.remove(receiver);
        }
    }
}

/// Sends one request on a fresh HTTP/1.1 connection and returns the status.
async fn post<IO>(io: IO, request: Request<Full<Bytes>>) -> Result<u16, SendError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| SendError::Transient(Failure::Unreachable, format!("http: {e}")))?;
    let driver = tokio::spawn(connection);
    let answer = sender.send_request(request).await;
    driver.abort();
    let response =
        answer.map_err(|e| SendError::Transient(Failure::Unreachable, format!("http: {e}")))?;
    Ok(response.status().as_u16())
}

/// Whether `roots_file` holds CA certificates `https` callbacks can be
/// checked against: a configured file that does not stops the server at
/// start, where a typo would otherwise fail every such callback.
pub fn check_roots(roots_file: &std::path::Path) -> Result<(), String> {
    tls_connector(roots_file).map(drop)
}

fn tls_connector(roots_file: &std::path::Path) -> Result<TlsConnector, String> {
    let pem = std::fs::read(roots_file).map_err(|e| e.to_string())?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| e.to_string())?;
        // A bundle may hold a certificate rustls cannot use; skip it.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err("no usable certificate".into());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}
