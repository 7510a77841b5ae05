//! The client commands: build the request, call the server, print the answer.

use std::collections::HashMap;
use std::io::{self, Write};
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::io::AsyncReadExt;
use tonic::Code;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::args::{
    CancelArgs, ClientCommand, ClientOpts, GetArgs, ListArgs, RetryArgs, StatsArgs, SubmitArgs,
    WatchArgs,
};
use super::error::{ClientError, code_name};
use super::print;
use crate::pb::job_service_client::JobServiceClient;
use crate::pb::{
    Backoff, CancelJobRequest, GetJobRequest, JobState, ListJobsRequest, ListJobsResponse,
    RetryFilter, RetryJobRequest, StatsRequest, SubmitRequest, WatchJobRequest, retry_job_request,
};

/// Metadata key that carries the tenant of every call.
pub const TENANT_METADATA: &str = "x-intray-tenant";

/// How long to wait for the TCP (and HTTP/2) connection before giving up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest response the client accepts. A page of jobs can carry up to 1 MiB
/// of payload and 1 MiB of result per job, far past tonic's 4 MiB default.
const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;

/// Consecutive failed reconnects after which `watch` gives up.
const WATCH_MAX_RECONNECTS: u32 = 10;

/// Runs one client command against the server named in `opts`.
///
/// Arguments are checked and the request is built before connecting, so a
/// typo fails at once even when the server is down. Output that stops being
/// read (`intray list | head`) ends the command quietly, as other CLIs do;
/// but not `watch`, whose exit status says how the job ended: a watch cut
/// short does not know, and must not pass for a success.
pub async fn run(opts: ClientOpts, cmd: ClientCommand) -> Result<(), ClientError> {
    let watching = matches!(cmd, ClientCommand::Watch(_));
    match execute(opts, cmd).await {
        Err(ClientError::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe && !watching => Ok(()),
        other => other,
    }
}

async fn execute(opts: ClientOpts, cmd: ClientCommand) -> Result<(), ClientError> {
    let tenant = tenant_metadata(opts.tenant.as_deref())?;
    let json = opts.json;
    match cmd {
        ClientCommand::Work(args) => super::work::run(&opts, args).await,
        ClientCommand::Submit(args) => submit(&opts, tenant, json, *args).await,
        ClientCommand::Get(GetArgs { id, events }) => {
            let mut session = Session::connect(&opts, tenant).await?;
            let request = session.request(GetJobRequest { id: id.clone() });
            let job = session.client.get(request).await?.into_inner();
            if !events {
                return if json {
                    print_json(&job, &[])
                } else {
                    print_text(|out| print::write_job(out, &job))
                };
            }
            let events = history(&mut session, id).await?;
            if json {
                let value = serde_json::json!({
                    "job": print::json_value(&job, &[])?,
                    "events": events
                        .iter()
                        .map(|e| print::json_value(e, &[]))
                        .collect::<Result<Vec<_>, _>>()?,
                });
                let text = serde_json::to_string_pretty(&value)?;
                print_text(|out| writeln!(out, "{text}"))
            } else {
                print_text(|out| {
                    print::write_job(out, &job)?;
                    writeln!(out)?;
                    print::write_timeline(out, &events)
                })
            }
        }
        ClientCommand::Cancel(CancelArgs { id, reason }) => {
            let mut session = Session::connect(&opts, tenant).await?;
            let request = session.request(CancelJobRequest {
                id,
                reason: reason.unwrap_or_default(),
            });
            let job = session.client.cancel(request).await?.into_inner();
            if json {
                print_json(&job, &[])
            } else {
                print_text(|out| print::write_job(out, &job))
            }
        }
        ClientCommand::Watch(args) => {
            let mut session = Session::connect(&opts, tenant).await?;
            tokio::select! {
                watched = watch(&mut session, args, json) => watched,
                () = super::closed_output::closed() => {
                    Err(ClientError::Output(io::ErrorKind::BrokenPipe.into()))
                }
            }
        }
        ClientCommand::List(args) => {
            let all = args.all;
            let request = list_request(args)?;
            let mut session = Session::connect(&opts, tenant).await?;
            list(&mut session, request, all, json).await
        }
        ClientCommand::Retry(args) => {
            let dry_run = args.dry_run;
            let request = retry_request(args);
            let mut session = Session::connect(&opts, tenant).await?;
            let response = session
                .client
                .retry(session.request(request))
                .await?
                .into_inner();
            if json {
                print_json(
                    &response,
                    &[("retried", serde_json::json!([])), ("matched", "0".into())],
                )
            } else {
                print_text(|out| print::write_retry(out, &response, dry_run))
            }
        }
        ClientCommand::Stats(StatsArgs { queue }) => {
            let mut session = Session::connect(&opts, tenant).await?;
            let request = session.request(StatsRequest {
                queue: queue.unwrap_or_default(),
            });
            let stats = session.client.stats(request).await?.into_inner();
            if json {
                print_json(&stats, &[])
            } else {
                print_text(|out| print::write_stats(out, &stats))
            }
        }
    }
}

/// A connected client, and the tenant and token every request is sent with.
struct Session {
    client: JobServiceClient<Channel>,
    tenant: Option<AsciiMetadataValue>,
    authorization: Option<AsciiMetadataValue>,
}

impl Session {
    async fn connect(
        opts: &ClientOpts,
        tenant: Option<AsciiMetadataValue>,
    ) -> Result<Self, ClientError> {
        let authorization = authorization(opts.token.as_deref())?;
        let (addr, endpoint) = endpoint(opts)?;
        // Without keepalive, a connection that died silently would hang a
        // `watch` (or any call) forever.
        let channel = crate::worker::with_keep_alive(endpoint)
            .tcp_nodelay(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .connect()
            .await
            .map_err(|source| ClientError::Connect { addr, source })?;
        let client = JobServiceClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES);
        Ok(Session {
            client,
            tenant,
            authorization,
        })
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
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
        request
    }
}

/// The server's endpoint from `--addr`, with TLS for an `https://` address
/// (trusting `--tls-ca`, presenting `--client-cert` when given); the
/// address as typed, for error messages.
pub(crate) fn endpoint(opts: &ClientOpts) -> Result<(String, Endpoint), ClientError> {
    // Another scheme went as plaintext: `htps://` would have sent the
    // token in the clear to a server the user meant to reach over TLS.
    let addr = crate::worker::connection::server_uri(&opts.addr)
        .map_err(|e| ClientError::BadArgument(format!("--addr {e}")))?;
    let endpoint = Endpoint::from_shared(addr.clone())
        .map_err(|e| ClientError::BadArgument(format!("invalid --addr {addr:?}: {e}")))?;
    let https = addr.to_ascii_lowercase().starts_with("https://");
    let tls_flags = opts.tls_ca.is_some() || opts.client_cert.is_some();
    if !https {
        if tls_flags {
            return Err(ClientError::BadArgument(format!(
                "--tls-ca and --client-cert need an https:// address, not {addr:?}"
            )));
        }
        let token = opts.token.as_deref().is_some_and(|t| !t.trim().is_empty());
        if token && !is_loopback(endpoint.uri().host()) {
            // Warned, not refused: inside a service mesh the plaintext
            // hop is the sidecar's, which encrypts it.
            let _ = writeln!(
                io::stderr(),
                "warning: the token goes in cleartext to {addr}: anyone on the way can read it \
                 and act as this client; use https://, unless what carries the connection \
                 encrypts it (a service mesh's mTLS)"
            );
        }
        return Ok((addr, endpoint));
    }
    // The system's roots only without `--tls-ca`: loading them fails where
    // there are none (a bare container), which must not stop a client
    // that brought its own CA.
    let mut tls = match &opts.tls_ca {
        Some(ca) => {
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_pem(ca, "--tls-ca")?))
        }
        None => ClientTlsConfig::new().with_native_roots(),
    };
    if let (Some(cert), Some(key)) = (&opts.client_cert, &opts.client_key) {
        tls = tls.identity(Identity::from_pem(
            read_pem(cert, "--client-cert")?,
            read_pem(key, "--client-key")?,
        ));
    }
    let endpoint = endpoint
        .tls_config(tls)
        // tonic's own text is only its kind ("transport error"); the cause
        // (no system roots, say) is further down.
        .map_err(|e| {
            ClientError::BadArgument(format!(
                "tls for {addr:?}: {}",
                crate::report::with_causes(&e)
            ))
        })?;
    Ok((addr, endpoint))
}

