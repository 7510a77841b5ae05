//! Rendering of responses, as readable text or as proto3 JSON.
//!
//! Everything here writes to a `Write` and talks to no server, so the output
//! formats are unit-tested without one.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use pbjson_types::Timestamp;
use serde::Serialize;

use crate::domain::json::whole_numbers_as_integers;
use crate::pb::{
    BreakerState, Job, JobEvent, JobEventType, JobState, RetryJobResponse, StatsResponse,
    SubmitResponse,
};

/// Lowercase state name, as `--state` takes it; unknown numbers (a newer
/// server) still print instead of failing.
pub fn state_name(state: i32) -> String {
    match JobState::try_from(state) {
        Ok(JobState::Unspecified) => "unspecified".into(),
        Ok(known) => strip_prefix(known.as_str_name(), "JOB_STATE_"),
        Err(_) => format!("state({state})"),
    }
}

/// Lowercase event type name (`lease_expired`); unknown numbers still print.
pub fn event_type_name(event_type: i32) -> String {
    match JobEventType::try_from(event_type) {
        Ok(JobEventType::Unspecified) => "unspecified".into(),
        Ok(known) => strip_prefix(known.as_str_name(), "JOB_EVENT_TYPE_"),
        Err(_) => format!("event({event_type})"),
    }
}

fn strip_prefix(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix)
        .unwrap_or(name)
        .to_ascii_lowercase()
}

/// RFC 3339 in UTC with the given precision; a timestamp chrono cannot
/// represent prints as its raw fields rather than aborting the whole output.
pub fn format_timestamp(ts: &Timestamp, precision: SecondsFormat) -> String {
    match DateTime::<Utc>::try_from(*ts) {
        Ok(t) => t.to_rfc3339_opts(precision, true),
        Err(_) => format!("<invalid timestamp {}s {}ns>", ts.seconds, ts.nanos),
    }
}

/// A short duration such as `450ms`, `45s`, `2m30s`, `3h5m` or `2d4h`: the
/// two largest units are enough to judge a queue's age at a glance.
pub fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    let units = [
        (secs / 86_400, "d"),
        (secs / 3_600 % 24, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
    ];
    let first = units.iter().position(|(n, _)| *n > 0).unwrap_or(3);
    units[first..]
        .iter()
        .take(2)
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect()
}

/// Compact one-line JSON of any serialisable value (payload, result, detail).
fn one_line_json<T: Serialize>(value: &T) -> String {
    match json_value(value, &[]).and_then(|v| serde_json::to_string(&v)) {
        Ok(text) => text,
        Err(e) => format!("<unprintable: {e}>"),
    }
}

/// The proto3 JSON of `message` as a `serde_json::Value`, with the given
/// top-level fields present even when they hold their default value.
///
/// The proto3 mapping leaves default values out, so `created: false` or
/// `matched: 0` would vanish; a script should not have to know that.
/// Going through `serde_json::Value` also sorts object keys, which would
/// otherwise come out in `HashMap` order and differ from run to run.
pub fn json_value<T: Serialize>(
    message: &T,
    defaults: &[(&str, serde_json::Value)],
) -> Result<serde_json::Value, serde_json::Error> {
    let mut value = serde_json::to_value(message)?;
    // A payload's `1` would print as `1.0`.
    whole_numbers_as_integers(&mut value);
    if let Some(object) = value.as_object_mut() {
        for (key, default) in defaults {
            object
                .entry((*key).to_owned())
                .or_insert_with(|| default.clone());
        }
    }
    Ok(value)
}

