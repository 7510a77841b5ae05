//! Compiles `proto/` with protox (pure Rust: no protoc needed), writes the
//! descriptor set that server reflection serves, and generates proto3-JSON
//! serde impls with pbjson.
use std::{env, fs, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // sqlx::migrate! embeds these; with an explicit rerun list cargo no longer
    // rebuilds on every change, so name the folder too.
    println!("cargo:rerun-if-changed=migrations");

    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler
        .include_imports(true)
        .include_source_info(true)
        .open_files(["proto/intray/v1/intray.proto"])?;

    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let descriptor = compiler.encode_file_descriptor_set();
    fs::write(out_dir.join("intray_descriptor.bin"), &descriptor)?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        // Smaller per-call buffers (see src/codec.rs).
        .codec_path("crate::codec::LeanCodec")
        .compile_fds(compiler.file_descriptor_set())?;

    pbjson_build::Builder::new()
        .register_descriptors(&descriptor)?
        .extern_path(".google.protobuf", "::pbjson_types")
        .build(&[".intray.v1"])?;
    Ok(())
}