/// Whether `host` names this machine: a token sent there in cleartext
/// never crosses a network.
fn is_loopback(host: Option<&str>) -> bool {
    let Some(host) = host else { return false };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn read_pem(path: &Path, flag: &str) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path)
        .map_err(|e| ClientError::BadArgument(format!("{flag} {}: {e}", path.display())))
}

/// `authorization: Bearer TOKEN`, marked sensitive; none for no token or an
/// empty one (an `INTRAY_TOKEN=` left in the environment). The token itself
/// never appears in an error.
pub(crate) fn authorization(
    token: Option<&str>,
) -> Result<Option<AsciiMetadataValue>, ClientError> {
    let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    if !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err(ClientError::BadArgument(
            "--token / INTRAY_TOKEN cannot be sent as gRPC metadata: use visible ASCII characters"
                .into(),
        ));
    }
    let mut value = AsciiMetadataValue::try_from(format!("Bearer {token}")).map_err(|_| {
        ClientError::BadArgument("--token / INTRAY_TOKEN is not valid metadata".into())
    })?;
    value.set_sensitive(true);
    Ok(Some(value))
}

/// `host:port` is what people type; tonic needs a URI with a scheme.
/// An empty tenant (an `INTRAY_TENANT=` left in the environment) means none,
/// so the server applies its default rather than rejecting "".
pub(crate) fn tenant_metadata(
    tenant: Option<&str>,
) -> Result<Option<AsciiMetadataValue>, ClientError> {
    match tenant.map(str::trim).filter(|t| !t.is_empty()) {
        None => Ok(None),
        Some(t) => {
            let bad = || {
                ClientError::BadArgument(format!(
                    "--tenant {t:?} cannot be sent as gRPC metadata: use visible ASCII characters"
                ))
            };
            // HTTP lets bytes 0x80..=0xFF through, but the server could not
            // read them back as text, so reject them here.
            if !t.chars().all(|c| c.is_ascii_graphic()) {
                return Err(bad());
            }
            AsciiMetadataValue::try_from(t).map(Some).map_err(|_| bad())
        }
    }
}

