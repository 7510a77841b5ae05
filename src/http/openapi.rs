//! `GET /api/v1/openapi.json`: the OpenAPI 3 document of the JSON API.
//!
//! The operations are [`OPERATIONS`]; `tests/http_api.rs` calls every one
//! of them and checks the router serves it. The schemas are generated from
//! the proto descriptors the server is built from, in the proto3 JSON
//! mapping, so they cannot drift from the messages.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::Response;
use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorSet};
use serde_json::{Map, Value, json};

use super::body::json;
use super::error::HttpError;

/// Where this document is served (public, also with a token file).
pub const PATH: &str = "/api/v1/openapi.json";

/// One documented operation.
pub struct Operation {
    /// `get` or `post`.
    pub method: &'static str,
    /// The path, in OpenAPI's template syntax.
    pub path: &'static str,
    /// The gRPC method it calls (and whose role it needs); empty for this
    /// document and `whoami`, which call none.
    pub rpc: &'static str,
    pub summary: &'static str,
    /// Request body schema, if it takes one.
    pub body: Option<&'static str>,
    /// Response schema of success (`None`: an event stream).
    pub response: Option<&'static str>,
    /// Query parameters.
    pub query: &'static [&'static str],
}

/// The deliveries listing: authorized as `Get`, but an operation of its own.
const DELIVERIES_PATH: &str = "/api/v1/jobs/{id}/deliveries";

/// The grouped dead set: authorized as `List`, but an operation of its own.
const DEAD_SET_PATH: &str = "/api/v1/dead-set";

/// The caller's identity: any known token, no method of its own.
const WHOAMI_PATH: &str = super::whoami::PATH;

/// Every operation the router serves under `/api/v1`.
pub const OPERATIONS: &[Operation] = &[
    Operation {
        method: "post",
        path: "/api/v1/jobs",
        rpc: "Submit",
        summary: "Submit a job: 202 with the new job and a Location header; with an Idempotency-Key already used for the same input, 200 with the original job; for other input, 409.",
        body: Some("SubmitRequest"),
        response: Some("Job"),
        query: &[],
    },
    Operation {
        method: "post",
        path: "/api/v1/jobs:batch",
        rpc: "SubmitBatch",
        summary: "Submit 1..=1000 jobs; each item is accepted or refused on its own (with its code, message and field), the accepted ones commit together.",
        body: Some("SubmitBatchRequest"),
        response: Some("SubmitBatchResponse"),
        query: &[],
    },
    Operation {
        method: "get",
        path: "/api/v1/jobs",
        rpc: "List",
        summary: "List jobs, newest first; the dead set is state=failed. state and label may repeat. view=basic leaves payloads and results out.",
        body: None,
        response: Some("ListJobsResponse"),
        query: &[
            "queue",
            "kind",
            "state",
            "error_class",
            "label",
            "page_size",
            "page_token",
            "view",
        ],
    },
    Operation {
        method: "get",
        path: "/api/v1/jobs/{id}",
        rpc: "Get",
        summary: "Get a job.",
        body: None,
        response: Some("Job"),
        query: &[],
    },
    Operation {
        method: "post",
        path: "/api/v1/jobs/{id}:cancel",
        rpc: "Cancel",
        summary: "Cancel a job (a running one is asked to stop). Body: optional {\"reason\": \"...\"}.",
        body: Some("CancelJobRequest"),
        response: Some("Job"),
        query: &[],
    },
    Operation {
        method: "get",
        path: "/api/v1/jobs/{id}/events",
        rpc: "WatchJob",
        summary: "The job's events as text/event-stream: id is the event's sequence, data the JobEvent; resumes after Last-Event-ID (or after_sequence) and ends after the terminal event; 204 when resumed after it.",
        body: None,
        response: None,
        query: &["after_sequence"],
    },
    Operation {
        method: "get",
        path: DELIVERIES_PATH,
        rpc: "Get",
        summary: "The job's completion callbacks (README, \"Webhooks\"): {\"deliveries\": [{webhook_id, sequence, type, url, status (pending, delivered, failed), attempts, created_at, last_attempt_at, last_status, last_error}]}. HTTP only; authorized as Get.",
        body: None,
        response: None,
        query: &[],
    },
    Operation {
        method: "post",
        path: "/api/v1/jobs:retry",
        rpc: "Retry",
        summary: "Replay one job ({\"id\"}) or every job matching a filter; dryRun only counts them.",
        body: Some("RetryJobRequest"),
        response: Some("RetryJobResponse"),
        query: &[],
    },
    Operation {
        method: "get",
        path: DEAD_SET_PATH,
        rpc: "List",
        summary: "The jobs a replay filter matches (the dead set, state=failed, without state), grouped by error class and queue, most jobs first: {\"groups\": [{error_class, queue, jobs, cost_cents}], \"complete\"}; at most 100,000 jobs are counted, and complete is false when that many were. HTTP only; authorized as List.",
        body: None,
        response: None,
        query: &["queue", "kind", "error_class", "state"],
    },
    Operation {
        method: "get",
        path: "/api/v1/stats",
        rpc: "Stats",
        summary: "Per-queue counts by state, oldest queued age, running, dead-set size, pause and breakers; recent workers.",
        body: None,
        response: Some("StatsResponse"),
        query: &["queue"],
    },
    Operation {
        method: "post",
        path: "/api/v1/queues/{queue}:pause",
        rpc: "PauseQueue",
        summary: "Pause a queue: its jobs are not leased until it is resumed. Body: optional, its queue the path's.",
        body: Some("PauseQueueRequest"),
        response: Some("PauseQueueResponse"),
        query: &[],
    },
    Operation {
        method: "post",
        path: "/api/v1/queues/{queue}:resume",
        rpc: "ResumeQueue",
        summary: "Resume a paused queue. Body: optional, its queue the path's.",
        body: Some("ResumeQueueRequest"),
        response: Some("ResumeQueueResponse"),
        query: &[],
    },
    Operation {
        method: "get",
        path: WHOAMI_PATH,
        rpc: "",
        summary: "The caller: {\"tenant\", \"roles\", \"methods\"}, the tenant its calls act for, its roles and the JobService methods they allow (by name, e.g. Retry). Any known token; every role in open mode. HTTP only.",
        body: None,
        response: None,
        query: &[],
    },
    Operation {
        method: "get",
        path: PATH,
        rpc: "",
        summary: "This document.",
        body: None,
        response: None,
        query: &[],
    },
];

