"""Chart tests with the real Helm engine (helm-python-sdk bundles Helm's Go
SDK): lint, render the default values and the production example, validate
every manifest against the Kubernetes schemas offline, and check the facts
that matter. Run by scripts/chart-test.sh."""

import pathlib
import re
import shutil
import sys
import tempfile

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
# Custom resources, whose schemas kubernetes_validate does not have: their
# fields are checked by the tests that render them. Any other apiVersion it
# does not know is a failure.
CRD_API_VERSIONS = {"monitoring.coreos.com/v1"}
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
                problem = invalid(doc)
                if problem:
                    failures.append(f"{name}: {problem}")
                    print(f"FAIL: {name} does not validate: {problem}")
    return docs, out


def invalid(doc):
    """Why a manifest does not validate against the Kubernetes schemas, or
    None; custom resources (CRD_API_VERSIONS) aside."""
    if doc.get("apiVersion") in CRD_API_VERSIONS:
        return None
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return None


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
    grpc_name, http_name = service_port_names(vals)
    check(targets == {grpc_name: "grpc", http_name: "http"}, f"{what}: the service exposes grpc and http")


def service_port_names(vals):
    """The Services' names for the gRPC and the HTTP port: with TLS, names a
    mesh reads as TLS (Istio takes a name's protocol from before its first
    "-", so not grpc-tls)."""
    if vals.get("tls", {}).get("enabled"):
        return "tls-grpc", "https"
    return "grpc", "http"


def cluster_service(docs):
    """The Service with a cluster IP (the headless one beside it aside)."""
    [svc] = [s for s in kind(docs, "Service") if s["spec"].get("clusterIP") != "None"]
    return svc


def headless_service(docs):
    return [s for s in kind(docs, "Service") if s["metadata"]["name"].endswith("-headless")]


def check_headless_service(vals):
    """A headless Service beside the ClusterIP one, on the gRPC port, for
    clients that balance their calls over the pods themselves; off when
    asked. Its name resolves to pod addresses, so the port it advertises is
    the pods' own (ports.grpc), whatever service.port says."""
    docs, _ = render(vals)
    services = {s["metadata"]["name"]: s for s in kind(docs, "Service")}
    headless = headless_service(docs)
    check(len(headless) == 1 and len(services) == 2, f"a headless Service beside the other: {sorted(services)}")
    if headless:
        spec = headless[0]["spec"]
        check(spec.get("clusterIP") == "None", "the headless Service has no cluster IP")
        check([(p["name"], p["targetPort"]) for p in spec["ports"]] == [(service_port_names(vals)[0], "grpc")],
              "the headless Service serves the gRPC port")
    moved = dict(vals, service=dict(vals.get("service", {}), port=443), ports={"grpc": 9000, "http": 9001})
    docs, _ = render(moved)
    got = [p["port"] for s in headless_service(docs) for p in s["spec"]["ports"]]
    check(got == [9000], f"the headless Service advertises the container's gRPC port (9000), not service.port: {got}")
    check(cluster_service(docs)["spec"]["ports"][0]["port"] == 443, "the ClusterIP Service keeps service.port")
    docs, _ = render(dict(vals, service=dict(vals.get("service", {}), headless=False)))
    check(len(kind(docs, "Service")) == 1, "service.headless=false renders one Service")


