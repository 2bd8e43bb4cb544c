"""deploy/grafana and deploy/prometheus.yml cannot drift from the code: every metric a Grafana
panel queries is exported by some registry, and the scrape targets are the ports `skyline up` uses."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml
from prometheus_client import CollectorRegistry

from skyline.core.config import SkylineConfig
from skyline.core.fleet import WorkerInfo
from skyline.gateway.metrics import GatewayMetrics
from skyline.tools.launcher import METRICS_PORT_BASE, plan_workers
from skyline.workers.endpoint import WorkerEndpoint
from skyline.workers.observe import WorkerMetrics

DEPLOY = Path(__file__).parents[1] / "deploy"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("_count", "_sum"), "unknown": ("",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry can export, children or not."""
    names = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def all_exported() -> set[str]:
    gateway = GatewayMetrics()
    gateway.watch_timeline(lambda: 0)
    info = WorkerInfo("w", "decode", "sim", "m", "h", 1, 0, 0, 0.0, 0.0, 0.0)
    runtime = SimpleNamespace(role="decode", worker_id="w", info=info, counters={"completed": 0}, stopping=None)
    endpoint = WorkerEndpoint(runtime, "127.0.0.1")
    worker = WorkerMetrics()
    worker.watch_timeline(SimpleNamespace(errors=0))
    return exported_names(gateway.registry) | exported_names(endpoint.registry) | exported_names(worker.registry)


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    dash = json.loads((DEPLOY / "grafana" / "skyline.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    queried = {name for e in exprs for name in re.findall(r"\bskyline_[a-z0-9_]+", e)}
    exported = all_exported()
    assert queried - exported == set(), f"the dashboard queries metrics no code exports: {queried - exported}"
    # And the dashboard covers what the issue asks for.
    for needed in ("skyline_gateway_ttft_seconds_bucket", "skyline_gateway_tpot_seconds_bucket",
                   "skyline_gateway_itl_seconds_bucket", "skyline_gateway_e2e_seconds_bucket",
                   "skyline_gateway_slo_met_total", "skyline_gateway_slo_missed_total", "skyline_queue_waiting",
                   "skyline_queue_pending", "skyline_worker_preemptions_total", "skyline_worker_migrations_total",
                   "skyline_worker_reclaims_total", "skyline_worker_dead_letters_total",
                   "skyline_worker_kv_transfer_seconds_bucket", "skyline_worker_kv_usage", "skyline_worker_running"):
        assert needed in queried, needed


def test_the_grafana_dashboard_shows_the_models_chosen_in_its_model_selector():
    """Several models through one gateway: every series of a model's (every metric but the fleet-wide ones)
    is filtered by the dashboard's `model` variable, whose values are the models the fleet serves."""
    dash = json.loads((DEPLOY / "grafana" / "skyline.json").read_text())
    model = next(v for v in dash["templating"]["list"] if v["name"] == "model")
    assert model["query"] == "label_values(skyline_fleet_workers, model)" and model["includeAll"] and model["multi"]
    fleet_wide = {"skyline_dead_letter_length", "skyline_timeline_write_errors_total"}  # no model label
    for expr in (t["expr"] for p in dash["panels"] for t in p.get("targets", [])):
        for name, selector in re.findall(r"\b(skyline_[a-z0-9_]+)(\{[^}]*\})?", expr):
            if name not in fleet_wide:
                assert 'model=~"$model"' in selector, (name, expr)


def test_metric_names_follow_one_style():
    for name in all_exported():
        assert re.fullmatch(r"skyline_(gateway|worker|queue|fleet|dead_letter|timeline)_?[a-z0-9_]*", name), name


def test_prometheus_scrapes_the_ports_skyline_up_assigns():
    conf = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in conf["scrape_configs"]}
    assert jobs["skyline-gateway"] == [f"127.0.0.1:{SkylineConfig().gateway.port}"]
    cfg = SkylineConfig()
    for n_prefill, n_decode in ((1, 1), (2, 2), (1, 3)):
        plan = plan_workers(cfg, n_prefill, n_decode)
        ports = [int(args[args.index("--metrics-port") + 1]) for _name, args in plan]
        assert len(set(ports)) == len(ports) and ports[0] == METRICS_PORT_BASE
        assert {f"127.0.0.1:{p}" for p in ports} <= set(jobs["skyline-workers"])
    assert all("--metrics-port" not in args for _n, args in plan_workers(cfg, 1, 1, metrics_port_base=0))
