//! The scenarios: each runs its load against the server, with a warm-up
//! first, and turns what the client saw into reports.

mod backlog;
mod dispatch;
mod load;
mod pipeline;
mod settle;
mod submit;
mod timed;
mod transport;
mod watchers;

use std::time::Duration;

use clap::ValueEnum;
use serde_json::Value;

use self::dispatch::Dispatch;
use self::load::{prefill, progress, verify_succeeded};
use self::pipeline::Pipeline;
use self::settle::Settle;
use super::conn::Conn;
use super::error::BenchError;
use super::report::Report;
use super::spawn::Backend;
use super::stats::{millis, rate, summarize};

/// A benchmark scenario; they run in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Scenario {
    /// Unary Submit from 1, 16 and 32 concurrent producers.
    Submit,
    /// Producers with unary Submit, workers with Lease(max_jobs 1) and
    /// Complete, at most --e2e-outstanding jobs outstanding.
    E2e,
    /// e2e with workers that report each job with CompleteAndLease, which
    /// claims their next job (max_jobs 1) in the same call: another shape,
    /// not e2e.
    E2eChained,
    /// SubmitBatch, Lease(max_jobs up to 100) and CompleteBatch, at most
    /// --batched-outstanding jobs outstanding.
    E2eBatched,
    /// A pre-submitted backlog drained with Lease(100) and CompleteBatch.
    BurnDown,
    /// burn-down with workers that report each batch with CompleteAndLease,
    /// which claims their next 100 in the same call.
    BurnDownChained,
    /// Submit to an idle, parked worker, one job at a time.
    Dispatch,
    /// e2e behind a runnable backlog held at a small and a large size, and
    /// dispatch beside a scheduled (never runnable) backlog of each size.
    Backlog,
    /// Thousands of WatchJob streams: memory, connections, event latency.
    Watchers,
    /// Calls that do no work (the health check) from as many callers as
    /// e2e: what the transport alone allows.
    Transport,
}

/// How much load each scenario sends.
#[derive(Clone, Debug)]
pub struct Sizes {
    /// Concurrent producers of the submit scenario, one row each.
    pub submit_producers: Vec<usize>,
    /// Measured jobs per submit row.
    pub submit_jobs: u64,
    /// Producers of e2e, e2e-batched and backlog.
    pub producers: usize,
    /// Workers of e2e, e2e-batched, burn-down, backlog and watchers.
    pub workers: usize,
    /// Measured jobs of e2e.
    pub e2e_jobs: u64,
    /// Most jobs outstanding (submitted, not yet answered as completed) in
    /// e2e and e2e-chained.
    pub e2e_outstanding: u64,
    /// Measured jobs of e2e-batched.
    pub batched_jobs: u64,
    /// Most jobs outstanding in e2e-batched.
    pub batched_outstanding: u64,
    /// Jobs per SubmitBatch, and Lease max_jobs (at most 100), of the batched scenarios.
    pub batch: usize,
    /// Jobs pre-submitted and drained by burn-down.
    pub burn_down_jobs: u64,
    /// Measured jobs of dispatch (and of each backlog size).
    pub dispatch_samples: u64,
    /// Pause from the idle worker having completed a dispatch job to the next Submit.
    pub dispatch_spacing: Duration,
    /// The large backlog (the small one is 1,000).
    pub backlog_size: u64,
    /// Measured e2e jobs at each backlog size.
    pub backlog_jobs: u64,
    /// Longest wait for the machine to settle before each scenario and each
    /// backlog part; zero skips settling.
    pub settle: Duration,
    /// Concurrent WatchJob streams.
    pub watchers: u64,
    /// Streams per HTTP/2 connection.
    pub watchers_per_channel: usize,
    /// Jobs (or dispatch samples, at most 100) run first and not measured.
    pub warmup: u64,
}

/// The small backlog size the large one is compared with.
pub const SMALL_BACKLOG: u64 = 1000;
/// Most jobs one Lease may ask for.
const MAX_LEASE: usize = 100;
/// Calls per job in e2e: Submit, Lease and Complete.
const E2E_CALLS_PER_JOB: u64 = 3;

/// What the scenarios need to know about the run.
pub struct Ctx {
    /// Connections to the server.
    pub conn: Conn,
    /// Load sizes.
    pub sizes: Sizes,
    /// Makes this run's queue names unique, so runs against one server do not mix.
    pub run_id: String,
    /// The server's process, for its memory.
    pub server_pid: Option<u32>,
    /// Its database, when known.
    pub database_url: Option<String>,
}

