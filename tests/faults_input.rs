//! Fault battery, bad input (issue 3): every field of every RPC at and beyond
//! its bounds gets the documented status, and a refused call writes no row
//! (`jobs` and `job_events` counted with sqlx before and after). Extends
//! `tests/api.rs`'s `validation`, which covers the first bounds of most
//! Submit and Lease fields; this file covers the rest: malformed UUIDs,
//! negative and out-of-range durations and timestamps, a request over the
//! message limit, JSON nested past its bound, NaN, unknown enum values, forged page
//! tokens, empty and oversized strings, invalid UTF-8 on the wire, and the
//! values exactly at each bound (accepted).

mod common;

use std::time::Duration;

use common::*;
use intray::pb;
use serde_json::json;
use tonic::Code;

common::backend_tests!(
    bad_input_writes_nothing,
    bounds_are_inclusive,
    json_nesting_bounds,
    a_batch_of_millions_of_empty_items_is_refused_undecoded
);

const TENANT: &str = "bad";

/// (rows in `jobs`, rows in `job_events`), read directly from the database.
async fn rows(server: &TestServer) -> (i64, i64) {
    let sql = "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM job_events)";
    let n = db_integers(server.backend, &server.settings.database_url, sql, &[]).await;
    (n[0], n[1])
}

fn nested(depth: usize) -> serde_json::Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!([v]);
    }
    v
}

fn dur(seconds: i64, nanos: i32) -> pbjson_types::Duration {
    pbjson_types::Duration { seconds, nanos }
}

fn bad_ts() -> pbjson_types::Timestamp {
    pbjson_types::Timestamp {
        seconds: 1,
        nanos: -1,
    }
}

const WRONG_UUIDS: [&str; 6] = [
    "",
    "not-a-uuid",
    "0196f3a2-7b1c-7e2a-9c4d",
    "0196f3a2-7b1c-7e2a-9c4d-5e6f7a8b9c0d0",
    "0196f3a2-7b1c-7e2a-9c4d-5e6f7a8b9c0g",
    "💥",
];

