//! Webhook settings: per-tenant signing secrets, the callback allow-list,
//! ingress sources (from a JSON file an operator writes), and the delivery
//! timings (from flags).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::domain::Backoff;
use crate::domain::validate;
use crate::domain::webhook::{AddressPolicy, Keyring, WebhookConfigError};

/// Why the webhooks file was refused.
#[derive(Debug, thiserror::Error)]
pub enum WebhooksFileError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// Not JSON, or not the file's shape; `message` is the parser's with
    /// every quoted value left out ([`without_values`]).
    #[error("{path}: {message}")]
    Json { path: String, message: String },
    #[error("{path}: {what}: {source}")]
    Value {
        path: String,
        what: String,
        source: WebhookConfigError,
    },
    #[error("{path}: source {source_name:?}: {reason}")]
    Source {
        path: String,
        source_name: String,
        reason: String,
    },
}

/// One provider that may post to `POST /hooks/{name}`: messages signed with
/// one of its secrets become jobs of `kind` in `queue` of `tenant`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngressSource {
    pub secret: Keyring,
    pub tenant: String,
    pub queue: String,
    pub kind: String,
}

/// What the webhooks file sets: the signing secrets, the callback
/// allow-list and the ingress sources. Replaced whole when the file is
/// reloaded ([`WebhookKeysSource`](super::webhook_source::WebhookKeysSource)).
#[derive(Clone, Debug, Default)]
pub struct WebhookKeys {
    /// Signing secrets of each tenant's callbacks.
    pub tenant_secrets: BTreeMap<String, Keyring>,
    /// Secrets of tenants without their own (the single-tenant, no-auth case).
    pub default_secret: Option<Keyring>,
    /// Non-public callback destinations that are still allowed.
    pub allow: AddressPolicy,
    /// Ingress sources by name.
    pub sources: BTreeMap<String, IngressSource>,
}

impl WebhookKeys {
    /// The secrets that sign `tenant`'s callbacks, if any are configured.
    pub fn secrets_for(&self, tenant: &str) -> Option<&Keyring> {
        self.tenant_secrets
            .get(tenant)
            .or(self.default_secret.as_ref())
    }

    /// Reads secrets, allow-list and sources from a JSON file (README,
    /// "Webhooks"); any bad entry refuses the whole file.
    pub fn from_file(path: &Path) -> Result<WebhookKeys, WebhooksFileError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| WebhooksFileError::Read {
            path: shown.clone(),
            source,
        })?;
        let file: File = serde_json::from_str(&text).map_err(|err| WebhooksFileError::Json {
            path: shown.clone(),
            message: without_values(&err.to_string()),
        })?;
        let value = |what: &str| {
            let path = shown.clone();
            let what = what.to_owned();
            move |source| WebhooksFileError::Value { path, what, source }
        };
        let mut keys = WebhookKeys {
            default_secret: file
                .default_secret
                .map(|s| s.keyring())
                .transpose()
                .map_err(value("default_secret"))?,
            allow: AddressPolicy::parse(&file.allow).map_err(value("allow"))?,
            ..WebhookKeys::default()
        };
        for (tenant, secret) in file.tenant_secrets {
            let secret = secret
                .keyring()
                .map_err(value(&format!("tenant_secrets.{tenant}")))?;
            keys.tenant_secrets.insert(tenant, secret);
        }
        for (name, source) in file.sources {
            let bad = |reason: String| WebhooksFileError::Source {
                path: shown.clone(),
                source_name: name.clone(),
                reason,
            };
            validate::queue("source", &name).map_err(|e| bad(e.to_string()))?;
            let secret = source.secret.keyring().map_err(|e| bad(e.to_string()))?;
            let tenant =
                validate::queue("tenant", &source.tenant).map_err(|e| bad(e.to_string()))?;
            let queue = validate::queue("queue", &source.queue).map_err(|e| bad(e.to_string()))?;
            let kind = validate::kind("kind", &source.kind).map_err(|e| bad(e.to_string()))?;
            keys.sources.insert(
                name.clone(),
                IngressSource {
                    secret,
                    tenant,
                    queue,
                    kind,
                },
            );
        }
        Ok(keys)
    }
}