impl Ctx {
    fn queue(&self, scenario: &str) -> String {
        format!("bench-{scenario}-{}", self.run_id)
    }

    fn backend(&self) -> Option<Backend> {
        self.database_url.as_deref().and_then(Backend::of)
    }

    fn settle(&self) -> Settle {
        Settle {
            checkpoint_url: match self.backend() {
                Some(Backend::Postgres) => self.database_url.clone(),
                _ => None,
            },
            give_up: self.sizes.settle,
        }
    }

    fn dispatch_warmup(&self) -> u64 {
        self.sizes.warmup.min(100)
    }

    fn pipeline(&self, queue: String, batched: bool, chain: bool) -> Pipeline {
        let batch = self.sizes.batch.clamp(1, load::MAX_BATCH);
        Pipeline {
            queue,
            producers: self.sizes.producers,
            workers: self.sizes.workers,
            submit_batch: if batched { batch } else { 1 },
            lease_max: if batched {
                batch.min(MAX_LEASE) as u32
            } else {
                1
            },
            priority: 0,
            chain,
            outstanding: if batched {
                self.sizes.batched_outstanding
            } else {
                self.sizes.e2e_outstanding
            },
        }
    }
}

fn opt(value: Option<f64>) -> Value {
    value.map_or(Value::Null, |v| ((v * 1000.0).round() / 1000.0).into())
}