async fn bad_input_writes_nothing(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);

    // One running job, so Heartbeat/Complete/Cancel checks reach their
    // field checks with everything else right.
    submit(&mut jobs, "q", "k", json!({})).await;
    let leased = lease_one(&mut workers, "w", "q").await;
    let before = rows(&server).await;
    let ok = || submit_req("q", "k", json!({"a": 1}));
    let mut refused = 0usize;

    macro_rules! invalid {
        ($call:expr, $fields:expr, $what:expr) => {{
            let res = within(Duration::from_secs(20), $what, $call).await;
            expect_invalid(res, $fields, $what);
            refused += 1;
        }};
    }
    macro_rules! bad_submit {
        ($fields:expr, $what:expr, |$r:ident| $edit:expr) => {{
            let mut $r = ok();
            $edit;
            invalid!(jobs.submit($r.clone()), $fields, $what);
            // The same item inside a batch fails alone, with the same field.
            let batch = jobs
                .submit_batch(pb::SubmitBatchRequest { jobs: vec![$r] })
                .await
                .unwrap_or_else(|s| panic!("SubmitBatch with one bad item ({}): {s:?}", $what))
                .into_inner();
            match &batch.results[0].result {
                Some(pb::submit_batch_result::Result::Error(e)) => {
                    assert_eq!(
                        e.code,
                        Code::InvalidArgument as i32,
                        "batch item: {}",
                        $what
                    )
                }
                other => panic!("batch item {} was not refused: {other:?}", $what),
            }
        }};
    }

    // --- Submit: names and strings ---
    bad_submit!(&["kind"], "kind of 129", |r| r.kind = "k".repeat(129));
    bad_submit!(&["kind"], "kind with a space", |r| r.kind = "a b".into());
    bad_submit!(&["queue"], "queue with non-ASCII", |r| r.queue =
        "qué".into());
    bad_submit!(&["queue"], "queue with a slash", |r| r.queue = "a/b".into());
    bad_submit!(&["idempotency_key"], "idempotency_key of 10,000", |r| r
        .idempotency_key =
        "k".repeat(10_000));
    // --- Submit: payload ---
    // (Nesting at and beyond the bound: json_nesting_bounds, below.)
    bad_submit!(&["payload"], "payload NaN", |r| r.payload =
        Some(pbjson_types::Value {
            kind: Some(pbjson_types::value::Kind::NumberValue(f64::NAN)),
        }));
    bad_submit!(&["payload"], "payload infinity", |r| r.payload =
        Some(pbjson_types::Value {
            kind: Some(pbjson_types::value::Kind::NumberValue(f64::INFINITY)),
        }));
    // --- Submit: numbers ---
    bad_submit!(&["priority"], "priority -1001", |r| r.priority = -1001);
    bad_submit!(&["priority"], "priority i32::MIN", |r| r.priority =
        i32::MIN);
    bad_submit!(&["max_attempts"], "max_attempts u32::MAX", |r| r
        .max_attempts =
        Some(u32::MAX));
    bad_submit!(&["max_cost_cents"], "max_cost_cents 0", |r| r
        .max_cost_cents =
        Some(0));
    bad_submit!(&["max_cost_cents"], "max_cost_cents -5", |r| r
        .max_cost_cents =
        Some(-5));
    // --- Submit: times and durations ---
    bad_submit!(&["run_at"], "run_at with negative nanos", |r| r.run_at =
        Some(bad_ts()));
    bad_submit!(&["deadline"], "deadline with negative nanos", |r| r
        .deadline =
        Some(bad_ts()));
    bad_submit!(&["run_at"], "run_at beyond year 9999", |r| r.run_at =
        Some(pbjson_types::Timestamp {
            seconds: i64::MAX,
            nanos: 0,
        }));
    bad_submit!(&["deadline"], "deadline equal to run_at", |r| {
        let t = ts(chrono::Utc::now() + chrono::Duration::hours(1));
        r.run_at = Some(t);
        r.deadline = Some(t);
    });
    bad_submit!(
        &["backoff.initial", "backoff"],
        "backoff initial -1 s",
        |r| r.backoff = Some(pb::Backoff {
            initial: Some(dur(-1, 0)),
            max: None,
        })
    );
    bad_submit!(&["backoff.max", "backoff"], "backoff max -1 ns", |r| r
        .backoff =
        Some(pb::Backoff {
            initial: None,
            max: Some(dur(0, -1)),
        }));
    bad_submit!(
        &["backoff.max", "backoff"],
        "backoff max below initial",
        |r| r.backoff = Some(pb::Backoff {
            initial: Some(dur(10, 0)),
            max: Some(dur(1, 0)),
        })
    );
    // --- Submit: labels and callback ---
    bad_submit!(&["labels"], "33 labels", |r| r.labels =
        (0..33).map(|i| (format!("l{i}"), "v".into())).collect());
    bad_submit!(&["labels"], "empty label key", |r| r
        .labels
        .insert(String::new(), "v".into()));
    bad_submit!(&["labels"], "label key of 64", |r| r
        .labels
        .insert("a".repeat(64), "v".into()));
    bad_submit!(&["labels"], "label value of 257", |r| r
        .labels
        .insert("k".into(), "v".repeat(257)));
    bad_submit!(&["callback_url"], "callback_url ftp", |r| r.callback_url =
        "ftp://example.com/x".into());
    bad_submit!(&["callback_url"], "callback_url without host", |r| r
        .callback_url =
        "https://".into());
    bad_submit!(&["callback_url"], "callback_url of 2049", |r| r
        .callback_url =
        format!("https://e.com/{}", "a".repeat(2049 - 14)));
    bad_submit!(&["callback_url"], "callback_url with a space", |r| r
        .callback_url =
        "https://e.com/a b".into());

    // A request over the 16 MiB message limit is refused by tonic before any
    // handler runs (README: RESOURCE_EXHAUSTED), from a client that would send it.
    let mut big_client = intray::pb::job_service_client::JobServiceClient::with_interceptor(
        server.new_channel().await,
        Tenant::named(TENANT),
    )
    .max_encoding_message_size(64 * 1024 * 1024);
    let mut huge = ok();
    huge.payload = Some(json_to_value(json!({"blob": "x".repeat(17 * 1024 * 1024)})));
    expect_code(
        big_client.submit(huge).await,
        Code::ResourceExhausted,
        "Submit of 17 MiB",
    );
    refused += 1;

    // --- SubmitBatch: its own bound ---
    invalid!(
        jobs.submit_batch(pb::SubmitBatchRequest {
            jobs: (0..1001)
                .map(|_| submit_req("q", "k", json!(null)))
                .collect(),
        }),
        &["jobs"],
        "SubmitBatch of 1001"
    );

    // --- Get, Cancel, WatchJob, Retry: ids ---
    for id in WRONG_UUIDS {
        invalid!(
            jobs.get(pb::GetJobRequest { id: id.into() }),
            &["id"],
            &format!("Get {id:?}")
        );
        invalid!(
            jobs.cancel(pb::CancelJobRequest {
                id: id.into(),
                reason: String::new(),
            }),
            &["id"],
            &format!("Cancel {id:?}")
        );
        invalid!(
            jobs.retry(pb::RetryJobRequest {
                target: Some(pb::retry_job_request::Target::Id(id.into())),
                ..Default::default()
            }),
            &["id"],
            &format!("Retry {id:?}")
        );
        let watch = async {
            match jobs
                .watch_job(pb::WatchJobRequest {
                    id: id.into(),
                    after_sequence: 0,
                })
                .await
            {
                Err(s) => Err(s),
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    match futures::StreamExt::next(&mut stream).await {
                        Some(Err(s)) => Err(s),
                        other => Ok(format!("{other:?}")),
                    }
                }
            }
        };
        invalid!(watch, &["id"], &format!("WatchJob {id:?}"));
    }
    let unknown = uuid::Uuid::now_v7().to_string();
    expect_code(
        jobs.get(pb::GetJobRequest {
            id: unknown.clone(),
        })
        .await,
        Code::NotFound,
        "Get of an unknown UUID",
    );
    expect_code(
        jobs.cancel(pb::CancelJobRequest {
            id: unknown.clone(),
            reason: String::new(),
        })
        .await,
        Code::NotFound,
        "Cancel of an unknown UUID",
    );
    invalid!(
        jobs.cancel(pb::CancelJobRequest {
            id: leased.job_id.clone(),
            reason: "r".repeat(1025),
        }),
        &["reason"],
        "Cancel with a reason of 1025"
    );

    // --- List ---
    for (states, what) in [
        (vec![99], "List states [99]"),
        (vec![0], "List states [UNSPECIFIED]"),
        (vec![-1], "List states [-1]"),
        (
            vec![pb::JobState::Failed as i32, 1000],
            "List states [FAILED, 1000]",
        ),
    ] {
        invalid!(
            jobs.list(pb::ListJobsRequest {
                states,
                ..list_req()
            }),
            &["states"],
            what
        );
    }
    for token in ["", "AAAA", "eyJpZCI6Ii0xIn0", "%%%", &"A".repeat(10_000)] {
        if token.is_empty() {
            continue; // empty is "first page"
        }
        invalid!(
            jobs.list(pb::ListJobsRequest {
                page_token: token.into(),
                ..list_req()
            }),
            &["page_token"],
            &format!("List page_token {:.20}", token)
        );
    }
    invalid!(
        jobs.list(pb::ListJobsRequest {
            queue: "bad queue".into(),
            ..list_req()
        }),
        &["queue"],
        "List with a bad queue"
    );
    invalid!(
        jobs.list(pb::ListJobsRequest {
            kind: "k".repeat(129),
            ..list_req()
        }),
        &["kind"],
        "List with a kind of 129"
    );
    invalid!(
        jobs.list(pb::ListJobsRequest {
            error_class: "bad class".into(),
            ..list_req()
        }),
        &["error_class"],
        "List with an error_class with a space"
    );

    // --- Retry by filter ---
    let filter = |queue: &str, states: Vec<i32>| pb::RetryFilter {
        queue: queue.into(),
        states,
        ..Default::default()
    };
    for (f, fields, what) in [
        (
            filter("q", vec![99]),
            &["filter.states"][..],
            "Retry filter states [99]",
        ),
        (
            filter("q", vec![pb::JobState::Running as i32]),
            &["filter.states"][..],
            "Retry filter states [RUNNING]",
        ),
        (
            filter("bad queue", vec![]),
            &["filter.queue"][..],
            "Retry filter bad queue",
        ),
    ] {
        invalid!(
            jobs.retry(pb::RetryJobRequest {
                target: Some(pb::retry_job_request::Target::Filter(f)),
                ..Default::default()
            }),
            fields,
            what
        );
    }
    for limit in [0, 10_001] {
        invalid!(
            jobs.retry(pb::RetryJobRequest {
                target: Some(pb::retry_job_request::Target::Filter(filter("q", vec![]))),
                limit: Some(limit),
                ..Default::default()
            }),
            &["limit"],
            &format!("Retry limit {limit}")
        );
    }
    invalid!(
        jobs.retry(pb::RetryJobRequest::default()),
        &["target"],
        "Retry with neither id nor filter"
    );

    // --- Stats, PauseQueue, ResumeQueue ---
    invalid!(
        jobs.stats(pb::StatsRequest {
            queue: "bad queue".into(),
        }),
        &["queue"],
        "Stats bad queue"
    );
    for q in ["", "bad queue", &"q".repeat(129)] {
        invalid!(
            jobs.pause_queue(pb::PauseQueueRequest { queue: q.into() }),
            &["queue"],
            &format!("PauseQueue {q:.20?}")
        );
        invalid!(
            jobs.resume_queue(pb::ResumeQueueRequest { queue: q.into() }),
            &["queue"],
            &format!("ResumeQueue {q:.20?}")
        );
    }

    // --- Lease ---
    let lease = || pb::LeaseRequest {
        worker_id: "w".into(),
        queues: vec!["q".into()],
        ..Default::default()
    };
    macro_rules! bad_lease {
        ($fields:expr, $what:expr, |$r:ident| $edit:expr) => {{
            let mut $r = lease();
            $edit;
            invalid!(workers.lease($r), $fields, $what);
        }};
    }
    bad_lease!(&["queues"], "65 queues", |r| r.queues =
        (0..65).map(|i| format!("q{i}")).collect());
    bad_lease!(&["kinds"], "65 kinds", |r| r.kinds =
        (0..65).map(|i| format!("k{i}")).collect());
    bad_lease!(&["queues"], "a bad queue name", |r| r.queues =
        vec!["q".into(), "bad queue".into()]);
    bad_lease!(&["kinds"], "an empty kind", |r| r.kinds =
        vec![String::new()]);
    bad_lease!(&["worker_id"], "worker_id of 10,000", |r| r.worker_id =
        "w".repeat(10_000));
    bad_lease!(&["lease_duration"], "lease_duration -1 s", |r| r
        .lease_duration =
        Some(dur(-1, 0)));
    bad_lease!(&["lease_duration"], "lease_duration 1 h + 1 s", |r| r
        .lease_duration =
        Some(secs(3601)));
    bad_lease!(&["wait"], "wait -1 s", |r| r.wait = Some(dur(-1, 0)));
    bad_lease!(&["wait"], "wait with nanos over 1e9", |r| r.wait =
        Some(dur(0, 2_000_000_000)));

    // --- Heartbeat ---
    let hb = || pb::HeartbeatRequest {
        job_id: leased.job_id.clone(),
        lease_token: leased.lease_token.clone(),
        ..Default::default()
    };
    macro_rules! bad_hb {
        ($fields:expr, $what:expr, |$r:ident| $edit:expr) => {{
            let mut $r = hb();
            $edit;
            invalid!(workers.heartbeat($r), $fields, $what);
        }};
    }
    for id in WRONG_UUIDS {
        bad_hb!(&["job_id"], &format!("Heartbeat job_id {id:?}"), |r| r
            .job_id =
            id.into());
    }
    bad_hb!(&["lease_token"], "empty lease_token", |r| r.lease_token =
        String::new());
    bad_hb!(&["lease_token"], "lease_token of 10,000", |r| r
        .lease_token =
        "t".repeat(10_000));
    bad_hb!(&["progress"], "progress -0.01", |r| r.progress =
        Some(-0.01));
    bad_hb!(&["progress"], "progress NaN", |r| r.progress =
        Some(f64::NAN));
    bad_hb!(&["message"], "message of 1025", |r| r.message =
        "m".repeat(1025));
    bad_hb!(&["extend_by"], "extend_by 0", |r| r.extend_by =
        Some(secs(0)));
    bad_hb!(&["extend_by"], "extend_by -5 s", |r| r.extend_by =
        Some(dur(-5, 0)));
    bad_hb!(&["extend_by"], "extend_by 1 h + 1 s", |r| r.extend_by =
        Some(secs(3601)));

    // --- Complete and CompleteBatch ---
    let failure = |class: &str| {
        let mut r = failure_req(&leased, class, Some(true), None);
        r.outcome = match r.outcome {
            Some(pb::complete_request::Outcome::Failure(f)) => {
                Some(pb::complete_request::Outcome::Failure(f))
            }
            o => o,
        };
        r
    };
    macro_rules! bad_complete {
        ($fields:expr, $what:expr, $r:expr) => {{
            let r = $r;
            invalid!(workers.complete(r.clone()), $fields, $what);
            let batch = workers
                .complete_batch(pb::CompleteBatchRequest { items: vec![r] })
                .await
                .unwrap_or_else(|s| panic!("CompleteBatch with one bad item ({}): {s:?}", $what))
                .into_inner();
            match &batch.results[0].result {
                Some(pb::complete_batch_result::Result::Error(e)) => {
                    assert_eq!(
                        e.code,
                        Code::InvalidArgument as i32,
                        "batch item: {}",
                        $what
                    )
                }
                other => panic!("batch item {} was not refused: {other:?}", $what),
            }
        }};
    }
    for id in WRONG_UUIDS {
        let mut r = success_req(&leased, json!(1));
        r.job_id = id.into();
        bad_complete!(&["job_id"], &format!("Complete job_id {id:?}"), r);
    }
    let mut r = success_req(&leased, json!(1));
    r.lease_token = String::new();
    bad_complete!(&["lease_token"], "Complete with an empty lease_token", r);
    bad_complete!(
        &["success.result"],
        "result over 1 MiB",
        success_req(&leased, json!("x".repeat(1024 * 1024 + 1)))
    );
    bad_complete!(&["failure.error_class"], "empty error_class", failure(""));
    bad_complete!(
        &["failure.error_class"],
        "error_class of 129",
        failure(&"e".repeat(129))
    );
    bad_complete!(
        &["failure.error_class"],
        "error_class with a space",
        failure("rate limited")
    );
    let mut r = failure("timeout");
    if let Some(pb::complete_request::Outcome::Failure(f)) = &mut r.outcome {
        f.retry_after = Some(dur(-1, 0));
    }
    bad_complete!(&["failure.retry_after"], "retry_after -1 s", r);
    let mut r = failure("timeout");
    if let Some(pb::complete_request::Outcome::Failure(f)) = &mut r.outcome {
        f.message = "m".repeat(100_000);
    }
    bad_complete!(&["failure.message"], "failure message of 100,000", r);
    let mut r = success_req(&leased, json!(1));
    r.cost_cents = -1;
    bad_complete!(&["cost_cents"], "cost_cents -1", r);
    for n in [0, 1001] {
        invalid!(
            workers.complete_batch(pb::CompleteBatchRequest {
                items: (0..n).map(|_| success_req(&leased, json!(1))).collect(),
            }),
            &["items"],
            &format!("CompleteBatch of {n}")
        );
    }

    // --- Invalid UTF-8 where the proto takes a string ---
    let raw = raw_submit(&server, b"q\xff\xfe".to_vec()).await;
    let status = raw.expect_err("a queue that is not UTF-8 is refused");
    assert_eq!(
        status.code(),
        Code::InvalidArgument,
        "invalid UTF-8: {status:?}"
    );
    assert_eq!(
        bad_request_fields(&status),
        ["queue"],
        "the field is named, as any bad field is: {status:?}"
    );
    refused += 1;

    let after = rows(&server).await;
    assert_eq!(
        before, after,
        "(jobs, job_events) rows before and after {refused} refused calls"
    );
    let job = get(&mut jobs, &leased.job_id).await;
    assert_eq!(
        state(&job),
        pb::JobState::Running,
        "the leased job is untouched"
    );
    assert_eq!((job.attempt, job.progress), (1, 0.0));
    println!("FAULTS bad input ({backend:?}): {refused} refused calls, rows written 0");
    server.stop().await;
}