fn labels_text(labels: &std::collections::HashMap<String, String>) -> String {
    let sorted: BTreeMap<_, _> = labels.iter().collect();
    sorted
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes a job as a block of `key  value` lines, leaving out what is unset.
pub fn write_job(out: &mut impl Write, job: &Job) -> io::Result<()> {
    let ts = |t: &Option<Timestamp>| {
        t.as_ref()
            .map(|t| format_timestamp(t, SecondsFormat::Millis))
    };
    let mut lines: Vec<(&str, String)> = Vec::new();
    lines.push(("id", job.id.clone()));
    if !job.tenant.is_empty() {
        lines.push(("tenant", job.tenant.clone()));
    }
    let mut state = state_name(job.state);
    if job.cancel_requested {
        state.push_str(" (cancel requested)");
    }
    lines.push(("state", state));
    lines.push(("queue/kind", format!("{}/{}", job.queue, job.kind)));
    lines.push(("attempt", format!("{}/{}", job.attempt, job.max_attempts)));
    lines.push(("priority", job.priority.to_string()));
    if job.progress > 0.0 {
        lines.push(("progress", format!("{:.0}%", job.progress * 100.0)));
    }
    if let Some(t) = ts(&job.created_at) {
        lines.push(("created", t));
    }
    // run_at equals created_at unless the job was delayed or is waiting for
    // a retry; only then is it news.
    if job.run_at.is_some() && job.run_at != job.created_at {
        lines.extend(ts(&job.run_at).map(|t| ("run at", t)));
    }
    lines.extend(ts(&job.started_at).map(|t| ("started", t)));
    lines.extend(ts(&job.finished_at).map(|t| ("finished", t)));
    lines.extend(ts(&job.updated_at).map(|t| ("updated", t)));
    lines.extend(ts(&job.deadline).map(|t| ("deadline", t)));
    if !job.lease_owner.is_empty() {
        let until = ts(&job.lease_expires_at).unwrap_or_else(|| "?".into());
        lines.push(("lease", format!("{} until {until}", job.lease_owner)));
    }
    if let Some(backoff) = &job.backoff {
        let part = |d: &Option<pbjson_types::Duration>| {
            d.and_then(|d| Duration::try_from(d).ok())
                .map_or_else(|| "default".to_owned(), format_duration)
        };
        lines.push((
            "backoff",
            format!("{}..{}", part(&backoff.initial), part(&backoff.max)),
        ));
    }
    if !job.idempotency_key.is_empty() {
        lines.push(("idempotency", job.idempotency_key.clone()));
    }
    if job.cost_cents != 0 {
        lines.push(("cost", format!("{} cents", job.cost_cents)));
    }
    if !job.callback_url.is_empty() {
        lines.push(("callback", job.callback_url.clone()));
    }
    if let Some(error) = &job.error
        && (!error.class.is_empty() || !error.message.is_empty())
    {
        lines.push(("error", format!("{}: {}", error.class, error.message)));
    }
    if let Some(payload) = &job.payload {
        lines.push(("payload", one_line_json(payload)));
    }
    if let Some(result) = &job.result {
        lines.push(("result", one_line_json(result)));
    }
    if !job.labels.is_empty() {
        lines.push(("labels", labels_text(&job.labels)));
    }
    for (key, value) in lines {
        writeln!(out, "{key:<12}{}", clean(&value))?;
    }
    Ok(())
}

/// Writes the outcome of a submit: whether it created a job, then the job.
pub fn write_submit(out: &mut impl Write, response: &SubmitResponse) -> io::Result<()> {
    if response.created {
        writeln!(out, "created a new job")?;
    } else {
        writeln!(
            out,
            "not created: an existing job with the same idempotency key was returned"
        )?;
    }
    match &response.job {
        Some(job) => write_job(out, job),
        None => writeln!(out, "(the server returned no job)"),
    }
}

/// Writes one event as one line: sequence, time, type, state, then whatever
/// else the event carries.
pub fn write_event(out: &mut impl Write, event: &JobEvent) -> io::Result<()> {
    let at = event.at.as_ref().map_or_else(
        || "-".to_owned(),
        |t| format_timestamp(t, SecondsFormat::Millis),
    );
    let mut line = format!(
        "#{:<4} {at}  {:<16}  {:<9}",
        event.sequence,
        event_type_name(event.r#type),
        state_name(event.state)
    );
    if event.attempt > 0 {
        line.push_str(&format!("  attempt={}", event.attempt));
    }
    if !event.worker_id.is_empty() {
        line.push_str(&format!("  worker={}", event.worker_id));
    }
    if let Some(detail) = event.detail.as_ref().filter(|d| !d.fields.is_empty()) {
        line.push_str("  ");
        line.push_str(&one_line_json(detail));
    }
    writeln!(out, "{}", clean(line.trim_end()))
}

/// Text from the server as a terminal should show it: control characters
/// written as escapes. Error messages, labels and worker ids are free text
/// (a command's stderr ends up in a message), and an escape sequence in
/// them could rewrite the screen or the clipboard, a newline forge a line.
fn clean(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// The time of an event, when it has a valid one.
fn event_time(event: &JobEvent) -> Option<DateTime<Utc>> {
    event.at.and_then(|t| DateTime::<Utc>::try_from(t).ok())
}

/// The error class and message an event's detail carries, if any.
fn detail_error(event: &JobEvent) -> Option<String> {
    let detail = serde_json::to_value(event.detail.as_ref()?).ok()?;
    let error = detail.get("error")?;
    let class = error.get("class").and_then(|c| c.as_str()).unwrap_or("?");
    match error.get("message").and_then(|m| m.as_str()) {
        Some(message) if !message.is_empty() => Some(format!("{class}: {message}")),
        _ => Some(class.to_owned()),
    }
}

/// Writes a job's events as a timeline: time since the first event and
/// since the previous one, then the event, its state, attempt, worker and
/// error; after the events, one line per attempt with who ran it, how long
/// it ran and how it ended.
pub fn write_timeline(out: &mut impl Write, events: &[JobEvent]) -> io::Result<()> {
    if events.is_empty() {
        return writeln!(out, "no events");
    }
    let first = events.iter().find_map(event_time);
    let mut previous: Option<DateTime<Utc>> = None;
    let elapsed = |from: Option<DateTime<Utc>>, to: Option<DateTime<Utc>>| match (from, to) {
        (Some(from), Some(to)) => format!(
            "+{}",
            format_duration((to - from).to_std().unwrap_or_default())
        ),
        _ => "-".to_owned(),
    };
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        let at = event_time(event);
        let mut notes = Vec::new();
        if event.attempt > 0 {
            notes.push(format!("attempt {}", event.attempt));
        }
        if !event.worker_id.is_empty() {
            notes.push(format!("worker {}", event.worker_id));
        }
        if let Some(error) = detail_error(event) {
            notes.push(format!("error {error}"));
        }
        rows.push(vec![
            format!("#{}", event.sequence),
            at.map_or_else(
                || "-".to_owned(),
                |t| t.to_rfc3339_opts(SecondsFormat::Millis, true),
            ),
            elapsed(first, at),
            elapsed(previous, at),
            event_type_name(event.r#type),
            state_name(event.state),
            notes.join(", "),
        ]);
        previous = at.or(previous);
    }
    write_table(
        out,
        &[
            "SEQ",
            "AT",
            "SINCE START",
            "SINCE PREV",
            "EVENT",
            "STATE",
            "",
        ],
        &rows,
        &[2, 3],
    )?;
    // Attempts: from each LEASED event to the next event that ends it.
    let mut attempts = Vec::new();
    for (i, event) in events.iter().enumerate() {
        if JobEventType::try_from(event.r#type) != Ok(JobEventType::Leased) {
            continue;
        }
        let end = events[i + 1..].iter().find(|e| {
            !matches!(
                JobEventType::try_from(e.r#type),
                Ok(JobEventType::Progress | JobEventType::CancelRequested)
            )
        });
        let (ran, outcome) = match end {
            Some(end) => (
                elapsed(event_time(event), event_time(end)),
                match detail_error(end) {
                    Some(error) => format!("{} ({error})", event_type_name(end.r#type)),
                    None => event_type_name(end.r#type),
                },
            ),
            None => ("-".to_owned(), "still running".to_owned()),
        };
        attempts.push(vec![
            event.attempt.to_string(),
            if event.worker_id.is_empty() {
                "-".into()
            } else {
                event.worker_id.clone()
            },
            ran.trim_start_matches('+').to_owned(),
            outcome,
        ]);
    }
    if !attempts.is_empty() {
        writeln!(out)?;
        write_table(
            out,
            &["ATTEMPT", "WORKER", "RAN", "OUTCOME"],
            &attempts,
            &[0, 2],
        )?;
    }
    Ok(())
}

/// Writes jobs as an aligned table, one row per job.
pub fn write_job_table(out: &mut impl Write, jobs: &[Job]) -> io::Result<()> {
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|job| {
            vec![
                job.id.clone(),
                state_name(job.state),
                job.queue.clone(),
                job.kind.clone(),
                format!("{}/{}", job.attempt, job.max_attempts),
                job.created_at
                    .as_ref()
                    .map_or_else(String::new, |t| format_timestamp(t, SecondsFormat::Secs)),
            ]
        })
        .collect();
    write_table(
        out,
        &["ID", "STATE", "QUEUE", "KIND", "ATTEMPT", "CREATED"],
        &rows,
        &[],
    )
}

/// Writes what a retry did (or, with `dry_run`, would do).
pub fn write_retry(
    out: &mut impl Write,
    response: &RetryJobResponse,
    dry_run: bool,
) -> io::Result<()> {
    if dry_run {
        return writeln!(
            out,
            "{} job(s) would be retried (dry run: nothing changed)",
            response.matched
        );
    }
    writeln!(
        out,
        "retried {} of {} matching job(s)",
        response.retried.len(),
        response.matched
    )?;
    for id in &response.retried {
        writeln!(out, "{id}")?;
    }
    Ok(())
}

/// Writes the per-queue counts as one table and the workers as another.
pub fn write_stats(out: &mut impl Write, stats: &StatsResponse) -> io::Result<()> {
    if stats.queues.is_empty() {
        writeln!(out, "no queues with jobs")?;
    } else {
        let rows: Vec<Vec<String>> = stats
            .queues
            .iter()
            .map(|q| {
                let count = |state: JobState| {
                    q.counts
                        .iter()
                        .filter(|c| c.state == state as i32)
                        .map(|c| c.count)
                        .sum::<u64>()
                        .to_string()
                };
                let oldest = q
                    .oldest_runnable_age
                    .and_then(|d| Duration::try_from(d).ok())
                    .map_or_else(|| "-".to_owned(), format_duration);
                let name = if q.paused {
                    format!("{} (paused)", q.queue)
                } else {
                    q.queue.clone()
                };
                vec![
                    name,
                    count(JobState::Queued),
                    q.running.to_string(),
                    count(JobState::Succeeded),
                    q.dead.to_string(),
                    count(JobState::Cancelled),
                    count(JobState::Expired),
                    oldest,
                ]
            })
            .collect();
        write_table(
            out,
            &[
                "QUEUE",
                "QUEUED",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "EXPIRED",
                "OLDEST RUNNABLE",
            ],
            &rows,
            &[1, 2, 3, 4, 5, 6],
        )?;
        for q in &stats.queues {
            for b in &q.breakers {
                let state = match BreakerState::try_from(b.state) {
                    Ok(BreakerState::Open) => "open",
                    Ok(BreakerState::HalfOpen) => "half-open",
                    _ => "closed",
                };
                let until = b.open_until.as_ref().map_or_else(String::new, |t| {
                    format!(" until {}", format_timestamp(t, SecondsFormat::Secs))
                });
                writeln!(
                    out,
                    "breaker {}/{}: {state}{until}, {} consecutive failures",
                    q.queue, b.kind, b.failures
                )?;
            }
        }
    }
    writeln!(out)?;
    if stats.workers.is_empty() {
        return writeln!(out, "no workers seen in the last 5 minutes");
    }
    let ts = |t: &Option<Timestamp>| {
        t.as_ref().map_or_else(
            || "-".to_owned(),
            |t| format_timestamp(t, SecondsFormat::Secs),
        )
    };
    let rows: Vec<Vec<String>> = stats
        .workers
        .iter()
        .map(|w| {
            vec![
                w.worker_id.clone(),
                w.leases_held.to_string(),
                ts(&w.last_lease_at),
                ts(&w.last_heartbeat_at),
                w.queues.join(","),
            ]
        })
        .collect();
    write_table(
        out,
        &["WORKER", "LEASES", "LAST LEASE", "LAST HEARTBEAT", "QUEUES"],
        &rows,
        &[1],
    )
}

/// Writes rows under headers in columns two spaces apart; the columns whose
/// index is in `right` (numbers) are right-aligned. Lines carry no trailing
/// spaces, so the output diffs and greps cleanly.
pub fn write_table(
    out: &mut impl Write,
    headers: &[&str],
    rows: &[Vec<String>],
    right: &[usize],
) -> io::Result<()> {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| clean(cell).into_owned()).collect())
        .collect();
    let rows = rows.as_slice();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header_row: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header_row).chain(rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = width.saturating_sub(cell.chars().count());
            if right.contains(&i) {
                line.extend(std::iter::repeat_n(' ', pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use crate::pb::{JobError, QueueStats, StateCount, WorkerInfo};

    use super::*;

    fn text(write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>) -> String {
        let mut out = Vec::new();
        if let Err(e) = write(&mut out) {
            panic!("writing to a Vec failed: {e}");
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    fn ts(rfc3339: &str) -> Option<Timestamp> {
        DateTime::parse_from_rfc3339(rfc3339)
            .ok()
            .map(|t| t.with_timezone(&Utc).into())
    }

    fn sample_job() -> Job {
        Job {
            id: "0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d".into(),
            tenant: "default".into(),
            queue: "default".into(),
            kind: "summarize".into(),
            state: JobState::Failed as i32,
            payload: serde_json::from_str(r#"{"doc":"hi","n":[1,2.5]}"#).ok(),
            error: Some(JobError {
                class: "rate_limited".into(),
                message: "429 from provider".into(),
            }),
            attempt: 3,
            max_attempts: 3,
            labels: HashMap::from([("b".into(), "2".into()), ("a".into(), "1".into())]),
            created_at: ts("2030-01-02T03:04:05Z"),
            run_at: ts("2030-01-02T03:04:05Z"),
            updated_at: ts("2030-01-02T03:05:00.250Z"),
            ..Job::default()
        }
    }

    #[test]
    fn control_characters_from_the_server_are_escaped() {
        let mut job = sample_job();
        job.error = Some(JobError {
            class: "boom".into(),
            message: "x\u{1b}]52;c;aGk=\u{7}\nstate       succeeded\u{9b}2J".into(),
        });
        job.lease_owner = "w\u{1b}[2J".into();
        let out = text(|out| write_job(out, &job));
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert_eq!(
            out.lines().count(),
            text(|out| write_job(out, &sample_job())).lines().count() + 1,
            "one line more (the lease), none forged: {out}"
        );
        assert!(out.contains("\\u{1b}]52"), "{out}");
        let rows = vec![vec!["a\u{1b}[31m".to_owned()]];
        let table = text(|out| write_table(out, &["H"], &rows, &[]));
        assert!(!table.contains('\u{1b}'), "{table:?}");
    }

    #[test]
    fn state_and_event_names_are_lowercase_without_prefix() {
        assert_eq!(state_name(JobState::Cancelled as i32), "cancelled");
        assert_eq!(state_name(99), "state(99)");
        assert_eq!(
            event_type_name(JobEventType::LeaseExpired as i32),
            "lease_expired"
        );
        assert_eq!(event_type_name(-1), "event(-1)");
    }

    #[test]
    fn durations_print_their_two_largest_units() {
        assert_eq!(format_duration(Duration::from_millis(450)), "450ms");
        assert_eq!(format_duration(Duration::from_secs(45)), "45s");
        assert_eq!(format_duration(Duration::from_secs(150)), "2m30s");
        assert_eq!(format_duration(Duration::from_secs(3 * 3600 + 301)), "3h5m");
        assert_eq!(format_duration(Duration::from_secs(3600)), "1h");
        assert_eq!(
            format_duration(Duration::from_secs(2 * 86_400 + 4 * 3600)),
            "2d4h"
        );
    }

    #[test]
    fn job_block_shows_what_is_set() {
        let out = text(|out| write_job(out, &sample_job()));
        assert_eq!(
            out,
            "\
id          0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d
tenant      default
state       failed
queue/kind  default/summarize
attempt     3/3
priority    0
created     2030-01-02T03:04:05.000Z
updated     2030-01-02T03:05:00.250Z
error       rate_limited: 429 from provider
payload     {\"doc\":\"hi\",\"n\":[1,2.5]}
labels      a=1, b=2
"
        );
    }

    #[test]
    fn submit_says_whether_the_job_is_new() {
        let response = SubmitResponse {
            job: Some(sample_job()),
            created: false,
        };
        let out = text(|out| write_submit(out, &response));
        assert!(out.starts_with("not created: an existing job"));
    }

    #[test]
    fn events_print_one_line_each() {
        let event = JobEvent {
            job_id: "j".into(),
            sequence: 2,
            r#type: JobEventType::Leased as i32,
            state: JobState::Running as i32,
            attempt: 1,
            worker_id: "w-1".into(),
            at: ts("2030-01-02T03:04:05.5Z"),
            detail: None,
        };
        assert_eq!(
            text(|out| write_event(out, &event)),
            "#2    2030-01-02T03:04:05.500Z  leased            running    attempt=1  worker=w-1\n"
        );
    }

    #[test]
    fn job_table_is_aligned() {
        let mut other = sample_job();
        other.id = "0190c3c6-0000-7000-8000-000000000000".into();
        other.state = JobState::Queued as i32;
        other.queue = "q".into();
        other.attempt = 0;
        let out = text(|out| write_job_table(out, &[sample_job(), other]));
        assert_eq!(
            out,
            "\
ID                                    STATE   QUEUE    KIND       ATTEMPT  CREATED
0190c3c6-7f7e-7c8a-9d3e-2a6f0e1b4c5d  failed  default  summarize  3/3      2030-01-02T03:04:05Z
0190c3c6-0000-7000-8000-000000000000  queued  q        summarize  0/3      2030-01-02T03:04:05Z
"
        );
    }

    #[test]
    fn stats_print_queues_and_workers() {
        let stats = StatsResponse {
            queues: vec![QueueStats {
                queue: "default".into(),
                counts: vec![
                    StateCount {
                        state: JobState::Queued as i32,
                        count: 12,
                    },
                    StateCount {
                        state: JobState::Succeeded as i32,
                        count: 340,
                    },
                ],
                oldest_runnable_age: Some(Duration::from_secs(75).into()),
                running: 2,
                dead: 1,
                paused: false,
                breakers: vec![],
            }],
            workers: vec![WorkerInfo {
                worker_id: "w-1".into(),
                queues: vec!["default".into(), "bulk".into()],
                last_lease_at: ts("2030-01-02T03:04:05Z"),
                last_heartbeat_at: None,
                leases_held: 2,
            }],
        };
        assert_eq!(
            text(|out| write_stats(out, &stats)),
            "\
QUEUE    QUEUED  RUNNING  SUCCEEDED  FAILED  CANCELLED  EXPIRED  OLDEST RUNNABLE
default      12        2        340       1          0        0  1m15s

WORKER  LEASES  LAST LEASE            LAST HEARTBEAT  QUEUES
w-1          2  2030-01-02T03:04:05Z  -               default,bulk
"
        );
    }

    #[test]
    fn retry_reports_counts() {
        let response = RetryJobResponse {
            retried: vec!["a".into()],
            matched: 2,
        };
        assert_eq!(
            text(|out| write_retry(out, &response, false)),
            "retried 1 of 2 matching job(s)\na\n"
        );
        assert_eq!(
            text(|out| write_retry(out, &response, true)),
            "2 job(s) would be retried (dry run: nothing changed)\n"
        );
    }

    #[test]
    fn json_keeps_named_defaults() {
        let response = SubmitResponse {
            job: None,
            created: false,
        };
        let value = json_value(&response, &[("created", false.into())]);
        assert_eq!(value.ok(), Some(serde_json::json!({ "created": false })));
        let job = serde_json::to_value(sample_job()).ok();
        assert_eq!(
            job.as_ref().and_then(|j| j["state"].as_str()),
            Some("JOB_STATE_FAILED")
        );
    }

    #[test]
    fn timeline_shows_gaps_attempts_workers_and_errors() {
        let event = |sequence: u64, kind: JobEventType, state: JobState, at: &str| JobEvent {
            job_id: "j".into(),
            sequence,
            r#type: kind as i32,
            state: state as i32,
            attempt: u32::from(sequence > 1),
            worker_id: if sequence > 1 {
                "w-1".into()
            } else {
                String::new()
            },
            at: ts(at),
            detail: None,
        };
        let mut failed = event(
            3,
            JobEventType::RetryScheduled,
            JobState::Queued,
            "2030-01-01T00:00:12.500Z",
        );
        failed.detail = serde_json::from_value(serde_json::json!({
            "error": {"class": "rate_limited", "message": "429"}
        }))
        .ok();
        let events = [
            event(
                1,
                JobEventType::Submitted,
                JobState::Queued,
                "2030-01-01T00:00:00Z",
            ),
            event(
                2,
                JobEventType::Leased,
                JobState::Running,
                "2030-01-01T00:00:02Z",
            ),
            failed,
        ];
        let out = text(|out| write_timeline(out, &events));
        assert!(out.contains("+2s"), "{out}");
        assert!(out.contains("+10s"), "{out}");
        assert!(out.contains("+12s"), "{out}");
        assert!(out.contains("retry_scheduled"), "{out}");
        assert!(out.contains("error rate_limited: 429"), "{out}");
        assert!(
            out.lines().any(|l| l.contains("w-1")
                && l.contains("10s")
                && l.contains("retry_scheduled (rate_limited: 429)")),
            "{out}"
        );
    }
}