def check_tls_service_ports(vals):
    """With TLS the Services' ports say TLS (name and appProtocol), so that a
    mesh does not parse the TLS as cleartext HTTP/2 or HTTP; without, gRPC.
    Their targets, and the probes, name container ports that exist."""
    for enabled in (False, True):
        tls = dict(vals.get("tls", {}), enabled=enabled, secretName="intray-tls")
        docs, _ = render(dict(vals, tls=tls))
        what = "TLS" if enabled else "no TLS"
        got = [(p["name"], p.get("appProtocol")) for p in cluster_service(docs)["spec"]["ports"]]
        want = [("tls-grpc", "tls"), ("https", "https")] if enabled else [("grpc", "grpc"), ("http", None)]
        check(got == want, f"{what}: the Service's ports are {want}: {got}")
        got = [(p["name"], p.get("appProtocol")) for s in headless_service(docs) for p in s["spec"]["ports"]]
        check(got == want[:1], f"{what}: the headless Service's port is {want[:1]}: {got}")
        [dep] = kind(docs, "Deployment")
        [c] = dep["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in c["ports"]}
        refs = [p["targetPort"] for s in kind(docs, "Service") for p in s["spec"]["ports"]]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            for action in c[probe].values():
                if isinstance(action, dict) and isinstance(action.get("port"), str):
                    refs.append(action["port"])
        check(set(refs) <= names, f"{what}: Services and probes name container ports: {refs} in {sorted(names)}")


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


def render_fails(overrides, about, schema=True):
    """Whether the chart refuses these values with a message naming `about`
    (a `fail` in a template, or the schema, which a render checks first).
    With schema=False, a copy of the chart without values.schema.json: the
    templates' own guards, which the schema would otherwise hide."""
    with tempfile.TemporaryDirectory() as tmp:
        path = CHART
        if not schema:
            path = pathlib.Path(tmp) / CHART.name
            shutil.copytree(CHART, path)
            (path / "values.schema.json").unlink()
        try:
            with helm_python.Chart.load(path) as chart:
                chart.render(overrides, name="intray", namespace="jobs", is_install=True)
        except helm_python.HelmError as e:
            # Refused for something else: neither the refusal looked for nor
            # a render.
            check(about in str(e), f"refused for {about}, not another reason: {e}")
            return about in str(e)
    return False


def rejected(overrides):
    with helm_python.Chart.load(CHART) as chart:
        try:
            chart.validate_schema(overrides)
        except helm_python.HelmValuesError:
            return True
    return False


def pod_annotations(vals):
    docs, _ = render(vals)
    [dep] = kind(docs, "Deployment")
    return dep["spec"]["template"]["metadata"].get("annotations") or {}


def check_database_checksum(vals):
    """A new database URL in the chart's Secret rolls the pods (they read it
    from the environment, at start); new tokens do not (the server reloads
    their file). An existing Secret is not the chart's to hash."""
    tokens = "sha256:" + "a" * 64 + " acme producer\n"
    base = dict(vals, database={"url": "postgres://u:p@db/a"}, auth={"tokens": tokens})
    before = pod_annotations(base).get("checksum/database")
    moved = pod_annotations(dict(base, database={"url": "postgres://u:p@db/b"})).get("checksum/database")
    check(before is not None and moved is not None and before != moved,
          f"a new database URL changes the pods' checksum/database: {before} -> {moved}")
    rotated = pod_annotations(dict(base, auth={"tokens": tokens.replace("a", "b")}))
    check(rotated.get("checksum/database") == before, "new tokens leave checksum/database alone")
    check(pod_annotations(dict(base, podAnnotations={"team": "jobs"})) == {"checksum/database": before, "team": "jobs"},
          "podAnnotations sit beside checksum/database")
    for what, database in (("an existing Secret", {"existingSecret": "db"}), ("no database", {})):
        check("checksum/database" not in pod_annotations(dict(vals, database=database)),
              f"no checksum/database with {what}")


def strategy(vals):
    docs, _ = render(vals)
    [dep] = kind(docs, "Deployment")
    return dep["spec"].get("strategy")


def check_strategy(vals):
    """No strategy by default (Kubernetes' RollingUpdate); the one asked for
    otherwise, e.g. Recreate to cross a migration with the old pods stopped."""
    check(strategy(vals) is None, "no strategy by default")
    check(strategy(dict(vals, strategy={"type": "Recreate"})) == {"type": "Recreate"}, "strategy Recreate renders")
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "25%"}}
    check(strategy(dict(vals, strategy=rolling)) == rolling, "a RollingUpdate strategy renders as given")
    check(rejected(dict(vals, strategy={"type": "Recreate", "rollingUpdate": {"maxSurge": 1}})),
          "schema refuses rollingUpdate settings with Recreate")
    check(rejected(dict(vals, strategy={"type": "Rolling"})), "schema refuses an unknown strategy type")


