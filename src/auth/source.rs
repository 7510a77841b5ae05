//! The tokens in force, and their reload.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use super::file::{self, TokenFileError};
use super::grant::Grant;
use super::identity::Identity;
use super::tokens::TokenTable;

/// Where tokens come from and which ones are in force now.
///
/// Calls read the table through [`current`](TokenSource::current), an `Arc`
/// clone, so a reload never waits for a call and a call never sees half a
/// file.
#[derive(Debug)]
pub struct TokenSource {
    path: Option<PathBuf>,
    table: RwLock<Arc<TokenTable>>,
    /// Told of every reload that took, for the calls holding a [`Grant`].
    reloaded: watch::Sender<()>,
}

impl TokenSource {
    /// No token file: open development mode, every call allowed.
    pub fn open() -> TokenSource {
        TokenSource {
            path: None,
            table: RwLock::new(Arc::new(TokenTable::default())),
            reloaded: watch::Sender::new(()),
        }
    }

    /// Tokens from a file, which must parse now. An empty file is not open
    /// mode: it lets nobody in (removing every token must not open the
    /// server).
    pub fn from_file(path: impl Into<PathBuf>) -> Result<TokenSource, TokenFileError> {
        let path = path.into();
        let table = file::load(&path)?;
        Ok(TokenSource {
            path: Some(path),
            table: RwLock::new(Arc::new(table)),
            reloaded: watch::Sender::new(()),
        })
    }

    /// Whether the server runs without authentication.
    pub fn is_open(&self) -> bool {
        self.path.is_none()
    }

    /// The token file, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The tokens in force.
    pub fn current(&self) -> Arc<TokenTable> {
        // A poisoned lock only means a writer panicked between two complete
        // assignments; the Arc inside is whole either way.
        let guard = self.table.read().unwrap_or_else(|e| e.into_inner());
        Arc::clone(&guard)
    }

    /// Re-reads the file. On success the new tokens are in force for every
    /// later call and their count is returned; on failure the old tokens
    /// stay. Does nothing in open mode.
    pub fn reload(&self) -> Result<usize, TokenFileError> {
        let Some(path) = &self.path else {
            return Ok(0);
        };
        let table = Arc::new(file::load(path)?);
        let count = table.len();
        {
            let mut guard = self.table.write().unwrap_or_else(|e| e.into_inner());
            *guard = table;
        }
        self.reloaded.send_replace(());
        Ok(count)
    }

    /// What a call that stays open holds of its caller's `identity`: ended
    /// by [`Grant::revoked`] once a reload takes the token away.
    pub fn grant(self: &Arc<Self>, identity: Option<&Identity>) -> Grant {
        match identity {
            Some(identity) if identity.token.is_some() => {
                // The token was checked when the call arrived, and a reload
                // since (while the call waited for a slot, say) would count
                // as seen by a new receiver: the grant's first look is at
                // the table in force now.
                let mut reloaded = self.reloaded.subscribe();
                reloaded.mark_changed();
                Grant::new(Arc::clone(self), identity, reloaded)
            }
            // Nothing a reload could take: no receiver to keep per call.
            _ => Grant::none(),
        }
    }

    /// [`reload`](Self::reload), logging the outcome; what the file watch
    /// and SIGHUP call.
    pub fn reload_and_log(&self) {
        match self.reload() {
            Ok(tokens) => tracing::info!(tokens, "token file reloaded"),
            Err(err) => {
                tracing::error!(error = %err, "token file reload failed; keeping the previous tokens")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_reload_keeps_old_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokens");
        std::fs::write(&path, "first-token-0123456789 a producer\n").expect("write");
        let source = TokenSource::from_file(&path).expect("valid file");
        assert!(!source.is_open());
        assert!(source.current().find("first-token-0123456789").is_some());

        std::fs::write(&path, "second-token-0123456789 a producer\n").expect("write");
        assert_eq!(source.reload().expect("reload"), 1);
        assert!(source.current().find("first-token-0123456789").is_none());
        assert!(source.current().find("second-token-0123456789").is_some());

        std::fs::write(&path, "garbage\n").expect("write");
        assert!(source.reload().is_err());
        assert!(
            source.current().find("second-token-0123456789").is_some(),
            "a bad file keeps the previous tokens"
        );
    }

    #[test]
    fn open_mode_has_no_file() {
        let source = TokenSource::open();
        assert!(source.is_open());
        assert_eq!(source.reload().expect("nothing to do"), 0);
    }
}
