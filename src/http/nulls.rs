//! Request bodies whose fields may be `null`. proto3 JSON reads a `null`
//! field as the field's default, but the generated decoders (pbjson)
//! refuse it for strings, numbers, enums, maps and lists, and JSON clients
//! often write every field of an object, unset ones as `null`.
//!
//! [`from_slice`] reads a message as if each of its known fields that is
//! `null` had been left out, in every message of the body (repeated and
//! nested ones too), without building the body as a tree: each field's
//! value is first read as the raw text it spans, which is skipped when it
//! is `null` and decoded otherwise. What is not a message field keeps its
//! nulls: a payload's `{"a": null}` is the payload. A field named twice is
//! refused even when one of them is `null`, and an unknown field is
//! refused whatever its value, as the decoders do.
//!
//! Reading a field twice (once for its extent, once to decode it) costs
//! one more pass per level of nesting, so [`super::body::parse`] comes
//! here only for a body the plain decoder refused. A body refused here too
//! is refused with the path of the field whose value was wrong
//! (`backoff.initial`, `jobs[1].priority`).

use std::cell::RefCell;

use serde::de::{
    self, DeserializeSeed, Deserializer, Error as _, IntoDeserializer, MapAccess, SeqAccess,
    Visitor,
};
use serde_json::value::RawValue;

thread_local! {
    /// The path of the value that failed, innermost first, filled in as
    /// the error travels out through the levels of [`from_slice`] (serde's
    /// errors carry text only). Decoding runs on one thread, start to end.
    static FAILED_AT: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Why a body was refused, and where.
#[derive(Debug)]
pub struct Refused {
    /// The field whose value was wrong, as validation names fields
    /// (`backoff.initial`, `jobs[1].max_attempts`); `None` when the body
    /// as a whole was (not JSON, an unknown or repeated field at the top).
    pub field: Option<String>,
    /// The decoder's reason.
    pub error: serde_json::Error,
}

/// Decodes `body` as a `T`, its messages' `null` fields read as left out.
pub fn from_slice<'de, T: de::Deserialize<'de>>(body: &'de [u8]) -> Result<T, Refused> {
    FAILED_AT.with(|path| path.borrow_mut().clear());
    let mut reader = serde_json::Deserializer::from_slice(body);
    let read = T::deserialize(Lenient(&mut reader)).and_then(|value| {
        reader.end()?;
        Ok(value)
    });
    read.map_err(|error| Refused {
        field: FAILED_AT.with(|path| field_path(&path.take())),
        error,
    })
}

/// Notes that the value at `segment` (a field's name, or `[index]`)
/// failed, around whatever failed inside it.
fn failed_at(segment: String) {
    FAILED_AT.with(|path| path.borrow_mut().push(segment));
}

/// `["initial", "backoff"]` as `backoff.initial`, names in snake_case as
/// validation writes them (`maxAttempts` is `max_attempts`).
fn field_path(innermost_first: &[String]) -> Option<String> {
    let mut path = String::new();
    for segment in innermost_first.iter().rev() {
        if !segment.starts_with('[') && !path.is_empty() {
            path.push('.');
        }
        for c in segment.chars() {
            if c.is_ascii_uppercase() {
                path.push('_');
                path.push(c.to_ascii_lowercase());
            } else {
                path.push(c);
            }
        }
    }
    (!path.is_empty()).then_some(path)
}

/// A deserializer whose structs skip their `null` fields, and whose
/// options and sequences hand the same leniency to what they hold. Every
/// other request goes to the inner deserializer as it is: a
/// `google.protobuf.Value` (read with `deserialize_any`) keeps its nulls.
struct Lenient<D>(D);

/// The requests a [`Lenient`] passes through unchanged.
macro_rules! pass_through {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Self::Error> {
                self.0.$method($($arg,)* visitor)
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Lenient<D> {
    type Error = D::Error;

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_struct(name, fields, Fields { visitor, fields })
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_option(Optional(visitor))
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_seq(Items(visitor))
    }

    pass_through! {
        deserialize_any();
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
        deserialize_str();
        deserialize_string();
        deserialize_bytes();
        deserialize_byte_buf();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier();
        deserialize_ignored_any();
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// A message's visitor, handed the fields without their nulls.
struct Fields<V> {
    visitor: V,
    fields: &'static [&'static str],
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Fields<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.visitor.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.visitor.visit_map(WithoutNulls {
            map,
            fields: self.fields,
            seen: Vec::new(),
            value: None,
        })
    }
}

/// The entries of a message's object, its known fields that are `null`
/// left out.
struct WithoutNulls<'de, A> {
    map: A,
    fields: &'static [&'static str],
    /// The known fields met so far, nulls included.
    seen: Vec<String>,
    /// The value of the key last handed out, and that key.
    value: Option<(String, &'de RawValue)>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for WithoutNulls<'de, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(key) = self.map.next_key::<String>()? {
            let value: &'de RawValue = self.map.next_value()?;
            if self.fields.contains(&key.as_str()) {
                if self.seen.contains(&key) {
                    return Err(A::Error::custom(format_args!("duplicate field `{key}`")));
                }
                self.seen.push(key.clone());
                if value.get() == "null" {
                    continue;
                }
            }
            self.value = Some((key.clone(), value));
            return seed.deserialize(key.into_deserializer()).map(Some);
        }
        Ok(None)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| A::Error::custom("a field's value asked for before its name"))?;
        let read = match whole_number(value) {
            Some(n) => seed.deserialize(Whole(n)),
            None => seed.deserialize(Lenient(value)),
        };
        read.map_err(|e| {
            failed_at(key);
            A::Error::custom(e)
        })
    }
}