def data_volume(docs):
    [dep] = kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "data"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "data"]
    return mount["mountPath"], volume


def check_persistence(vals):
    """SQLite on a PersistentVolumeClaim with persistence.enabled, kept by
    helm uninstall, the pod replaced with Recreate (two pods must never open
    one SQLite file; a rolling update of an RWO volume hangs on
    Multi-Attach); refused with PostgreSQL and with a RollingUpdate."""
    docs, _ = render(vals)
    check(data_volume(docs) == ("/var/lib/intray", {"name": "data", "emptyDir": {}})
          and not kind(docs, "PersistentVolumeClaim"),
          "without persistence, the data directory is an emptyDir")

    on = dict(vals, persistence=dict(vals.get("persistence", {}), enabled=True))
    docs, _ = render(on)
    claims = kind(docs, "PersistentVolumeClaim")
    check(len(claims) == 1, f"persistence.enabled makes one claim: {len(claims)}")
    if claims:
        [pvc] = claims
        check(pvc["metadata"]["name"] == "intray-data", "the claim is <fullname>-data")
        check(pvc["metadata"].get("annotations", {}).get("helm.sh/resource-policy") == "keep",
              "helm uninstall keeps the claim")
        check(pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
              and pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
              and "storageClassName" not in pvc["spec"],
              f"the claim: ReadWriteOnce, 1Gi, the default class: {pvc['spec']}")
    claim = {"name": "data", "persistentVolumeClaim": {"claimName": "intray-data"}}
    check(data_volume(docs) == ("/var/lib/intray", claim),
          f"the claim is mounted at the data directory: {data_volume(docs)}")
    [dep] = kind(docs, "Deployment")
    [c] = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    check(env["INTRAY_DATABASE_URL"].startswith("sqlite:///var/lib/intray/"), "the SQLite file is on the claim")
    check(dep["spec"].get("strategy") == {"type": "Recreate"}, "persistence replaces the pod with Recreate")
    check(strategy(dict(on, strategy={"type": "Recreate"})) == {"type": "Recreate"},
          "persistence takes strategy Recreate")

    for storage_class, want in (("fast", "fast"), ("-", "")):
        docs, _ = render(dict(on, persistence=dict(on["persistence"], storageClass=storage_class, size="5Gi",
                                                   accessModes=["ReadWriteOncePod"])))
        [pvc] = kind(docs, "PersistentVolumeClaim") or [{"spec": {}}]
        check(pvc["spec"].get("storageClassName") == want and pvc["spec"].get("accessModes") == ["ReadWriteOncePod"]
              and pvc["spec"].get("resources", {}).get("requests", {}).get("storage") == "5Gi",
              f"storageClass {storage_class!r}, size and accessModes reach the claim: {pvc['spec']}")

    docs, _ = render(dict(on, persistence=dict(on["persistence"], existingClaim="intray-old")))
    check(not kind(docs, "PersistentVolumeClaim")
          and data_volume(docs)[1] == {"name": "data", "persistentVolumeClaim": {"claimName": "intray-old"}},
          "persistence.existingClaim is mounted, and no claim made")

    for what, database in (("a PostgreSQL URL", {"url": "postgres://u:p@db/intray"}),
                           ("an existing database Secret", {"existingSecret": "db"})):
        check(render_fails(dict(on, database=database), "persistence.enabled"),
              f"persistence is refused with {what}")
    for rolling in ({"type": "RollingUpdate"}, {"rollingUpdate": {"maxSurge": 1}}):
        check(render_fails(dict(on, strategy=rolling), "persistence.enabled"),
              f"persistence is refused with a rolling update: {rolling}")
    check(rejected(dict(vals, persistence={"enable": True})),
          "schema refuses a misspelt persistence key (the data would stay on an emptyDir)")
    check(rejected(dict(vals, persistence={"enabled": True, "size": "lots"})),
          "schema refuses a size that is no quantity")


