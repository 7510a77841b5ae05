//! The token file: one token per line, three whitespace-separated fields.
//!
//! ```text
//! # TOKEN                                                                  TENANT  ROLES
//! sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b  acme    producer
//! acme-worker-7f3a9c1e55d04b2a                                              acme    worker
//! sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8  ops     admin,producer
//! ```
//!
//! - TOKEN is `sha256:` and the 64 hex digits of the token's sha256 (so the
//!   file holds no secret: `printf %s "$TOKEN" | sha256sum`), or the token
//!   itself: at least 16 characters, without whitespace, not starting with
//!   `#` or `sha256:`.
//! - TENANT is the tenant the token acts for, written like a queue name
//!   (letters, digits, `_ . : -`). For an admin it is the default tenant,
//!   used when a call names none in `x-intray-tenant`.
//! - ROLES is a comma-separated list of `producer`, `worker`, `admin`,
//!   `metrics`.
//!
//! Blank lines and lines starting with `#` are ignored; a token may appear
//! only once. Any error rejects the whole file, naming the line.

use std::collections::HashSet;
use std::path::Path;

use super::role::{Role, Roles};
use super::tokens::{TokenDigest, TokenEntry, TokenTable};
use crate::domain::validate;

/// Shortest plain token accepted: shorter ones are guessable.
pub const MIN_PLAIN_TOKEN_LEN: usize = 16;

/// Why a token file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read token file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("token file line {line}: {reason}")]
    Line { line: usize, reason: String },
}

fn line_error(line: usize, reason: impl Into<String>) -> TokenFileError {
    TokenFileError::Line {
        line,
        reason: reason.into(),
    }
}

/// Reads and parses a token file.
pub fn load(path: &Path) -> Result<TokenTable, TokenFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text)
}

/// Parses the text of a token file.
pub fn parse(text: &str) -> Result<TokenTable, TokenFileError> {
    let mut entries = Vec::new();
    let mut seen = HashSet::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = trimmed.split_whitespace().collect();
        let [token, tenant, roles] = fields[..] else {
            return Err(line_error(
                line,
                format!(
                    "expected 3 fields (TOKEN TENANT ROLES), found {}",
                    fields.len()
                ),
            ));
        };
        let digest = digest_field(token).map_err(|reason| line_error(line, reason))?;
        if !seen.insert(digest) {
            return Err(line_error(
                line,
                "the same token appears on an earlier line",
            ));
        }
        let tenant = validate::queue("tenant", tenant)
            .map_err(|e| line_error(line, format!("tenant {tenant:?}: {}", e.reason)))?;
        let roles = roles_field(roles).map_err(|reason| line_error(line, reason))?;
        entries.push(TokenEntry {
            digest,
            tenant,
            roles,
        });
    }
    Ok(TokenTable::new(entries))
}

fn digest_field(token: &str) -> Result<TokenDigest, String> {
    if let Some(hex) = token.strip_prefix("sha256:") {
        return TokenDigest::from_hex(hex)
            .ok_or_else(|| "sha256: must be followed by 64 hex digits".to_owned());
    }
    if token.len() < MIN_PLAIN_TOKEN_LEN {
        // The token is not echoed: the log must not carry it.
        return Err(format!(
            "a plain token must be at least {MIN_PLAIN_TOKEN_LEN} characters"
        ));
    }
    Ok(TokenDigest::of(token))
}

fn roles_field(text: &str) -> Result<Roles, String> {
    let mut roles = Roles::NONE;
    for name in text.split(',') {
        let role = Role::parse(name).ok_or_else(|| {
            format!("unknown role {name:?} (expected producer, worker, admin or metrics)")
        })?;
        roles = roles.with(role);
    }
    Ok(roles)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
# comment
  
sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b acme producer
acme-worker-7f3a9c1e55d04b2a\tacme   worker
ops-admin-token-0123456789 ops admin,producer
";

    #[test]
    fn parses_hashed_and_plain_tokens() {
        let table = parse(GOOD).expect("valid file");
        assert_eq!(table.len(), 3);
        // sha256("secret") is the digest on the first line.
        let producer = table.find("secret").expect("hashed token found");
        assert_eq!(producer.tenant, "acme");
        assert_eq!(producer.roles.to_string(), "producer");
        let worker = table.find("acme-worker-7f3a9c1e55d04b2a").expect("plain");
        assert_eq!(worker.roles.to_string(), "worker");
        let admin = table.find("ops-admin-token-0123456789").expect("admin");
        assert_eq!(admin.tenant, "ops");
        assert_eq!(admin.roles.to_string(), "producer,admin");
        assert!(
            table
                .find("sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b")
                .is_none(),
            "the digest itself is not a token"
        );
    }

    #[test]
    fn empty_file_has_no_tokens() {
        assert!(parse("").expect("empty is valid").is_empty());
        assert!(parse("# only comments\n\n").expect("valid").is_empty());
    }

    fn error_of(text: &str) -> String {
        parse(text).expect_err("must be rejected").to_string()
    }

    #[test]
    fn rejects_bad_lines_naming_them() {
        let e = error_of("# ok\nonly-two-fields-here-xx acme\n");
        assert!(e.contains("line 2") && e.contains("3 fields"), "{e}");
        let e = error_of("short acme producer\n");
        assert!(e.contains("at least 16") && !e.contains("short"), "{e}");
        let e = error_of("sha256:abcd acme producer\n");
        assert!(e.contains("64 hex"), "{e}");
        let e = error_of("long-enough-token-1234 acme producer,boss\n");
        assert!(e.contains("\"boss\""), "{e}");
        let e = error_of("long-enough-token-1234 acme producer,\n");
        assert!(e.contains("unknown role"), "{e}");
        let e = error_of("long-enough-token-1234 \"bad/tenant\" producer\n");
        assert!(e.contains("tenant"), "{e}");
        let e = error_of("long-enough-token-1234 a producer\nlong-enough-token-1234 b worker\n");
        assert!(e.contains("line 2") && e.contains("earlier line"), "{e}");
        let e = error_of("a b c d\n");
        assert!(e.contains("found 4"), "{e}");
    }

    #[test]
    fn same_token_hashed_and_plain_is_a_duplicate() {
        let text = "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b a producer\n\
                    secret-but-longer-0000 a producer\n";
        assert!(parse(text).is_ok());
        let digest = hex::encode(TokenDigest::of("secret-but-longer-0000").0);
        let dup = format!("sha256:{digest} a producer\nsecret-but-longer-0000 a worker\n");
        assert!(error_of(&dup).contains("earlier line"));
    }

    #[test]
    fn load_reports_missing_file() {
        let e = load(Path::new("/nonexistent/intray-tokens")).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/intray-tokens"));
    }
}
