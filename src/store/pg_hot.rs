//! Connections for the hot path, held outside sqlx's pool.
//!
//! sqlx's pool pings every connection it takes back, whatever its options
//! say (`return_to_pool` in sqlx-core 0.9): one more round trip after every
//! claim, `Complete` and hand-off, which woke a PostgreSQL backend about as
//! often as the statements themselves did. Taken back without it, e2e ran
//! 4 % faster (docs/performance-log.md, "Changes of 2026-12-05"). What the
//! ping guards against, a connection left in the middle of a statement or a
//! transaction by a future that was dropped, is kept out here another way: a
//! connection goes back only when its user says that its work ended
//! ([`HotConn::finish`]), and one dropped otherwise is closed, which makes
//! PostgreSQL roll back whatever it was doing.

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, Executor};
use tokio::sync::{Semaphore, SemaphorePermit};

/// How long a caller waits for a connection (a free one, or a new one).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection this old is replaced instead of reused, as sqlx's pool
/// does by default: a backend's caches only grow.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// At most `size` connections to one database, each set up with the same
/// session statements when it opens. Connections open on first need and stay
/// open; the most recently used is handed out first.
pub struct HotPool {
    options: PgConnectOptions,
    setup: &'static [&'static str],
    slots: Semaphore,
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: PgConnection,
    opened: Instant,
}

impl std::fmt::Debug for HotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotPool")
            .field("free_slots", &self.slots.available_permits())
            .finish_non_exhaustive()
    }
}

impl HotPool {
    /// A pool for `url` that runs `setup` (each one or more `SET`s) on each
    /// new connection. Nothing connects yet.
    pub fn new(
        url: &str,
        size: u32,
        setup: &'static [&'static str],
    ) -> Result<HotPool, sqlx::Error> {
        Ok(HotPool {
            options: PgConnectOptions::from_str(url)?,
            setup,
            slots: Semaphore::new(usize::try_from(size.max(1)).unwrap_or(1)),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// A connection for one unit of work. Waits for a free one, or opens
    /// one; fails with `PoolTimedOut` after [`ACQUIRE_TIMEOUT`].
    pub async fn acquire(&self) -> Result<HotConn<'_>, sqlx::Error> {
        tokio::time::timeout(ACQUIRE_TIMEOUT, async {
            let slot = self
                .slots
                .acquire()
                .await
                .map_err(|_| sqlx::Error::PoolClosed)?;
            let idle = match self.take_idle() {
                Some(idle) => idle,
                None => self.open().await?,
            };
            Ok(HotConn {
                idle: Some(idle),
                pool: self,
                finished: false,
                _slot: slot,
            })
        })
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    /// The most recently used idle connection young enough to reuse; older
    /// ones are closed on the way.
    fn take_idle(&self) -> Option<Idle> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(candidate) = idle.pop() {
            if candidate.opened.elapsed() < MAX_LIFETIME {
                return Some(candidate);
            }
            tokio::spawn(async move {
                // Closing only says goodbye; a failure leaves nothing behind.
                let _ = candidate.conn.close().await;
            });
        }
        None
    }

    async fn open(&self) -> Result<Idle, sqlx::Error> {
        let mut conn = self.options.connect().await?;
        for statements in self.setup {
            conn.execute(*statements).await?;
        }
        Ok(Idle {
            conn,
            opened: Instant::now(),
        })
    }
}

/// A connection taken from a [`HotPool`]; derefs to the connection.
/// Dropped without [`HotConn::finish`], it is closed rather than reused.
pub struct HotConn<'a> {
    idle: Option<Idle>,
    pool: &'a HotPool,
    finished: bool,
    /// Released after `drop` has put the connection back, so that a waiter
    /// finds it idle rather than opening another.
    _slot: SemaphorePermit<'a>,
}

impl HotConn<'_> {
    /// Hands the connection back for reuse. Call it once the work's last
    /// statement (or its COMMIT) has returned, so that nothing is left in
    /// flight on it; an error on the way skips the call, and the
    /// connection is closed instead.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl Deref for HotConn<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.idle {
            Some(idle) => &idle.conn,
            None => unreachable!("a HotConn holds its connection until dropped"),
        }
    }
}

impl DerefMut for HotConn<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.idle {
            Some(idle) => &mut idle.conn,
            None => unreachable!("a HotConn holds its connection until dropped"),
        }
    }
}

impl Drop for HotConn<'_> {
    fn drop(&mut self) {
        let Some(idle) = self.idle.take() else {
            return;
        };
        if self.finished {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(idle);
        }
        // Otherwise `idle` drops here and its socket closes: PostgreSQL ends
        // the session and rolls back an open transaction.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The admin URL the integration tests use; these tests only read.
    fn url() -> String {
        std::env::var("INTRAY_TEST_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    async fn backend_pid(conn: &mut PgConnection) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("ask for the backend's pid")
    }

    #[tokio::test]
    async fn a_finished_connection_is_reused_with_its_settings() {
        let pool = HotPool::new(&url(), 2, &["SET application_name = 'intray_hot_test'"])
            .expect("a valid URL");
        let mut conn = pool.acquire().await.expect("connect");
        let first = backend_pid(&mut conn).await;
        conn.finish();
        let mut conn = pool.acquire().await.expect("reuse");
        assert_eq!(backend_pid(&mut conn).await, first);
        let name: String = sqlx::query_scalar("SHOW application_name")
            .fetch_one(&mut *conn)
            .await
            .expect("read the setting");
        assert_eq!(name, "intray_hot_test");
        conn.finish();
    }

    #[tokio::test]
    async fn an_unfinished_connection_is_closed_not_reused() {
        let pool = HotPool::new(&url(), 1, &["SET jit = off"]).expect("a valid URL");
        let mut conn = pool.acquire().await.expect("connect");
        let first = backend_pid(&mut conn).await;
        drop(conn);
        let mut conn = pool.acquire().await.expect("open another");
        assert_ne!(backend_pid(&mut conn).await, first);
        conn.finish();
    }

    #[tokio::test]
    async fn a_statement_cut_short_leaves_no_broken_connection_behind() {
        let pool = HotPool::new(&url(), 1, &["SET jit = off"]).expect("a valid URL");
        let mut conn = pool.acquire().await.expect("connect");
        let first = backend_pid(&mut conn).await;
        let cut = tokio::time::timeout(
            Duration::from_millis(50),
            sqlx::query("SELECT pg_sleep(5)").execute(&mut *conn),
        )
        .await;
        assert!(cut.is_err(), "the statement was still running");
        drop(conn);
        let mut conn = pool.acquire().await.expect("open another");
        assert_ne!(backend_pid(&mut conn).await, first);
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *conn)
            .await
            .expect("the new connection works");
        assert_eq!(one, 1);
        conn.finish();
    }

    #[tokio::test]
    async fn a_full_pool_makes_callers_wait_for_a_finished_connection() {
        let pool = HotPool::new(&url(), 1, &["SET jit = off"]).expect("a valid URL");
        let mut conn = pool.acquire().await.expect("connect");
        let first = backend_pid(&mut conn).await;
        let waiting = pool.acquire();
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "a second connection while the only slot is taken"
        );
        conn.finish();
        let mut conn = waiting.await.expect("the finished connection");
        assert_eq!(backend_pid(&mut conn).await, first);
        conn.finish();
    }
}
