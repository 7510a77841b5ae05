# intray: one static-enough binary on a slim Debian, run as a non-root user.
#
#   docker build -t intray .
#   docker run --rm -p 50051:50051 intray            # serve, SQLite in /var/lib/intray
#   docker run --rm intray migrate --database-url postgres://...
#
# The build command below is the one scripts/check-image.sh runs, so a
# change here must be made there too (the script checks they agree).

FROM rust:1.95-bookworm AS builder
WORKDIR /src
# Only what the build reads: the manifest, the proto (compiled by protox in
# build.rs, no protoc needed), the migrations (embedded), the sources, and
# the benchmark the manifest declares (cargo refuses a manifest whose
# declared targets are missing, whatever it builds).
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY migrations ./migrations
COPY benches ./benches
COPY src ./src
RUN cargo build --release --locked --bin intray \
 && cp target/release/intray /usr/local/bin/intray

FROM debian:bookworm-slim
# ca-certificates: TLS to PostgreSQL or an OTLP collector verifies against them.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 intray \
 && useradd --system --uid 10001 --gid intray --home-dir /var/lib/intray --no-create-home intray \
 && mkdir -p /var/lib/intray \
 && chown intray:intray /var/lib/intray
COPY --from=builder /usr/local/bin/intray /usr/local/bin/intray
USER 10001:10001
# The default SQLite file (sqlite://intray.db) lands here; mount a volume to keep it.
WORKDIR /var/lib/intray
# gRPC, and HTTP (JSON API, dashboard, /metrics, health).
EXPOSE 50051 8080
ENTRYPOINT ["/usr/local/bin/intray"]
CMD ["serve"]
