//! Any bytes a client could send as a JSON payload, through the path a
//! payload takes before the store: protobuf `Value` conversion, validation,
//! canonical hash. Nothing may panic, and the hash must not depend on how
//! the same value was written (key order, `1` vs `1.0`).

#![no_main]

use intray::domain::Backoff;
use intray::domain::validate::{self, Limits, SubmitInput};
use intray::domain::webhook::AddressPolicy;
use libfuzzer_sys::fuzz_target;
use std::time::Duration;

fn limits() -> Limits {
    Limits {
        default_max_attempts: 3,
        default_backoff: Backoff::try_new(Duration::from_secs(5), Duration::from_secs(300))
            .expect("valid default backoff"),
        max_payload_bytes: 1024 * 1024,
        default_lease: Duration::from_secs(60),
        max_lease: Duration::from_secs(3600),
    }
}

fn hash_of(payload: serde_json::Value) -> Option<String> {
    let input = SubmitInput {
        queue: "q".into(),
        kind: "k".into(),
        payload,
        ..Default::default()
    };
    validate::submit(
        input,
        &limits(),
        &AddressPolicy::default(),
        chrono::Utc::now(),
    )
    .ok()
    .map(|job| job.input_hash)
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    // What the gRPC layer does: JSON -> protobuf Value -> JSON.
    let Ok(proto) = serde_json::from_value::<pbjson_types::Value>(value.clone()) else {
        return;
    };
    let Ok(through_proto) = serde_json::to_value(&proto) else {
        return;
    };
    let direct = hash_of(value.clone());
    let via_proto = hash_of(through_proto);
    assert_eq!(
        direct, via_proto,
        "the protobuf round trip changed the hash"
    );
    // Re-serialised (object keys come back sorted): the same hash.
    if let Ok(text) = serde_json::to_string(&value) {
        let reparsed: serde_json::Value = serde_json::from_str(&text).expect("own output parses");
        assert_eq!(direct, hash_of(reparsed), "re-serialising changed the hash");
    }
});
