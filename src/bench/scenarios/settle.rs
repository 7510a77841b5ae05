//! Letting the machine calm down before a figure is taken.
//!
//! Growing a backlog by a million jobs leaves PostgreSQL with WAL to write
//! out and tables to vacuum and analyse for many seconds afterwards. A
//! latency measured meanwhile measures that background work on a shared
//! machine, not the claim, and it lands on only one of the two figures a
//! backlog ratio compares. So before each measured part a scenario can ask
//! for a CHECKPOINT and then wait, for a bounded time, until this machine's
//! CPU is mostly idle.

use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::load::progress;

/// Busy share of all cores under which the machine counts as settled.
const CALM_PERCENT: u64 = 25;
/// How long one CPU sample spans, unless the whole wait is shorter.
const SAMPLE: Duration = Duration::from_secs(2);
/// The shortest sample: a shorter one is mostly rounding.
const MIN_SAMPLE: Duration = Duration::from_millis(100);

/// Waits for background work to end before a measurement.
#[derive(Clone, Debug)]
pub struct Settle {
    /// A PostgreSQL database to CHECKPOINT first (none for SQLite or an
    /// unknown database).
    pub checkpoint_url: Option<String>,
    /// The wait gives up after this long and says so; zero skips settling.
    pub give_up: Duration,
}

impl Settle {
    /// CHECKPOINTs the database, if any, then waits until the CPU is under
    /// [`CALM_PERCENT`] busy over one sample ([`SAMPLE`], or `give_up` when
    /// shorter), at most `give_up`. Where either cannot be done (no
    /// permission, no `/proc/stat`) it says so and goes on: settling makes
    /// figures steadier, it is not what they measure.
    pub async fn wait(&self) {
        if self.give_up.is_zero() {
            return;
        }
        if let Some(url) = &self.checkpoint_url
            && let Err(e) = checkpoint(url).await
        {
            progress(&format!("settle: no CHECKPOINT ({e}); going on"));
        }
        let sample = SAMPLE.min(self.give_up).max(MIN_SAMPLE);
        let started = Instant::now();
        loop {
            let Some(busy) = busy_percent(sample).await else {
                progress("settle: no /proc/stat to read the CPU from; going on");
                return;
            };
            if busy < CALM_PERCENT {
                progress(&format!("settle: CPU {busy} % busy"));
                return;
            }
            if started.elapsed() >= self.give_up {
                progress(&format!(
                    "settle: CPU still {busy} % busy after {:?}; measuring anyway",
                    self.give_up
                ));
                return;
            }
        }
    }
}

async fn checkpoint(url: &str) -> Result<(), sqlx::Error> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query("CHECKPOINT").execute(&mut conn).await?;
    conn.close().await
}

/// Percent of all cores' time spent busy over `span`; `None` without a
/// readable `/proc/stat`.
async fn busy_percent(span: Duration) -> Option<u64> {
    let before = cpu_times(&tokio::fs::read_to_string("/proc/stat").await.ok()?)?;
    tokio::time::sleep(span).await;
    let after = cpu_times(&tokio::fs::read_to_string("/proc/stat").await.ok()?)?;
    let total = after.total.saturating_sub(before.total);
    let idle = after.idle.saturating_sub(before.idle);
    Some(
        (100 * (total - idle.min(total)))
            .checked_div(total)
            .unwrap_or(0),
    )
}

/// Jiffies since boot, summed over cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CpuTimes {
    total: u64,
    /// Idle and waiting for I/O.
    idle: u64,
}

/// The first (`cpu `) line of a `/proc/stat` text: user, nice, system,
/// idle, iowait, irq, softirq, steal. Guest time is already in user.
fn cpu_times(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    if fields.len() < 5 {
        return None;
    }
    Some(CpuTimes {
        total: fields.iter().sum(),
        idle: fields[3] + fields[4],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_summed_cpu_line() {
        let stat = "cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 50 2 25 400 10 0 1 1 0 0\nintr 1\n";
        assert_eq!(
            cpu_times(stat),
            Some(CpuTimes {
                total: 981,
                idle: 820
            })
        );
        assert_eq!(cpu_times("cpu0 1 2 3 4 5\n"), None);
        assert_eq!(cpu_times("cpu  1 2 x 4 5\n"), None);
        assert_eq!(cpu_times("cpu  1 2 3\n"), None);
    }

    #[tokio::test]
    async fn this_machine_reports_a_share() {
        let busy = busy_percent(Duration::from_millis(50)).await;
        assert!(busy.is_some_and(|b| b <= 100));
    }
}
