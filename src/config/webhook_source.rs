//! The webhook keys in force, and their reload from the webhooks file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::webhooks::{WebhookKeys, WebhooksFileError};

/// Which secrets, allow-list and ingress sources are in force now.
///
/// Readers take an `Arc` of the whole set ([`current`](Self::current)), so a
/// reload never waits for a delivery or a request, and none of them sees
/// half a file: a secret rotated together with an allow-list entry changes
/// for every later reader at the same instant.
#[derive(Debug)]
pub struct WebhookKeysSource {
    file: Option<PathBuf>,
    keys: RwLock<Arc<WebhookKeys>>,
}

impl WebhookKeysSource {
    /// `keys` in force, re-read from `file` (if any) on [`reload`](Self::reload).
    pub fn new(keys: WebhookKeys, file: Option<PathBuf>) -> WebhookKeysSource {
        WebhookKeysSource {
            file,
            keys: RwLock::new(Arc::new(keys)),
        }
    }

    /// The webhooks file, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The keys in force.
    pub fn current(&self) -> Arc<WebhookKeys> {
        // A poisoned lock only means a writer panicked between two complete
        // assignments; the Arc inside is whole either way.
        let guard = self.keys.read().unwrap_or_else(|e| e.into_inner());
        Arc::clone(&guard)
    }

    /// Re-reads the file. On success its keys are in force for every later
    /// reader; on failure (unreadable, not JSON, any bad entry) the old ones
    /// stay, so a half-written or mistyped file never drops a source or a
    /// secret. Does nothing without a file.
    pub fn reload(&self) -> Result<(), WebhooksFileError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let keys = Arc::new(WebhookKeys::from_file(file)?);
        let mut guard = self.keys.write().unwrap_or_else(|e| e.into_inner());
        *guard = keys;
        Ok(())
    }

    /// [`reload`](Self::reload), logging the outcome; what the file watch
    /// and SIGHUP call.
    pub fn reload_and_log(&self) {
        match self.reload() {
            Ok(()) => {
                let keys = self.current();
                tracing::info!(
                    sources = keys.sources.len(),
                    tenant_secrets = keys.tenant_secrets.len(),
                    "webhooks file reloaded"
                );
            }
            Err(err) => tracing::error!(
                error = %err,
                "webhooks file reload failed; keeping the previous secrets, allow-list and sources"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SECOND: &str = "whsec_c2Vjb25kLWtleS1mb3ItdGhlLXJlbG9hZC10ZXN0";

    fn file_with(source: &str, secret: &str) -> String {
        format!(
            r#"{{"default_secret": "{secret}",
                 "sources": {{"{source}": {{"secret": "{secret}", "queue": "q", "kind": "k"}}}}}}"#
        )
    }

    #[test]
    fn a_reload_replaces_the_whole_set_and_a_failed_one_keeps_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("webhooks.json");
        std::fs::write(&path, file_with("first", FIRST)).expect("write");
        let keys = WebhookKeys::from_file(&path).expect("valid file");
        let source = WebhookKeysSource::new(keys, Some(path.clone()));
        let before = source.current();
        assert!(before.sources.contains_key("first"));

        std::fs::write(&path, file_with("second", SECOND)).expect("write");
        source.reload().expect("reload");
        let after = source.current();
        assert!(!after.sources.contains_key("first"), "removed sources go");
        assert_eq!(
            after.sources["second"].secret,
            after.secrets_for("any").cloned().expect("default secret")
        );
        assert_ne!(after.secrets_for("any"), before.secrets_for("any"));
        assert!(
            before.sources.contains_key("first"),
            "a reader's set never changes under it"
        );

        std::fs::write(&path, r#"{"sources": {"x": {"secret": "nope"#).expect("write");
        assert!(source.reload().is_err());
        std::fs::write(&path, file_with("bad name!", SECOND)).expect("write");
        assert!(source.reload().is_err());
        assert!(
            source.current().sources.contains_key("second"),
            "failed reloads keep the set in force"
        );
    }

    #[test]
    fn without_a_file_a_reload_changes_nothing() {
        let source = WebhookKeysSource::new(WebhookKeys::default(), None);
        source.reload().expect("nothing to read");
        assert!(source.file().is_none() && source.current().sources.is_empty());
    }
}