async fn submit(
    opts: &ClientOpts,
    tenant: Option<AsciiMetadataValue>,
    json: bool,
    args: SubmitArgs,
) -> Result<(), ClientError> {
    let payload = read_payload(args.payload.as_deref(), args.payload_file.as_deref()).await?;
    let request = submit_request(args, payload, Utc::now())?;
    let mut session = Session::connect(opts, tenant).await?;
    let response = session
        .client
        .submit(session.request(request))
        .await?
        .into_inner();
    if json {
        print_json(&response, &[("created", false.into())])
    } else {
        print_text(|out| print::write_submit(out, &response))
    }
}

/// The payload from `--payload` or `--payload-file` (`-` for standard input).
async fn read_payload(
    text: Option<&str>,
    file: Option<&Path>,
) -> Result<Option<pbjson_types::Value>, ClientError> {
    match (text, file) {
        (Some(text), _) => parse_payload(text, "--payload").map(Some),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut text = String::new();
            tokio::io::stdin()
                .read_to_string(&mut text)
                .await
                .map_err(|e| {
                    ClientError::BadArgument(format!("cannot read the payload from stdin: {e}"))
                })?;
            parse_payload(&text, "the payload on stdin").map(Some)
        }
        (None, Some(path)) => {
            let text = tokio::fs::read_to_string(path).await.map_err(|e| {
                ClientError::BadArgument(format!(
                    "cannot read payload file {}: {e}",
                    path.display()
                ))
            })?;
            parse_payload(&text, &format!("payload file {}", path.display())).map(Some)
        }
        (None, None) => Ok(None),
    }
}

/// Parses JSON text into the `google.protobuf.Value` the request carries.
pub fn parse_payload(text: &str, origin: &str) -> Result<pbjson_types::Value, ClientError> {
    serde_json::from_str(text).map_err(|e| {
        let why = crate::domain::json::payload_reason(&e.to_string());
        if e.is_data() {
            ClientError::BadArgument(format!("{origin} is JSON a job payload cannot hold: {why}"))
        } else {
            ClientError::BadArgument(format!("{origin} is not valid JSON: {why}"))
        }
    })
}

