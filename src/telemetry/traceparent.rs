//! W3C `traceparent` values (<https://www.w3.org/TR/trace-context/>), and the
//! ids of an attempt's span. Pure: jobs store these strings, and any replica
//! can rebuild an attempt's span context from what the job row holds.

use std::fmt;

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// A parsed `traceparent`: `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// Trace flags; bit 0 is "sampled".
    pub flags: u8,
}

/// Bit 0 of the trace flags.
const SAMPLED: u8 = 0x01;

fn hex_exact<const N: usize>(s: &str) -> Option<[u8; N]> {
    // Uppercase is invalid in traceparent, and hex::decode would accept it.
    if s.len() != 2 * N || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

impl TraceParent {
    /// Parses a header value. Version `00` must be exactly four fields;
    /// later versions may append fields (the spec's forward compatibility).
    /// All-zero ids and version `ff` are invalid.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim();
        let mut parts = value.split('-');
        let version = parts.next()?;
        let trace_id = hex_exact::<16>(parts.next()?)?;
        let span_id = hex_exact::<8>(parts.next()?)?;
        let flags = hex_exact::<1>(parts.next()?)?[0];
        let [version] = hex_exact::<1>(version)?;
        if version == 0xff || (version == 0 && parts.next().is_some()) {
            return None;
        }
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Whether the caller recorded this trace.
    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The attempt span of a job leased under `lease_token`: in the
    /// submitter's trace (or, without one, in a trace whose id is the job id,
    /// so all of a job's attempts still share one trace), with a span id
    /// derived from the lease token. The token is random per lease and
    /// stored with it, so every replica derives the same id without a
    /// column of its own, and a digest does not reveal the token.
    pub fn for_attempt(job_id: Uuid, parent: Option<&str>, lease_token: &str) -> TraceParent {
        let parent = parent.and_then(TraceParent::parse);
        let digest = Sha256::new()
            .chain_update(b"intray.attempt\0")
            .chain_update(lease_token.as_bytes())
            .finalize();
        let mut span_id = [0u8; 8];
        span_id.copy_from_slice(&digest[..8]);
        if span_id == [0; 8] {
            span_id[7] = 1;
        }
        TraceParent {
            trace_id: parent.map_or(*job_id.as_bytes(), |p| p.trace_id),
            span_id,
            flags: parent.map_or(SAMPLED, |p| p.flags),
        }
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_the_spec_example() {
        let tp = TraceParent::parse(EXAMPLE).expect("valid");
        assert_eq!(hex::encode(tp.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(tp.span_id), "00f067aa0ba902b7");
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), EXAMPLE);
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_may_append_fields() {
        let tp =
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-future")
                .expect("forward compatible");
        assert!(!tp.sampled());
    }

    #[test]
    fn an_attempt_joins_the_submitters_trace_with_a_stable_span_id() {
        let job = Uuid::now_v7();
        let a = TraceParent::for_attempt(job, Some(EXAMPLE), "token-1");
        assert_eq!(hex::encode(a.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(a, TraceParent::for_attempt(job, Some(EXAMPLE), "token-1"));
        let b = TraceParent::for_attempt(job, Some(EXAMPLE), "token-2");
        assert_ne!(a.span_id, b.span_id, "each lease is its own span");
        assert_eq!(TraceParent::parse(&a.to_string()), Some(a));
    }

    #[test]
    fn without_a_submitter_the_job_id_is_the_trace_id() {
        let job = Uuid::now_v7();
        let a = TraceParent::for_attempt(job, None, "t");
        assert_eq!(a.trace_id, *job.as_bytes());
        assert!(a.sampled());
        // An unparsable stored value is treated as absent.
        assert_eq!(TraceParent::for_attempt(job, Some("junk"), "t"), a);
    }
}
