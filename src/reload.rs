//! Noticing that files changed: a poll of their metadata every few seconds,
//! and SIGHUP. Polling works everywhere, including Kubernetes Secret
//! volumes, which are swapped by renaming a symlink and so do not show up
//! as writes to the file an inotify watch was put on.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

/// What is compared between two polls: modification time, length and (on
/// Unix) inode, so that a rename of a new file into place is seen even
/// within one mtime tick.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Fingerprint(Vec<Option<(SystemTime, u64, u64)>>);

fn fingerprint(paths: &[PathBuf]) -> Fingerprint {
    Fingerprint(
        paths
            .iter()
            .map(|p| {
                // Follows symlinks, which is what a Secret volume needs.
                let meta = std::fs::metadata(p).ok()?;
                #[cfg(unix)]
                let inode = std::os::unix::fs::MetadataExt::ino(&meta);
                #[cfg(not(unix))]
                let inode = 0;
                Some((meta.modified().ok()?, meta.len(), inode))
            })
            .collect(),
    )
}

/// How long a changed file must hold still before it is read: a file
/// rewritten in place (`cp`, a shell redirect) changes more than once, and
/// read between two of its writes it would put half a token file in force
/// (ending the open calls of every token past the cut) until the next poll.
const SETTLE: Duration = Duration::from_millis(250);

/// Calls `on_change` whenever one of `paths` changes (checked every
/// `interval`, and read once it has held still for a moment) or the process
/// gets SIGHUP, until `stop` is cancelled; and once at the start, since the
/// files were first read before the watch began (before the migrations,
/// say), and a change in between (a token revoked during a rollout) would
/// otherwise wait for the next one.
pub async fn watch(
    what: &'static str,
    paths: Vec<PathBuf>,
    interval: Duration,
    stop: CancellationToken,
    on_change: impl Fn() + Send,
) {
    watch_settled(what, paths, interval, SETTLE, stop, on_change).await;
}

/// [`watch`], a change read once it has held still for `settle`.
async fn watch_settled(
    what: &'static str,
    paths: Vec<PathBuf>,
    interval: Duration,
    settle: Duration,
    stop: CancellationToken,
    on_change: impl Fn() + Send,
) {
    let mut last = fingerprint(&paths);
    on_change();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    #[cfg(unix)]
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(signal) => Some(signal),
        Err(err) => {
            tracing::warn!(error = %err, what, "cannot listen for SIGHUP; relying on the file poll");
            None
        }
    };
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(signal) => signal.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<Option<()>>();
        tokio::select! {
            () = stop.cancelled() => return,
            _ = hangup => {
                tracing::info!(what, "SIGHUP: reloading");
                last = fingerprint(&paths);
                on_change();
            }
            _ = ticker.tick() => {
                let now = fingerprint(&paths);
                if now == last {
                    continue;
                }
                tokio::time::sleep(settle).await;
                if fingerprint(&paths) != now {
                    // Still being written: a later poll reads it whole.
                    continue;
                }
                tracing::info!(what, "file changed: reloading");
                last = now;
                on_change();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, PoisonError};

    use super::*;

    /// A file rewritten after it was first read and before its watch began
    /// is read again, though nothing changes after the watch began.
    #[tokio::test]
    async fn a_change_before_the_watch_began_is_not_missed() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("tokens");
        std::fs::write(&path, "old").expect("write");
        let read = Arc::new(Mutex::new(std::fs::read_to_string(&path).expect("read")));
        std::fs::write(&path, "new").expect("rewrite");
        let stop = CancellationToken::new();
        let watch = tokio::spawn(watch(
            "test",
            vec![path.clone()],
            Duration::from_secs(3600),
            stop.clone(),
            {
                let read = Arc::clone(&read);
                move || {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    *read.lock().unwrap_or_else(PoisonError::into_inner) = text;
                }
            },
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while read.lock().unwrap_or_else(PoisonError::into_inner).as_str() != "new" {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the change was missed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.cancel();
        watch.await.expect("the watch ends");
    }

    /// A file written bit by bit is read only once it holds still: every
    /// read sees it whole, never the part written so far (it was read at
    /// the first poll after the first write). On tokio's paused clock, so
    /// that a loaded machine cannot stall the writer past the settle.
    #[tokio::test(start_paused = true)]
    async fn a_file_still_being_written_is_not_read() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("tokens");
        std::fs::write(&path, "whole\n").expect("write");
        let reads = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let watch = tokio::spawn(watch_settled(
            "test",
            vec![path.clone()],
            Duration::from_millis(20),
            Duration::from_secs(1),
            stop.clone(),
            {
                let reads = Arc::clone(&reads);
                let path = path.clone();
                move || {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    reads
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(text);
                }
            },
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Written in place, a line every 10 ms, far less than the settle.
        let mut file = std::fs::File::create(&path).expect("truncate");
        for _ in 0..30 {
            std::io::Write::write_all(&mut file, b"part\n").expect("write");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::io::Write::write_all(&mut file, b"whole\n").expect("write");
        drop(file);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let reads = reads.lock().unwrap_or_else(PoisonError::into_inner).clone();
            assert!(
                reads.iter().all(|text| text.ends_with("whole\n")),
                "a read of part of the file: {reads:?}"
            );
            if reads.len() >= 2 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "never read again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        watch.await.expect("the watch ends");
    }
}