/// A `SubmitRequest` whose `queue` (field 1) carries raw bytes, sent with a
/// hand-made message type, since prost will not encode invalid UTF-8 into a
/// `String`.
async fn raw_submit(server: &TestServer, queue: Vec<u8>) -> Result<(), tonic::Status> {
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawSubmit {
        #[prost(bytes = "vec", tag = "1")]
        queue: Vec<u8>,
        #[prost(string, tag = "2")]
        kind: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct Empty {}
    let mut grpc = tonic::client::Grpc::new(server.new_channel().await);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(e.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/intray.v1.JobService/Submit");
    let codec = tonic_prost::ProstCodec::<RawSubmit, Empty>::default();
    grpc.unary(
        req(
            TENANT,
            RawSubmit {
                queue,
                kind: "k".into(),
            },
        ),
        path,
        codec,
    )
    .await
    .map(|_| ())
}

/// The process's peak resident memory, in bytes (`VmHWM`).
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM in kB")
        * 1024
}

/// A `SubmitBatch` just under the 16 MiB message limit made of empty items
/// (two bytes each: eight million of them) is refused as too many items
/// before any is decoded. Decoded first, as before, they took gigabytes of
/// the server's memory ahead of the count check.
async fn a_batch_of_millions_of_empty_items_is_refused_undecoded(backend: Backend) {
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawBatch {
        #[prost(bytes = "vec", repeated, tag = "1")]
        jobs: Vec<Vec<u8>>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct Empty {}
    let server = TestServer::start(backend).await;
    let before = rows(&server).await;
    let items = (16 * 1024 * 1024 - 64) / 2;
    let batch = RawBatch {
        jobs: vec![Vec::new(); items],
    };
    // The server runs in this process: its peak is this process's.
    let peak_before = peak_rss();
    let mut grpc = tonic::client::Grpc::new(server.new_channel().await);
    grpc.ready().await.expect("the channel is ready");
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/intray.v1.JobService/SubmitBatch");
    let codec = tonic_prost::ProstCodec::<RawBatch, Empty>::default();
    let answer = grpc.unary(req(TENANT, batch), path, codec).await;
    let status = answer.expect_err("eight million items are refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let grown = peak_rss().saturating_sub(peak_before);
    assert!(
        grown < 1024 * 1024 * 1024,
        "the peak memory grew by {} MiB",
        grown / (1024 * 1024)
    );
    assert_eq!(rows(&server).await, before, "nothing written");
    server.stop().await;
}

/// The values exactly at each bound are accepted.
async fn bounds_are_inclusive(backend: Backend) {
    // A callback is signed: the tenant needs a secret.
    let server = TestServer::start_with(backend, |s| {
        s.webhooks.keys.default_secret = Some(
            intray::domain::webhook::Keyring::parse(&["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
                .expect("secret"),
        );
    })
    .await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let mut r = submit_req(
        &"q".repeat(128),
        &"k/".repeat(64),
        nested(intray::domain::validate::MAX_JSON_DEPTH),
    );
    r.idempotency_key = "i".repeat(256);
    r.priority = -1000;
    r.max_attempts = Some(100);
    r.labels = (0..32)
        .map(|i| (format!("{i:0>63}"), "v".repeat(256)))
        .collect();
    r.callback_url = format!("https://e.com/{}", "a".repeat(2048 - 14));
    r.max_cost_cents = Some(1);
    let job = submit_with(&mut jobs, r).await;
    let mut r = submit_req("other", "k", json!({}));
    r.priority = 1000;
    r.max_attempts = Some(1);
    submit_with(&mut jobs, r).await;
    let leased = workers
        .lease(pb::LeaseRequest {
            worker_id: "w".repeat(128),
            queues: (0..64)
                .map(|i| {
                    if i == 0 {
                        "q".repeat(128)
                    } else {
                        format!("q{i}")
                    }
                })
                .collect(),
            kinds: vec![],
            max_jobs: Some(100),
            lease_duration: Some(secs(3600)),
            wait: Some(secs(0)),
            all_tenants: false,
        })
        .await
        .expect("Lease at its bounds")
        .into_inner()
        .jobs;
    assert_eq!(leased.len(), 1);
    assert_eq!(leased[0].job_id, job.id);
    workers
        .heartbeat(pb::HeartbeatRequest {
            job_id: job.id.clone(),
            lease_token: leased[0].lease_token.clone(),
            extend_by: Some(secs(3600)),
            progress: Some(1.0),
            message: "m".repeat(1024),
        })
        .await
        .expect("Heartbeat at its bounds");
    let mut done = failure_req(
        &leased[0],
        &"e".repeat(128),
        Some(false),
        Some(Duration::ZERO),
    );
    done.cost_cents = 0;
    workers
        .complete(done)
        .await
        .expect("Complete at its bounds");
    let page = jobs
        .list(pb::ListJobsRequest {
            page_size: Some(1000),
            ..list_req()
        })
        .await
        .expect("List page_size 1000")
        .into_inner();
    assert_eq!(page.jobs.len(), 2);
    server.stop().await;
}

/// A payload nested exactly `MAX_JSON_DEPTH` deep (arrays or objects) is
/// accepted; one level deeper is INVALID_ARGUMENT naming `payload` (and
/// `success.result` on Complete), and nesting beyond what the protobuf
/// decoder reads at all is still a caller error. None writes anything.
async fn json_nesting_bounds(backend: Backend) {
    let server = TestServer::start(backend).await;
    let mut jobs = server.jobs_client(TENANT);
    let mut workers = server.workers_client(TENANT);
    let objects = |depth: usize| {
        let mut v = json!({});
        for _ in 1..depth {
            v = json!({ "a": v });
        }
        v
    };
    let max = intray::domain::validate::MAX_JSON_DEPTH;
    submit(&mut jobs, "q", "k", nested(max)).await;
    submit(&mut jobs, "q", "k", objects(max)).await;
    let leased = lease_one(&mut workers, "w", "q").await;
    let before = rows(&server).await;
    for (payload, what) in [
        (nested(max + 1), "arrays nested one level too deep"),
        (objects(max + 1), "objects nested one level too deep"),
    ] {
        expect_invalid(
            jobs.submit(submit_req("q", "k", payload.clone())).await,
            &["payload"],
            what,
        );
        expect_invalid(
            workers.complete(success_req(&leased, payload)).await,
            &["success.result"],
            what,
        );
    }
    // Beyond what the protobuf decoder reads at all: still a caller error,
    // naming the field.
    let status = jobs
        .submit(submit_req("q", "k", nested(80)))
        .await
        .expect_err("arrays 80 deep are refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert_eq!(bad_request_fields(&status), ["payload"], "{status:?}");
    assert_eq!(before, rows(&server).await, "refused calls wrote nothing");
    workers
        .complete(success_req(&leased, objects(max)))
        .await
        .expect("a result at the nesting bound is accepted");
    server.stop().await;
}