/// Everything about webhooks, both directions.
#[derive(Clone, Debug)]
pub struct WebhookSettings {
    /// Secrets, allow-list and ingress sources as the server starts.
    pub keys: WebhookKeys,
    /// The file `keys` came from, re-read when it changes or on SIGHUP.
    pub file: Option<PathBuf>,
    /// Longest a callback request may take.
    pub timeout: Duration,
    /// How long a callback is retried before it is marked failed.
    pub retry_window: Duration,
    /// Delay between attempts (full jitter).
    pub backoff: Backoff,
    /// How often the dispatcher looks for due deliveries when idle.
    pub poll: Duration,
    /// Most callback attempts one replica has in flight at one receiver
    /// (`host:port`), out of its 32.
    pub per_receiver: usize,
    /// Largest ingress body.
    pub max_body_bytes: usize,
    /// PEM CA certificates that `https` callbacks are checked against;
    /// `None`: `SSL_CERT_FILE`, else the system bundle.
    pub ca_file: Option<PathBuf>,
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            keys: WebhookKeys::default(),
            file: None,
            timeout: Duration::from_secs(10),
            retry_window: Duration::from_secs(24 * 3600),
            backoff: match Backoff::try_new(Duration::from_secs(1), Duration::from_secs(3600)) {
                Ok(b) => b,
                Err(_) => unreachable!("1s..1h is a valid backoff"),
            },
            poll: Duration::from_secs(1),
            per_receiver: 8,
            max_body_bytes: 256 * 1024,
            ca_file: None,
        }
    }
}

/// The file's shape.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    default_secret: Option<Secrets>,
    #[serde(default)]
    tenant_secrets: BTreeMap<String, Secrets>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    sources: BTreeMap<String, SourceEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceEntry {
    secret: Secrets,
    #[serde(default = "default_tenant")]
    tenant: String,
    queue: String,
    kind: String,
}

/// A secret, or a list of them while one is rotated.
#[derive(Deserialize)]
#[serde(untagged)]
enum Secrets {
    One(String),
    Several(Vec<String>),
}

impl Secrets {
    fn keyring(self) -> Result<Keyring, WebhookConfigError> {
        match self {
            Secrets::One(secret) => Keyring::parse(&[secret]),
            Secrets::Several(secrets) => Keyring::parse(&secrets),
        }
    }
}

fn default_tenant() -> String {
    "default".to_owned()
}

/// A parser's message without the values it quotes: the file holds
/// secrets, and a secret in the wrong place (`invalid type: string
/// "whsec_...", expected a map`) would reach the log. Field names, quoted
/// in backticks, stay.
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    for c in message.chars() {
        if c == '"' {
            if !quoted {
                out.push_str("\"...\"");
            }
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misplaced_secret_is_not_echoed() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("webhooks.json");
        std::fs::write(
            &path,
            r#"{"tenant_secrets": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}"#,
        )
        .expect("write");
        let err = WebhookKeys::from_file(&path)
            .expect_err("a string where a map belongs")
            .to_string();
        assert!(!err.contains("MfKQ9r8"), "{err}");
        assert!(
            err.contains("expected a map") && err.contains("line 1"),
            "{err}"
        );
        std::fs::write(&path, r#"{"sources": {"x": {"queue": "q"}}}"#).expect("write");
        let err = WebhookKeys::from_file(&path)
            .expect_err("no secret")
            .to_string();
        assert!(err.contains("`secret`"), "field names stay: {err}");
    }

    #[test]
    fn reads_a_file_and_refuses_bad_entries() {
        let dir = std::env::temp_dir().join(format!("intray-webhooks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("webhooks.json");
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        std::fs::write(
            &path,
            format!(
                r#"{{"default_secret": "{secret}", "tenant_secrets": {{"acme": "{secret}"}},
                    "allow": ["127.0.0.1"],
                    "sources": {{"stripe": {{"secret": "{secret}", "queue": "payments", "kind": "stripe.event"}}}}}}"#
            ),
        )
        .expect("write");
        let s = WebhookKeys::from_file(&path).expect("valid file");
        assert!(s.secrets_for("acme").is_some() && s.secrets_for("other").is_some());
        assert_eq!(s.sources["stripe"].tenant, "default");
        assert!(s.allow.allows_ip("127.0.0.1".parse().expect("ip")));

        std::fs::write(
            &path,
            r#"{"sources": {"x": {"secret": "nope", "queue": "q", "kind": "k"}}}"#,
        )
        .expect("write");
        let err = WebhookKeys::from_file(&path).expect_err("bad secret");
        assert!(err.to_string().contains("\"x\""), "{err}");
        std::fs::write(&path, r#"{"secrets": {}}"#).expect("write");
        assert!(WebhookKeys::from_file(&path).is_err());
        // A rotation lists several secrets; five is refused.
        std::fs::write(
            &path,
            format!(r#"{{"tenant_secrets": {{"acme": ["{secret}", "{secret}"]}}}}"#),
        )
        .expect("write");
        let s = WebhookKeys::from_file(&path).expect("two secrets");
        assert_eq!(
            s.secrets_for("acme")
                .expect("acme")
                .sign("m", 1, b"{}")
                .split(' ')
                .count(),
            2
        );
        std::fs::write(
            &path,
            format!(r#"{{"default_secret": ["{secret}", "{secret}", "{secret}", "{secret}", "{secret}"]}}"#),
        )
        .expect("write");
        let err = WebhookKeys::from_file(&path).expect_err("five secrets");
        assert!(err.to_string().contains("default_secret"), "{err}");
        std::fs::write(&path, r#"{"default_secret": []}"#).expect("write");
        assert!(WebhookKeys::from_file(&path).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
