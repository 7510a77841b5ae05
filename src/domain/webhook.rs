//! Webhooks, the pure part: Standard Webhooks signatures (both directions),
//! callback URL parsing and the address policy that keeps callbacks from
//! reaching private networks (server-side request forgery).
//!
//! Signature scheme (<https://www.standardwebhooks.com/>): the signed content
//! is `{webhook-id}.{webhook-timestamp}.{body}`, the MAC is HMAC-SHA256 keyed
//! with the base64 part of a `whsec_...` secret, and `webhook-signature` is
//! a space-separated list of `v1,<base64 mac>` (several during a key
//! rotation).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Prefix of a secret in the Standard Webhooks text format.
pub const SECRET_PREFIX: &str = "whsec_";
/// How far a `webhook-timestamp` may be from the receiver's clock, in
/// seconds, before the message is refused as a possible replay.
pub const TIMESTAMP_TOLERANCE_SECS: i64 = 5 * 60;

type HmacSha256 = Hmac<Sha256>;

/// Longest `webhook-id` taken. Standard Webhooks sets no bound; ids
/// longer than an idempotency key allows are stored as their SHA-256.
pub const MAX_ID_BYTES: usize = 4096;

/// Most secrets one keyring may hold: enough for a rotation (the new one,
/// the old one) with room to spare, few enough that every callback does
/// not carry a pile of signatures.
pub const MAX_KEYRING: usize = 4;

/// Why a secret, URL or allow-list entry was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WebhookConfigError {
    #[error("a webhook secret must be `whsec_` followed by base64 of at least 16 bytes")]
    Secret,
    #[error("a list of webhook secrets must hold 1 to {MAX_KEYRING}")]
    KeyringSize,
    #[error("allow-list entry {0:?} is neither an IP address, a CIDR block nor a host name")]
    AllowEntry(String),
}

/// Why an incoming message was refused. Every variant is a `401` to the
/// sender; the variants exist for the log and the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("missing or malformed webhook-id, webhook-timestamp or webhook-signature header")]
    Headers,
    #[error("webhook-timestamp is outside the replay window")]
    Stale,
    #[error("no webhook-signature matches")]
    Signature,
}

/// A signing key: the raw bytes behind a `whsec_...` secret, keyed into
/// an HMAC once.
#[derive(Clone)]
pub struct Secret {
    key: Vec<u8>,
    keyed: HmacSha256,
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.key == other.key
    }
}

impl Eq for Secret {}

impl std::fmt::Debug for Secret {
    // Never print key material, not even in a debug dump of the settings.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Parses `whsec_<base64>`; keys shorter than 16 bytes are refused
    /// (the specification asks for 24 to 64 bytes; 16 is a floor against
    /// typos, not a recommendation).
    pub fn parse(text: &str) -> Result<Secret, WebhookConfigError> {
        let encoded = text
            .trim()
            .strip_prefix(SECRET_PREFIX)
            .ok_or(WebhookConfigError::Secret)?;
        let key = B64
            .decode(encoded)
            .map_err(|_| WebhookConfigError::Secret)?;
        if key.len() < 16 {
            return Err(WebhookConfigError::Secret);
        }
        let keyed = HmacSha256::new_from_slice(&key).map_err(|_| WebhookConfigError::Secret)?;
        Ok(Secret { key, keyed })
    }

    fn mac(&self, id: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
        let mut mac = self.keyed.clone();
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// The `webhook-signature` header value for a message: `v1,<base64>`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let tag = self.mac(id, timestamp, body).finalize().into_bytes();
        format!("v1,{}", B64.encode(tag))
    }

