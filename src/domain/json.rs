//! JSON numbers across `google.protobuf.Value`, which holds every number as
//! a double.
//!
//! A payload's `5` crosses gRPC as `5.0`: kept so, it reaches a handler as a
//! float (`payload["n"].as_u64()` is `None` in Rust, `range(n)` fails in
//! Python) and shows as `5.0` over HTTP. Whole numbers are written back as
//! integers wherever JSON comes out of a `Value`, as other proto3 JSON
//! printers do.

use std::io;

use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter};
use serde_json::{Number, Value};

/// From 2^53 on a double no longer holds every integer (and a `Value` is
/// not made from such an integer).
const EXACT: f64 = 9_007_199_254_740_992.0;

/// pbjson's refusal of an integer literal from 2^53 to the 64-bit range
/// when it reads a `Value` (it reads one past that range as a double, as
/// it would `1e20`).
const INEXACT: &str = "out of range integral type conversion attempted";

/// `reason`, a refusal to read JSON as a `Value`, in words a sender can act
/// on: pbjson's own for an integer a payload cannot hold exactly names a
/// type conversion.
pub fn payload_reason(reason: &str) -> String {
    reason.replace(
        INEXACT,
        "an integer beyond 2^53, which a payload cannot hold exactly (its numbers are \
         doubles): send it as a string",
    )
}

/// Turns every whole number less than 2^53 from zero back into an integer;
/// other numbers stay as they are.
pub fn whole_numbers_as_integers(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64())
                && is_whole(f)
            {
                // The range check above makes the cast exact.
                *n = Number::from(f as i64);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(map) => map.values_mut().for_each(whole_numbers_as_integers),
        _ => {}
    }
}

/// Whether `f` is written as an integer: whole and under 2^53, but not
/// -0.0, whose sign an integer would lose (and with it the idempotency
/// hash a payload holding it had).
fn is_whole(f: f64) -> bool {
    f.fract() == 0.0 && f.abs() < EXACT && (f != 0.0 || f.is_sign_positive())
}

/// Turns every number into the double a `Value` will hold: an integer a
/// double cannot hold exactly becomes the nearest one, as in any proto3
/// JSON client, instead of the whole value being refused.
pub fn numbers_as_doubles(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if !n.is_f64()
                && let Some(double) = n.as_f64().and_then(Number::from_f64)
            {
                *n = double;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(numbers_as_doubles),
        Value::Object(map) => map.values_mut().for_each(numbers_as_doubles),
        _ => {}
    }
}

/// `value` as JSON text with whole doubles written as integers: what
/// [`whole_numbers_as_integers`] does to a tree, done while writing, for
/// answers built from protobuf messages (no tree to build or walk).
pub fn to_vec_whole<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(128);
    value.serialize(&mut serde_json::Serializer::with_formatter(
        &mut out,
        WholeNumbers,
    ))?;
    Ok(out)
}

/// [`to_vec_whole`] as a string.
pub fn to_string_whole<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<String> {
    // serde_json writes UTF-8 only; the lossy path is never taken.
    to_vec_whole(value).map(|bytes| {
        String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    })
}

/// serde_json's compact output, whole doubles within 2^53 as integers.
struct WholeNumbers;

impl Formatter for WholeNumbers {
    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        if is_whole(value) {
            // The range check above makes the cast exact.
            CompactFormatter.write_i64(writer, value as i64)
        } else {
            CompactFormatter.write_f64(writer, value)
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn whole_doubles_become_integers_and_the_rest_stay() {
        let mut value = json!({"n": 5.0, "list": [1.0, -2.0, 2.5], "big": 1e300, "s": "5.0"});
        whole_numbers_as_integers(&mut value);
        assert_eq!(
            value,
            json!({"n": 5, "list": [1, -2, 2.5], "big": 1e300, "s": "5.0"})
        );
        assert_eq!(value["n"].as_u64(), Some(5));
        let mut zeros = json!([0.0, -0.0]);
        whole_numbers_as_integers(&mut zeros);
        assert_eq!(zeros[0], json!(0));
        assert!(
            zeros[1]
                .as_f64()
                .is_some_and(|z| z == 0.0 && z.is_sign_negative())
        );
        let mut edge = json!([9_007_199_254_740_991.0, 9_007_199_254_740_992.0]);
        whole_numbers_as_integers(&mut edge);
        assert_eq!(
            edge,
            json!([9_007_199_254_740_991_i64, 9_007_199_254_740_992.0])
        );
    }

    #[test]
    fn written_whole_doubles_are_integers() {
        let value: pbjson_types::Value =
            serde_json::from_value(json!({"n": 5, "x": [0.5, -2, 1e300], "s": "5.0"}))
                .expect("a Value");
        let text = to_string_whole(&value).expect("written");
        let back: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(back, json!({"n": 5, "x": [0.5, -2, 1e300], "s": "5.0"}));
        assert_eq!(back["n"].as_u64(), Some(5), "{text}");
    }

    #[test]
    fn every_number_becomes_the_double_a_value_holds() {
        let mut value = json!({"id": 9_007_199_254_740_993_u64, "n": [-3, 0.5]});
        numbers_as_doubles(&mut value);
        assert!(value["id"].is_f64());
        assert_eq!(value["id"].as_f64(), Some(9_007_199_254_740_992.0));
        assert_eq!(value["n"], json!([-3.0, 0.5]));
        let held: Result<pbjson_types::Value, _> = serde_json::from_value(value);
        assert!(held.is_ok(), "a Value holds it: {held:?}");
    }
}