/// A query parameter as the routes read it: `page_size` and
/// `after_sequence` are numbers, `state` and `label` may repeat
/// (`state=failed&state=expired`), `view` is `basic` or `full`, the rest
/// are one string each.
fn query_parameter(name: &str) -> Value {
    let schema = match name {
        "page_size" => json!({
            "type": "integer",
            "minimum": 1,
            "maximum": crate::domain::validate::MAX_PAGE_SIZE,
        }),
        "after_sequence" => json!({"type": "integer", "minimum": 0}),
        "state" | "label" => json!({"type": "array", "items": {"type": "string"}}),
        "view" => json!({"type": "string", "enum": ["basic", "full"], "default": "full"}),
        _ => json!({"type": "string"}),
    };
    json!({"name": name, "in": "query", "schema": schema, "style": "form", "explode": true})
}

/// A `$ref` to a component schema.
fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn operation(op: &Operation) -> Value {
    let mut parameters: Vec<Value> = op
        .path
        .split('/')
        .filter_map(|segment| {
            let start = segment.find('{')?;
            let end = segment.find('}')?;
            Some(
                json!({"name": &segment[start + 1..end], "in": "path", "required": true,
                        "schema": {"type": "string"}}),
            )
        })
        .collect();
    parameters.extend(op.query.iter().map(|q| query_parameter(q)));
    if op.rpc == "Submit" {
        parameters.push(json!({"name": "Idempotency-Key", "in": "header",
                               "schema": {"type": "string"}}));
    }
    if op.rpc == "WatchJob" {
        parameters.push(json!({"name": "Last-Event-ID", "in": "header",
                               "schema": {"type": "string"}}));
    }
    if op.path != PATH {
        parameters.push(json!({"name": crate::auth::identity::TENANT_HEADER, "in": "header",
            "description": "The tenant to act as: admins and open mode only; a token bound to a tenant acts as its own",
            "schema": {"type": "string"}}));
    }
    let success = match (op.response, op.rpc) {
        (Some(name), _) => json!({"description": "OK",
            "content": {"application/json": {"schema": schema_ref(name)}}}),
        (None, "WatchJob") => json!({"description": "The event stream",
            "content": {"text/event-stream": {"schema": {"type": "string"}}}}),
        (None, _) => json!({"description": "OK",
            "content": {"application/json": {"schema": {"type": "object"}}}}),
    };
    let error = json!({"description": "Error",
        "content": {"application/json": {"schema": schema_ref("Error")}}});
    let mut responses = Map::new();
    let ok = if op.rpc == "Submit" { "202" } else { "200" };
    responses.insert(ok.into(), success.clone());
    if op.rpc == "Submit" {
        responses.insert("200".into(), success);
    }
    if op.rpc == "WatchJob" {
        responses.insert(
            "204".into(),
            json!({"description": "Nothing after Last-Event-ID: the job had already ended"}),
        );
    }
    responses.insert("default".into(), error);
    let mut out = json!({
        "operationId": format!("{}{}", op.method, op.rpc),
        "summary": op.summary,
        "parameters": parameters,
        "responses": responses,
    });
    if op.path == WHOAMI_PATH {
        out["operationId"] = json!("getWhoami");
    } else if op.path == PATH {
        out["operationId"] = json!("openapi");
        // Served without a token, whatever the document's default.
        out["security"] = json!([]);
    } else if op.path == DELIVERIES_PATH {
        out["operationId"] = json!("getDeliveries");
    } else if op.path == DEAD_SET_PATH {
        out["operationId"] = json!("getDeadSet");
    } else {
        out["x-grpc-method"] = json!(format!("intray.v1.JobService/{}", op.rpc));
    }
    if let Some(body) = op.body {
        out["requestBody"] = json!({"required": false,
            "content": {"application/json": {"schema": schema_ref(body)}}});
    }
    out
}

