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

/// Calls `on_change` whenever one of `paths` changes (checked every
/// `interval`) or the process gets SIGHUP, until `stop` is cancelled; and
/// once at the start, since the files were first read before the watch
/// began (before the migrations, say), and a change in between (a token
/// revoked during a rollout) would otherwise wait for the next one.
pub async fn watch(
    what: &'static str,
    paths: Vec<PathBuf>,
    interval: Duration,
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
                if now != last {
                    tracing::info!(what, "file changed: reloading");
                    last = now;
                    on_change();
                }
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
}