    /// Checks an incoming message over its raw `body` bytes: the timestamp
    /// must be within [`TIMESTAMP_TOLERANCE_SECS`] of `now` (Unix seconds)
    /// and one of the `v1` signatures must match, compared in constant time.
    pub fn verify(
        &self,
        id: &str,
        timestamp: &str,
        signatures: &str,
        body: &[u8],
        now: i64,
    ) -> Result<(), VerifyError> {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return Err(VerifyError::Headers);
        }
        let timestamp: i64 = timestamp.trim().parse().map_err(|_| VerifyError::Headers)?;
        // abs_diff: a timestamp near i64::MIN must not overflow.
        if now.abs_diff(timestamp) > TIMESTAMP_TOLERANCE_SECS.unsigned_abs() {
            return Err(VerifyError::Stale);
        }
        let mac = self.mac(id, timestamp, body);
        // A sender lists one signature per secret it holds; thousands in one
        // header would make an unauthenticated request cost that many MACs.
        let matched = signatures
            .split_whitespace()
            .take(MAX_SIGNATURES)
            .filter_map(|s| s.strip_prefix("v1,"))
            .filter_map(|s| B64.decode(s).ok())
            // verify_slice compares in constant time.
            .any(|tag| mac.clone().verify_slice(&tag).is_ok());
        if matched {
            Ok(())
        } else {
            Err(VerifyError::Signature)
        }
    }
}

/// The secrets one signer or sender uses at a time: one, or several while
/// a secret is rotated.
///
/// Signing writes one `v1` signature per secret into the header (the
/// Standard Webhooks way to rotate: a receiver that knows either secret
/// finds its match), and verifying accepts a message that any of them
/// signed. So a rotation is: add the new secret beside the old, move the
/// other side over, drop the old.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyring(Vec<Secret>);