/// The schema of a field's value (without `repeated`).
fn value_schema(field: &FieldDescriptorProto, maps: &BTreeMap<String, Value>) -> Value {
    let type_name = field.type_name();
    match field.r#type() {
        Type::Double | Type::Float => json!({"type": "number"}),
        Type::Int32 | Type::Sint32 | Type::Sfixed32 => {
            json!({"type": "integer", "format": "int32"})
        }
        Type::Uint32 | Type::Fixed32 => json!({"type": "integer", "format": "int32", "minimum": 0}),
        // proto3 JSON writes 64-bit integers as strings (and reads numbers too).
        Type::Int64 | Type::Sint64 | Type::Sfixed64 | Type::Uint64 | Type::Fixed64 => {
            json!({"type": "string", "format": "int64"})
        }
        Type::Bool => json!({"type": "boolean"}),
        Type::String => json!({"type": "string"}),
        Type::Bytes => json!({"type": "string", "format": "byte"}),
        Type::Enum => schema_ref(local_name(type_name)),
        Type::Message | Type::Group => match type_name {
            ".google.protobuf.Timestamp" => json!({"type": "string", "format": "date-time"}),
            ".google.protobuf.Duration" => {
                json!({"type": "string", "description": "seconds with an s suffix, e.g. 1.5s"})
            }
            ".google.protobuf.Value" => json!({"description": "any JSON value"}),
            ".google.protobuf.Struct" => json!({"type": "object"}),
            name => match maps.get(name) {
                Some(map) => map.clone(),
                None => schema_ref(local_name(name)),
            },
        },
    }
}

/// `.intray.v1.CompleteRequest.Success` -> `CompleteRequest.Success`.
fn local_name(type_name: &str) -> &str {
    type_name
        .strip_prefix(".intray.v1.")
        .unwrap_or(type_name.trim_start_matches('.'))
}

/// Adds the schemas of `message` and its nested messages and enums.
fn add_message(
    prefix: &str,
    message: &DescriptorProto,
    schemas: &mut Map<String, Value>,
    maps: &mut BTreeMap<String, Value>,
) {
    let name = format!("{prefix}{}", message.name());
    // Map fields are repeated entries of a nested `...Entry` message; their
    // JSON is an object, so they are inlined rather than referenced.
    for nested in &message.nested_type {
        if nested.options.as_ref().is_some_and(|o| o.map_entry()) {
            let value = nested.field.iter().find(|f| f.name() == "value");
            let values = value.map_or(json!({}), |v| value_schema(v, maps));
            maps.insert(
                format!(".intray.v1.{name}.{}", nested.name()),
                json!({"type": "object", "additionalProperties": values}),
            );
        }
    }
    let mut properties = Map::new();
    for field in &message.field {
        let value = value_schema(field, maps);
        let is_map = maps.contains_key(field.type_name());
        let schema = if field.label() == Label::Repeated && !is_map {
            json!({"type": "array", "items": value})
        } else {
            value
        };
        let json_name = field
            .json_name
            .clone()
            .unwrap_or_else(|| field.name().to_owned());
        properties.insert(json_name, schema);
    }
    schemas.insert(
        name.clone(),
        json!({"type": "object", "properties": properties}),
    );
    for nested in &message.nested_type {
        if !nested.options.as_ref().is_some_and(|o| o.map_entry()) {
            add_message(&format!("{name}."), nested, schemas, maps);
        }
    }
    for e in &message.enum_type {
        add_enum(&format!("{name}.{}", e.name()), e, schemas);
    }
}

