//! The locks that keep running caps exact across replicas on PostgreSQL.
//!
//! A claim counts running jobs in its statement's snapshot, so two capped
//! claims that ran at once, on two replicas or side by side in one, each
//! counted without the other's jobs and together passed the cap (the test
//! `running_cap_holds_across_replicas` saw 4 running under a cap of 3 in each
//! of six runs). So a capped claim runs in a transaction that first takes a
//! lock per tenant and queue it claims from: caps are per tenant and queue,
//! so claims of other queues or tenants do not wait. A claim across tenants
//! cannot name its tenants beforehand; it takes one lock alone, of which
//! every one-tenant capped claim holds a shared part. The claim statement
//! starts after the locks, so its snapshot holds every capped claim that
//! held them before.
//!
//! The circuit breakers' counts need the same care: a batch that counts
//! the first failure of a queue and kind finds no breaker row to lock, so
//! two such batches would each write a count of one. Batches that count
//! outcomes against breakers take a lock per tenant, queue and kind first.
//!
//! Two-key advisory locks do not share a key space with `pg_counts`'s
//! one-key lock. A tenant and queue whose key equals another's only waits
//! more.

/// First key of the lock that claims across tenants take alone (second key
/// 0) and one-tenant capped claims share. An arbitrary number that only
/// these locks use.
const ACROSS_TENANTS: i32 = 1_769_238_130;
/// First key of a tenant's queue's lock; the second is [`queue_key`].
const TENANT_QUEUE: i32 = 1_769_238_131;

/// The statements that open a capped claim's transaction and take its
/// locks, for the simple-query protocol (one round trip): `BEGIN`, then the
/// locks of `queues` of `only_tenant`, or the lock across tenants when there
/// is no one tenant. The queue locks go in key order, so that claims of
/// overlapping queues cannot deadlock; the text holds only integers.
pub fn begin_and_lock(only_tenant: Option<&str>, queues: &[String]) -> String {
    let Some(tenant) = only_tenant else {
        return format!("BEGIN; SELECT pg_advisory_xact_lock({ACROSS_TENANTS}, 0)");
    };
    let mut keys: Vec<i32> = queues.iter().map(|q| queue_key(tenant, q)).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut sql = format!("BEGIN; SELECT pg_advisory_xact_lock_shared({ACROSS_TENANTS}, 0)");
    for key in keys {
        sql.push_str(&format!(", pg_advisory_xact_lock({TENANT_QUEUE}, {key})"));
    }
    sql
}

/// First key of a breaker's lock; the second is [`key`] of its tenant,
/// queue and kind.
pub const BREAKER: i32 = 1_769_238_132;

/// The second keys of the breaker locks for `pairs` (queue, kind) of
/// `tenant`, sorted and without repeats: taken in this order, concurrent
/// batches cannot deadlock.
pub fn breaker_keys<'a>(tenant: &str, pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<i32> {
    let mut keys: Vec<i32> = pairs.map(|(q, k)| key(&[tenant, q, k])).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

fn queue_key(tenant: &str, queue: &str) -> i32 {
    key(&[tenant, queue])
}

/// FNV-1a (32 bits) of the parts with a zero byte between them: the same
/// in every replica and every build, unlike a hasher seeded per process.
fn key(parts: &[&str]) -> i32 {
    const OFFSET: u32 = 2_166_136_261;
    const PRIME: u32 = 16_777_619;
    let mut bytes = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            bytes.push(0);
        }
        bytes.extend_from_slice(part.as_bytes());
    }
    let hash = bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u32::from(*b)).wrapping_mul(PRIME));
    i32::from_ne_bytes(hash.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(names: &[&str]) -> Vec<String> {
        names.iter().map(|&q| q.to_owned()).collect()
    }

    #[test]
    fn keys_are_fnv_1a_of_tenant_and_queue() {
        // Reference values computed apart (FNV-1a, 32 bits, as i32).
        assert_eq!(queue_key("t", "q"), -1_347_718_600);
        assert_eq!(queue_key("acme", "llm"), 1_348_255_280);
        // The separator keeps ("ab", "c") apart from ("a", "bc").
        assert_ne!(queue_key("ab", "c"), queue_key("a", "bc"));
    }

    #[test]
    fn breaker_keys_are_sorted_once_each_and_apart_from_queue_keys() {
        let keys = breaker_keys("t", [("q", "b"), ("q", "a"), ("q", "b")].into_iter());
        let mut expected = vec![key(&["t", "q", "a"]), key(&["t", "q", "b"])];
        expected.sort_unstable();
        assert_eq!(keys, expected);
        assert_ne!(key(&["t", "q", ""]), queue_key("t", "q"));
    }

    #[test]
    fn a_claim_across_tenants_takes_the_one_lock_alone() {
        assert_eq!(
            begin_and_lock(None, &queues(&["a", "b"])),
            "BEGIN; SELECT pg_advisory_xact_lock(1769238130, 0)"
        );
    }

    #[test]
    fn a_tenant_locks_each_queue_once_in_key_order() {
        let sql = begin_and_lock(Some("t"), &queues(&["q", "r", "q"]));
        let rest = sql
            .strip_prefix("BEGIN; SELECT pg_advisory_xact_lock_shared(1769238130, 0), ")
            .expect("the shared lock across tenants first");
        let mut expected = [queue_key("t", "q"), queue_key("t", "r")];
        expected.sort_unstable();
        let locks: Vec<String> = expected
            .iter()
            .map(|k| format!("pg_advisory_xact_lock(1769238131, {k})"))
            .collect();
        assert_eq!(rest, locks.join(", "));
    }
}
