//! The OTLP trace pipeline, configured only by the standard `OTEL_*`
//! variables: no endpoint, no exporter and no cost.
//!
//! The pipeline is a handle ([`Tracing`]) passed to the server rather than a
//! process global, so that several servers in one process (tests, replicas)
//! can each export to their own collector.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};

/// `service.name` when neither `OTEL_SERVICE_NAME` nor
/// `OTEL_RESOURCE_ATTRIBUTES` names one.
pub const DEFAULT_SERVICE_NAME: &str = "intray";

/// The SDK's export timeout when the environment sets none.
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("otlp exporter: {0}")]
pub struct TracingError(String);

/// The trace pipeline of one server: a tracer provider exporting over OTLP
/// gRPC, or nothing. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Tracing {
    inner: Option<Arc<Pipeline>>,
}

#[derive(Debug)]
struct Pipeline {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// The export timeout, which the last flush at shutdown may take too
    /// (the SDK's own bound there is 5 s, whatever the export's).
    export_timeout: Duration,
}

impl Tracing {
    /// No tracing: spans are neither built nor exported.
    pub fn off() -> Tracing {
        Tracing::default()
    }

    /// The pipeline the environment asks for (see [`settings_from`]), and
    /// the warnings to log once logging is up. The
    /// sampler (`OTEL_TRACES_SAMPLER[_ARG]`), resource
    /// (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), batching
    /// (`OTEL_BSP_*`) and export timeout (`OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT`,
    /// 10 s by default) are read by the SDK itself. Must run inside a tokio
    /// runtime.
    pub fn from_env() -> Result<(Tracing, Vec<String>), TracingError> {
        let settings = settings_from(|name| std::env::var(name).ok());
        let tracing = match &settings.endpoint {
            Some(endpoint) => Tracing::to_endpoint(endpoint)?,
            None => Tracing::off(),
        };
        Ok((tracing, settings.warnings))
    }

    /// A pipeline exporting to `endpoint` (`http://host:4317`). Must run
    /// inside a tokio runtime: the exporter's channel needs its reactor.
    pub fn to_endpoint(endpoint: &str) -> Result<Tracing, TracingError> {
        // No timeout set here: one set in code overrides the environment's.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|e| TracingError(e.to_string()))?;
        let env = |name: &str| std::env::var(name).ok();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_id_generator(PresetIds::default())
            .with_resource(resource(
                Resource::builder().build(),
                env("OTEL_SERVICE_NAME"),
            ))
            .build();
        let tracer = provider.tracer("intray");
        Ok(Tracing {
            inner: Some(Arc::new(Pipeline {
                provider,
                tracer,
                export_timeout: export_timeout(env),
            })),
        })
    }

    /// The tracer, when tracing is on.
    pub fn tracer(&self) -> Option<&SdkTracer> {
        self.inner.as_ref().map(|p| &p.tracer)
    }

    /// The provider, when tracing is on (for the `tracing` bridge).
    pub fn provider(&self) -> Option<&SdkTracerProvider> {
        self.inner.as_ref().map(|p| &p.provider)
    }

    /// Exports what is buffered. The SDK blocks the calling thread while
    /// the export runs on tokio, so it runs on a blocking thread (inline on
    /// a current-thread runtime it deadlocks).
    pub async fn flush(&self) {
        if let Some(p) = &self.inner {
            let provider = p.provider.clone();
            match tokio::task::spawn_blocking(move || provider.force_flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(error = %err, "trace flush failed"),
                Err(err) => tracing::warn!(error = %err, "trace flush task failed"),
            }
        }
    }

    /// Flushes and stops the exporter; spans ended afterwards are dropped.
    pub async fn shutdown(&self) {
        if let Some(p) = &self.inner {
            let provider = p.provider.clone();
            let timeout = p.export_timeout;
            match tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout)).await
            {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(error = %err, "trace shutdown failed"),
                Err(err) => tracing::warn!(error = %err, "trace shutdown task failed"),
            }
        }
    }
}