fn add_enum(name: &str, e: &prost_types::EnumDescriptorProto, schemas: &mut Map<String, Value>) {
    let values: Vec<&str> = e.value.iter().map(|v| v.name()).collect();
    schemas.insert(name.to_owned(), json!({"type": "string", "enum": values}));
}

/// Schemas of every message and enum of `intray.v1`, and of the error body.
fn schemas() -> Result<Map<String, Value>, prost::DecodeError> {
    let set = FileDescriptorSet::decode(crate::pb::FILE_DESCRIPTOR_SET)?;
    let mut schemas = Map::new();
    let mut maps = BTreeMap::new();
    for file in set.file.iter().filter(|f| f.package() == "intray.v1") {
        for e in &file.enum_type {
            add_enum(e.name(), e, &mut schemas);
        }
        for message in &file.message_type {
            add_message("", message, &mut schemas, &mut maps);
        }
    }
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["code", "message", "details"],
            "properties": {
                "code": {"type": "string", "description": "the gRPC code's name, e.g. NOT_FOUND"},
                "message": {"type": "string"},
                "details": {"type": "array", "items": {"type": "object",
                    "description": "google.rpc details in their JSON form (BadRequest, RetryInfo), with @type"}}
            }
        }),
    );
    Ok(schemas)
}

/// The whole document.
pub fn document() -> Result<Value, prost::DecodeError> {
    let mut paths = Map::new();
    for op in OPERATIONS {
        let entry = paths.entry(op.path).or_insert_with(|| json!({}));
        entry[op.method] = operation(op);
    }
    Ok(json!({
        "openapi": "3.0.3",
        "info": {
            "title": "intray JSON API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The JSON face of intray.v1.JobService: the same service code, roles and errors as gRPC, with bodies in the proto3 JSON mapping. Send the bearer token as Authorization: Bearer <token>.",
        },
        "components": {
            "schemas": schemas()?,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }))
}

/// Serves [`document`].
pub async fn serve() -> Response {
    match document() {
        Ok(doc) => json(StatusCode::OK, &doc),
        Err(err) => {
            tracing::error!(error = %err, "cannot decode the embedded descriptor set");
            axum::response::IntoResponse::into_response(HttpError::Rpc(tonic::Status::internal(
                "internal error",
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_follow_the_proto() {
        let doc = document().expect("descriptor decodes");
        let schemas = &doc["components"]["schemas"];
        let job = &schemas["Job"]["properties"];
        assert_eq!(job["costCents"]["type"], "string", "int64 is a string");
        assert_eq!(job["state"]["$ref"], "#/components/schemas/JobState");
        assert_eq!(job["labels"]["type"], "object");
        assert_eq!(job["createdAt"]["format"], "date-time");
        let list = &schemas["ListJobsRequest"]["properties"];
        assert_eq!(list["states"]["type"], "array");
        assert!(
            schemas["JobState"]["enum"]
                .as_array()
                .expect("enum")
                .contains(&json!("JOB_STATE_FAILED"))
        );
        assert!(schemas["CompleteRequest.Failure"].is_object());
        // Every reference resolves.
        let text = doc.to_string();
        for part in text.split("#/components/schemas/").skip(1) {
            let name = &part[..part.find('"').expect("closing quote")];
            assert!(schemas[name].is_object(), "dangling $ref {name}");
        }
    }

    #[test]
    fn every_operation_is_in_the_paths() {
        let doc = document().expect("descriptor decodes");
        for op in OPERATIONS {
            assert!(
                doc["paths"][op.path][op.method].is_object(),
                "{} {}",
                op.method,
                op.path
            );
        }
    }
}
