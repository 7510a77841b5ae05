//! Text for the operator: an error with its causes, a URL without its
//! secrets.

use std::error::Error;

/// `err` followed by each of its causes that its text does not already
/// say: a server that cannot open its database printed only "database
/// unavailable", and not that the file's directory was missing.
pub fn with_causes(err: &dyn Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

/// A URL without its password, whether in its credentials
/// (`user:secret@`) or in a parameter (`?password=`, `sslpassword=`:
/// PostgreSQL takes both), for the log or a printed command line. Text
/// that is not a URL comes back as it is.
pub fn redacted_url(url: &str) -> String {
    let Some(scheme) = url.find("://") else {
        return url.to_owned();
    };
    // The query starts after the scheme: a `?` before it is not one.
    let (base, query) = match url[scheme..].find('?') {
        Some(at) => (&url[..scheme + at], Some(&url[scheme + at + 1..])),
        None => (url, None),
    };
    let rest = &base[scheme + 3..];
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    let mut text = match authority.rfind('@').and_then(|at| {
        let colon = authority[..at].find(':')?;
        Some((colon, at))
    }) {
        Some((colon, at)) => format!(
            "{}{}:***{}",
            &base[..scheme + 3],
            &rest[..colon],
            &rest[at..]
        ),
        None => base.to_owned(),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                    format!("{name}=***")
                }
                _ => param.to_owned(),
            })
            .collect();
        text.push('?');
        text.push_str(&params.join("&"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden_wherever_the_url_has_them() {
        assert_eq!(
            redacted_url("postgres://intray:s3cret@db:5432/intray"),
            "postgres://intray:***@db:5432/intray"
        );
        assert_eq!(
            redacted_url("postgres://intray@db/intray?password=s3cret&sslmode=require"),
            "postgres://intray@db/intray?password=***&sslmode=require"
        );
        assert_eq!(
            redacted_url("postgres://db/intray?sslmode=verify-full&sslpassword=k&user=u"),
            "postgres://db/intray?sslmode=verify-full&sslpassword=***&user=u"
        );
        assert_eq!(redacted_url("sqlite://intray.db"), "sqlite://intray.db");
        assert_eq!(
            redacted_url("postgres://postgres@127.0.0.1/db"),
            "postgres://postgres@127.0.0.1/db"
        );
        assert_eq!(redacted_url("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db");
        assert_eq!(redacted_url("two words?"), "two words?");
        assert_eq!(redacted_url("x?y://u:p@z"), "x?y://u:***@z");
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot open the database: {0}")]
        Says(#[source] Inner),
        #[error("cannot open the database")]
        Hides(#[source] Inner),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("database unavailable")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn causes_are_added_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory");
        assert_eq!(
            with_causes(&Outer::Says(Inner(io()))),
            "cannot open the database: database unavailable: no such directory"
        );
        assert_eq!(
            with_causes(&Outer::Hides(Inner(io()))),
            "cannot open the database: database unavailable: no such directory"
        );
    }
}