/// What the `OTEL_*` variables ask of the trace pipeline.
#[derive(Debug, Default, PartialEq)]
pub struct TraceSettings {
    /// The collector, or `None`: tracing off.
    pub endpoint: Option<String>,
    /// What was asked and cannot be done, for the log once it is up (the
    /// pipeline is built before logging, whose layer needs it, and a
    /// warning logged then was lost).
    pub warnings: Vec<String>,
}

/// What the variables `env` reads ask: the collector of
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`;
/// none (off) with neither, with `OTEL_SDK_DISABLED=true`, or with an
/// `OTEL_TRACES_EXPORTER` list without `otlp`. Only OTLP over gRPC is built
/// in: another protocol asked for gets a warning and gRPC, since such a
/// setting is often made for a whole cluster while intray's endpoint is a
/// gRPC one, and refusing to start over it would make a tracing setting an
/// outage. For the same reason a sampler the SDK cannot build is warned
/// about, not refused.
pub fn settings_from(env: impl Fn(&str) -> Option<String>) -> TraceSettings {
    let set = |name: &str| {
        env(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let mut settings = TraceSettings::default();
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return settings;
    }
    if let Some(exporters) = set("OTEL_TRACES_EXPORTER")
        && !exporters.split(',').any(|e| e.trim() == "otlp")
    {
        if exporters.split(',').any(|e| e.trim() != "none") {
            settings.warnings.push(format!(
                "OTEL_TRACES_EXPORTER={exporters}: only otlp is built in; tracing is off"
            ));
        }
        return settings;
    }
    settings.endpoint =
        set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"));
    if let Some(endpoint) = &settings.endpoint {
        let protocol = [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|name| set(name).map(|value| (name, value)));
        if let Some((name, protocol)) = protocol
            && protocol != "grpc"
        {
            settings.warnings.push(format!(
                "{name}={protocol}: only OTLP over gRPC is built in; exporting over gRPC to \
                 {endpoint} (an HTTP endpoint, port 4318, gets no spans)"
            ));
        }
        settings.warnings.extend(sampler_warning(&env));
    }
    settings
}

/// Samplers the SDK builds from `OTEL_TRACES_SAMPLER`, and whether each
/// reads `OTEL_TRACES_SAMPLER_ARG`.
const SAMPLERS: [(&str, bool); 6] = [
    ("always_on", false),
    ("always_off", false),
    ("traceidratio", true),
    ("parentbased_always_on", false),
    ("parentbased_always_off", false),
    ("parentbased_traceidratio", true),
];

/// What the SDK does without a word (its own warnings go to an internal
/// log intray does not show): an unknown sampler, or a ratio it cannot
/// read, samples every trace. It reads both variables as they are, without
/// trimming, and so does this.
fn sampler_warning(env: impl Fn(&str) -> Option<String>) -> Option<String> {
    let sampler = env("OTEL_TRACES_SAMPLER")?;
    let Some(&(_, ratio)) = SAMPLERS.iter().find(|(name, _)| *name == sampler) else {
        return Some(format!(
            "OTEL_TRACES_SAMPLER={sampler} is not a sampler this build knows (always_on, \
             always_off, traceidratio, parentbased_always_on, parentbased_always_off, \
             parentbased_traceidratio); sampling every trace (parentbased_always_on)"
        ));
    };
    let arg = env("OTEL_TRACES_SAMPLER_ARG");
    let readable = arg.as_deref().is_some_and(|a| a.parse::<f64>().is_ok());
    (ratio && !readable).then(|| {
        format!(
            "OTEL_TRACES_SAMPLER={sampler} with OTEL_TRACES_SAMPLER_ARG={}: the ratio must be a \
             number from 0 to 1; sampling every trace",
            arg.as_deref().unwrap_or("(unset)")
        )
    })
}

/// The environment's resource (`detected`), named `intray` unless it
/// names itself. `OTEL_SERVICE_NAME` (`service_name`) wins over a
/// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, as the specification
/// orders them; the SDK's detectors apply them the other way round.
fn resource(detected: Resource, service_name: Option<String>) -> Resource {
    let detected_name = detected
        .get(&opentelemetry::Key::new("service.name"))
        .map(|v| v.as_str().into_owned())
        .filter(|name| !name.starts_with("unknown_service"));
    let name = service_name
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .or(detected_name)
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned());
    Resource::builder_empty()
        .with_attributes(
            detected
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_service_name(name)
        .build()
}

/// The export timeout the environment sets: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`,
/// else `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds), else 10 s, as the SDK
/// reads them for each export.
fn export_timeout(env: impl Fn(&str) -> Option<String>) -> Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .into_iter()
    .find_map(|name| env(name).and_then(|v| v.trim().parse::<u64>().ok()))
    .map_or(DEFAULT_EXPORT_TIMEOUT, Duration::from_millis)
}

