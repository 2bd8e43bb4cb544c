"""deploy/kubernetes/, deploy/compose.yaml and the Procfiles, validated offline.

Both Kubernetes layouts (elastic/, the default, and fixed-pools/, over base/) are
checked: objects against the API's JSON schemas (`kubernetes-validate`, which
ships them), KEDA objects against a vendored minimal schema
(tests/schemas/keda-v1alpha1.json), and both against the code: stream and group
names come from skyline/core/keys.py and the stages of each worker role from
scheduler/elastic.py, metric names from the worker endpoint, every command line
parses with the `skyline` CLI, every option in the ConfigMap loads, ports and
probes agree. Where kubectl is on PATH, `kubectl kustomize` builds every layout
and overlay (it is not installed by the Makefile: without it that test skips). A
rename in the code fails here instead of in a cluster.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from skyline.scheduler.elastic import STAGES_OF_ROLE
from skyline.tools import launcher
from skyline.workers.endpoint import GAUGES

from skyline.cli import build_parser
from skyline.core.config import load_config
from skyline.core.keys import STAGES, Keys
from skyline.core.redisconn import parse_redis_url

ROOT = Path(__file__).parents[1]
K8S = ROOT / "deploy" / "kubernetes"
# Each layout's workers: the Deployment skyline-<role> runs `skyline worker <role>`.
LAYOUTS = {"elastic": ("elastic",), "fixed-pools": ("prefill", "decode")}
DEFAULT_LAYOUT = "elastic"  # as `skyline up`'s default fleet (launcher.resolve_pools)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _build(folder: Path) -> list[dict]:
    """What a kustomization holds: its resources (files, or folders built the same way) less what its
    `$patch: delete` patches remove. Namespace, labels and images: `kubectl kustomize` (below)."""
    k = _kustomization(folder)
    out: list[dict] = []
    for name in k.get("resources", []):
        path = (folder / name).resolve()
        out += _build(path) if path.is_dir() else _docs(path)
    for p in k.get("patches", []):
        patch = yaml.safe_load(p["patch"])
        assert patch.pop("$patch") == "delete", "only delete patches are modelled here"
        key = (patch["kind"], patch["metadata"]["name"])
        assert key in {(r["kind"], r["metadata"]["name"]) for r in out}, f"{folder.name} deletes a missing {key}"
        out = [r for r in out if (r["kind"], r["metadata"]["name"]) != key]
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def resources(layout) -> list[dict]:
    return _build(K8S / layout)


def _one(resources, kind: str, name: str) -> dict:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The ConfigMap's skyline.toml, loaded by the real config loader (unknown options fail)."""
    path = tmp_path_factory.mktemp("cm") / "skyline.toml"
    path.write_text(_one(_build(K8S / "base"), "ConfigMap", "skyline-config")["data"]["skyline.toml"])
    return load_config(path)


def test_the_default_is_the_elastic_layout_as_skyline_ups_default_fleet():
    assert _kustomization(K8S)["resources"] == [DEFAULT_LAYOUT]
    fleet = argparse.Namespace(elastic=None, prefill=None, decode=None)
    launcher.resolve_pools(fleet)
    assert (fleet.elastic, fleet.prefill, fleet.decode) == (launcher.DEFAULT_ELASTIC, 0, 0)
    assert LAYOUTS[DEFAULT_LAYOUT] == ("elastic",)
    workers = [r for r in _build(K8S) if r["kind"] == "Deployment" and r["metadata"]["name"] != "skyline-gateway"]
    assert [w["metadata"]["name"] for w in workers] == ["skyline-elastic"]
    assert workers[0]["spec"]["replicas"] == launcher.DEFAULT_ELASTIC
    so = _one(_build(K8S), "ScaledObject", "skyline-elastic")
    assert so["spec"]["minReplicaCount"] == launcher.DEFAULT_ELASTIC