def check_values_declared(vals):
    """Every value a template reads is in values.yaml and in the schema."""
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    used = set()
    for template in (CHART / "templates").iterdir():
        used |= set(re.findall(r"\.Values((?:\.[A-Za-z0-9_]+)+)", template.read_text()))
    for path in sorted(used):
        keys = path.strip(".").split(".")
        node, props = vals, schema
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
            props = (props or {}).get("properties", {}).get(key)
        check(node is not None, f"values.yaml sets .Values{path}")
        check(props is not None, f"values.schema.json declares .Values{path}")


def check_pdb(vals):
    """A budget must leave one pod evictable, whether minAvailable is a count
    or a percentage (rounded up, as Kubernetes does)."""
    pg = dict(vals, database={"existingSecret": "db"})
    for replicas, min_available, refused in ((1, 1, True), (2, 1, False), (3, 2, False), (3, 3, True),
                                             (1, "100%", True), (3, "100%", True), (1, "50%", True),
                                             (2, "50%", False), (3, "50%", False), (3, "67%", True), (3, "0%", False)):
        over = dict(pg, replicaCount=replicas, podDisruptionBudget={"enabled": True, "minAvailable": min_available})
        check(render_fails(over, "minAvailable") == refused,
              f"a PDB of {min_available} of {replicas} replica(s) is {'refused' if refused else 'rendered'}")
    for bad in ("2", "half", -1):
        check(rejected(dict(vals, podDisruptionBudget={"enabled": True, "minAvailable": bad})),
              f"schema refuses minAvailable {bad!r} (neither a count nor a percentage)")


OPTIONAL_KINDS = ("ServiceMonitor", "NetworkPolicy", "HorizontalPodAutoscaler")


def check_optional_kinds_off(docs, what):
    """The ServiceMonitor, the NetworkPolicy and the HPA are opt-in."""
    got = [d["kind"] for d in docs if d["kind"] in OPTIONAL_KINDS]
    check(not got, f"{what}: no ServiceMonitor, NetworkPolicy or HPA unless asked: {got}")