thread_local! {
    /// Ids the next span built on this thread must take (see [`with_ids`]).
    static PRESET: Cell<(Option<TraceId>, Option<SpanId>)> = const { Cell::new((None, None)) };
}

/// Random ids, except for a span built inside [`with_ids`]. The SDK's span
/// builder (0.33) has no way to set a span's own id, and an attempt's span
/// must carry the id decided at lease time (the worker already nests its
/// spans under it); the tracer asks its id generator synchronously while
/// building, so a thread-local preset is taken by exactly that span.
#[derive(Debug, Default)]
struct PresetIds {
    random: RandomIdGenerator,
}

impl IdGenerator for PresetIds {
    fn new_trace_id(&self) -> TraceId {
        let (trace, span) = PRESET.get();
        match trace {
            Some(id) => {
                PRESET.set((None, span));
                id
            }
            None => self.random.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> SpanId {
        let (trace, span) = PRESET.get();
        match span {
            Some(id) => {
                PRESET.set((trace, None));
                id
            }
            None => self.random.new_span_id(),
        }
    }
}

/// Runs `build` (which must build exactly one span, synchronously) so that
/// the span gets `span_id`, and `trace_id` when it has no parent.
pub(crate) fn with_ids<T>(trace_id: TraceId, span_id: SpanId, build: impl FnOnce() -> T) -> T {
    PRESET.set((Some(trace_id), Some(span_id)));
    let built = build();
    // A span with a parent takes its trace id from it: drop what is left.
    PRESET.set((None, None));
    built
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service_name(resource: &Resource) -> String {
        resource
            .get(&opentelemetry::Key::new("service.name"))
            .map(|v| v.as_str().into_owned())
            .unwrap_or_default()
    }

    #[test]
    fn otel_service_name_wins_over_the_resource_attributes() {
        let detected = || {
            Resource::builder_empty()
                .with_attributes([
                    KeyValue::new("service.name", "from-attributes"),
                    KeyValue::new("deployment.environment", "prod"),
                ])
                .build()
        };
        let named = resource(detected(), Some("from-env".into()));
        assert_eq!(service_name(&named), "from-env");
        assert_eq!(
            named
                .get(&opentelemetry::Key::new("deployment.environment"))
                .map(|v| v.as_str().into_owned()),
            Some("prod".into()),
            "the other attributes stay"
        );
        assert_eq!(service_name(&resource(detected(), None)), "from-attributes");
        assert_eq!(
            service_name(&resource(detected(), Some(" ".into()))),
            "from-attributes"
        );
        let unnamed = Resource::builder_empty()
            .with_attributes([KeyValue::new("service.name", "unknown_service:intray")])
            .build();
        assert_eq!(service_name(&resource(unnamed, None)), DEFAULT_SERVICE_NAME);
    }

    #[test]
    fn the_export_timeout_comes_from_the_traces_variable_first() {
        let timeout = |vars: &[(&str, &str)]| {
            export_timeout(|name| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        assert_eq!(timeout(&[]), Duration::from_secs(10));
        assert_eq!(
            timeout(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")]),
            Duration::from_secs(2)
        );
        assert_eq!(
            timeout(&[
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "20000"),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3000")
            ]),
            Duration::from_secs(3)
        );
        assert_eq!(
            timeout(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")]),
            Duration::from_secs(10)
        );
    }

    fn settings(vars: &[(&str, &str)]) -> TraceSettings {
        settings_from(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    fn endpoint(vars: &[(&str, &str)]) -> Option<String> {
        let settings = settings(vars);
        assert!(settings.warnings.is_empty(), "{:?}", settings.warnings);
        settings.endpoint
    }

    #[test]
    fn a_sampler_the_sdk_would_replace_is_warned_about() {
        let at = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317");
        let sampler = |vars: &[(&str, &str)]| {
            let mut all = vec![at];
            all.extend_from_slice(vars);
            settings(&all).warnings
        };
        assert!(sampler(&[("OTEL_TRACES_SAMPLER", "parentbased_always_off")]).is_empty());
        assert!(
            sampler(&[
                ("OTEL_TRACES_SAMPLER", "traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ])
            .is_empty()
        );
        let unknown = sampler(&[("OTEL_TRACES_SAMPLER", "ratio")]);
        assert!(
            unknown.len() == 1 && unknown[0].contains("OTEL_TRACES_SAMPLER=ratio"),
            "{unknown:?}"
        );
        // The SDK compares as written: a stray space is an unknown sampler.
        assert_eq!(sampler(&[("OTEL_TRACES_SAMPLER", "always_on ")]).len(), 1);
        for arg in [None, Some("half"), Some("")] {
            let mut vars = vec![("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")];
            vars.extend(arg.map(|a| ("OTEL_TRACES_SAMPLER_ARG", a)));
            let warned = sampler(&vars);
            assert!(
                warned.len() == 1 && warned[0].contains("sampling every trace"),
                "{arg:?}: {warned:?}"
            );
        }
        // Without a collector nothing is sampled, so nothing is said.
        assert!(
            settings(&[("OTEL_TRACES_SAMPLER", "ratio")])
                .warnings
                .is_empty()
        );
    }

    #[test]
    fn the_environment_names_the_collector_or_turns_tracing_off() {
        let at = "http://collector:4317";
        assert_eq!(endpoint(&[]), None);
        assert_eq!(
            endpoint(&[("OTEL_EXPORTER_OTLP_ENDPOINT", at)]),
            Some(at.to_owned())
        );
        assert_eq!(
            endpoint(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", at),
            ]),
            Some(at.to_owned()),
            "the traces endpoint first"
        );
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(
                endpoint(&[("OTEL_EXPORTER_OTLP_ENDPOINT", at), off]),
                None,
                "{off:?}"
            );
        }
        for exporters in ["otlp", "otlp,console", " console , otlp"] {
            assert_eq!(
                endpoint(&[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", at),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                    ("OTEL_TRACES_EXPORTER", exporters),
                ]),
                Some(at.to_owned()),
                "{exporters}"
            );
        }
    }

    #[test]
    fn what_cannot_be_honoured_is_said_once_logging_is_up() {
        let at = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317");
        let http = settings(&[at, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]);
        assert_eq!(http.endpoint.as_deref(), Some(at.1), "exported over gRPC");
        assert!(
            http.warnings.len() == 1 && http.warnings[0].contains("http/protobuf"),
            "{:?}",
            http.warnings
        );
        let traces_first = settings(&[
            at,
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ]);
        assert!(
            traces_first.warnings[0].contains("TRACES_PROTOCOL"),
            "{:?}",
            traces_first.warnings
        );
        let zipkin = settings(&[at, ("OTEL_TRACES_EXPORTER", "zipkin")]);
        assert_eq!(zipkin.endpoint, None, "not an exporter built in: off");
        assert_eq!(zipkin.warnings.len(), 1);
        assert_eq!(
            settings(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]),
            TraceSettings::default(),
            "no endpoint: off, nothing to say"
        );
    }
}
