//! What a call that stays open keeps of its caller's token, so that it ends
//! when a reload takes the token away instead of serving a revoked caller
//! until the job ends (a watch) or the wait runs out (a long-poll).

use std::sync::Arc;

use tokio::sync::watch;

use super::identity::Identity;
use super::role::{Role, Roles};
use super::source::TokenSource;
use super::tokens::TokenDigest;

/// An open call's hold on what its token was granted when the call began.
#[derive(Debug)]
pub struct Grant {
    /// None for a caller without a token (open mode, the webhook ingress):
    /// no reload can take anything from it.
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    source: Arc<TokenSource>,
    token: TokenDigest,
    tenant: String,
    roles: Roles,
    reloaded: watch::Receiver<()>,
}

impl Grant {
    /// The grant of `identity`'s token, told of reloads by `reloaded`.
    pub(super) fn new(
        source: Arc<TokenSource>,
        identity: &Identity,
        reloaded: watch::Receiver<()>,
    ) -> Grant {
        let held = identity.token.map(|token| Held {
            source,
            token,
            tenant: identity.tenant.clone(),
            roles: identity.roles,
            reloaded,
        });
        Grant { held }
    }

    /// The grant of a caller without a token: never revoked.
    pub(super) fn none() -> Grant {
        Grant { held: None }
    }

    /// Resolves once a reload no longer grants what the call began with:
    /// the token is gone, its roles changed, or (for a token that is not an
    /// admin's, whose tenant is its own) its tenant changed. Never for a
    /// call without a token. Cancel-safe: a reload while the caller was
    /// not waiting here is seen on the next wait.
    pub async fn revoked(&mut self) {
        let Some(held) = &mut self.held else {
            return std::future::pending().await;
        };
        loop {
            if held.reloaded.changed().await.is_err() {
                // Cannot happen while this grant holds the source (which
                // holds the sender); never resolve rather than spin.
                return std::future::pending().await;
            }
            if !held.still_granted() {
                return;
            }
        }
    }

    /// Whether a reload not yet looked at took the grant away: a check
    /// without waiting, for a call that is busy sending (a watch replaying
    /// a long history) and so not waiting in [`revoked`](Self::revoked).
    pub fn revoked_now(&mut self) -> bool {
        let Some(held) = &mut self.held else {
            return false;
        };
        if !held.reloaded.has_changed().unwrap_or(false) {
            return false;
        }
        held.reloaded.mark_unchanged();
        !held.still_granted()
    }
}

impl Held {
    fn still_granted(&self) -> bool {
        let table = self.source.current();
        table.by_digest(&self.token).is_some_and(|entry| {
            entry.roles == self.roles
                && (self.roles.contains(Role::Admin) || entry.tenant == self.tenant)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::auth::layer::authorize;

    const LEASE: &str = "/intray.v1.WorkerService/Lease";

    fn identity_of(source: &TokenSource, token: &str) -> Identity {
        let mut headers = tonic::codegen::http::HeaderMap::new();
        headers.insert(
            "authorization",
            format!("Bearer {token}").parse().expect("a header value"),
        );
        authorize(source, LEASE, &headers)
            .expect("allowed")
            .expect("an identity")
    }

    async fn ends_within(grant: &mut Grant, wait: Duration) -> bool {
        tokio::time::timeout(wait, grant.revoked()).await.is_ok()
    }

    /// A token file, its source, and the identity of `worker-token-0123456789`.
    struct Tokens {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        source: Arc<TokenSource>,
        identity: Identity,
    }

    impl Tokens {
        fn new(text: &str) -> Tokens {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("tokens");
            std::fs::write(&path, text).expect("write");
            let source = Arc::new(TokenSource::from_file(&path).expect("valid file"));
            let identity = identity_of(&source, "worker-token-0123456789");
            Tokens {
                _dir: dir,
                path,
                source,
                identity,
            }
        }

        fn reload(&self, text: &str) {
            std::fs::write(&self.path, text).expect("write");
            self.source.reload().expect("reload");
        }

        fn grant(&self) -> Grant {
            self.source.grant(Some(&self.identity))
        }
    }

    /// A reload that keeps the token as it was ends nothing; one that
    /// removes it, changes its roles or moves it to another tenant ends
    /// the grant; a grant without a token never ends.
    #[tokio::test]
    async fn a_reload_ends_the_grants_it_takes_away() {
        let tokens = Tokens::new(
            "worker-token-0123456789 acme worker\nother-token-0123456789 acme worker\n",
        );
        let short = Duration::from_millis(50);

        let mut kept = tokens.grant();
        tokens.reload("worker-token-0123456789 acme worker\n");
        assert!(
            !ends_within(&mut kept, short).await,
            "the token is unchanged"
        );

        for changed in [
            "worker-token-0123456789 acme worker,producer\n",
            "worker-token-0123456789 globex worker\n",
            "other-token-0123456789 acme worker\n",
        ] {
            tokens.reload("worker-token-0123456789 acme worker\n");
            let mut grant = tokens.grant();
            tokens.reload(changed);
            assert!(ends_within(&mut grant, short).await, "ended by {changed:?}");
        }

        let mut open = tokens.source.grant(None);
        assert!(
            !ends_within(&mut open, short).await,
            "no token, nothing to take"
        );
    }

    /// A reload between the token's check and the grant (a call waiting
    /// for a concurrency slot) is not missed, and a call busy sending sees
    /// a reload without waiting for one.
    #[tokio::test]
    async fn a_reload_before_the_grant_or_while_busy_is_seen() {
        let tokens = Tokens::new("worker-token-0123456789 acme worker\n");

        let mut kept = tokens.grant();
        assert!(!kept.revoked_now(), "nothing taken yet");
        tokens.reload("other-token-0123456789 acme worker\n");
        assert!(kept.revoked_now(), "seen without waiting");

        let mut late = tokens.grant();
        assert!(
            ends_within(&mut late, Duration::from_millis(50)).await,
            "a reload before the grant"
        );
    }
}
