"""Chart tests with the real Helm engine (helm-python-sdk bundles Helm's Go
SDK): lint, render the default values and the production example, validate
every manifest against the Kubernetes schemas offline, and check the facts
that matter. Run by scripts/chart-test.sh."""

import pathlib
import sys

import helm_python
import kubernetes_validate
import yaml

CHART = pathlib.Path(__file__).parent / "intray"
K8S_VERSION = "1.30.0"
# The export timeout of the last traces, flushed after the drain (src/telemetry/otlp.rs).
TRACE_FLUSH = 10
# How long the store waits for its last notification to the other replicas
# after the drain (CLOSE_WAIT in src/store/postgres.rs).
LAST_NOTIFY = 2
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


def values(path):
    return yaml.safe_load((CHART / path).read_text())


def render(overrides):
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(overrides)
        out = chart.render(overrides, name="intray", namespace="jobs", is_install=True)
    docs = []
    for name, text in out.items():
        if not name.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
                try:
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    failures.append(f"{name}: {e}")
                    print(f"FAIL: {name} does not validate: {e}")
    return docs, out


def kind(docs, k):
    return [d for d in docs if d["kind"] == k]


def seconds(duration):
    """A duration as the server's flags take them ("35s", "2m")."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in sorted(units, key=len, reverse=True):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    return float(duration)


def check_ports_and_grace(docs, vals, what):
    [dep] = kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    want = vals.get("ports", {"grpc": 50051, "http": 8080})
    check(ports == want, f"{what}: container ports grpc and http")
    check(env["INTRAY_GRPC_ADDR"] == f"0.0.0.0:{want['grpc']}"
          and env["INTRAY_HTTP_ADDR"] == f"0.0.0.0:{want['http']}",
          f"{what}: the server listens on the container ports")
    grace = seconds(env.get("INTRAY_SHUTDOWN_GRACE") or "20s")
    delay = seconds(env.get("INTRAY_SHUTDOWN_DELAY") or "0s")
    check(seconds(env["INTRAY_RPC_TIMEOUT"]) <= grace
          and delay + grace + LAST_NOTIFY + TRACE_FLUSH <= pod["terminationGracePeriodSeconds"],
          f"{what}: in-flight calls get the RPC timeout, and SIGKILL comes after the delay,"
          " the grace, the last notification and the traces' export")
    svc = cluster_service(docs)
    targets = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    check(targets == {"grpc": "grpc", "http": "http"}, f"{what}: the service exposes grpc and http")


def cluster_service(docs):
    """The Service with a cluster IP (the headless one beside it aside)."""
    [svc] = [s for s in kind(docs, "Service") if s["spec"].get("clusterIP") != "None"]
    return svc


def check_headless_service(vals):
    """A headless Service beside the ClusterIP one, on the gRPC port, for
    clients that balance their calls over the pods themselves; off when
    asked."""
    docs, _ = render(vals)
    services = {s["metadata"]["name"]: s for s in kind(docs, "Service")}
    headless = [s for name, s in services.items() if name.endswith("-headless")]
    check(len(headless) == 1 and len(services) == 2, f"a headless Service beside the other: {sorted(services)}")
    if headless:
        spec = headless[0]["spec"]
        check(spec.get("clusterIP") == "None", "the headless Service has no cluster IP")
        check([(p["name"], p["targetPort"]) for p in spec["ports"]] == [("grpc", "grpc")],
              "the headless Service serves the gRPC port")
    docs, _ = render(dict(vals, service=dict(vals.get("service", {}), headless=False)))
    check(len(kind(docs, "Service")) == 1, "service.headless=false renders one Service")


def check_tls_probes(vals):
    """With TLS, HTTPS probes on the HTTP port's /readyz and /healthz; with
    mTLS, whose client certificate a kubelet cannot present, TCP connects."""
    tls = dict(vals.get("tls", {}), enabled=True, secretName="intray-tls")
    for client_auth in (False, True):
        docs, _ = render(dict(vals, tls=dict(tls, clientAuth=client_auth)))
        [dep] = kind(docs, "Deployment")
        [c] = dep["spec"]["template"]["spec"]["containers"]
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            if client_auth:
                check(c[probe].get("tcpSocket", {}).get("port") == "grpc", f"mTLS: {probe} is a TCP connect")
            else:
                got = c[probe].get("httpGet", {})
                check(got == {"scheme": "HTTPS", "port": "http", "path": path},
                      f"TLS: {probe} is HTTPS GET {path}: {got}")


def render_fails(overrides):
    """Whether the templates refuse these values (a `fail` in a template)."""
    try:
        with helm_python.Chart.load(CHART) as chart:
            chart.render(overrides, name="intray", namespace="jobs", is_install=True)
    except Exception as e:  # the SDK's error for a failed render
        return "minAvailable" in str(e) or "replicaCount" in str(e)
    return False


def rejected(overrides):
    with helm_python.Chart.load(CHART) as chart:
        try:
            chart.validate_schema(overrides)
        except helm_python.HelmValuesError:
            return True
    return False


def main():
    lint = helm_python.lint(CHART, strict=True)
    print("lint:", lint)

    defaults = values("values.yaml")
    docs, out = render(defaults)
    [dep] = kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    check(c["readinessProbe"].get("grpc", {}).get("port") == 50051, "readiness is a gRPC probe")
    check(c["livenessProbe"].get("grpc", {}).get("port") == 50051, "liveness is a gRPC probe")
    check(pod["securityContext"]["runAsNonRoot"] is True, "pod runs as non-root")
    check(c["securityContext"]["readOnlyRootFilesystem"] is True, "read-only root filesystem")
    svc = cluster_service(docs)
    check(svc["spec"]["ports"][0]["appProtocol"] == "grpc", "service port is appProtocol grpc")
    check(not kind(docs, "Secret"), "no Secret without database URL or tokens")
    check_ports_and_grace(docs, defaults, "defaults")
    check("authentication is OFF" in out.get("intray/templates/NOTES.txt", ""), "NOTES warn about open mode")

    prod = values("values-production.yaml")
    docs, out = render(prod)
    [dep] = kind(docs, "Deployment")
    [c] = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    check(env["INTRAY_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "intray-database",
          "database URL from the existing secret")
    check(env["INTRAY_AUTH_FILE"]["value"] == "/etc/intray/auth/tokens", "token file mounted")
    check(not kind(docs, "Secret"), "secrets not inlined when existingSecret is set")
    check(dep["spec"]["replicas"] == 3, "three replicas")
    check(len(kind(docs, "PodDisruptionBudget")) == 1, "PDB rendered")
    check("INTRAY_TLS_CERT" in env, "TLS configured")
    check_ports_and_grace(docs, prod, "production")
    check_tls_probes(prod)
    check_headless_service(prod)

    moved = dict(defaults, ports={"grpc": 9000, "http": 9001})
    docs, _ = render(moved)
    check_ports_and_grace(docs, moved, "ports moved")
    [dep] = kind(docs, "Deployment")
    [c] = dep["spec"]["template"]["spec"]["containers"]
    check(c["readinessProbe"]["grpc"]["port"] == 9000 and c["livenessProbe"]["grpc"]["port"] == 9000,
          "the probes follow the gRPC port")

    hooks = dict(defaults,
                 config=dict(defaults["config"], INTRAY_WEBHOOKS_FILE="/etc/intray/webhooks/hooks.toml"),
                 extraVolumes=[{"name": "webhooks", "secret": {"secretName": "intray-webhooks"}}],
                 extraVolumeMounts=[{"name": "webhooks", "mountPath": "/etc/intray/webhooks",
                                     "readOnly": True}])
    docs, _ = render(hooks)
    [dep] = kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    check(any(v["name"] == "webhooks" for v in pod["volumes"])
          and any(m["name"] == "webhooks" for m in c["volumeMounts"]),
          "extra volumes and mounts reach the pod (the webhooks file)")

    inline = dict(defaults, database={"url": "postgres://u:p@db/intray"},
                  auth={"tokens": "sha256:" + "a" * 64 + " acme producer\n"})
    docs, _ = render(inline)
    [secret] = kind(docs, "Secret")
    check("DATABASE_URL" in secret["stringData"] and "tokens" in secret["stringData"],
          "inline URL and tokens go to the chart's Secret")

    check(rejected(dict(defaults, replicaCount=2)), "schema refuses SQLite with 2 replicas")
    check(render_fails(dict(defaults, podDisruptionBudget={"enabled": True, "minAvailable": 1})),
          "a PDB that would allow no eviction (minAvailable 1 of 1 replica) is refused")
    check(not render_fails(dict(defaults, replicaCount=2, database={"existingSecret": "db"},
                                podDisruptionBudget={"enabled": True, "minAvailable": 1})),
          "a PDB of 1 of 2 replicas renders")
    check(rejected(dict(defaults, replicaCount=2, database={"url": "sqlite:///x.db"})),
          "schema refuses a SQLite URL with 2 replicas")
    check(not rejected(dict(defaults, replicaCount=2, database={"existingSecret": "db"})),
          "schema accepts 2 replicas on an existing secret")
    check(rejected(dict(defaults, config={"INTRAY_DATABASE_URL": "postgres://inline"})),
          "schema refuses the database URL inlined in config")
    check(rejected(dict(defaults, config={"INTRAY_GRPC_ADDR": "0.0.0.0:1"})),
          "schema refuses a listen address in config (the chart sets it from ports)")

    if failures:
        print(f"{len(failures)} chart check(s) failed")
        sys.exit(1)
    print("chart: ok")


if __name__ == "__main__":
    main()