/// Builds a `SubmitRequest`; relative times (`--delay`, `--timeout`) count
/// from `now`, which is a parameter so tests need no clock.
pub fn submit_request(
    args: SubmitArgs,
    payload: Option<pbjson_types::Value>,
    now: DateTime<Utc>,
) -> Result<SubmitRequest, ClientError> {
    let run_at = match (args.run_at, args.delay) {
        (Some(at), _) => Some(at),
        (None, Some(delay)) => Some(after(now, delay, "--delay")?),
        (None, None) => None,
    };
    let deadline = match (args.deadline, args.timeout) {
        (Some(at), _) => Some(at),
        (None, Some(timeout)) => Some(after(now, timeout, "--timeout")?),
        (None, None) => None,
    };
    // Send a Backoff only when asked, so the server's defaults apply to the
    // half that was not given.
    let backoff = (args.backoff_initial.is_some() || args.backoff_max.is_some()).then(|| Backoff {
        initial: args.backoff_initial.map(Into::into),
        max: args.backoff_max.map(Into::into),
    });
    Ok(SubmitRequest {
        queue: args.queue,
        kind: args.kind,
        payload,
        idempotency_key: args.idempotency_key.unwrap_or_default(),
        priority: args.priority.unwrap_or_default(),
        run_at: run_at.map(Into::into),
        deadline: deadline.map(Into::into),
        max_attempts: args.max_attempts,
        backoff,
        labels: label_map(args.labels)?,
        callback_url: args.callback_url.unwrap_or_default(),
        max_cost_cents: args.max_cost_cents,
    })
}

fn after(now: DateTime<Utc>, delay: Duration, flag: &str) -> Result<DateTime<Utc>, ClientError> {
    chrono::Duration::from_std(delay)
        .ok()
        .and_then(|delay| now.checked_add_signed(delay))
        .ok_or_else(|| ClientError::BadArgument(format!("{flag} is too far in the future")))
}

/// Collects `--label` pairs; a key given twice is a mistake, not an override.
pub fn label_map(labels: Vec<(String, String)>) -> Result<HashMap<String, String>, ClientError> {
    let mut map = HashMap::with_capacity(labels.len());
    for (key, value) in labels {
        if map.contains_key(&key) {
            return Err(ClientError::BadArgument(format!(
                "--label {key} is given more than once"
            )));
        }
        map.insert(key, value);
    }
    Ok(map)
}

fn states<S: Into<JobState>>(states: Vec<S>) -> Vec<i32> {
    states.into_iter().map(|s| s.into() as i32).collect()
}

/// Builds the `ListJobsRequest` of the first page.
pub fn list_request(args: ListArgs) -> Result<ListJobsRequest, ClientError> {
    Ok(ListJobsRequest {
        queue: args.queue.unwrap_or_default(),
        kind: args.kind.unwrap_or_default(),
        states: states(args.states),
        error_class: args.error_class.unwrap_or_default(),
        labels: label_map(args.labels)?,
        page_size: args.limit,
        page_token: args.page_token.unwrap_or_default(),
        // `--json` prints whole jobs.
        view: crate::pb::JobView::Full as i32,
    })
}

/// Builds a `RetryJobRequest`: by id, or by filter when no id is given.
pub fn retry_request(args: RetryArgs) -> RetryJobRequest {
    let target = match args.id {
        Some(id) => retry_job_request::Target::Id(id),
        None => retry_job_request::Target::Filter(RetryFilter {
            queue: args.queue.unwrap_or_default(),
            kind: args.kind.unwrap_or_default(),
            error_class: args.error_class.unwrap_or_default(),
            states: states(args.states),
        }),
    };
    RetryJobRequest {
        target: Some(target),
        dry_run: args.dry_run,
        limit: args.limit,
    }
}