impl Keyring {
    /// Parses 1 to [`MAX_KEYRING`] `whsec_...` secrets.
    pub fn parse<S: AsRef<str>>(texts: &[S]) -> Result<Keyring, WebhookConfigError> {
        if texts.is_empty() || texts.len() > MAX_KEYRING {
            return Err(WebhookConfigError::KeyringSize);
        }
        texts
            .iter()
            .map(|t| Secret::parse(t.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map(Keyring)
    }

    /// The `webhook-signature` header value: each secret's `v1,<base64>`,
    /// separated by spaces, in the order the secrets were given.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        self.0
            .iter()
            .map(|s| s.sign(id, timestamp, body))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// [`Secret::verify`] with each secret; the message passes if one of
    /// them signed it.
    pub fn verify(
        &self,
        id: &str,
        timestamp: &str,
        signatures: &str,
        body: &[u8],
        now: i64,
    ) -> Result<(), VerifyError> {
        let mut outcome = Err(VerifyError::Signature);
        for secret in &self.0 {
            outcome = secret.verify(id, timestamp, signatures, body, now);
            if outcome.is_ok() {
                break;
            }
        }
        outcome
    }
}

/// The most signatures of a `webhook-signature` header that are checked.
pub const MAX_SIGNATURES: usize = 8;

/// Where a callback goes, split out of its URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `https` rather than `http`.
    pub tls: bool,
    /// Host name or IP address (IPv6 without brackets), lowercased.
    pub host: String,
    /// Port, defaulted from the scheme.
    pub port: u16,
    /// Path and query, at least `/`.
    pub path: String,
}

impl Target {
    /// Splits an `http://` or `https://` URL; `None` when it is not one,
    /// holds whitespace or control characters, has credentials in it
    /// (`user@host`), has no usable host or port, or a path and query an
    /// HTTP request cannot carry as they are (an unescaped `<`, say).
    pub fn parse(url: &str) -> Option<Target> {
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return None;
        }
        let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else {
            (false, url.strip_prefix("http://")?)
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if authority.is_empty() || authority.contains('@') {
            return None;
        }
        let (host, port) = if let Some(inner) = authority.strip_prefix('[') {
            let (host, after) = inner.split_once(']')?;
            host.parse::<Ipv6Addr>().ok()?;
            (host, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        let port = match port {
            Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0)?,
            None if tls => 443,
            None => 80,
        };
        let valid_host = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
        if !valid_host {
            return None;
        }
        let tail = tail.split('#').next().unwrap_or_default();
        let path = if tail.starts_with('/') {
            tail.to_owned()
        } else {
            format!("/{tail}")
        };
        // What the dispatcher's request will carry: a path it could not
        // send is refused at `Submit`, not failed for good at delivery.
        path.parse::<hyper::http::uri::PathAndQuery>().ok()?;
        Some(Target {
            tls,
            host: host.to_ascii_lowercase(),
            port,
            path,
        })
    }

    /// The host as an IP address, when it is a literal one, in any of the
    /// forms the resolver reads as one (`2130706433` is `127.0.0.1`).
    pub fn literal_ip(&self) -> Option<IpAddr> {
        self.host
            .parse()
            .ok()
            .or_else(|| numeric_ipv4(&self.host).map(IpAddr::V4))
    }
}

/// The IPv4 address a host made of numbers names, as `inet_aton` (and so
/// the resolver) and URL parsers read it: one to four parts, each
/// decimal, `0x` hex or `0`-led octal, the last filling the bytes left
/// (`2130706433`, `0x7f000001`, `127.1`, `0177.0.0.1`). Without this such
/// a host passed `Submit` as a name, to be refused only at delivery.
fn numeric_ipv4(host: &str) -> Option<Ipv4Addr> {
    let host = host.strip_suffix('.').unwrap_or(host);
    let mut numbers = Vec::with_capacity(4);
    for part in host.split('.') {
        let (digits, radix) =
            if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
                (hex, 16)
            } else if part.len() > 1 && part.starts_with('0') {
                (&part[1..], 8)
            } else {
                (part, 10)
            };
        let number = match digits {
            "" if radix == 16 => 0,
            "" => return None,
            _ => u64::from_str_radix(digits, radix).ok()?,
        };
        numbers.push(number);
    }
    let (last, leading) = numbers.split_last()?;
    if leading.len() > 3 || leading.iter().any(|n| *n > 255) {
        return None;
    }
    let last_bytes = 4 - leading.len();
    if *last >= 1u64 << (8 * last_bytes) {
        return None;
    }
    let address = leading
        .iter()
        .zip([24, 16, 8])
        .fold(*last, |acc, (n, shift)| acc | (n << shift));
    u32::try_from(address).ok().map(Ipv4Addr::from)
}

/// Whether an address is on the public internet: not loopback, private,
/// carrier-grade NAT, link-local, unique-local, unspecified, multicast,
/// broadcast, benchmarking, IETF protocol or documentation space. IPv6
/// addresses that carry an IPv4 address (mapped, compatible, translated,
/// NAT64's well-known prefix, 6to4) are judged as that IPv4 address, since
/// a gateway delivers them there; NAT64's local-use prefix and Teredo are
/// not public.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    let this_network = a == 0;
    let shared = a == 100 && (64..128).contains(&b);
    let protocol_assignments = a == 192 && b == 0 && c == 0;
    let benchmarking = a == 198 && (b == 18 || b == 19);
    !(this_network
        || shared
        || protocol_assignments
        || benchmarking
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || a >= 240)
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let segments = ip.segments();
    let v4 = |high: u16, low: u16| {
        let [a, b] = high.to_be_bytes();
        let [c, d] = low.to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    };
    match segments {
        // IPv4-compatible (`::a.b.c.d`; `::` and `::1` are judged below).
        [0, 0, 0, 0, 0, 0, high, low] if high != 0 || low > 1 => {
            return is_public_v4(v4(high, low));
        }
        // IPv4-translated, `::ffff:0:a.b.c.d`.
        [0, 0, 0, 0, 0xffff, 0, high, low] => return is_public_v4(v4(high, low)),
        // NAT64's well-known prefix, 64:ff9b::/96.
        [0x64, 0xff9b, 0, 0, 0, 0, high, low] => return is_public_v4(v4(high, low)),
        // NAT64's local-use prefix 64:ff9b:1::/48, and Teredo 2001::/32.
        [0x64, 0xff9b, 1, ..] | [0x2001, 0, ..] => return false,
        // 6to4, 2002:a.b.c.d::/48.
        [0x2002, high, low, ..] => return is_public_v4(v4(high, low)),
        _ => {}
    }
    let first = segments[0];
    let unique_local = first & 0xfe00 == 0xfc00;
    let link_local = first & 0xffc0 == 0xfe80;
    // Deprecated, but still routed inside some networks.
    let site_local = first & 0xffc0 == 0xfec0;
    // Discard-only, 100::/64.
    let discard = matches!(segments, [0x100, 0, 0, 0, ..]);
    let documentation = first == 0x2001 && ip.segments()[1] == 0x0db8;
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || unique_local
        || link_local
        || site_local
        || discard
        || documentation)
}

