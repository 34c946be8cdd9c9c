"""deploy/: the Kubernetes manifests validate against the Kubernetes schema, and the manifests
and docker-compose.yml agree with the code (commands the CLI accepts, ports, env names it reads)."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kiln.apps.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
STAGES = ("importer", "optimizer", "codegen", "executor")
POOL = {"importer": "cpu", "optimizer": "cpu", "codegen": "gpu", "executor": "gpu"}


def manifests() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def env_names_the_code_reads() -> set[str]:
    names = set()
    for pkg in ("kiln", "importer_svc", "optimizer_svc", "codegen_svc", "executor_svc"):
        for path in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names | {f"KILN_{s.upper()}_ADDR" for s in STAGES}


def check_command(args: list[str], stage: str, port: int) -> None:
    ns = build_parser().parse_args(args)
    assert ns.cmd == "serve" and ns.stage == stage and ns.port == port, args


def check_env(names: set[str]) -> None:
    known = env_names_the_code_reads()
    for n in names:
        assert n in known or n.startswith("OTEL_"), f"{n} is not read by kiln"


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_each_service_has_deployment_headless_service_and_hpa_matching_the_code():
    by_kind = {}
    for d in manifests():
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    for stage in STAGES:
        name = f"kiln-{stage}"
        dep, svc, hpa = by_kind["Deployment"][name], by_kind["Service"][name], by_kind["HorizontalPodAutoscaler"][name]
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        port = c["ports"][0]["containerPort"]
        check_command(c["args"], stage, port)
        env = {e["name"]: e for e in c["env"]}
        check_env(set(env))
        assert env["KILN_HOST"]["value"] == "0.0.0.0"
        assert env["KILN_STORE"]["value"].startswith("s3://")
        # credentials come from a Secret, never from the manifest
        assert "valueFrom" in env["KILN_S3_ACCESS_KEY"] and "valueFrom" in env["KILN_S3_SECRET_KEY"]
        assert pod["nodeSelector"]["kiln.dev/pool"] == POOL[stage]
        assert c["image"].startswith("kiln-cuda" if POOL[stage] == "gpu" else "kiln-cpu")
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port  # grpc.health.v1, which every server serves
        # Prometheus scrapes the port `kiln serve` serves /metrics on
        metrics = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert int(env["KILN_METRICS_PORT"]["value"]) == metrics
        notes = dep["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == metrics
        assert svc["spec"]["clusterIP"] == "None"  # headless: clients balance over the pods
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        assert svc["spec"]["ports"][0]["port"] == port
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        if stage == "optimizer":  # fan-out peers: its own headless Service's DNS name
            assert env["KILN_OPTIMIZER_PEERS"]["value"] == f"dns:///{name}.kiln.svc.cluster.local:{port}"
    assert "kiln-minio" in by_kind["Service"] and "kiln-otel-collector" in by_kind["Service"]


def test_compose_matches_the_code():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"minio", "otel-collector", "jaeger", *STAGES} <= set(services)
    for i, stage in enumerate(STAGES):
        s = services[stage]
        port = 50051 + i
        check_command(s["command"], stage, port)
        check_env(set(s["environment"]))
        assert s["environment"]["KILN_S3_ENDPOINT"] == "http://minio:9000"
        assert any(str(p).endswith(f":{port}") for p in s["ports"])
    assert services["optimizer"]["environment"]["KILN_OPTIMIZER_PEERS"] == "dns:///optimizer:50052"
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / dockerfile).read_text()
        assert "requirements.txt" in text and 'ENTRYPOINT ["python", "-m", "kiln"]' in text


def test_a_replica_list_or_a_dns_name_is_a_client_target():
    from kiln.rpc.client import channel_target
    from kiln.core.errors import InvalidArgument

    assert channel_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("dns:///kiln-optimizer.kiln.svc.cluster.local:50052") == \
        "dns:///kiln-optimizer.kiln.svc.cluster.local:50052"
    with pytest.raises(InvalidArgument, match="DNS name"):
        channel_target("host-a:1,host-b:2")


def test_the_validator_rejects_a_broken_manifest():
    import copy

    dep = next(d for d in manifests() if d["kind"] == "Deployment")
    broken = copy.deepcopy(dep)
    broken["spec"]["replicaz"] = 2  # a typo strict validation catches
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