def check_validation_skips_only_crds():
    """Strict validation leaves out the ServiceMonitor's apiVersion alone:
    another unknown apiVersion, or a known kind with a stray field, fails."""
    meta = {"name": "x"}
    check(invalid({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta}) is None,
          "a ServiceMonitor is not validated against Kubernetes' schemas")
    check(invalid({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": meta}) is not None,
          "an unknown apiVersion other than the ServiceMonitor's fails validation")
    check(invalid({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
                   "spec": {"podSelector": {}, "ingres": []}}) is not None,
          "a NetworkPolicy with a misspelt field fails strict validation")


def check_service_monitor(vals, prod):
    """A ServiceMonitor scraping /metrics on the ClusterIP Service's HTTP
    port (named https under TLS, then scraped over HTTPS with the
    tlsConfig given), with the interval, timeout and labels asked for, and
    a metrics token when auth is on; refused when a scrape could not
    succeed (no token under auth, no tlsConfig under TLS, a timeout above
    the interval)."""
    on = {"enabled": True, "labels": {"release": "kube-prometheus"}}
    docs, _ = render(dict(vals, metrics={"serviceMonitor": on}))
    monitors = kind(docs, "ServiceMonitor")
    check(len(monitors) == 1, f"metrics.serviceMonitor.enabled renders one ServiceMonitor: {len(monitors)}")
    if monitors:
        [sm] = monitors
        svc = cluster_service(docs)
        http_port = [p["name"] for p in svc["spec"]["ports"] if p["targetPort"] == "http"]
        check(sm["apiVersion"] == "monitoring.coreos.com/v1", f"ServiceMonitor apiVersion: {sm['apiVersion']}")
        check(sm["metadata"]["name"] == "intray"
              and sm["metadata"]["labels"].get("release") == "kube-prometheus"
              and sm["metadata"]["labels"].get("app.kubernetes.io/instance") == "intray",
              f"the ServiceMonitor carries the chart's labels and the extra ones: {sm['metadata']}")
        selector = sm["spec"]["selector"]["matchLabels"]
        check(selector.items() <= svc["metadata"]["labels"].items(),
              f"the ServiceMonitor selects the ClusterIP Service: {selector}")
        check(sm["spec"]["namespaceSelector"] == {"matchNames": ["jobs"]},
              "the ServiceMonitor looks in the release's namespace")
        check(sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s",
                                           "scrapeTimeout": "10s"}] and http_port == ["http"],
              f"the ServiceMonitor scrapes /metrics on the Service's HTTP port {http_port}: {sm['spec']['endpoints']}")
        headless_ports = [p["name"] for s in headless_service(docs) for p in s["spec"]["ports"]]
        check("http" not in headless_ports,
              f"the headless Service, which it selects too, has no port of that name: {headless_ports}")
        check(set(sm["spec"]) == {"namespaceSelector", "selector", "endpoints"},
              f"the ServiceMonitor's spec has the fields of monitoring.coreos.com/v1: {sorted(sm['spec'])}")

    docs, _ = render(dict(vals, metrics={"serviceMonitor": dict(on, interval="", scrapeTimeout="")}))
    [sm] = kind(docs, "ServiceMonitor") or [{"spec": {"endpoints": [{}]}}]
    check(sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics"}],
          f"an empty interval and scrapeTimeout leave Prometheus' own: {sm['spec']['endpoints']}")
    for interval, timeout, refused in (("1m", "1m", False), ("1s", "500ms", False), ("1m30s", "90s", False),
                                       ("1m", "61s", True), ("500ms", "1s", True), ("1h", "1h1ms", True)):
        sm_vals = dict(on, interval=interval, scrapeTimeout=timeout)
        check(render_fails(dict(vals, metrics={"serviceMonitor": sm_vals}), "scrapeTimeout") == refused,
              f"scrapeTimeout {timeout} with interval {interval} is {'refused' if refused else 'rendered'}")

    # Production: a token file and TLS.
    check(render_fails(dict(prod, metrics={"serviceMonitor": on}), "tokenSecret.name"),
          "with auth on, a ServiceMonitor without a metrics token is refused (its scrapes would get 401)")
    token = {"name": "intray-metrics-token", "key": "token"}
    check(render_fails(dict(prod, metrics={"serviceMonitor": dict(on, tokenSecret=token)}), "tlsConfig"),
          "with TLS, a ServiceMonitor without tlsConfig is refused (its scrapes could not verify the pods)")
    tls_config = {"ca": {"secret": {"name": "intray-tls", "key": "ca.crt"}}, "serverName": "intray.jobs.svc"}
    docs, _ = render(dict(prod, metrics={"serviceMonitor": dict(on, tokenSecret=token, tlsConfig=tls_config)}))
    [sm] = kind(docs, "ServiceMonitor") or [{"spec": {"endpoints": [{}]}}]
    want = {"port": "https", "path": "/metrics", "scheme": "https", "tlsConfig": tls_config, "interval": "30s",
            "scrapeTimeout": "10s",
            "authorization": {"type": "Bearer", "credentials": {"name": "intray-metrics-token", "key": "token"}}}
    check(sm["spec"]["endpoints"] == [want],
          f"with TLS and a token: HTTPS on the port named https, with the tlsConfig and the token: "
          f"{sm['spec']['endpoints']}")

    mtls = dict(prod, tls=dict(prod["tls"], clientAuth=True))
    check(render_fails(dict(mtls, metrics={"serviceMonitor": dict(on, tokenSecret=token, tlsConfig=tls_config)}),
                       "tlsConfig.cert"),
          "with tls.clientAuth, a ServiceMonitor without a client certificate is refused (the server refuses"
          " every such scrape)")
    client = dict(tls_config, cert={"secret": {"name": "prom-client", "key": "tls.crt"}},
                  keySecret={"name": "prom-client", "key": "tls.key"})
    docs, out = render(dict(mtls, metrics={"serviceMonitor": dict(on, tokenSecret=token, tlsConfig=client)}))
    check(len(kind(docs, "ServiceMonitor")) == 1, "with tls.clientAuth and a client certificate it renders")
    check("-cert client.crt -key client.key" in out.get("intray/templates/NOTES.txt", ""),
          "under tls.clientAuth the NOTES' grpcurl presents a client certificate")

    check(rejected(dict(vals, metrics={"serviceMonitor": {"enable": True}})),
          "schema refuses a misspelt serviceMonitor key")
    check(rejected(dict(vals, metrics={"serviceMonitor": {"enabled": True, "interval": "30 seconds"}})),
          "schema refuses an interval that is no Prometheus duration")


