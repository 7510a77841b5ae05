//! The service's metrics and their Prometheus text exposition (format
//! 0.0.4).
//!
//! Written by hand rather than with `prometheus-client`: the set is small and
//! fixed (counters, gauges and histograms with a few string labels), the text
//! format is a page of code, and the scrape test parses what this produces.
//! A crate would add a dependency and its own registry types for no
//! behaviour we lack.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use crate::store::{QueueDepth, QueueWorkers};

/// Buckets (seconds) for waits and attempt durations: jobs run from
/// milliseconds (embeddings) to many minutes (imports).
const JOB_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];
/// Buckets (seconds) for RPC latency; a long-polling `Lease` lands high.
const RPC_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 60.0,
];

/// Most label sets one metric keeps (see [`Family::with`]).
const MAX_SERIES: usize = 2000;
/// The label value of the series that counts label sets beyond
/// [`MAX_SERIES`].
const OVERFLOW: &str = "_other";
/// Queues with series of their own in the database gauges. Queue names are
/// the callers', and each queue has eight gauge series: a producer using
/// fifty thousand queue names put four hundred thousand series in every
/// scrape of every replica until retention deleted their jobs.
const MAX_GAUGE_QUEUES: usize = 250;

#[derive(Clone, Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; cumulated when rendered.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

/// One metric name with its label sets.
#[derive(Debug)]
struct Family<V> {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    values: Mutex<BTreeMap<Vec<String>, V>>,
}