/// Runs `scenario`, handing each report to `emit` as soon as it is ready.
pub async fn run(
    scenario: Scenario,
    ctx: &Ctx,
    emit: &mut dyn FnMut(Report) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let s = &ctx.sizes;
    // What the scenario before left to the database (dead rows to vacuum,
    // WAL to write) is not this one's cost.
    ctx.settle().wait().await;
    match scenario {
        Scenario::Submit => {
            let queue = ctx.queue("submit");
            for &producers in &s.submit_producers {
                progress(&format!(
                    "submit: {producers} producers, {} jobs",
                    s.submit_jobs
                ));
                if s.warmup > 0 {
                    submit::run(&ctx.conn, &queue, producers, s.warmup).await?;
                }
                let run = submit::run(&ctx.conn, &queue, producers, s.submit_jobs).await?;
                emit(
                    Report::new("submit")
                        .field("producers", producers)
                        .field("jobs", s.submit_jobs)
                        .rate("jobs_per_s", rate(s.submit_jobs, run.elapsed))
                        .latency("latency", summarize(run.latencies))
                        .field("warmup_jobs", s.warmup),
                )?;
            }
        }
        Scenario::E2e | Scenario::E2eChained | Scenario::E2eBatched => {
            let batched = scenario == Scenario::E2eBatched;
            let chain = scenario == Scenario::E2eChained;
            let (name, jobs) = match scenario {
                Scenario::E2eBatched => ("e2e-batched", s.batched_jobs),
                Scenario::E2eChained => ("e2e-chained", s.e2e_jobs),
                _ => ("e2e", s.e2e_jobs),
            };
            let queue = ctx.queue(name);
            let pipeline = ctx.pipeline(queue.clone(), batched, chain);
            progress(&format!(
                "{name}: {} producers, {} workers, {jobs} jobs, at most {} outstanding",
                pipeline.producers, pipeline.workers, pipeline.outstanding
            ));
            if s.warmup > 0 {
                pipeline.run(&ctx.conn, s.warmup).await?;
            }
            let run = pipeline.run(&ctx.conn, jobs).await?;
            let expected = jobs + s.warmup;
            let counted = verify_succeeded(
                &ctx.conn,
                name,
                &queue,
                expected,
                &format!("{jobs} jobs + {} warm-up", s.warmup),
            )
            .await?;
            emit(
                Report::new(name)
                    .field("producers", pipeline.producers)
                    .field("workers", pipeline.workers)
                    .field("jobs", jobs)
                    .field("outstanding", pipeline.outstanding)
                    .field("submit_batch", pipeline.submit_batch)
                    .field("lease_max_jobs", pipeline.lease_max)
                    .field("complete_and_lease", chain)
                    .rate("jobs_per_s", rate(jobs, run.elapsed))
                    .latency("queue", summarize(run.queue_times))
                    .field("completed", run.completed)
                    .field("stats_succeeded", counted)
                    .field("expected_succeeded", expected)
                    .field("warmup_jobs", s.warmup),
            )?;
        }
        Scenario::BurnDown | Scenario::BurnDownChained => {
            let chain = scenario == Scenario::BurnDownChained;
            let name = if chain {
                "burn-down-chained"
            } else {
                "burn-down"
            };
            let queue = ctx.queue(name);
            let pipeline = ctx.pipeline(queue.clone(), true, chain);
            if s.warmup > 0 {
                prefill(&ctx.conn, &queue, s.warmup, 0, None).await?;
                pipeline.drain(&ctx.conn, s.warmup).await?;
            }
            progress(&format!("{name}: pre-submitting {} jobs", s.burn_down_jobs));
            prefill(&ctx.conn, &queue, s.burn_down_jobs, 0, None).await?;
            progress(&format!(
                "{name}: draining with {} workers",
                pipeline.workers
            ));
            let run = pipeline.drain(&ctx.conn, s.burn_down_jobs).await?;
            let expected = s.burn_down_jobs + s.warmup;
            let counted = verify_succeeded(
                &ctx.conn,
                name,
                &queue,
                expected,
                &format!("{} jobs + {} warm-up", s.burn_down_jobs, s.warmup),
            )
            .await?;
            emit(
                Report::new(name)
                    .field("workers", pipeline.workers)
                    .field("jobs", s.burn_down_jobs)
                    .field("lease_max_jobs", pipeline.lease_max)
                    .field("complete_and_lease", chain)
                    .rate("jobs_per_s", rate(s.burn_down_jobs, run.elapsed))
                    .field("completed", run.completed)
                    .field("stats_succeeded", counted)
                    .field("expected_succeeded", expected)
                    .field("warmup_jobs", s.warmup),
            )?;
        }
        Scenario::Dispatch => {
            let probe = Dispatch {
                queue: ctx.queue("dispatch"),
                samples: s.dispatch_samples,
                warmup: ctx.dispatch_warmup(),
                spacing: s.dispatch_spacing,
                priority: 0,
            };
            progress(&format!(
                "dispatch: {} jobs to an idle worker",
                probe.samples
            ));
            let latencies = probe.run(&ctx.conn).await?;
            let expected = probe.samples + probe.warmup;
            let counted = verify_succeeded(
                &ctx.conn,
                "dispatch",
                &probe.queue,
                expected,
                &format!("{} samples + {} warm-up", probe.samples, probe.warmup),
            )
            .await?;
            emit(
                Report::new("dispatch")
                    .field("samples", latencies.len())
                    .field("spacing_ms", millis(probe.spacing))
                    .latency("dispatch", summarize(latencies))
                    .field("stats_succeeded", counted)
                    .field("expected_succeeded", expected)
                    .field("warmup_jobs", probe.warmup),
            )?;
        }
        Scenario::Backlog => {
            let queue = ctx.queue("backlog");
            let pipeline = ctx.pipeline(queue.clone(), false, false);
            let plan = backlog::Plan {
                pipeline,
                e2e_jobs: s.backlog_jobs,
                warmup: s.warmup,
                dispatch: Dispatch {
                    queue,
                    samples: s.dispatch_samples,
                    warmup: ctx.dispatch_warmup(),
                    spacing: s.dispatch_spacing,
                    priority: 0,
                },
                settle: ctx.settle(),
            };
            let sizes = [SMALL_BACKLOG, s.backlog_size.max(SMALL_BACKLOG)];
            let mut first: Option<backlog::AtSize> = None;
            let mut reports = Vec::new();
            backlog::run(&ctx.conn, &plan, &sizes, |at| {
                let mut report = Report::new("backlog")
                    .field("backlog", at.backlog)
                    .field("e2e_backlog", "runnable")
                    .field("dispatch_backlog", "scheduled")
                    .field("producers", plan.pipeline.producers)
                    .field("workers", plan.pipeline.workers)
                    .field("e2e_jobs", plan.e2e_jobs)
                    .field("e2e_outstanding", at.backlog)
                    .rate("e2e_jobs_per_s", at.e2e_jobs_per_s)
                    .latency("dispatch", at.dispatch)
                    .field("dispatch_samples", plan.dispatch.samples);
                if let Some(small) = &first {
                    report = report
                        .field("vs_backlog", small.backlog)
                        .field(
                            "e2e_ratio",
                            opt(backlog::ratio(at.e2e_jobs_per_s, small.e2e_jobs_per_s)),
                        )
                        .field(
                            "dispatch_p50_ratio",
                            opt(backlog::latency_ratio(
                                at.dispatch.map(|d| d.p50),
                                small.dispatch.map(|d| d.p50),
                            )),
                        )
                        .field(
                            "dispatch_p99_ratio",
                            opt(backlog::latency_ratio(
                                at.dispatch.map(|d| d.p99),
                                small.dispatch.map(|d| d.p99),
                            )),
                        );
                }
                let extra = at.e2e_completed.saturating_sub(plan.e2e_jobs + plan.warmup);
                let checks = [
                    (
                        at.e2e_queue.clone(),
                        at.e2e_completed,
                        format!(
                            "e2e: {} jobs + {} warm-up, and {extra} that other workers \
                             held or were leasing as a run reached its count",
                            plan.e2e_jobs, plan.warmup
                        ),
                    ),
                    (
                        at.dispatch_queue.clone(),
                        at.dispatch_jobs,
                        format!(
                            "dispatch: {} samples and each round's warm-up",
                            plan.dispatch.samples
                        ),
                    ),
                ];
                reports.push((report.field("arrangement", backlog::ARRANGEMENT), checks));
                if first.is_none() {
                    first = Some(at);
                }
                Ok(())
            })
            .await?;
            // Each size's completed e2e jobs and dispatch jobs, warm-ups
            // included, ended SUCCEEDED; the backlogs are still queued.
            for (report, checks) in reports {
                let (mut counted, mut expected) = (0, 0);
                for (queue, jobs, what) in checks {
                    counted += verify_succeeded(&ctx.conn, "backlog", &queue, jobs, &what).await?;
                    expected += jobs;
                }
                emit(
                    report
                        .field("stats_succeeded", counted)
                        .field("expected_succeeded", expected)
                        .field("warmup_jobs", s.warmup),
                )?;
            }
        }
        Scenario::Watchers => {
            let queue = ctx.queue("watchers");
            let pg_url = match ctx.backend() {
                Some(Backend::Postgres) => ctx.database_url.as_deref(),
                _ => None,
            };
            progress(&format!("watchers: {} streams", s.watchers));
            let watched = watchers::run(
                &ctx.conn,
                &queue,
                s.watchers,
                s.watchers_per_channel,
                s.workers,
                watchers::Probes {
                    server_pid: ctx.server_pid,
                    pg_url,
                },
            )
            .await?;
            let counted = verify_succeeded(
                &ctx.conn,
                "watchers",
                &queue,
                s.watchers,
                &format!("{} watched jobs", s.watchers),
            )
            .await?;
            let above = watched
                .rss_watching
                .zip(watched.rss_idle)
                .map(|(w, i)| w.saturating_sub(i));
            let pool = match ctx.backend() {
                Some(Backend::Sqlite) => Value::from("sqlite: 1 writer + 4 readers"),
                Some(Backend::Postgres) => Value::from("postgres: serve --max-connections"),
                None => Value::Null,
            };
            emit(
                Report::new("watchers")
                    .field("watchers", watched.streams)
                    .field("channels", watched.channels)
                    .latency("event", summarize(watched.latencies))
                    .latency("complete_call", summarize(watched.completes))
                    .latency("delivery_after_answer", summarize(watched.deliveries))
                    .mib("rss_idle_mib", watched.rss_idle)
                    .mib("rss_watching_mib", watched.rss_watching)
                    .mib("rss_above_idle_mib", above)
                    .field("db_connections", watched.db_connections.map(|c| c.open))
                    .field(
                        "db_connections_busy",
                        watched.db_connections.map(|c| c.busy),
                    )
                    .field("db_pool", pool)
                    .field("stats_succeeded", counted)
                    .field("expected_succeeded", s.watchers),
            )?;
        }
        Scenario::Transport => {
            let callers = s.producers + s.workers;
            let calls = s.e2e_jobs * E2E_CALLS_PER_JOB;
            progress(&format!("transport: {callers} callers, {calls} calls"));
            if s.warmup > 0 {
                transport::run(&ctx.conn, callers, s.warmup).await?;
            }
            let run = transport::run(&ctx.conn, callers, calls).await?;
            let calls_per_s = rate(calls, run.elapsed);
            emit(
                Report::new("transport")
                    .field("callers", callers)
                    .field("calls", calls)
                    .rate("calls_per_s", calls_per_s)
                    .latency("latency", summarize(run.latencies))
                    .field(
                        "e2e_ceiling_jobs_per_s",
                        (calls_per_s / E2E_CALLS_PER_JOB as f64).round(),
                    )
                    .field("warmup_calls", s.warmup),
            )?;
        }
    }
    Ok(())
}
