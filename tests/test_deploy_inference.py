"""deploy/inference-gateway: the Gateway API Inference Extension example over the consumers. Its
core resources (EPP Deployment, Service, RBAC, ConfigMap) validate strictly against the Kubernetes
schemas; the InferencePool (inference.networking.k8s.io/v1) and HTTPRoute are custom resources the
offline validator has no schema for, so their shape is checked here by hand against the consumer
manifest they point at (labels, HTTP port, EPP service and port, the metric names the consumers
publish). The consumer manifest and compose file open the HTTP port."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_deploy import VERSIONS, container, manifests, resource, validate_folder

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / "deploy/inference-gateway"
CUSTOM = {"InferencePool", "HTTPRoute"}


def gateway(kind: str, name: str) -> dict:
    for docs in manifests(GATEWAY).values():
        for doc in docs:
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind}/{name} in deploy/inference-gateway")


@pytest.mark.parametrize("version", VERSIONS)
def test_core_resources_validate_against_kubernetes_schemas(tmp_path, version):
    core = [d for docs in manifests(GATEWAY).values() for d in docs if d["kind"] not in CUSTOM]
    (tmp_path / "core.yaml").write_text(yaml.safe_dump_all(core))
    assert validate_folder(tmp_path, version) == len(core) >= 6


def test_kustomization_lists_every_file():
    listed = yaml.safe_load((GATEWAY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(manifests(GATEWAY))


def test_the_pool_selects_the_consumers_on_their_http_port_and_names_its_picker():
    pool = gateway("InferencePool", "scd-consumers")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    consumer = resource("Deployment", "scd-consumer")["spec"]["template"]
    assert spec["selector"]["matchLabels"] == consumer["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container("scd-consumer")["ports"]}
    env = {e["name"]: e.get("value") for e in container("scd-consumer")["env"]}
    assert [p["number"] for p in spec["targetPorts"]] == [ports["http"]] == [int(env["SCD_CONSUMER_HTTP_PORT"])]
    picker = spec["endpointPickerRef"]
    service = gateway("Service", picker["name"])
    assert picker["port"]["number"] == service["spec"]["ports"][0]["port"] and picker["failureMode"] in ("FailOpen", "FailClose")
    route = gateway("HTTPRoute", "scd-openai")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool", "scd-consumers")


def test_the_picker_scrapes_the_consumers_metrics_port_for_names_they_publish():
    (epp,) = gateway("Deployment", "scd-consumers-epp")["spec"]["template"]["spec"]["containers"]
    args = dict(a[2:].split("=", 1) for a in epp["args"])
    ports = {p["name"]: p["containerPort"] for p in container("scd-consumer")["ports"]}
    assert int(args["model-server-metrics-port"]) == ports["metrics"]
    published = (ROOT / "shared/metrics.py").read_text()
    for flag in ("total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
                 "cache-info-metric"):
        assert f'"{args[flag]}"' in published, flag
    assert args["pool-name"] == "scd-consumers"
    config = yaml.safe_load(gateway("ConfigMap", "scd-consumers-epp")["data"]["config.yaml"])
    assert {p["type"] for p in config["plugins"]} >= {"queue-scorer", "kv-cache-utilization-scorer"}


def test_compose_publishes_the_http_port_and_leaves_kv_events_off_by_default():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("consumer", "consumer-gpu"):
        env = services[name]["environment"]
        assert env["SCD_CONSUMER_HTTP_PORT"] == "8000"
        assert any(str(p).endswith(":8000") for p in services[name]["ports"])
        assert env["SCD_CONSUMER_KV_EVENTS_ENDPOINT"] == "${SCD_KV_EVENTS_ENDPOINT:-}"