/// Which non-public destinations callbacks may still reach: CIDR blocks and
/// host names an operator listed (a test's `127.0.0.1`, an internal service).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    blocks: Vec<(IpAddr, u8)>,
    hosts: Vec<String>,
}

impl AddressPolicy {
    /// Parses entries such as `127.0.0.1`, `10.0.0.0/8`, `fd00::/8` or
    /// `hooks.internal`.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<AddressPolicy, WebhookConfigError> {
        let mut policy = AddressPolicy::default();
        for entry in entries {
            let entry = entry.as_ref().trim();
            let bad = || WebhookConfigError::AllowEntry(entry.to_owned());
            let (addr, len) = match entry.split_once('/') {
                Some((addr, len)) => (addr, Some(len.parse::<u8>().map_err(|_| bad())?)),
                None => (entry, None),
            };
            if let Ok(ip) = addr.parse::<IpAddr>() {
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let len = len.unwrap_or(max);
                if len > max {
                    return Err(bad());
                }
                policy.blocks.push((ip, len));
            } else if len.is_none()
                && !entry.is_empty()
                && entry
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            {
                policy.hosts.push(entry.to_ascii_lowercase());
            } else {
                return Err(bad());
            }
        }
        Ok(policy)
    }

    /// Whether the operator listed this host name.
    pub fn allows_host(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host))
    }

    /// Whether a callback may connect to `ip`: public, or in a listed block.
    pub fn allows_ip(&self, ip: IpAddr) -> bool {
        is_public(ip) || self.blocks.iter().any(|&(net, len)| in_block(ip, net, len))
    }

    /// The check at `Submit`: a literal IP address must be allowed; a host
    /// name is checked after resolution, at delivery.
    pub fn allows_target(&self, target: &Target) -> bool {
        self.allows_host(&target.host) || target.literal_ip().is_none_or(|ip| self.allows_ip(ip))
    }
}

fn in_block(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    fn prefix(bits: u128, len: u8, width: u8) -> u128 {
        if len == 0 { 0 } else { bits >> (width - len) }
    }
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            prefix(u32::from(ip).into(), len, 32) == prefix(u32::from(net).into(), len, 32)
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            prefix(u128::from(ip), len, 128) == prefix(u128::from(net), len, 128)
        }
        (IpAddr::V6(ip), IpAddr::V4(_)) => ip
            .to_ipv4_mapped()
            .is_some_and(|v4| in_block(IpAddr::V4(v4), net, len)),
        (IpAddr::V4(_), IpAddr::V6(_)) => false,
    }
}

/// What to do after a failed delivery attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterFailure {
    /// Try again after this delay.
    Retry(std::time::Duration),
    /// The retry window is used up.
    GiveUp,
}

