//! intray: a durable job-orchestration service.

pub mod api;
pub mod auth;
pub mod bench;
pub mod cli;
pub mod client;
pub mod codec;
pub mod config;
pub mod domain;
pub mod engine;
pub mod http;
pub mod protect;
pub mod reload;
pub mod report;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod worker;

/// Generated gRPC types and services of `proto/intray/v1/intray.proto`, with
/// proto3-JSON serde impls.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("intray.v1");
    include!(concat!(env!("OUT_DIR"), "/intray.v1.serde.rs"));
    /// Descriptor set served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("intray_descriptor");
}
