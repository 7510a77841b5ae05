//! A first, rough end-to-end throughput figure: an in-process server on the
//! given database, producers calling unary `Submit`, workers calling
//! `Lease` (max_jobs 1) and `Complete` over real gRPC on loopback.
//!
//! ```text
//! cargo run --release --example rough_e2e -- sqlite:///tmp/rough.db 5000 16 4
//! cargo run --release --example rough_e2e -- postgres://postgres@127.0.0.1/rough 5000 16 4
//! ```
//! Arguments: database URL (must be empty or new), jobs, workers, producers.
//! The proper benchmark is `intray bench` (issue 6); this only gives an
//! order of magnitude.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use intray::config::Settings;
use intray::pb::job_service_client::JobServiceClient;
use intray::pb::worker_service_client::WorkerServiceClient;
use intray::pb::{self, complete_request::Outcome};
use tonic::transport::{Channel, Endpoint};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let url = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "sqlite:///tmp/rough_e2e.db".into());
    let jobs: u64 = args.get(2).map_or(Ok(5000), |s| s.parse())?;
    let workers: u64 = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let producers: u64 = args.get(4).map_or(Ok(4), |s| s.parse())?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(intray::server::run(
        Settings::new(url.clone()),
        listener,
        async {
            let _ = stop_rx.await;
        },
    ));
    let channel = connect(&format!("http://{addr}")).await?;

    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let mut client = JobServiceClient::new(channel.clone());
        let share = jobs / producers + u64::from(p < jobs % producers);
        tasks.push(tokio::spawn(async move {
            for _ in 0..share {
                client
                    .submit(pb::SubmitRequest {
                        queue: "rough".into(),
                        kind: "noop".into(),
                        ..Default::default()
                    })
                    .await?;
            }
            Ok::<(), Error>(())
        }));
    }
    let done = Arc::new(AtomicU64::new(0));
    for w in 0..workers {
        let mut client = WorkerServiceClient::new(channel.clone());
        let done = Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            while done.load(Ordering::Relaxed) < jobs {
                let leased = client
                    .lease(pb::LeaseRequest {
                        worker_id: format!("w{w}"),
                        queues: vec!["rough".into()],
                        max_jobs: Some(1),
                        wait: Some(pbjson_types::Duration {
                            seconds: 0,
                            nanos: 200_000_000,
                        }),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                for job in leased.jobs {
                    client
                        .complete(pb::CompleteRequest {
                            job_id: job.job_id,
                            lease_token: job.lease_token,
                            outcome: Some(Outcome::Success(pb::complete_request::Success {
                                result: None,
                            })),
                            cost_cents: 0,
                        })
                        .await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<(), Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let elapsed = started.elapsed();
    println!(
        "rough_e2e url={} jobs={jobs} workers={workers} producers={producers}: {:.2}s, {:.0} jobs/s",
        redact(&url),
        elapsed.as_secs_f64(),
        jobs as f64 / elapsed.as_secs_f64()
    );
    println!(
        "command: cargo run --release --example rough_e2e -- {} {jobs} {workers} {producers}",
        redact(&url)
    );
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), server).await???;
    Ok(())
}

async fn connect(url: &str) -> Result<Channel, Error> {
    for _ in 0..50 {
        if let Ok(channel) = Endpoint::from_shared(url.to_owned())?
            .tcp_nodelay(true)
            .connect()
            .await
        {
            return Ok(channel);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("server did not come up".into())
}

fn redact(url: &str) -> &str {
    url.split('?').next().unwrap_or(url)
}
