//! Tokens as the server keeps them: sha256 digests, never the token itself,
//! looked up with a comparison whose time does not depend on where (or
//! whether) the presented token matches.

use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::role::Roles;

/// The sha256 of a token.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenDigest(pub [u8; 32]);

impl TokenDigest {
    /// The digest of a token as presented by a client.
    pub fn of(token: &str) -> TokenDigest {
        TokenDigest(Sha256::digest(token.as_bytes()).into())
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Option<TokenDigest> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).ok()?;
        Some(TokenDigest(out))
    }

    /// Constant-time equality: every byte is compared whatever the others.
    pub fn ct_eq(&self, other: &TokenDigest) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    /// A short, non-secret name for logs and rate-limit keys: the first 8
    /// bytes of the digest (a digest of a digest would add nothing, since
    /// the token cannot be recovered from its sha256).
    pub fn short(&self) -> String {
        hex::encode(&self.0[..8])
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenDigest({}..)", self.short())
    }
}

/// One token of the token file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEntry {
    pub digest: TokenDigest,
    /// The tenant the token acts for (an admin's default tenant).
    pub tenant: String,
    pub roles: Roles,
}

/// Every configured token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenTable {
    entries: Vec<TokenEntry>,
}

impl TokenTable {
    /// A table of these entries.
    pub fn new(entries: Vec<TokenEntry>) -> TokenTable {
        TokenTable { entries }
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of a presented token. Compares against every entry, always,
    /// and picks the match with a constant-time select, so the time taken
    /// says nothing about which entry (if any) matched or how many leading
    /// bytes agreed. Hashing first makes every comparison 32 bytes long
    /// whatever the token's length.
    pub fn find(&self, presented: &str) -> Option<&TokenEntry> {
        self.by_digest(&TokenDigest::of(presented))
    }

    /// The entry of a token's digest, compared as [`find`](Self::find) does.
    pub fn by_digest(&self, digest: &TokenDigest) -> Option<&TokenEntry> {
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, entry) in self.entries.iter().enumerate() {
            let hit = entry.digest.0.ct_eq(&digest.0);
            index.conditional_assign(&(i as u64), hit);
            found |= hit;
        }
        if bool::from(found) {
            usize::try_from(index)
                .ok()
                .and_then(|i| self.entries.get(i))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::role::Role;

    fn entry(token: &str, tenant: &str) -> TokenEntry {
        TokenEntry {
            digest: TokenDigest::of(token),
            tenant: tenant.into(),
            roles: [Role::Producer].into_iter().collect(),
        }
    }

    #[test]
    fn finds_the_matching_entry_only() {
        let table = TokenTable::new(vec![entry("alpha", "a"), entry("beta", "b")]);
        assert_eq!(table.find("beta").map(|e| e.tenant.as_str()), Some("b"));
        assert_eq!(table.find("alpha").map(|e| e.tenant.as_str()), Some("a"));
        assert!(table.find("gamma").is_none());
        assert!(table.find("").is_none());
        assert!(table.find("alph").is_none(), "a prefix is not a match");
        assert!(TokenTable::default().find("alpha").is_none());
    }

    #[test]
    fn constant_time_compare_is_exact() {
        let a = TokenDigest::of("secret");
        let mut b = a;
        assert!(a.ct_eq(&b));
        b.0[31] ^= 1;
        assert!(!a.ct_eq(&b), "last byte differs");
        let mut c = a;
        c.0[0] ^= 0x80;
        assert!(!a.ct_eq(&c), "first byte differs");
    }

    #[test]
    fn hex_digests_round_trip() {
        let d = TokenDigest::of("secret");
        assert_eq!(TokenDigest::from_hex(&hex::encode(d.0)), Some(d));
        assert_eq!(TokenDigest::from_hex("abc"), None);
        assert_eq!(TokenDigest::from_hex(&"zz".repeat(32)), None);
        assert!(
            !format!("{d:?}").contains(&hex::encode(d.0)),
            "debug output is short"
        );
    }
}
