"""Deployment files: the Kubernetes manifests in deploy/k8s validate against the offline
Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors) and say what the
operations design needs (headless producer Service, gRPC probes, GPU for the consumer, only
consumers reach producers, Secrets mounted, drain before kill); a broken manifest fails the
same check. The compose file's own `config -q` check is in test_packaging; here its shape."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev dependency kubernetes-validate not installed")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/k8s"
# The oldest Kubernetes the manifests promise to work on (gRPC probes GA 1.27, preStop sleep 1.30)
# and the newest schema the validator ships.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def manifests(folder: Path = K8S) -> dict[str, list[dict]]:
    """Every Kubernetes resource under folder, by file name (kustomization.yaml is kustomize's)."""
    return {
        p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
        for p in sorted(folder.glob("*.yaml"))
        if p.name != "kustomization.yaml"
    }


class InvalidManifest(AssertionError):
    """A resource the schemas reject, named by file, kind and name."""


def validate_folder(folder: Path, version: str) -> int:
    """Validate every resource strictly; InvalidManifest on the first bad one."""
    count = 0
    for name, docs in manifests(folder).items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise InvalidManifest(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}") from exc
            count += 1
    return count


def resource(kind: str, name: str) -> dict:
    for docs in manifests().values():
        for doc in docs:
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind}/{name} in deploy/k8s")


def container(deployment: str) -> dict:
    (only,) = resource("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return only


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c["env"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    assert validate_folder(K8S, version) >= 10


@pytest.mark.parametrize(
    "breakage",
    [
        ("replicas: 2", "replicas: two"),  # wrong type
        ("terminationGracePeriodSeconds: 30", "terminationGracePeriodSecs: 30"),  # unknown field (strict)
        (
            "              port: 50060\n              service: liveness",
            "              service: liveness",
        ),  # grpc probe without port
    ],
)
def test_a_broken_manifest_fails_validation(tmp_path, breakage):
    for p in K8S.glob("*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    text = (tmp_path / "producer.yaml").read_text()
    assert breakage[0] in text
    (tmp_path / "producer.yaml").write_text(text.replace(breakage[0], breakage[1], 1))
    with pytest.raises(InvalidManifest, match="producer.yaml: Deployment/scd-producer") as err:
        validate_folder(tmp_path, VERSIONS[-1])
    assert isinstance(err.value.__cause__, kubernetes_validate.ValidationError)


def test_kustomization_lists_every_manifest_but_the_secret_example():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(set(manifests()) - {"secrets.example.yaml"})


def test_producers_sit_behind_a_headless_service_the_consumer_resolves():
    service = resource("Service", "scd-producer")
    assert service["spec"]["clusterIP"] == "None"
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    port = service["spec"]["ports"][0]["port"]
    assert env(container("scd-consumer"))["SCD_CONSUMER_PRODUCER"] == f"dns:///scd-producer.{namespace}.svc.cluster.local:{port}"
    consumer_service = resource("Service", "scd-consumer")
    assert consumer_service["spec"].get("clusterIP") != "None"


@pytest.mark.parametrize(
    "deployment,service", [("scd-producer", "scd.v1.ProducerService"), ("scd-consumer", "scd.v1.ConsumerService")]
)
def test_native_grpc_probes_readiness_apart_from_liveness(deployment, service):
    c = container(deployment)
    ready, live = c["readinessProbe"]["grpc"], c["livenessProbe"]["grpc"]
    assert ready["service"] == service and live["service"] != service
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ready["port"] == live["port"] == c["startupProbe"]["grpc"]["port"] == ports["health"]


def test_consumer_gets_a_gpu_and_every_container_has_resources():
    assert container("scd-consumer")["resources"]["limits"]["nvidia.com/gpu"] == 1
    for name in ("scd-producer", "scd-consumer"):
        resources = container(name)["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


def test_only_consumers_reach_the_producer_grpc_port():
    policy = resource("NetworkPolicy", "scd-producer-ingress")["spec"]
    producer_labels = resource("Deployment", "scd-producer")["spec"]["template"]["metadata"]["labels"]
    consumer_labels = resource("Deployment", "scd-consumer")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == producer_labels and policy["policyTypes"] == ["Ingress"]
    to_grpc = [rule for rule in policy["ingress"] if {"protocol": "TCP", "port": 50051} in rule["ports"]]
    assert [rule["from"] for rule in to_grpc] == [[{"podSelector": {"matchLabels": consumer_labels}}]]


@pytest.mark.parametrize(
    "deployment,secret_paths",
    [
        ("scd-producer", {"/etc/scd/tls": "scd-producer-tls"}),
        ("scd-consumer", {"/etc/scd/tls": "scd-consumer-tls", "/etc/scd/auth": "scd-consumer-token"}),
    ],
)
def test_tls_and_token_secrets_are_mounted_where_the_env_points(deployment, secret_paths):
    pod = resource("Deployment", deployment)["spec"]["template"]["spec"]
    c = container(deployment)
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounted = {m["mountPath"]: secrets[m["name"]] for m in c["volumeMounts"] if m["name"] in secrets}
    assert mounted == secret_paths
    assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"] in secrets)
    file_env = [v for k, v in env(c).items() if re.search(r"_(TLS_\w+|TOKEN_FILE)$", k)]
    assert file_env and all(any(v.startswith(path + "/") for path in secret_paths) for v in file_env)
    example = {d["metadata"]["name"]: set(d["stringData"]) for d in manifests()["secrets.example.yaml"]}
    for value in file_env:
        directory, key = value.rsplit("/", 1)
        assert key in example[secret_paths[directory]], value


@pytest.mark.parametrize("deployment", ["scd-producer", "scd-consumer"])
def test_pods_run_as_non_root_and_drain_before_kill(deployment):
    pod = resource("Deployment", deployment)["spec"]["template"]["spec"]
    c = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    drain = float(next(v for k, v in env(c).items() if k.endswith("_DRAIN_GRACE_S")))
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > drain + pause
    # service links would put SCD_<SERVICE>_PORT=tcp://... (and _SERVICE_HOST...) in the pod's environment
    assert pod["enableServiceLinks"] is False


def test_compose_runs_producer_replicas_behind_a_dns_target_with_limits_and_a_gpu_profile():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert re.fullmatch(r"\$\{SCD_PRODUCERS:-2\}", str(services["producer"]["deploy"]["replicas"]))
    assert services["consumer"]["environment"]["SCD_CONSUMER_PRODUCER"] == "dns:///producer:50051"
    for name in ("producer", "consumer"):
        assert services[name]["deploy"]["resources"]["limits"]["memory"]
        assert services[name]["healthcheck"]["test"][1:4] == ["python", "-m", "shared.healthcheck"]
    gpu = services["consumer-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert gpu["build"]["args"]["USE_WHEELHOUSE"] == "no"


@pytest.mark.parametrize("dockerfile", ["producer", "consumer"])
def test_images_run_as_non_root_keep_the_base_image_arg_and_use_only_runtime_pins(dockerfile):
    text = (ROOT / f"docker/{dockerfile}.Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER 10001", final_stage, re.M)
    assert "--no-index --find-links /wheels" in text and "[dev]" not in text
    assert f'ENTRYPOINT ["python", "-m", "{dockerfile}"]' in final_stage