/// A number written with a fraction or an exponent whose value is whole
/// and exact as a double (`2.0`, `1e1`): proto3 JSON takes it for an
/// integer field, the generated decoders do not. For any other field it
/// is the same number.
fn whole_number(raw: &RawValue) -> Option<i64> {
    let text = raw.get();
    if !text.contains(['.', 'e', 'E']) {
        return None;
    }
    let n: f64 = text.parse().ok()?;
    // Under 2^53 the cast is exact.
    (n.is_finite() && n.fract() == 0.0 && n.abs() < 9_007_199_254_740_992.0).then_some(n as i64)
}

/// A whole number handed to a field's decoder as an integer.
struct Whole(i64);

impl<'de> Deserializer<'de> for Whole {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_i64(self.0)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_some(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct newtype_struct seq tuple tuple_struct
        map struct enum identifier ignored_any
    }
}

/// An option's visitor, which hands the leniency to the value it holds.
struct Optional<V>(V);

impl<'de, V: Visitor<'de>> Visitor<'de> for Optional<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.0.expecting(f)
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.0.visit_some(Lenient(deserializer))
    }
}

/// A sequence's visitor, which hands the leniency to each item.
struct Items<V>(V);

impl<'de, V: Visitor<'de>> Visitor<'de> for Items<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.0.expecting(f)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.0.visit_seq(LenientItems { seq, index: 0 })
    }
}

/// The items of a sequence, each read by a [`Lenient`].
struct LenientItems<A> {
    seq: A,
    /// The next item's.
    index: usize,
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for LenientItems<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        let item = self.seq.next_element_seed(LenientSeed(seed));
        if item.is_err() {
            failed_at(format!("[{}]", self.index));
        }
        self.index += 1;
        item
    }

    fn size_hint(&self) -> Option<usize> {
        self.seq.size_hint()
    }
}

