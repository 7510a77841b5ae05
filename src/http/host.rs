//! The host names the HTTP port answers to: the defence against DNS
//! rebinding.
//!
//! A page on a site whose name its owner re-points at the server's address
//! is same-origin with the server as far as the browser knows: it may read
//! the JSON API and post to it, and no `Origin` or `Sec-Fetch-Site` header
//! gives it away. Its requests do carry that site's name as their host. In
//! open mode (no token file) the port therefore answers only to IP
//! addresses, `localhost` and the names it is given; with a token file such
//! a page has no token to send, and every name is answered unless names
//! are given. The webhook ingress is left out: its signature decides.

use std::net::IpAddr;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tonic::Status;

use super::error::HttpError;

/// Which host names the port answers to, besides IP addresses and
/// `localhost` (and names under `.localhost`), which it always does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowedHosts {
    /// Every name.
    Any,
    /// Only these: exact names, or `*.suffix` for every name under it.
    Named(Vec<String>),
}

impl AllowedHosts {
    /// The names of `--http-allowed-hosts` (`None` or only empty ones: not
    /// given), where
    /// `open` says that the server runs without a token file. `*` alone
    /// answers every name.
    ///
    /// # Errors
    /// A name that carries a port, a scheme or a path.
    pub fn new(listed: Option<&[String]>, open: bool) -> Result<AllowedHosts, String> {
        // An empty variable (templating leaves them so) is no list at all.
        let listed = listed.filter(|names| names.iter().any(|name| !name.trim().is_empty()));
        let Some(listed) = listed else {
            return Ok(if open {
                AllowedHosts::Named(Vec::new())
            } else {
                AllowedHosts::Any
            });
        };
        let mut names = Vec::with_capacity(listed.len());
        // A trailing comma leaves an empty entry.
        for name in listed.iter().filter(|name| !name.trim().is_empty()) {
            let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
            if name == "*" {
                return Ok(AllowedHosts::Any);
            }
            let bare = name.strip_prefix("*.").unwrap_or(&name);
            let valid = !bare.is_empty()
                && bare
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
            if !valid {
                return Err(format!(
                    "--http-allowed-hosts: {name:?} is not a host name (no port, scheme or path; \
                     `*.example.com` for the names under example.com, `*` for every name)"
                ));
            }
            names.push(name);
        }
        Ok(AllowedHosts::Named(names))
    }

    /// Whether a request to `authority` (a `Host` header or an HTTP/2
    /// `:authority`, with or without its port) is answered.
    pub fn allows(&self, authority: &str) -> bool {
        let host = host_of(authority)
            .trim_end_matches('.')
            .to_ascii_lowercase();
        if host.parse::<IpAddr>().is_ok() || host == "localhost" || host.ends_with(".localhost") {
            return true;
        }
        match self {
            AllowedHosts::Any => true,
            AllowedHosts::Named(names) => names.iter().any(|name| match name.strip_prefix('*') {
                Some(suffix) => host.ends_with(suffix),
                None => *name == host,
            }),
        }
    }
}

/// The host of an authority: without its port, an IPv6 address without
/// its brackets.
fn host_of(authority: &str) -> &str {
    if let Some(bracketed) = authority.strip_prefix('[') {
        return bracketed.split(']').next().unwrap_or(bracketed);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// Refuses a request to a host name the port does not answer to. A request
/// that names no host at all is let through: browsers always name one.
pub async fn refuse_unknown_host(
    State(allowed): State<AllowedHosts>,
    request: Request,
    next: Next,
) -> Response {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            request
                .headers()
                .get(header::HOST)
                .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        });
    if let Some(authority) = authority
        && !allowed.allows(&authority)
    {
        return HttpError::Rpc(Status::permission_denied(
            "this host name is not one the server answers to: list it in \
             --http-allowed-hosts (INTRAY_HTTP_ALLOWED_HOSTS); without --auth-file the \
             server answers only to IP addresses and localhost",
        ))
        .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(names: &[&str]) -> AllowedHosts {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        AllowedHosts::new(Some(&names), true).expect("valid names")
    }

    #[test]
    fn open_mode_answers_addresses_and_localhost_only() {
        let open = AllowedHosts::new(None, true).expect("default");
        for authority in [
            "127.0.0.1:8080",
            "10.0.0.7",
            "[::1]:8080",
            "[fe80::1]",
            "localhost:8080",
            "LOCALHOST",
            "localhost.",
            "app.localhost:3000",
        ] {
            assert!(open.allows(authority), "{authority}");
        }
        for authority in [
            "evil.example:8080",
            "intray",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "",
        ] {
            assert!(!open.allows(authority), "{authority}");
        }
    }

    #[test]
    fn with_tokens_every_name_is_answered_unless_names_are_given() {
        let closed = AllowedHosts::new(None, false).expect("default");
        assert_eq!(closed, AllowedHosts::Any);
        assert!(closed.allows("intray.jobs.svc:8080"));
        let listed = vec!["intray.example.com".to_owned()];
        let closed = AllowedHosts::new(Some(&listed), false).expect("valid");
        assert!(closed.allows("intray.example.com") && !closed.allows("evil.example"));
    }

    #[test]
    fn given_names_match_exactly_or_under_a_wildcard() {
        let hosts = named(&["Intray.Example.com.", "*.svc.cluster.local"]);
        assert!(hosts.allows("intray.example.com:8080"));
        assert!(hosts.allows("INTRAY.EXAMPLE.COM"));
        assert!(hosts.allows("intray.jobs.svc.cluster.local:8080"));
        assert!(!hosts.allows("svc.cluster.local"));
        assert!(!hosts.allows("example.com"));
        assert!(!hosts.allows("evilintray.example.com"));
        assert!(!hosts.allows("intray.example.com.evil.example"));
        assert_eq!(named(&["a", "*"]), AllowedHosts::Any);
    }

    #[test]
    fn an_empty_list_is_no_list_and_empty_entries_are_skipped() {
        assert_eq!(named(&[""]), AllowedHosts::Named(Vec::new()));
        assert_eq!(named(&["a", " "]), AllowedHosts::Named(vec!["a".into()]));
        let listed = vec![String::new()];
        let closed = AllowedHosts::new(Some(&listed), false).expect("valid");
        assert_eq!(closed, AllowedHosts::Any, "as if not given");
    }

    #[test]
    fn a_name_with_a_port_scheme_or_path_is_refused() {
        for bad in [
            "intray:8080",
            "http://intray",
            "intray/x",
            "in tray",
            ".",
            "*.*",
        ] {
            let listed = vec![bad.to_owned()];
            assert!(AllowedHosts::new(Some(&listed), true).is_err(), "{bad:?}");
        }
    }
}
