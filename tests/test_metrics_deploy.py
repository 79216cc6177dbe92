"""deploy/ and docs/ stay in step with the services' declared metrics: every metric the Grafana
dashboard queries exists, the Prometheus scrape ports are the services' ports, docs/METRICS.md
is what the declarations generate, and the files are package data."""
import json
import re
import tomllib
from pathlib import Path

from trainguard.metrics import series_names
from trainguard.service_metrics import METRICS_PORTS, SERVICES, markdown

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "trainguard.json"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"


def declared_series() -> dict:
    return {service: series_names(declarations())
            for service, (_, _, declarations) in SERVICES.items()}


def dashboard_queries() -> list:
    def walk(panels):
        for panel in panels:
            yield from ((panel["title"], t["expr"]) for t in panel.get("targets", []))
            yield from walk(panel.get("panels", []))
    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def test_every_metric_in_the_dashboard_exists_in_some_service():
    known = set().union(*declared_series().values())
    queries = dashboard_queries()
    assert len(queries) >= 20
    missing = [(title, name) for title, expr in queries
               for name in re.findall(r"\btrainguard_[a-z0-9_]+", expr) if name not in known]
    assert not missing, f"the dashboard queries metrics no service declares: {missing}"


def test_the_dashboard_shows_every_service():
    used = {name for _, expr in dashboard_queries()
            for name in re.findall(r"\btrainguard_[a-z0-9_]+", expr)}
    for service, names in declared_series().items():
        assert used & names, f"no panel of the dashboard shows the {service} metrics"


def test_prometheus_scrapes_each_service_on_its_port():
    text = PROMETHEUS.read_text()
    jobs = dict(re.findall(r"job_name: trainguard-(\w+)\s+static_configs:\s+- targets: "
                           r"\[\"127\.0\.0\.1:(\d+)\"\]", text))
    assert set(jobs) == set(SERVICES)
    for service, port in METRICS_PORTS.items():
        if port:
            assert int(jobs[service]) == port, service


def test_metrics_doc_is_generated_from_the_declarations():
    doc = (REPO / "docs" / "METRICS.md").read_text()
    assert doc == markdown(), ("docs/METRICS.md is stale: "
                               "python -m trainguard.service_metrics > docs/METRICS.md")


def test_deploy_files_are_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["trainguard.deploy"]
    assert {"prometheus/prometheus.yml", "grafana/trainguard.json"} <= set(data)