impl<V: Clone> Family<V> {
    fn new(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Self {
        Family {
            name,
            help,
            labels,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<String>, V>> {
        // Each update is a single insert or add: a panic cannot leave it torn.
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Updates the series of `labels`. A family that already holds
    /// [`MAX_SERIES`] series counts a new label set under [`OVERFLOW`] in
    /// every label instead: queues, kinds and error classes are chosen by
    /// callers, and each distinct one would otherwise stay in every
    /// replica's memory, and in every scrape, for the process's life.
    fn with(&self, labels: &[&str], default: impl FnOnce() -> V, f: impl FnOnce(&mut V)) {
        let key: Vec<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        let mut values = self.lock();
        let key = if values.len() >= MAX_SERIES && !values.contains_key(&key) {
            vec![OVERFLOW.to_owned(); labels.len()]
        } else {
            key
        };
        f(values.entry(key).or_insert_with(default));
    }

    fn snapshot(&self) -> Vec<(Vec<String>, V)> {
        self.lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn header(&self, out: &mut String, kind: &str) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {kind}", self.name);
    }
}

/// `{a="x",b="y"}` with the exposition format's escapes.
fn label_set(names: &[&str], values: &[String], extra: Option<(&str, String)>) -> String {
    let mut pairs: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(n, v)| format!("{n}=\"{}\"", escape(v)))
        .collect();
    if let Some((n, v)) = extra {
        pairs.push(format!("{n}=\"{v}\""));
    }
    if pairs.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", pairs.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_scalars(out: &mut String, family: &Family<f64>, kind: &str) {
    family.header(out, kind);
    for (labels, v) in family.snapshot() {
        let _ = writeln!(
            out,
            "{}{} {v}",
            family.name,
            label_set(family.labels, &labels, None)
        );
    }
}

fn render_histograms(out: &mut String, family: &Family<Histogram>) {
    family.header(out, "histogram");
    for (labels, h) in family.snapshot() {
        let mut cumulative = 0;
        for (bound, n) in h.bounds.iter().zip(&h.counts) {
            cumulative += n;
            let set = label_set(family.labels, &labels, Some(("le", bound.to_string())));
            let _ = writeln!(out, "{}_bucket{set} {cumulative}", family.name);
        }
        let set = label_set(family.labels, &labels, Some(("le", "+Inf".into())));
        let _ = writeln!(out, "{}_bucket{set} {}", family.name, h.count);
        let set = label_set(family.labels, &labels, None);
        let _ = writeln!(out, "{}_sum{set} {}", family.name, h.sum);
        let _ = writeln!(out, "{}_count{set} {}", family.name, h.count);
    }
}

/// Every metric of one server. Counters and histograms count what this
/// replica did; the `intray_jobs*` gauges come from the database and are the
/// same on every replica (aggregate them with `max`, not `sum`).
#[derive(Debug)]
pub struct Metrics {
    jobs: Family<f64>,
    oldest_runnable: Family<f64>,
    leases_in_flight: Family<f64>,
    workers: Family<f64>,
    queue_wait: Family<Histogram>,
    attempt_duration: Family<Histogram>,
    attempts: Family<f64>,
    lease_expirations: Family<f64>,
    dead_set_arrivals: Family<f64>,
    long_polling: AtomicI64,
    rpc_duration: Family<Histogram>,
    rpc_responses: Family<f64>,
    refresh_failures: Family<f64>,
    unreadable_rows: Family<f64>,
    webhook_deliveries: Family<f64>,
    webhook_ingress: Family<f64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Empty metrics.
    pub fn new() -> Self {
        let metrics = Metrics {
            jobs: Family::new(
                "intray_jobs",
                "Jobs by tenant, queue and state (refreshed on a timer).",
                &["tenant", "queue", "state"],
            ),
            oldest_runnable: Family::new(
                "intray_oldest_runnable_job_age_seconds",
                "Age of the oldest queued job whose run_at has come (refreshed on a timer).",
                &["tenant", "queue"],
            ),
            leases_in_flight: Family::new(
                "intray_leases_in_flight",
                "Running jobs, i.e. leases held by workers (refreshed on a timer).",
                &["tenant", "queue"],
            ),
            workers: Family::new(
                "intray_workers",
                "Workers whose last Lease named the queue, within five minutes or while they hold a lease (refreshed on a timer).",
                &["tenant", "queue"],
            ),
            queue_wait: Family::new(
                "intray_queue_wait_seconds",
                "Time from runnable (run_at) to leased, per attempt.",
                &["queue"],
            ),
            attempt_duration: Family::new(
                "intray_attempt_duration_seconds",
                "Time from lease to the end of the attempt.",
                &["queue", "kind"],
            ),
            attempts: Family::new(
                "intray_attempts_total",
                "Ended attempts by outcome and error class.",
                &["queue", "kind", "outcome", "error_class"],
            ),
            lease_expirations: Family::new(
                "intray_lease_expirations_total",
                "Leases the reaper reclaimed because they ran out on their worker (the job queued again or failed lease_expired; not a cancel past its grace or a deadline passed while running).",
                &["queue"],
            ),
            dead_set_arrivals: Family::new(
                "intray_dead_set_arrivals_total",
                "Jobs that became FAILED (the dead set).",
                &["queue", "kind", "error_class"],
            ),
            long_polling: AtomicI64::new(0),
            rpc_duration: Family::new(
                "intray_rpc_duration_seconds",
                "gRPC call latency until the response headers (a long-poll includes its wait).",
                &["method"],
            ),
            rpc_responses: Family::new(
                "intray_rpc_responses_total",
                "gRPC calls by method and status code.",
                &["method", "code"],
            ),
            refresh_failures: Family::new(
                "intray_metrics_refresh_failures_total",
                "Timer refreshes of the database gauges that failed.",
                &[],
            ),
            unreadable_rows: Family::new(
                "intray_unreadable_job_rows_total",
                "Job rows left out of claims and reaper passes because they could not be read, each time one was met (refreshed on a timer).",
                &[],
            ),
            webhook_deliveries: Family::new(
                "intray_webhook_delivery_attempts_total",
                "Completion callback attempts by outcome (delivered, retry, failed).",
                &["outcome"],
            ),
            webhook_ingress: Family::new(
                "intray_webhook_ingress_total",
                "POST /hooks/{source} calls by source and HTTP status.",
                &["source", "code"],
            ),
        };
        // At 0 from the start: a series that appears at 1 hides its first
        // increase from rate() and increase().
        metrics.refresh_failures.with(&[], || 0.0, |_| {});
        metrics
    }

    /// Replaces the database gauges with a fresh reading; queues that
    /// vanished from the reading vanish from the gauges. The
    /// [`MAX_GAUGE_QUEUES`] queues with the most jobs queued or running
    /// keep series of their own; the others are summed under
    /// `tenant="_other", queue="_other"` (their oldest runnable job's age
    /// is the oldest among them).
    pub fn set_depths(&self, depths: &[QueueDepth]) {
        let live = |d: &QueueDepth| {
            let n = |state| d.counts.get(state).copied().unwrap_or(0);
            (n("queued") + n("running"), d.counts.values().sum::<u64>())
        };
        let mut ranked: Vec<&QueueDepth> = depths.iter().collect();
        ranked.sort_by_key(|d| std::cmp::Reverse(live(d)));
        let mut jobs = BTreeMap::new();
        let mut oldest = BTreeMap::new();
        let mut running = BTreeMap::new();
        for (rank, d) in ranked.into_iter().enumerate() {
            let key = gauge_key(rank, &d.tenant, &d.queue);
            for state in crate::domain::JobState::ALL {
                let n = d.counts.get(state.as_str()).copied().unwrap_or(0);
                let mut k = key.clone();
                k.push(state.as_str().to_owned());
                *jobs.entry(k).or_insert(0.0) += n as f64;
            }
            *running.entry(key.clone()).or_insert(0.0) +=
                d.counts.get("running").copied().unwrap_or(0) as f64;
            // A queue with nothing runnable has age 0, so alerts see it recover.
            let age = d.oldest_runnable_age.map_or(0.0, |a| a.as_secs_f64());
            let oldest = oldest.entry(key).or_insert(0.0_f64);
            *oldest = oldest.max(age);
        }
        *self.jobs.lock() = jobs;
        *self.oldest_runnable.lock() = oldest;
        *self.leases_in_flight.lock() = running;
    }

    /// Sets the workers gauge to `counts`, dropping queues no longer in it:
    /// the [`MAX_GAUGE_QUEUES`] queues with the most workers by name, the
    /// others summed under `_other`.
    pub fn set_workers(&self, counts: &[QueueWorkers]) {
        let mut ranked: Vec<&QueueWorkers> = counts.iter().collect();
        ranked.sort_by_key(|c| std::cmp::Reverse(c.workers));
        let mut workers = BTreeMap::new();
        for (rank, c) in ranked.into_iter().enumerate() {
            let key = gauge_key(rank, &c.tenant, &c.queue);
            *workers.entry(key).or_insert(0.0) += c.workers as f64;
        }
        *self.workers.lock() = workers;
    }

    /// A failed refresh of the database gauges.
    pub fn refresh_failed(&self) {
        self.refresh_failures.with(&[], || 0.0, |v| *v += 1.0);
    }

    /// The store's count of unreadable job rows left out so far.
    pub fn set_unreadable_rows(&self, n: u64) {
        self.unreadable_rows.with(&[], || 0.0, |v| *v = n as f64);
    }

    /// A job was leased after waiting `wait` since it became runnable.
    pub fn leased(&self, queue: &str, wait: Duration) {
        self.queue_wait.with(
            &[queue],
            || Histogram::new(JOB_BUCKETS),
            |h| h.observe(wait.as_secs_f64()),
        );
    }

    /// An attempt ended.
    pub fn attempt_ended(
        &self,
        queue: &str,
        kind: &str,
        outcome: &str,
        error_class: &str,
        duration: Option<Duration>,
    ) {
        self.attempts
            .with(&[queue, kind, outcome, error_class], || 0.0, |v| *v += 1.0);
        if let Some(d) = duration {
            self.attempt_duration.with(
                &[queue, kind],
                || Histogram::new(JOB_BUCKETS),
                |h| h.observe(d.as_secs_f64()),
            );
        }
    }

    /// The reaper reclaimed an expired lease.
    pub fn lease_expired(&self, queue: &str) {
        self.lease_expirations.with(&[queue], || 0.0, |v| *v += 1.0);
    }

    /// A job became FAILED.
    pub fn dead_set_arrival(&self, queue: &str, kind: &str, error_class: &str) {
        self.dead_set_arrivals
            .with(&[queue, kind, error_class], || 0.0, |v| *v += 1.0);
    }

    /// Counts a long-polling `Lease` call until the guard is dropped
    /// (however the call ends, a cancelled one included).
    pub fn long_poll(&self) -> LongPoll<'_> {
        self.long_polling.fetch_add(1, Ordering::Relaxed);
        LongPoll(&self.long_polling)
    }

    /// A gRPC call answered with `code` after `elapsed`.
    pub fn rpc(&self, method: &str, code: &str, elapsed: Duration) {
        self.rpc_duration.with(
            &[method],
            || Histogram::new(RPC_BUCKETS),
            |h| h.observe(elapsed.as_secs_f64()),
        );
        self.rpc_responses
            .with(&[method, code], || 0.0, |v| *v += 1.0);
    }

    /// A completion callback attempt ended with `outcome`.
    pub fn webhook_attempt(&self, outcome: &str) {
        self.webhook_deliveries
            .with(&[outcome], || 0.0, |v| *v += 1.0);
    }

    /// An ingress call was answered with `code`; unknown sources are
    /// counted under `source=""` so that callers cannot grow the label set.
    pub fn webhook_ingress(&self, source: &str, code: u16) {
        self.webhook_ingress
            .with(&[source, &code.to_string()], || 0.0, |v| *v += 1.0);
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        render_scalars(&mut out, &self.jobs, "gauge");
        render_scalars(&mut out, &self.oldest_runnable, "gauge");
        render_scalars(&mut out, &self.leases_in_flight, "gauge");
        render_scalars(&mut out, &self.workers, "gauge");
        render_histograms(&mut out, &self.queue_wait);
        render_histograms(&mut out, &self.attempt_duration);
        render_scalars(&mut out, &self.attempts, "counter");
        render_scalars(&mut out, &self.lease_expirations, "counter");
        render_scalars(&mut out, &self.dead_set_arrivals, "counter");
        let _ = writeln!(
            out,
            "# HELP intray_long_polling_workers Lease calls on this replica waiting for work.\n\
             # TYPE intray_long_polling_workers gauge\n\
             intray_long_polling_workers {}",
            self.long_polling.load(Ordering::Relaxed)
        );
        render_histograms(&mut out, &self.rpc_duration);
        render_scalars(&mut out, &self.rpc_responses, "counter");
        render_scalars(&mut out, &self.refresh_failures, "counter");
        render_scalars(&mut out, &self.unreadable_rows, "counter");
        render_scalars(&mut out, &self.webhook_deliveries, "counter");
        render_scalars(&mut out, &self.webhook_ingress, "counter");
        out
    }
}

/// The labels of the queue ranked `rank` in a database gauge: its own
/// within [`MAX_GAUGE_QUEUES`], the overflow series' beyond.
fn gauge_key(rank: usize, tenant: &str, queue: &str) -> Vec<String> {
    if rank < MAX_GAUGE_QUEUES {
        vec![tenant.to_owned(), queue.to_owned()]
    } else {
        vec![OVERFLOW.to_owned(), OVERFLOW.to_owned()]
    }
}

/// A long-polling `Lease` call, counted while this lives.
#[derive(Debug)]
pub struct LongPoll<'a>(&'a AtomicI64);

impl Drop for LongPoll<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labels_escaped_and_histograms_cumulative() {
        let m = Metrics::new();
        m.leased("q\"1", Duration::from_millis(20));
        m.leased("q\"1", Duration::from_secs(2));
        m.rpc(
            "/intray.v1.JobService/Submit",
            "OK",
            Duration::from_millis(3),
        );
        let text = m.render();
        assert!(text.contains("intray_queue_wait_seconds_bucket{queue=\"q\\\"1\",le=\"0.025\"} 1"));
        assert!(text.contains("intray_queue_wait_seconds_bucket{queue=\"q\\\"1\",le=\"2.5\"} 2"));
        assert!(text.contains("intray_queue_wait_seconds_bucket{queue=\"q\\\"1\",le=\"+Inf\"} 2"));
        assert!(text.contains("intray_queue_wait_seconds_count{queue=\"q\\\"1\"} 2"));
        assert!(text.contains(
            "intray_rpc_responses_total{method=\"/intray.v1.JobService/Submit\",code=\"OK\"} 1"
        ));
        assert!(text.contains("# TYPE intray_jobs gauge"));
        assert!(
            text.contains("\nintray_metrics_refresh_failures_total 0\n"),
            "a counter at 0 from the start"
        );
    }