async fn list(
    session: &mut Session,
    mut request: ListJobsRequest,
    all: bool,
    json: bool,
) -> Result<(), ClientError> {
    let mut page = session
        .client
        .list(session.request(request.clone()))
        .await?
        .into_inner();
    if all {
        let mut jobs = std::mem::take(&mut page.jobs);
        while !page.next_page_token.is_empty() {
            // A server that hands back the token it was given would loop
            // this forever.
            if page.next_page_token == request.page_token {
                return Err(tonic::Status::internal("the server repeated a page token").into());
            }
            request.page_token = std::mem::take(&mut page.next_page_token);
            page = session
                .client
                .list(session.request(request.clone()))
                .await?
                .into_inner();
            jobs.append(&mut page.jobs);
        }
        page = ListJobsResponse {
            jobs,
            next_page_token: String::new(),
        };
    }
    if json {
        return print_json(&page, &[("jobs", serde_json::json!([]))]);
    }
    if page.jobs.is_empty() {
        print_text(|out| writeln!(out, "no jobs match"))?;
    } else {
        print_text(|out| print::write_job_table(out, &page.jobs))?;
    }
    if !page.next_page_token.is_empty() {
        // On stderr, so the table on stdout stays clean for pipes.
        let _ = writeln!(
            io::stderr(),
            "more jobs: add --page-token {} (or --all)",
            page.next_page_token
        );
    }
    Ok(())
}

/// Streams the events of a job until the job has ended.
///
/// How long the history stream may stay quiet, once it has sent an event,
/// before the history is taken as complete: the server sends stored events
/// in bursts straight from the database, then waits for new ones.
const HISTORY_IDLE: std::time::Duration = std::time::Duration::from_millis(500);
/// How long the first event may take: every job has one, and a busy
/// database may be slow to give it.
const HISTORY_FIRST: std::time::Duration = std::time::Duration::from_secs(10);

/// A job's events so far: `WatchJob` from the start, until the server ends
/// the stream (after the latest event of an ended job: a replayed job's
/// history holds earlier terminal events) or until it goes quiet (the job
/// is still live).
async fn history(
    session: &mut Session,
    id: String,
) -> Result<Vec<crate::pb::JobEvent>, ClientError> {
    let request = session.request(WatchJobRequest {
        id,
        after_sequence: 0,
    });
    let mut stream = session.client.watch_job(request).await?.into_inner();
    let mut events = Vec::new();
    loop {
        let quiet = if events.is_empty() {
            HISTORY_FIRST
        } else {
            HISTORY_IDLE
        };
        match tokio::time::timeout(quiet, stream.message()).await {
            Ok(next) => match next? {
                Some(event) => events.push(event),
                None => break,
            },
            Err(_) => break,
        }
    }
    Ok(events)
}

/// The server ends the stream after the terminal event. When the stream
/// breaks off before that (a restart, a lost connection, a server shutting
/// down, which ends it `UNAVAILABLE`), this reconnects after the last event
/// printed: the server's `after_sequence` contract means nothing is missed
/// or printed twice.
/// A job that ended other than `SUCCEEDED` is [`ClientError::NotSucceeded`],
/// so that `intray watch ID && next-step` stops there.
async fn watch(session: &mut Session, args: WatchArgs, json: bool) -> Result<(), ClientError> {
    let mut after = args.after;
    let mut failures = 0u32;
    let mut finished = false;
    let mut last_state = JobState::Unspecified as i32;
    loop {
        let request = session.request(WatchJobRequest {
            id: args.id.clone(),
            after_sequence: after,
        });
        let mut got_events = false;
        let ended_with = match session.client.watch_job(request).await {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(event)) => {
                            got_events = true;
                            failures = 0;
                            after = after.max(event.sequence);
                            finished = is_terminal(event.state);
                            last_state = event.state;
                            if json {
                                let line = serde_json::to_string(&print::json_value(&event, &[])?)?;
                                print_text(|out| writeln!(out, "{line}"))?;
                            } else {
                                print_text(|out| print::write_event(out, &event))?;
                            }
                        }
                        Ok(None) => break None,
                        Err(status) => break Some(status),
                    }
                }
            }
            Err(status) => Some(status),
        };
        let interruption = match ended_with {
            Some(status) if reconnectable(status.code()) => status,
            Some(status) => return Err(status.into()),
            None if finished => return ended(last_state),
            // Ended early after some events, as older servers ended a
            // stream on shutdown (newer ones end it `UNAVAILABLE`): pick up
            // where it stopped.
            None if got_events => continue,
            None => {
                // An empty stream is also what a job that ended at or before
                // `after` gives, so ask the job itself.
                let request = session.request(GetJobRequest {
                    id: args.id.clone(),
                });
                match session.client.get(request).await {
                    Ok(job) if is_terminal(job.get_ref().state) => {
                        return ended(job.get_ref().state);
                    }
                    Ok(_) => {
                        // The server is up but ended the stream: not a
                        // connection failure, so wait briefly and go on.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    Err(status) if reconnectable(status.code()) => status,
                    Err(status) => return Err(status.into()),
                }
            }
        };
        if failures >= WATCH_MAX_RECONNECTS {
            return Err(interruption.into());
        }
        failures += 1;
        let delay = Duration::from_secs(1 << failures.min(4));
        let _ = writeln!(
            io::stderr(),
            "watch: {}: {}; reconnecting in {} after event #{after}",
            code_name(interruption.code()),
            interruption.message(),
            print::format_duration(delay)
        );
        tokio::time::sleep(delay).await;
    }
}

