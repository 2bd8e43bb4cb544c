"""deploy/kubernetes/ and deploy/compose.yaml, validated offline.

Kubernetes objects against the API's JSON schemas (`kubernetes-validate`, which
ships them), KEDA objects against a vendored minimal schema
(tests/schemas/keda-v1alpha1.json), and both against the code: stream and group
names come from skyline/core/keys.py, metric names from the worker endpoint, every
command line parses with the `skyline` CLI, every option in the ConfigMap loads,
ports and probes agree. A rename in the code fails here instead of in a cluster.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from skyline.workers.endpoint import GAUGES

from skyline.cli import build_parser
from skyline.core.config import load_config
from skyline.core.keys import STAGES, Keys
from skyline.core.redisconn import parse_redis_url

ROOT = Path(__file__).parents[1]
K8S = ROOT / "deploy" / "kubernetes"
WORKER_ROLES = ("prefill", "decode")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources(kustomization) -> list[dict]:
    return [d for name in kustomization["resources"] for d in _docs(K8S / name)]


def _one(resources, kind: str, name: str) -> dict:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def config(resources, tmp_path_factory):
    """The ConfigMap's skyline.toml, loaded by the real config loader (unknown options fail)."""
    path = tmp_path_factory.mktemp("cm") / "skyline.toml"
    path.write_text(_one(resources, "ConfigMap", "skyline-config")["data"]["skyline.toml"])
    return load_config(path)


def test_kustomization_lists_every_manifest(kustomization):
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


def test_kubernetes_objects_match_the_api_schemas(resources):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    core = [r for r in resources if not r["apiVersion"].startswith("keda.sh/")]
    assert {r["kind"] for r in core} >= {"Namespace", "ConfigMap", "Secret", "StatefulSet", "Service", "Deployment",
                                         "PodDisruptionBudget"}
    for r in core:
        # strict: unknown fields (a typo the API server would silently drop) are errors too.
        kubernetes_validate.validate(r, version, strict=True)


def test_keda_objects_match_the_vendored_schema(resources):
    schema = json.loads((ROOT / "tests" / "schemas" / "keda-v1alpha1.json").read_text())
    keda = [r for r in resources if r["apiVersion"].startswith("keda.sh/")]
    assert {r["kind"] for r in keda} == {"ScaledObject", "TriggerAuthentication"}
    for r in keda:
        jsonschema.validate(r, schema)
    bad = _one(resources, "ScaledObject", "skyline-prefill") | {}
    bad = {**bad, "spec": {**bad["spec"], "minReplicas": 1}}  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_scaled_objects_target_the_worker_deployments_with_streams_from_the_key_module(resources, config):
    keys = Keys(config.key_prefix)
    tiers = set(config.tier_names)
    auths = {r["metadata"]["name"] for r in resources if r["kind"] == "TriggerAuthentication"}
    for role in WORKER_ROLES:
        so = _one(resources, "ScaledObject", f"skyline-{role}")
        assert so["spec"]["scaleTargetRef"]["name"] == _one(resources, "Deployment", f"skyline-{role}")["metadata"]["name"]
        stream_triggers = [t for t in so["spec"]["triggers"] if t["type"] == "redis-streams"]
        lag_streams = set()
        for t in stream_triggers:
            md = t["metadata"]
            assert md["consumerGroup"] == Keys.group(role)
            assert md["stream"] in {key for _tier, key in keys.lanes(role, tuple(tiers))}, md["stream"]
            assert t["authenticationRef"]["name"] in auths
            host, port = md["address"].rsplit(":", 1)
            assert host.split(".")[0] == "skyline-redis" and int(port) == 6379
            if "lagCount" in md:
                lag_streams.add(md["stream"])
        # Every tier's queue (and its retry lane) can scale its stage out: a forgotten one would queue unseen.
        assert lag_streams == {key for _tier, key in keys.lanes(role, tuple(tiers))}
    for stage in STAGES:
        assert stage in WORKER_ROLES