    #[test]
    fn label_sets_beyond_the_bound_are_counted_together() {
        let m = Metrics::new();
        for i in 0..MAX_SERIES + 100 {
            m.attempt_ended("q", "k", "failed", &format!("class-{i}"), None);
        }
        m.attempt_ended("q", "k", "failed", "class-0", None);
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("intray_attempts_total{"))
            .count();
        assert_eq!(series, MAX_SERIES + 1, "the bound and one overflow series");
        assert!(text.contains(
            "intray_attempts_total{queue=\"_other\",kind=\"_other\",outcome=\"_other\",error_class=\"_other\"} 100"
        ));
        assert!(
            text.contains("error_class=\"class-0\"} 2"),
            "a series kept goes on counting"
        );
    }

    #[test]
    fn queues_beyond_the_gauge_bound_are_summed_together() {
        let m = Metrics::new();
        let depth = |i: usize, queued: u64| QueueDepth {
            tenant: "t".into(),
            queue: format!("q{i}"),
            counts: [("queued", queued), ("running", 1)].into_iter().collect(),
            oldest_runnable_age: Some(Duration::from_secs(i as u64)),
        };
        // The busiest queue last: the rank, not the order read, decides.
        let mut depths: Vec<QueueDepth> = (0..MAX_GAUGE_QUEUES + 10).map(|i| depth(i, 1)).collect();
        depths.push(depth(9999, 50));
        m.set_depths(&depths);
        m.set_workers(
            &(0..MAX_GAUGE_QUEUES + 3)
                .map(|i| QueueWorkers {
                    tenant: "t".into(),
                    queue: format!("q{i}"),
                    workers: 2,
                })
                .collect::<Vec<_>>(),
        );
        let text = m.render();
        let queued =
            |line: &str| line.starts_with("intray_jobs{") && line.contains("state=\"queued\"");
        assert_eq!(
            text.lines().filter(|l| queued(l)).count(),
            MAX_GAUGE_QUEUES + 1,
            "the bound and one overflow series"
        );
        assert!(text.contains("intray_jobs{tenant=\"t\",queue=\"q9999\",state=\"queued\"} 50"));
        assert!(
            text.contains("intray_jobs{tenant=\"_other\",queue=\"_other\",state=\"queued\"} 11")
        );
        assert!(text.contains("intray_leases_in_flight{tenant=\"_other\",queue=\"_other\"} 11"));
        assert!(text.contains(&format!(
            "intray_oldest_runnable_job_age_seconds{{tenant=\"_other\",queue=\"_other\"}} {}",
            MAX_GAUGE_QUEUES + 9
        )));
        assert!(text.contains("intray_workers{tenant=\"_other\",queue=\"_other\"} 6"));
    }

    #[test]
    fn a_refresh_replaces_the_gauges() {
        let m = Metrics::new();
        let mut d = QueueDepth {
            tenant: "t".into(),
            queue: "a".into(),
            ..Default::default()
        };
        d.counts.insert("queued", 3);
        d.oldest_runnable_age = Some(Duration::from_secs(7));
        m.set_depths(&[d]);
        let text = m.render();
        assert!(text.contains("intray_jobs{tenant=\"t\",queue=\"a\",state=\"queued\"} 3"));
        assert!(text.contains("intray_jobs{tenant=\"t\",queue=\"a\",state=\"failed\"} 0"));
        assert!(
            text.contains("intray_oldest_runnable_job_age_seconds{tenant=\"t\",queue=\"a\"} 7")
        );
        m.set_depths(&[]);
        assert!(!m.render().contains("queue=\"a\""));
    }
}