/// Whether a watch that broke off with `code` may try again: the server
/// going away or restarting, and a connection cut mid-stream (which the
/// transport reports as `UNKNOWN`, or `INTERNAL` for a protocol error).
/// What the server decided (not found, not allowed) stands.
fn reconnectable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
    )
}

/// How a watch ends for a job in the terminal `state`.
fn ended(state: i32) -> Result<(), ClientError> {
    if state == JobState::Succeeded as i32 {
        Ok(())
    } else {
        Err(ClientError::NotSucceeded(print::state_name(state)))
    }
}

fn is_terminal(state: i32) -> bool {
    matches!(
        JobState::try_from(state),
        Ok(JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Expired)
    )
}

/// Writes pretty proto3 JSON of `message` to stdout.
fn print_json<T: Serialize>(
    message: &T,
    defaults: &[(&str, serde_json::Value)],
) -> Result<(), ClientError> {
    let text = serde_json::to_string_pretty(&print::json_value(message, defaults)?)?;
    print_text(|out| writeln!(out, "{text}"))
}

/// Runs a text printer on locked stdout and flushes, keeping the lock out of
/// any `.await` so the command's future stays `Send`.
fn print_text(
    write: impl FnOnce(&mut io::StdoutLock<'static>) -> io::Result<()>,
) -> Result<(), ClientError> {
    let mut out = io::stdout().lock();
    write(&mut out)
        .and_then(|()| out.flush())
        .map_err(ClientError::Output)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::client::args::RetryStateArg;

    #[test]
    fn only_this_machine_is_loopback() {
        for host in [
            "localhost",
            "LOCALHOST",
            "127.0.0.1",
            "127.9.9.9",
            "[::1]",
            "::1",
        ] {
            assert!(is_loopback(Some(host)), "{host}");
        }
        for host in [
            "intray.example.com",
            "10.0.0.5",
            "0.0.0.0",
            "[2001:db8::1]",
            "localhost.evil.com",
        ] {
            assert!(!is_loopback(Some(host)), "{host}");
        }
        assert!(!is_loopback(None));
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        opts: ClientOpts,
        #[command(subcommand)]
        command: ClientCommand,
    }

    #[test]
    fn an_address_of_another_scheme_is_refused() {
        let opts = |addr: &str| {
            Cli::try_parse_from(["intray", "--addr", addr, "stats"])
                .map(|cli| cli.opts)
                .expect("parse")
        };
        for bad in ["ftp://127.0.0.1:50051", "htps://example.com:443"] {
            assert!(
                matches!(endpoint(&opts(bad)), Err(ClientError::BadArgument(_))),
                "{bad}"
            );
        }
        for good in [
            "127.0.0.1:50051",
            "http://127.0.0.1:50051",
            "HTTP://localhost:1",
        ] {
            assert!(endpoint(&opts(good)).is_ok(), "{good}");
        }
    }

    fn command(args: &[&str]) -> ClientCommand {
        match Cli::try_parse_from(std::iter::once("intray").chain(args.iter().copied())) {
            Ok(cli) => cli.command,
            Err(e) => panic!("{args:?}: {e}"),
        }
    }

    fn submit_args(extra: &[&str]) -> SubmitArgs {
        let mut args = vec!["submit", "--queue", "q", "--kind", "k"];
        args.extend_from_slice(extra);
        match command(&args) {
            ClientCommand::Submit(args) => *args,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_900_000_000, 0).unwrap_or_default()
    }

    #[test]
    fn relative_times_count_from_now() {
        let request = submit_request(
            submit_args(&["--delay", "30s", "--timeout", "10m"]),
            None,
            now(),
        );
        let Ok(request) = request else {
            panic!("{request:?}")
        };
        assert_eq!(request.run_at.map(|t| t.seconds), Some(1_900_000_030));
        assert_eq!(request.deadline.map(|t| t.seconds), Some(1_900_000_600));
    }

    #[test]
    fn unset_options_leave_server_defaults() {
        let request = submit_request(submit_args(&[]), None, now());
        let Ok(request) = request else {
            panic!("{request:?}")
        };
        assert_eq!(request.max_attempts, None);
        assert_eq!(request.backoff, None);
        assert_eq!(request.run_at, None);
        assert_eq!(request.payload, None);
        let request = submit_request(submit_args(&["--backoff-max", "1m"]), None, now());
        let backoff = request.ok().and_then(|r| r.backoff);
        assert_eq!(backoff.and_then(|b| b.initial), None);
        assert_eq!(backoff.and_then(|b| b.max).map(|d| d.seconds), Some(60));
    }

    #[test]
    fn a_label_given_twice_is_rejected() {
        let request = submit_request(
            submit_args(&["--label", "a=1", "--label", "a=2"]),
            None,
            now(),
        );
        assert!(matches!(request, Err(ClientError::BadArgument(_))));
    }

    #[test]
    fn payload_must_be_json() {
        let value = parse_payload(r#"{"doc": "x"}"#, "--payload");
        assert!(value.is_ok_and(|v| v.kind.is_some()));
        let error = parse_payload("{doc}", "--payload");
        assert!(
            matches!(error, Err(ClientError::BadArgument(m)) if m.starts_with("--payload is not valid JSON"))
        );
        // Valid JSON a payload cannot hold is said to be that, with what
        // to do instead.
        let error = parse_payload(r#"{"id": 9223372036854775807}"#, "--payload");
        assert!(
            matches!(&error, Err(ClientError::BadArgument(m))
                if m.starts_with("--payload is JSON a job payload cannot hold") && m.contains("as a string")),
            "{error:?}"
        );
    }

    #[test]
    fn retry_builds_an_id_or_a_filter() {
        let ClientCommand::Retry(args) =
            command(&["retry", "--queue", "q", "--state", "expired", "--dry-run"])
        else {
            panic!("not a retry")
        };
        let request = retry_request(args);
        assert!(request.dry_run);
        assert_eq!(
            request.target,
            Some(retry_job_request::Target::Filter(RetryFilter {
                queue: "q".into(),
                states: vec![JobState::from(RetryStateArg::Expired) as i32],
                ..RetryFilter::default()
            }))
        );
    }

    #[test]
    fn addresses_get_a_scheme_and_tenants_must_be_ascii() {
        let uri = crate::worker::connection::server_uri;
        assert_eq!(
            uri("localhost:50051").as_deref(),
            Ok("http://localhost:50051")
        );
        assert_eq!(uri("https://x:1").as_deref(), Ok("https://x:1"));
        assert!(matches!(tenant_metadata(Some("")), Ok(None)));
        assert!(matches!(tenant_metadata(Some("acme")), Ok(Some(_))));
        assert!(tenant_metadata(Some("ä")).is_err());
    }

    #[test]
    fn run_is_send() {
        // main may run the command on a spawned task; keep that possible.
        fn assert_send<T: Send>(_: &T) {}
        let opts = Cli::try_parse_from(["intray", "stats"]).map(|cli| (cli.opts, cli.command));
        let Ok((opts, cmd)) = opts else {
            panic!("stats did not parse")
        };
        assert_send(&run(opts, cmd));
    }
}