def network_policy(vals):
    docs, _ = render(vals)
    policies = kind(docs, "NetworkPolicy")
    check(len(policies) == 1, f"networkPolicy.enabled renders one NetworkPolicy: {len(policies)}")
    return docs, (policies or [{"spec": {}}])[0]["spec"]


def check_network_policy(vals, prod):
    """A NetworkPolicy on the intray pods letting in the gRPC and the HTTP
    port only (the container's ports, which the policy sees), from the
    peers asked for or from anywhere; egress left alone unless restricted,
    and then DNS plus the rules asked for."""
    for what, base in (("defaults", vals), ("production", prod),
                       ("ports moved", dict(vals, ports={"grpc": 9000, "http": 9001}))):
        docs, spec = network_policy(dict(base, networkPolicy={"enabled": True}))
        [dep] = kind(docs, "Deployment")
        [c] = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        check(spec.get("podSelector") == {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
              f"{what}: the NetworkPolicy selects the Deployment's pods: {spec.get('podSelector')}")
        check(spec.get("policyTypes") == ["Ingress"] and "egress" not in spec,
              f"{what}: egress is not restricted by default: {spec.get('policyTypes')}")
        want = [{"ports": [{"port": ports["grpc"], "protocol": "TCP"}, {"port": ports["http"], "protocol": "TCP"}]}]
        check(spec.get("ingress") == want,
              f"{what}: in to the gRPC and the HTTP port only, from anywhere: {spec.get('ingress')}")

    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "workers"}}},
             {"podSelector": {"matchLabels": {"app": "producer"}}}]
    scrape = {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
              "ports": [{"port": 8080, "protocol": "TCP"}]}
    _, spec = network_policy(dict(vals, networkPolicy={"enabled": True, "from": peers, "extraIngress": [scrape]}))
    check(spec.get("ingress") == [{"ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}],
                                   "from": peers}, scrape],
          f"`from` limits the two ports to those peers, and extraIngress is added: {spec.get('ingress')}")

    database = {"to": [{"ipBlock": {"cidr": "10.0.12.0/24"}}], "ports": [{"port": 5432, "protocol": "TCP"}]}
    otlp = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
                    "podSelector": {"matchLabels": {"app": "otel-collector"}}}],
            "ports": [{"port": 4317, "protocol": "TCP"}]}
    dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    _, spec = network_policy(dict(prod, networkPolicy={"enabled": True,
                                                       "egress": {"restrict": True, "rules": [database, otlp]}}))
    check(spec.get("policyTypes") == ["Ingress", "Egress"], f"egress.restrict adds Egress: {spec.get('policyTypes')}")
    check(spec.get("egress") == [dns, database, otlp],
          f"restricted egress: DNS (UDP and TCP 53) and the rules given: {spec.get('egress')}")
    _, spec = network_policy(dict(vals, networkPolicy={"enabled": True, "egress": {"restrict": True}}))
    check(spec.get("egress") == [dns], f"restricted egress without rules: DNS only: {spec.get('egress')}")

    check(rejected(dict(vals, networkPolicy={"enabled": True, "from": [{"podSelectr": {}}]})),
          "schema refuses a misspelt peer (it would be dropped, and the rule widened)")
    check(rejected(dict(vals, networkPolicy={"enabled": True, "from": [{}]})), "schema refuses an empty peer")
    check(rejected(dict(vals, networkPolicy={"enabled": True, "egress": {"restricted": True}})),
          "schema refuses a misspelt egress key")