def test_kustomizations_list_every_manifest():
    # Nothing but the default's kustomization at the top: every manifest belongs to base/ or a layout.
    assert {p.name for p in K8S.glob("*.yaml")} == {"kustomization.yaml"}
    folders = {p.parent.name for p in K8S.glob("*/kustomization.yaml")}
    assert folders == {"base", "external-redis", *LAYOUTS}
    for name in ("base", *LAYOUTS):
        k = _kustomization(K8S / name)
        files = [r for r in k["resources"] if not (K8S / name / r).is_dir()]
        on_disk = {p.name for p in (K8S / name).glob("*.yaml")} - {"kustomization.yaml"}
        assert set(files) == on_disk, name
    for name in LAYOUTS:  # each layout is the base and its workers, named, labelled and imaged alike
        k = _kustomization(K8S / name)
        assert k["resources"][0] == "../base"
        assert {f: k[f] for f in ("namespace", "labels", "images")} == {
            f: _kustomization(K8S / DEFAULT_LAYOUT)[f] for f in ("namespace", "labels", "images")}
    base = {(r["kind"], r["metadata"]["name"]) for r in _build(K8S / "base")}
    for name, roles in LAYOUTS.items():
        workers = {(r["kind"], r["metadata"]["name"]) for r in _build(K8S / name)} - base
        assert workers == {(kind, f"skyline-{role}") for role in roles
                           for kind in ("Deployment", "ScaledObject", "PodDisruptionBudget")}, name


def test_kubernetes_objects_match_the_api_schemas(resources):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    core = [r for r in resources if not r["apiVersion"].startswith("keda.sh/")]
    assert {r["kind"] for r in core} >= {"Namespace", "ConfigMap", "Secret", "StatefulSet", "Service", "Deployment",
                                         "PodDisruptionBudget"}
    for r in core:
        # strict: unknown fields (a typo the API server would silently drop) are errors too.
        kubernetes_validate.validate(r, version, strict=True)


def test_keda_objects_match_the_vendored_schema(resources, layout):
    schema = json.loads((ROOT / "tests" / "schemas" / "keda-v1alpha1.json").read_text())
    keda = [r for r in resources if r["apiVersion"].startswith("keda.sh/")]
    assert {r["kind"] for r in keda} == {"ScaledObject", "TriggerAuthentication"}
    for r in keda:
        jsonschema.validate(r, schema)
    bad = _one(resources, "ScaledObject", f"skyline-{LAYOUTS[layout][0]}") | {}
    bad = {**bad, "spec": {**bad["spec"], "minReplicas": 1}}  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_scaled_objects_target_the_worker_deployments_with_streams_from_the_key_module(resources, layout, config):
    keys = Keys(config.key_prefix)
    tiers = tuple(config.tier_names)
    auths = {r["metadata"]["name"] for r in resources if r["kind"] == "TriggerAuthentication"}
    assert {so["metadata"]["name"] for so in resources if so["kind"] == "ScaledObject"} == {
        f"skyline-{role}" for role in LAYOUTS[layout]}
    for role in LAYOUTS[layout]:
        so = _one(resources, "ScaledObject", f"skyline-{role}")
        assert so["spec"]["scaleTargetRef"]["name"] == _one(resources, "Deployment", f"skyline-{role}")["metadata"]["name"]
        # The stages this role consumes (an elastic worker: both), as the worker itself reads them.
        stages = STAGES_OF_ROLE[role]
        assert set(stages) <= set(STAGES)
        stage_of = {key: stage for stage in stages for _tier, key in keys.lanes(stage, tiers)}
        stream_triggers = [t for t in so["spec"]["triggers"] if t["type"] == "redis-streams"]
        lag_streams = set()
        for t in stream_triggers:
            md = t["metadata"]
            assert md["stream"] in stage_of, f"{role} scales on {md['stream']}, a stream it does not read"
            assert md["consumerGroup"] == Keys.group(stage_of[md["stream"]])
            assert t["authenticationRef"]["name"] in auths
            host, port = md["address"].rsplit(":", 1)
            assert host.split(".")[0] == "skyline-redis" and int(port) == 6379
            if "lagCount" in md:
                lag_streams.add(md["stream"])
        # Every tier's queue (and its retry lane) of every stage it reads can scale it out: a forgotten
        # one would queue unseen.
        assert lag_streams == set(stage_of), f"{role}: no lag trigger on {sorted(set(stage_of) - lag_streams)}"


