//! Notices that nobody reads the command's output any more.
//!
//! A write to a pipe whose reader has gone fails, but `intray watch` writes
//! only when the job has a new event, which may be hours away: `intray
//! watch ID | head -n1` would hang until then. Polling stdout for no event
//! at all still reports the error and hang-up conditions, which a pipe or
//! socket shows as soon as its other end closes.

use std::os::fd::AsFd;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// Resolves once stdout's reader has closed it. Never resolves for output
/// that cannot be closed from the other end (a terminal that stays, a
/// file) or when stdout cannot be polled.
pub async fn closed() {
    let (tell, told) = tokio::sync::oneshot::channel();
    // A thread of its own, not the blocking pool: the poll may never
    // return, and the runtime waits for its blocking tasks when it ends.
    let spawned = std::thread::Builder::new()
        .name("stdout-watch".into())
        .spawn(move || {
            if reader_gone() {
                let _ = tell.send(());
            }
        });
    if spawned.is_err() || told.await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Blocks until stdout shows an error or a hang-up; false if it cannot be
/// polled.
fn reader_gone() -> bool {
    let stdout = std::io::stdout();
    loop {
        let mut fds = [PollFd::new(stdout.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::NONE) {
            // With no event asked for, poll returns only for these; any
            // other answer ends the polling (the watch goes on) rather
            // than spin on it.
            Ok(_) => {
                let gone = PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL;
                return fds[0].revents().is_some_and(|r| r.intersects(gone));
            }
            Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
}