/// The step after failed attempt number `attempt` (1-based) of a delivery
/// that is `age` old: a full-jitter backoff delay (`jitter` a uniform draw
/// in `[0, 1)`), cut so that the last attempt comes at the end of `window`
/// rather than a backoff's length before it; none once `window` has passed.
pub fn after_failure(
    backoff: &super::Backoff,
    attempt: u32,
    age: std::time::Duration,
    window: std::time::Duration,
    jitter: f64,
) -> AfterFailure {
    match window.checked_sub(age) {
        Some(left) if !left.is_zero() => {
            AfterFailure::Retry(backoff.delay(attempt, jitter).min(left))
        }
        _ => AfterFailure::GiveUp,
    }
}

/// The `type` of a completion callback for a terminal event type
/// (`succeeded` → `job.succeeded`).
pub fn callback_type(event_type: &str) -> String {
    format!("job.{event_type}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_made_of_numbers_are_addresses() {
        let loopback = Some(IpAddr::from([127, 0, 0, 2]));
        for url in [
            "http://2130706434/",
            "http://0x7f000002/",
            "http://0X7F000002/",
            "http://127.2/",
            "http://127.0.2/",
            "http://017700000002/",
            "http://0177.0.0.2/",
            "http://0x7f.0.0.0x2/",
            "http://127.0.0.2./",
        ] {
            let target = Target::parse(url).expect("url");
            assert_eq!(target.literal_ip(), loopback, "{url}");
            assert!(!AddressPolicy::default().allows_target(&target), "{url}");
        }
        for name in [
            "http://example.com/",
            "http://1.2.3.4.5/",
            "http://256.1.1.1/",
            "http://1.2.3.256/",
            "http://1.2.65536/",
            "http://4294967296/",
            "http://1..2/",
            "http://09/",
            "http://1e5/",
            "http://0x1g/",
        ] {
            let target = Target::parse(name).expect("url");
            assert_eq!(target.literal_ip(), None, "{name}");
        }
        assert_eq!(
            Target::parse("http://4294967295/").and_then(|t| t.literal_ip()),
            Some(IpAddr::from([255, 255, 255, 255]))
        );
    }

    // The published example of the Standard Webhooks specification and of
    // its reference libraries' tests.
    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SPEC_TS: i64 = 1614265330;
    const SPEC_BODY: &str = r#"{"test": 2432232314}"#;
    const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    fn spec_secret() -> Secret {
        Secret::parse(SPEC_SECRET).expect("spec secret")
    }

    #[test]
    fn signs_the_specification_test_vector() {
        assert_eq!(
            spec_secret().sign(SPEC_ID, SPEC_TS, SPEC_BODY.as_bytes()),
            SPEC_SIGNATURE
        );
    }

    #[test]
    fn verifies_the_test_vector_and_refuses_tampering() {
        let s = spec_secret();
        let ts = SPEC_TS.to_string();
        let body = SPEC_BODY.as_bytes();
        assert_eq!(
            s.verify(SPEC_ID, &ts, SPEC_SIGNATURE, body, SPEC_TS),
            Ok(())
        );
        // A rotation sends several; any match is enough.
        let several = format!("v1,AAAA {SPEC_SIGNATURE} v2,zzz");
        assert_eq!(
            s.verify(SPEC_ID, &ts, &several, body, SPEC_TS + 299),
            Ok(())
        );
        // Only the first few are checked: a header of thousands costs no more.
        let buried = format!("{}{SPEC_SIGNATURE}", "v1,AAAA ".repeat(MAX_SIGNATURES));
        assert_eq!(
            s.verify(SPEC_ID, &ts, &buried, body, SPEC_TS),
            Err(VerifyError::Signature)
        );
        assert_eq!(
            s.verify(
                SPEC_ID,
                &ts,
                SPEC_SIGNATURE,
                b"{\"test\": 2432232315}",
                SPEC_TS
            ),
            Err(VerifyError::Signature)
        );
        assert_eq!(
            s.verify("msg_other", &ts, SPEC_SIGNATURE, body, SPEC_TS),
            Err(VerifyError::Signature)
        );
        assert_eq!(
            s.verify(SPEC_ID, &ts, SPEC_SIGNATURE, body, SPEC_TS + 301),
            Err(VerifyError::Stale)
        );
        assert_eq!(
            s.verify(SPEC_ID, &ts, SPEC_SIGNATURE, body, SPEC_TS - 301),
            Err(VerifyError::Stale)
        );
        assert_eq!(
            s.verify(
                SPEC_ID,
                &i64::MIN.to_string(),
                SPEC_SIGNATURE,
                body,
                SPEC_TS
            ),
            Err(VerifyError::Stale)
        );
        assert_eq!(
            s.verify(SPEC_ID, "soon", SPEC_SIGNATURE, body, SPEC_TS),
            Err(VerifyError::Headers)
        );
        assert_eq!(
            s.verify("", &ts, SPEC_SIGNATURE, body, SPEC_TS),
            Err(VerifyError::Headers)
        );
    }

    #[test]
    fn a_keyring_signs_with_every_secret_and_accepts_any() {
        let other = "whsec_b3RoZXIta2V5LWZvci10aGUta2V5cmluZy10ZXN0";
        let ring = Keyring::parse(&[other, SPEC_SECRET]).expect("two secrets");
        let header = ring.sign(SPEC_ID, SPEC_TS, SPEC_BODY.as_bytes());
        let signatures: Vec<&str> = header.split(' ').collect();
        assert_eq!(signatures.len(), 2, "{header}");
        assert_eq!(signatures[1], SPEC_SIGNATURE);
        // A receiver that knows only the old secret still finds its match.
        let ts = SPEC_TS.to_string();
        let body = SPEC_BODY.as_bytes();
        assert_eq!(
            spec_secret().verify(SPEC_ID, &ts, &header, body, SPEC_TS),
            Ok(())
        );
        let old_only = Keyring::parse(&[SPEC_SECRET]).expect("one secret");
        assert_eq!(
            ring.verify(SPEC_ID, &ts, SPEC_SIGNATURE, body, SPEC_TS),
            Ok(()),
            "a sender still on either secret passes"
        );
        let other_signed = Keyring::parse(&[other])
            .expect("one secret")
            .sign(SPEC_ID, SPEC_TS, body);
        assert_eq!(
            old_only.verify(SPEC_ID, &ts, &other_signed, body, SPEC_TS),
            Err(VerifyError::Signature)
        );
        assert_eq!(
            ring.verify(SPEC_ID, &ts, SPEC_SIGNATURE, body, SPEC_TS + 301),
            Err(VerifyError::Stale)
        );
        let none: [&str; 0] = [];
        assert_eq!(Keyring::parse(&none), Err(WebhookConfigError::KeyringSize));
        assert_eq!(
            Keyring::parse(&[SPEC_SECRET; MAX_KEYRING + 1]),
            Err(WebhookConfigError::KeyringSize)
        );
        assert_eq!(
            Keyring::parse(&[SPEC_SECRET, "whsec_AAAA"]),
            Err(WebhookConfigError::Secret)
        );
    }

    #[test]
    fn retries_with_jitter_inside_the_window_then_gives_up() {
        use std::time::Duration;
        let backoff =
            super::super::Backoff::try_new(Duration::from_secs(1), Duration::from_secs(3600))
                .expect("valid");
        let day = Duration::from_secs(24 * 3600);
        assert_eq!(
            after_failure(&backoff, 1, Duration::ZERO, day, 0.5),
            AfterFailure::Retry(Duration::from_millis(500))
        );
        assert_eq!(
            after_failure(&backoff, 30, Duration::from_secs(3600), day, 0.999),
            AfterFailure::Retry(Duration::from_secs(3600).mul_f64(0.999))
        );
        // The last attempt comes at the window's end, not a delay before it.
        assert_eq!(
            after_failure(&backoff, 30, day - Duration::from_secs(60), day, 0.5),
            AfterFailure::Retry(Duration::from_secs(60))
        );
        assert_eq!(
            after_failure(&backoff, 31, day, day, 0.5),
            AfterFailure::GiveUp
        );
        assert_eq!(
            after_failure(&backoff, 1, day + Duration::from_secs(1), day, 0.0),
            AfterFailure::GiveUp
        );
    }

    #[test]
    fn refuses_malformed_secrets() {
        for bad in [
            "",
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "whsec_",
            "whsec_!!!!",
            "whsec_AAAA",
        ] {
            assert_eq!(
                Secret::parse(bad),
                Err(WebhookConfigError::Secret),
                "{bad:?}"
            );
        }
        assert_eq!(format!("{:?}", spec_secret()), "Secret(..)");
    }

    #[test]
    fn parses_callback_urls() {
        let t = Target::parse("https://Hooks.Example.com/a/b?c=1#frag").expect("url");
        assert_eq!(
            t,
            Target {
                tls: true,
                host: "hooks.example.com".into(),
                port: 443,
                path: "/a/b?c=1".into()
            }
        );
        let t = Target::parse("http://127.0.0.1:8080").expect("url");
        assert_eq!((t.port, t.path.as_str()), (8080, "/"));
        assert_eq!(t.literal_ip(), Some(IpAddr::from([127, 0, 0, 1])));
        let t = Target::parse("http://[::1]:9/x").expect("url");
        assert_eq!((t.host.as_str(), t.port), ("::1", 9));
        for bad in [
            "ftp://x",
            "http://",
            "http://user:pw@host/",
            "http://host:0/",
            "http://host:99999/",
            "http://[nope]/",
            "http://ho st/",
            "http://host/a b",
            "http://host/a\nb",
            "https://host/a<b",
            "https://host/a>b",
        ] {
            assert_eq!(Target::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn classifies_addresses() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd12::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "192.0.0.1",
            "198.18.0.1",
            "198.19.255.255",
            "64:ff9b::a00:1",
            "64:ff9b::7f00:1",
            "64:ff9b:1::808:808",
            "2002:a00:1::1",
            "2002:7f00:1::1",
            "::a00:1",
            "::7f00:1",
            "::ffff:0:a00:1",
            "::2",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "fec0::1",
            "100::1",
        ] {
            let ip: IpAddr = private.parse().expect("ip");
            assert!(!is_public(ip), "{private} is not public");
        }
        for public in [
            "1.1.1.1",
            "93.184.216.34",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "::808:808",
            "198.20.0.1",
            "192.0.3.1",
        ] {
            let ip: IpAddr = public.parse().expect("ip");
            assert!(is_public(ip), "{public} is public");
        }
    }

    #[test]
    fn allow_list_opens_blocks_and_hosts() {
        let policy =
            AddressPolicy::parse(&["127.0.0.1", "10.0.0.0/8", "fd00::/8", "hooks.internal"])
                .expect("policy");
        assert!(policy.allows_ip("127.0.0.1".parse().expect("ip")));
        assert!(!policy.allows_ip("127.0.0.2".parse().expect("ip")));
        assert!(policy.allows_ip("10.200.0.1".parse().expect("ip")));
        assert!(policy.allows_ip("::ffff:10.0.0.1".parse().expect("ip")));
        assert!(policy.allows_ip("fd12::1".parse().expect("ip")));
        assert!(!policy.allows_ip("192.168.0.1".parse().expect("ip")));
        assert!(policy.allows_host("HOOKS.internal"));
        let target = |u: &str| Target::parse(u).expect("url");
        assert!(policy.allows_target(&target("http://hooks.internal/x")));
        assert!(policy.allows_target(&target("http://example.com/x")));
        assert!(!policy.allows_target(&target("http://192.168.0.1/x")));
        assert!(!AddressPolicy::default().allows_target(&target("http://[::1]/")));
        for bad in ["10.0.0.0/33", "1.2.3.4/x", "a b", "", "host/8"] {
            assert!(AddressPolicy::parse(&[bad]).is_err(), "{bad:?}");
        }
    }
}