def check_autoscaling(vals, prod):
    """An autoscaling/v2 HPA on the Deployment, which then leaves its
    replicas to it; refused on SQLite (one replica only), with minReplicas
    above maxReplicas, and without the requests utilization is a share of.
    A disruption budget is checked against minReplicas."""
    pg = dict(vals, database={"existingSecret": "db"})
    on = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetCPUUtilizationPercentage": 80}
    docs, out = render(dict(pg, autoscaling=on))
    hpas = kind(docs, "HorizontalPodAutoscaler")
    check(len(hpas) == 1, f"autoscaling.enabled renders one HPA: {len(hpas)}")
    [dep] = kind(docs, "Deployment")
    check("replicas" not in dep["spec"], f"with an HPA the Deployment sets no replicas: {dep['spec'].get('replicas')}")
    cpu = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}
    if hpas:
        [hpa] = hpas
        check(hpa["apiVersion"] == "autoscaling/v2", f"HPA apiVersion: {hpa['apiVersion']}")
        check(hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": dep["metadata"]["name"]},
              f"the HPA scales the chart's Deployment: {hpa['spec']['scaleTargetRef']}")
        check(hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
              and hpa["spec"]["metrics"] == [cpu] and "behavior" not in hpa["spec"],
              f"the HPA: 2 to 6 replicas on 80% CPU: {hpa['spec']}")
    check("2 to 6 replicas, autoscaled" in out.get("intray/templates/NOTES.txt", ""), "NOTES tell the HPA's range")

    behavior = {"scaleDown": {"stabilizationWindowSeconds": 600}}
    docs, _ = render(dict(prod, autoscaling=dict(on, minReplicas=3, targetMemoryUtilizationPercentage=75,
                                                 behavior=behavior)))
    [hpa] = kind(docs, "HorizontalPodAutoscaler") or [{"spec": {}}]
    memory = {"type": "Resource",
              "resource": {"name": "memory", "target": {"type": "Utilization", "averageUtilization": 75}}}
    check(hpa["spec"].get("metrics") == [cpu, memory] and hpa["spec"].get("behavior") == behavior,
          f"a memory target and behavior reach the HPA: {hpa['spec']}")
    [dep] = kind(docs, "Deployment")
    check("replicas" not in dep["spec"], "production with an HPA: no replicas in the Deployment")

    message = "autoscaling.enabled needs PostgreSQL"
    for what, over in (("no database", {}), ("a SQLite URL", {"database": {"url": "sqlite:///var/lib/intray/x.db"}}),
                       ("persistence", {"persistence": {"enabled": True}})):
        check(render_fails(dict(vals, autoscaling=on, **over), message),
              f"autoscaling is refused on SQLite ({what}), which allows one replica only")
    check(render_fails(dict(pg, autoscaling=dict(on, minReplicas=7)), "minReplicas must not exceed"),
          "autoscaling with minReplicas above maxReplicas is refused")
    # None deletes a default value, as `--set key=null` does.
    check(render_fails(dict(pg, autoscaling=on, resources={"requests": {"cpu": None}}), "resources.requests.cpu"),
          "a CPU target without a CPU request is refused")
    check(render_fails(dict(pg, autoscaling=dict(on, targetMemoryUtilizationPercentage=75),
                            resources={"requests": {"memory": None}}), "resources.requests.memory"),
          "a memory target without a memory request is refused")
    check(not render_fails(dict(pg, autoscaling=on, resources={"requests": {"memory": None}}),
                           "resources.requests.memory"),
          "a CPU target alone needs no memory request")

    # The budget against minReplicas, not replicaCount (1 here).
    for min_replicas, min_available, refused in ((2, 1, False), (2, 2, True), (1, 1, True), (3, "50%", False),
                                                 (2, "100%", True)):
        over = dict(pg, autoscaling=dict(on, minReplicas=min_replicas),
                    podDisruptionBudget={"enabled": True, "minAvailable": min_available})
        check(render_fails(over, "minAvailable") == refused,
              f"with an HPA from {min_replicas}, a PDB of {min_available} is {'refused' if refused else 'rendered'}")

    check(rejected(dict(pg, autoscaling=dict(on, minReplicas=0))), "schema refuses minReplicas 0")
    check(rejected(dict(pg, autoscaling={"enable": True})), "schema refuses a misspelt autoscaling key")
    check(rejected(dict(pg, autoscaling=dict(on, targetCPUUtilizationPercentage="80%"))),
          "schema refuses a CPU target that is no integer")