def test_prometheus_triggers_query_metrics_of_the_role_they_scale(resources, layout, config):
    for role in LAYOUTS[layout]:
        so = _one(resources, "ScaledObject", f"skyline-{role}")
        queries = {t["metadata"]["query"]: t["metadata"]["threshold"] for t in so["spec"]["triggers"]
                   if t["type"] == "prometheus"}
        if "decode" in STAGES_OF_ROLE[role]:
            assert any("skyline_worker_kv_usage" in q for q in queries), f"{role} decodes: it must scale on KV load"
        for q, threshold in queries.items():
            names = {n for n in GAUGES if n in q}
            assert names, f"query {q!r} uses no metric the worker endpoint exports ({sorted(GAUGES)})"
            assert re.findall(r'role="([a-z]+)"', q) == [role], f"{q!r} must read the {role} workers alone"
            if "skyline_worker_running" in q:  # scale out before every pod's sequences are taken
                assert float(threshold) < config.worker.max_running


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


def test_skyline_command_lines_parse_and_ports_agree(resources, layout):
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
            assert workload["metadata"]["name"] == f"skyline-{args.role}"
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
    assert seen == {"gateway", *LAYOUTS[layout]}


def test_services_and_budgets_select_existing_pods(resources, layout):
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
        "skyline-gateway", *(f"skyline-{role}" for role in LAYOUTS[layout])}


def test_the_redis_url_secret_points_at_the_redis_service(resources):
    url = _one(resources, "Secret", "skyline-redis")["stringData"]["url"]
    target = parse_redis_url(url)
    service = _one(resources, "Service", target.hosts[0])
    assert target.nodes[0][1] in {p["port"] for p in service["spec"]["ports"]}


def test_external_redis_overlay_deletes_what_the_base_defines():
    overlay = _kustomization(K8S / "external-redis")
    assert overlay["resources"] == [f"../{DEFAULT_LAYOUT}"]
    built = _build(K8S / "external-redis")  # each delete must find its object (_build checks)
    assert not [r for r in built if r["metadata"]["name"] == "skyline-redis" and r["kind"] != "Secret"
                and r["kind"] != "TriggerAuthentication"]
    assert len(overlay["patches"]) == 2


