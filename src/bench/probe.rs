//! What the server holds while it works: its resident memory (from
//! `/proc/PID/status`) and the database connections in use.

use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::error::BenchError;

/// Resident set size of process `pid` in bytes; `None` when it cannot be
/// read (not Linux, no such process).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    vm_rss(&status)
}

/// The `VmRSS:   1234 kB` line of a `/proc/PID/status` text, in bytes.
fn vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

/// Connections to a database, the one asking left out.
#[derive(Clone, Copy, Debug)]
pub struct PgConnections {
    /// Every connection open to it (a pool's idle ones included).
    pub open: i64,
    /// Those running a statement or inside a transaction.
    pub busy: i64,
}

/// `pg_stat_activity` rows for `current_database()` of `url`, minus this one.
pub async fn pg_connections(url: &str) -> Result<PgConnections, BenchError> {
    let db = |what: &str| {
        let what = what.to_owned();
        move |source| BenchError::Database { what, source }
    };
    let mut conn = PgConnection::connect(url)
        .await
        .map_err(db("connect to count connections"))?;
    let (open, busy): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE state IS DISTINCT FROM 'idle') \
         FROM pg_stat_activity WHERE datname = current_database()",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(db("count connections"))?;
    conn.close().await.map_err(db("close"))?;
    Ok(PgConnections {
        open: open - 1,
        busy: busy - 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_rss_in_kib() {
        let status = "Name:\tintray\nVmPeak:\t  9000 kB\nVmRSS:\t   2048 kB\nThreads:\t3\n";
        assert_eq!(vm_rss(status), Some(2048 * 1024));
        assert_eq!(vm_rss("Name:\tx\n"), None);
        assert_eq!(vm_rss("VmRSS:\t12 MB\n"), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        assert!(rss_bytes(std::process::id()).is_some_and(|b| b > 0));
    }
}