def main():
    lint = helm_python.lint(CHART, strict=True)
    print("lint:", lint)
    for what, report in (("defaults", lint),
                         ("production", helm_python.lint(CHART, values("values-production.yaml"), strict=True))):
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        check(not problems, f"lint ({what}) finds no warning or error: {problems}")
    everything = dict(values("values-production.yaml"),
                      autoscaling={"enabled": True, "minReplicas": 3, "maxReplicas": 6},
                      networkPolicy={"enabled": True, "egress": {"restrict": True}},
                      metrics={"serviceMonitor": {"enabled": True, "tokenSecret": {"name": "intray-metrics"},
                                                  "tlsConfig": {"insecureSkipVerify": True}}})
    report = helm_python.lint(CHART, everything, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    check(not problems, f"lint (HPA, NetworkPolicy, ServiceMonitor on) finds no warning or error: {problems}")

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
    check_optional_kinds_off(docs, "defaults")

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
    check_optional_kinds_off(docs, "production")
    check_tls_probes(prod)
    check_tls_service_ports(prod)
    check_tls_service_ports(defaults)
    check_headless_service(prod)
    check_headless_service(defaults)
    check_database_checksum(defaults)
    check_strategy(defaults)
    check_persistence(defaults)
    check_values_declared(defaults)
    check_pdb(defaults)
    check_validation_skips_only_crds()
    check_service_monitor(defaults, prod)
    check_network_policy(defaults, prod)
    check_autoscaling(defaults, prod)

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

    indented = "  # TOKEN TENANT ROLES\nsha256:" + "a" * 64 + " acme producer\n"
    docs, _ = render(dict(defaults, auth={"tokens": indented}))
    [secret] = kind(docs, "Secret")
    check(secret["stringData"]["tokens"] == indented,
          "inline tokens whose first line is indented reach the Secret as written")
    for key in ("INTRAY_TLS_CERT", "INTRAY_TLS_KEY", "INTRAY_TLS_CLIENT_CA"):
        check(rejected(dict(defaults, config=dict(defaults["config"], **{key: "/x"}))),
              f"schema refuses config.{key}, which tls.* sets")
    check(render_fails(dict(defaults, terminationGracePeriodSeconds=40), "terminationGracePeriodSeconds",
                       schema=False),
          "a kill budget below the delay, the grace and 12 s is refused")
    check(render_fails(dict(defaults, terminationGracePeriodSeconds=60,
                            config=dict(defaults["config"], INTRAY_SHUTDOWN_GRACE="60s")),
                       "terminationGracePeriodSeconds", schema=False),
          "a longer grace needs a longer kill budget")

    check(rejected(dict(defaults, replicaCount=2)), "schema refuses SQLite with 2 replicas")
    for what, database in (("no database", {}), ("a SQLite URL", {"url": "sqlite:///var/lib/intray/x.db"})):
        check(render_fails(dict(defaults, replicaCount=2, database=database), "replicaCount", schema=False),
              f"the template, schema aside, refuses 2 replicas with {what}")
    check(not render_fails(dict(defaults, replicaCount=2, database={"existingSecret": "db"}), "replicaCount",
                           schema=False),
          "the template, schema aside, takes 2 replicas on an existing secret")
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