/// A seed that reads its value through a [`Lenient`].
struct LenientSeed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for LenientSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Lenient(deserializer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    fn read<T: de::DeserializeOwned>(body: &str) -> Result<T, String> {
        from_slice(body.as_bytes()).map_err(|e| e.error.to_string())
    }

    fn refused_at<T: de::DeserializeOwned + std::fmt::Debug>(body: &str) -> Option<String> {
        from_slice::<T>(body.as_bytes()).expect_err(body).field
    }

    #[test]
    fn a_refusal_names_the_field_that_was_wrong() {
        type Submit = pb::SubmitRequest;
        type Batch = pb::SubmitBatchRequest;
        let at = |field: &str| Some(field.to_owned());
        assert_eq!(
            refused_at::<Submit>(r#"{"maxAttempts": -1}"#),
            at("max_attempts")
        );
        assert_eq!(
            refused_at::<Submit>(r#"{"priority": 1e99}"#),
            at("priority")
        );
        assert_eq!(
            refused_at::<Submit>(r#"{"labels": null, "backoff": {"initial": 5}}"#),
            at("backoff.initial")
        );
        assert_eq!(
            refused_at::<Batch>(r#"{"jobs": [{}, {"queue": "q", "max_cost_cents": "x"}]}"#),
            at("jobs[1].max_cost_cents")
        );
        assert_eq!(
            refused_at::<Batch>(r#"{"jobs": [{}, {"bogus": 1}]}"#),
            at("jobs[1]")
        );
        assert_eq!(refused_at::<Submit>(r#"{"bogus": 1}"#), None);
        assert_eq!(refused_at::<Submit>("{not json"), None);
    }

    #[test]
    fn a_null_field_is_a_field_left_out() {
        let body = r#"{"queue": "q", "kind": "k", "priority" :  null , "idempotencyKey": null,
            "labels": null, "maxAttempts": null, "runAt": null, "backoff": {"initial": null}}"#;
        let read: pb::SubmitRequest = read(body).expect("nulls read as left out");
        let plain: pb::SubmitRequest =
            serde_json::from_str(r#"{"queue": "q", "kind": "k", "backoff": {}}"#).expect("plain");
        assert_eq!(read, plain);
    }

    #[test]
    fn a_payload_keeps_its_nulls() {
        let body = r#"{"queue": "q", "kind": "k", "priority": null,
            "payload": {"a": null, "b": [null, 1], "c": {"kind": null}}}"#;
        let read: pb::SubmitRequest = read(body).expect("read");
        let payload = crate::api::convert::from_value("payload", read.payload).expect("payload");
        assert_eq!(
            payload,
            serde_json::json!({"a": null, "b": [null, 1], "c": {"kind": null}})
        );
    }

    #[test]
    fn whole_numbers_written_as_decimals_are_integers() {
        let body = r#"{"queue": "q", "kind": "k", "maxAttempts": 2.0, "priority": 1e1,
            "maxCostCents": "5", "payload": {"n": 2.0}}"#;
        let submit: pb::SubmitRequest = read(body).expect("read");
        assert_eq!(submit.max_attempts, Some(2));
        assert_eq!(submit.priority, 10);
        assert_eq!(submit.max_cost_cents, Some(5));
        let payload = crate::api::convert::from_value("payload", submit.payload).expect("payload");
        assert_eq!(payload, serde_json::json!({"n": 2}));
        for refused in [
            r#"{"maxAttempts": 2.5}"#,
            r#"{"priority": 1e300}"#,
            r#"{"queue": 1.0}"#,
        ] {
            assert!(read::<pb::SubmitRequest>(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn repeated_messages_are_lenient_too() {
        let body = r#"{"jobs": [{"queue": "q", "kind": "k", "priority": null},
            {"queue": "r", "kind": "k", "labels": null}]}"#;
        let read: pb::SubmitBatchRequest = read(body).expect("read");
        assert_eq!(read.jobs.len(), 2);
        assert_eq!(read.jobs[1].queue, "r");
    }

    #[test]
    fn what_the_decoder_refuses_is_still_refused() {
        let unknown = read::<pb::SubmitRequest>(r#"{"queue": "q", "bogus": null}"#);
        assert!(unknown.is_err_and(|e| e.contains("unknown field `bogus`")));
        for twice in [
            r#"{"queue": "q", "queue": null}"#,
            r#"{"queue": null, "queue": "q"}"#,
            r#"{"queue": "q", "queue": "r"}"#,
        ] {
            let refused = read::<pb::SubmitRequest>(twice);
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|e| e.contains("duplicate field")),
                "{twice}: {refused:?}"
            );
        }
        assert!(read::<pb::SubmitRequest>(r#"{"queue": "q"} x"#).is_err());
        assert!(read::<pb::SubmitRequest>("null").is_err());
    }
}