def test_prometheus_triggers_query_metrics_the_workers_export(resources):
    queries = [t["metadata"]["query"] for so in resources if so["kind"] == "ScaledObject"
               for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    assert any("skyline_worker_kv_usage" in q for q in queries), "decode must scale on KV load"
    for q in queries:
        names = {n for n in GAUGES if n in q}
        assert names, f"query {q!r} uses no metric the worker endpoint exports ({sorted(GAUGES)})"


def test_trigger_authentication_reads_keys_the_secret_has(resources):
    for auth in (r for r in resources if r["kind"] == "TriggerAuthentication"):
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in _one(resources, "Secret", ref["name"])["stringData"]


def _containers(resources):
    for r in resources:
        if r["kind"] in ("Deployment", "StatefulSet"):
            pod = r["spec"]["template"]
            for c in pod["spec"]["containers"]:
                yield r, pod, c


def test_skyline_command_lines_parse_and_ports_agree(resources):
    parser = build_parser()
    seen = set()
    for workload, pod, c in _containers(resources):
        if c["image"] != "skyline":
            continue
        argv = c["command"][1:] + c.get("args", [])
        args = parser.parse_args(argv)  # exits (SystemExit) on an unknown flag
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        annotations = pod["metadata"].get("annotations", {})
        if args.command == "worker":
            assert args.role == component
            assert ports["metrics"] == args.metrics_port == int(annotations["prometheus.io/port"])
            assert ports["nixl"] == args.nixl_port
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            env = {e["name"]: e for e in c["env"]}
            assert env["SKYLINE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert "kill -TERM 1" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert pod["spec"]["terminationGracePeriodSeconds"] >= 90  # room for the drain
        else:
            assert args.command == component == "gateway"
            assert ports["http"] == args.port == int(annotations["prometheus.io/port"])
            assert pod["spec"]["terminationGracePeriodSeconds"] >= 90  # it relays what the workers drain
        for probe in ("readinessProbe", "livenessProbe"):
            target = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
            if target:
                assert target["port"] in ports, f"{probe} of {component} names an unknown port"
        seen.add(component)
    assert seen == {"gateway", "prefill", "decode"}


def test_services_and_budgets_select_existing_pods(resources):
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in resources
                  if w["kind"] in ("Deployment", "StatefulSet")]

    def selects(selector: dict) -> bool:
        return any(all(labels.get(k) == v for k, v in selector.items()) for labels in pod_labels)

    for r in resources:
        if r["kind"] == "Service":
            assert selects(r["spec"]["selector"]), r["metadata"]["name"]
        if r["kind"] == "PodDisruptionBudget":
            assert selects(r["spec"]["selector"]["matchLabels"]), r["metadata"]["name"]
    assert {r["metadata"]["name"] for r in resources if r["kind"] == "PodDisruptionBudget"} == {
        "skyline-gateway", "skyline-prefill", "skyline-decode"}


def test_the_redis_url_secret_points_at_the_redis_service(resources):
    url = _one(resources, "Secret", "skyline-redis")["stringData"]["url"]
    target = parse_redis_url(url)
    service = _one(resources, "Service", target.hosts[0])
    assert target.nodes[0][1] in {p["port"] for p in service["spec"]["ports"]}


def test_external_redis_overlay_deletes_what_the_base_defines(resources):
    overlay = yaml.safe_load((K8S / "external-redis" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."]
    for p in overlay["patches"]:
        target = yaml.safe_load(p["patch"])
        assert target["$patch"] == "delete"
        _one(resources, target["kind"], target["metadata"]["name"])


# ---- compose -----------------------------------------------------------------------


def test_compose_file_runs_the_fleet_with_real_commands():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "prefill", "decode"}
    parser = build_parser()
    gw = parser.parse_args(services["gateway"]["command"][1:])
    assert gw.command == "gateway" and gw.host == "0.0.0.0"
    assert any(p.endswith(f":{gw.port}") for p in services["gateway"]["ports"])
    url = parse_redis_url(services["gateway"]["environment"]["SKYLINE_REDIS_URL"])
    assert url.hosts == ("redis",)
    for role in WORKER_ROLES:
        svc = services[role]
        args = parser.parse_args(svc["command"][1:])
        assert (args.command, args.role) == ("worker", role)
        assert svc["environment"]["SKYLINE_REDIS_URL"] == services["gateway"]["environment"]["SKYLINE_REDIS_URL"]
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    gpus = [services[r]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for r in WORKER_ROLES]
    assert gpus[0] != gpus[1], "prefill and decode engines need a GPU each"
    # The mounted config is the documented sample, and it loads.
    mount = next(v for v in services["gateway"]["volumes"] if v.endswith(":/etc/skyline/skyline.toml:ro"))
    load_config(ROOT / "deploy" / mount.split(":")[0])