def _kustomize(folder: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (make does not install it)")
def test_kubectl_kustomize_builds_every_layout_and_overlay(tmp_path):
    # The fixed pools with a Redis of one's own, as external-redis/kustomization.yaml says: one word changed.
    shutil.copytree(K8S, tmp_path / "kubernetes")
    swapped = tmp_path / "kubernetes" / "external-redis" / "kustomization.yaml"
    text = swapped.read_text()
    assert f"change `../{DEFAULT_LAYOUT}` below to `../fixed-pools`" in text
    swapped.write_text(text.replace(f"  - ../{DEFAULT_LAYOUT}\n", "  - ../fixed-pools\n"))
    image = _kustomization(K8S / DEFAULT_LAYOUT)["images"][0]
    for folder in (K8S, *(K8S / name for name in LAYOUTS), K8S / "external-redis", swapped.parent):
        built = _kustomize(folder)
        ours = _build(folder)
        assert sorted((r["kind"], r["metadata"]["name"]) for r in built) == sorted(
            (r["kind"], r["metadata"]["name"]) for r in ours), folder
        for r in built:
            assert r["metadata"]["labels"]["app.kubernetes.io/part-of"] == "skyline"
            if r["kind"] != "Namespace":
                assert r["metadata"]["namespace"] == "skyline", (folder, r["metadata"]["name"])
        for _w, _pod, c in _containers(built):
            if c["name"] != "redis":
                assert c["image"] == f"{image['newName']}:{image['newTag']}"
    assert {r["metadata"]["name"] for r in _kustomize(swapped.parent) if r["kind"] == "Deployment"} == {
        "skyline-gateway", "skyline-prefill", "skyline-decode"}


# ---- compose -----------------------------------------------------------------------

COMPOSE = ROOT / "deploy" / "compose.yaml"
FIXED_POOLS_PROFILE = "fixed-pools"


def _gpu(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["capabilities"] == ["gpu"]
    return devices[0]["device_ids"]


def test_compose_file_runs_the_fleet_with_real_commands():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    parser = build_parser()
    gw = parser.parse_args(services["gateway"]["command"][1:])
    assert gw.command == "gateway" and gw.host == "0.0.0.0"
    assert any(p.endswith(f":{gw.port}") for p in services["gateway"]["ports"])
    url = parse_redis_url(services["gateway"]["environment"]["SKYLINE_REDIS_URL"])
    assert url.hosts == ("redis",)
    roles = {}
    for name, svc in services.items():
        if name in ("redis", "gateway"):
            assert "profiles" not in svc
            continue
        args = parser.parse_args(svc["command"][1:])
        assert args.command == "worker" and name.split("-")[0] == args.role
        roles[name] = args.role
        assert svc["environment"]["SKYLINE_REDIS_URL"] == services["gateway"]["environment"]["SKYLINE_REDIS_URL"]
        assert svc["environment"]["UCX_TLS"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["ipc"] == "host" and svc["stop_grace_period"]
    # `docker compose up`: the default fleet, as `skyline up` starts it (two elastic workers).
    default = sorted(n for n in roles if "profiles" not in services[n])
    assert default == [f"elastic-{i}" for i in range(launcher.DEFAULT_ELASTIC)]
    # The fixed pools only when named: one prefill and one decode worker, as `skyline up --prefill 1 --decode 1`.
    fixed = sorted(n for n in roles if n not in default)
    assert sorted(roles[n] for n in fixed) == ["decode", "prefill"]
    assert all(services[n]["profiles"] == [FIXED_POOLS_PROFILE] for n in fixed)
    for fleet in (default, fixed):
        gpus = [tuple(_gpu(services[n])) for n in fleet]
        assert len(set(gpus)) == len(gpus), f"{fleet}: each engine needs a GPU of its own"
    # The documented command for the fixed pools names exactly them and what they need.
    named = re.search(r"docker compose -f deploy/compose.yaml up ([a-z -]+)\n", COMPOSE.read_text()).group(1).split()
    assert sorted(named) == sorted(["redis", "gateway", *fixed])
    # The mounted config is the documented sample, and it loads.
    mount = next(v for v in services["gateway"]["volumes"] if v.endswith(":/etc/skyline/skyline.toml:ro"))
    load_config(ROOT / "deploy" / mount.split(":")[0])


# ---- Procfiles ----------------------------------------------------------------------


def _procfile(path: Path) -> dict[str, list[str]]:
    procs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, command = line.split(":", 1)
            assert re.fullmatch(r"[A-Za-z0-9_-]+", name), f"{name!r}: not a Procfile process name"
            procs[name] = command.split()
    return procs


@pytest.mark.parametrize("name, pools", [("Procfile", {}), ("Procfile.fixed-pools", {"prefill": 1, "decode": 1})])
def test_procfiles_start_the_fleet_skyline_up_starts(name, pools, monkeypatch):
    procs = _procfile(ROOT / "deploy" / name)
    parser = build_parser()
    assert set(procs) >= {"redis", "gateway"}
    assert parser.parse_args(procs["gateway"][1:]).command == "gateway"
    fleet = argparse.Namespace(elastic=None, prefill=pools.get("prefill"), decode=pools.get("decode"))
    launcher.resolve_pools(fleet)
    # `skyline up`'s plan on a two-core machine: names, roles, cores and metrics ports, in its order.
    monkeypatch.setattr(launcher, "_cores", lambda: [0, 1])
    cfg = load_config(None, {"engine": {"kind": "vllm"}, "gateway": {"mode": "disagg"}})  # as the Procfiles run
    plan = launcher.plan_workers(cfg, fleet.prefill, fleet.decode, launcher.METRICS_PORT_BASE,
                                 fleet.elastic)
    workers = {n: argv for n, argv in procs.items() if n not in ("redis", "gateway")}
    assert len(workers) == len(plan)
    nixl_ports = set()
    for (proc, argv), (planned, extra) in zip(workers.items(), plan):
        assert argv[0].endswith("/skyline") and argv[1] == "worker"
        args = parser.parse_args(argv[1:])
        want = parser.parse_args(["worker", *extra])
        assert proc in (planned, planned.rsplit("-", 1)[0])  # elastic-0 ..., or the pool's name
        assert (args.role, args.cpu_bind, args.metrics_port) == (want.role, want.cpu_bind, want.metrics_port)
        nixl_ports.add(args.nixl_port)
    assert len(nixl_ports) == len(workers) and None not in nixl_ports
