"""The Kubernetes manifests under deploy/kubernetes/, checked offline: every built-in
resource against the Kubernetes OpenAPI schemas (JSON Schema, strict: an unknown
field fails) shipped by the ``kubernetes-validate`` package; the ServiceMonitor,
whose CRD schema no PyPI package ships, against the Kubernetes definitions of what
it embeds and the Prometheus Operator's field names; the references between the
objects; and the gateway's ConfigMap through ``pd-orchestrator check-config``."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest
from referencing import Registry, Resource

from pd_orchestrator.children import python_command
from pd_orchestrator.cli.main import build_parser
from pd_orchestrator.cli.sidecar import sidecar_config
from pd_orchestrator.config.settings import LifecycleConfig
from pd_orchestrator.telemetry.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.30", "1.37")  # the oldest Kubernetes these manifests are for, the newest schemas
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
Doc = dict[str, Any]


def _documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> Iterator[tuple[Path, Doc]]:
    for directory in sorted(p.parent for p in KUBE.glob("*/kustomization.yaml")):
        for path in sorted(directory.glob("*.yaml")):
            if path.name != "kustomization.yaml":
                for doc in _documents(path):
                    yield path, doc


MANIFESTS = list(_manifests())


def _id(item: tuple[Path, Doc]) -> str:
    path, doc = item
    return f"{path.parent.name}/{path.name}:{doc['kind']}/{doc['metadata']['name']}"


def _find(kind: str, name: str, directory: str) -> Doc:
    return next(
        doc
        for path, doc in MANIFESTS
        if path.parent.name == directory and doc["kind"] == kind and doc["metadata"]["name"] == name
    )


def _pod(workload: Doc) -> Doc:
    return dict(workload["spec"]["template"]["spec"])


def _containers(workload: Doc) -> list[Doc]:
    pod = _pod(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _ours(workload: Doc) -> list[Doc]:
    return [c for c in _containers(workload) if c["image"].split(":")[0] == "pd-orchestrator"]


# -- schemas ----------------------------------------------------------------------------------
BUILT_IN = [item for item in MANIFESTS if (item[1]["apiVersion"], item[1]["kind"]) not in CRDS]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", BUILT_IN, ids=_id)
def test_every_resource_validates_against_the_kubernetes_schema(
    item: tuple[Path, Doc], version: str
) -> None:
    kubernetes_validate.validate(item[1], version, strict=True)


def test_the_schemas_catch_a_misspelt_field() -> None:
    deployment = copy.deepcopy(_find("Deployment", "pd-orchestrator", "gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_every_kind_is_covered() -> None:
    kinds = {doc["kind"] for _, doc in MANIFESTS}
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
        "ServiceMonitor",
        "StatefulSet",
    }


# -- the ServiceMonitor -----------------------------------------------------------------------
def _check_embedded(value: Any, schema: str, version: str) -> None:
    """Validate ``value`` against one schema file of kubernetes-validate (strict),
    resolving its references the way the package does."""
    files = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    folder = files / f"v{version}.0-local-strict"
    contents = json.loads((folder / schema).read_text())
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(contents) @ Registry())
    jsonschema.Draft202012Validator(contents, registry=registry).validate(value)


# Field names of the ServiceMonitor spec and of one endpoint, from the Prometheus
# Operator's API reference (monitoring.coreos.com/v1); no PyPI package ships the
# CRD's openAPIV3Schema, so the names used here are held against this list.
SERVICE_MONITOR_SPEC = {"endpoints", "selector", "namespaceSelector", "jobLabel", "targetLabels"}
SERVICE_MONITOR_ENDPOINT = {
    "port",
    "targetPort",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "relabelings",
    "metricRelabelings",
}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_service_monitor_scrapes_the_gateway_service(version: str) -> None:
    monitor = _find("ServiceMonitor", "pd-orchestrator", "gateway")
    _check_embedded(monitor["metadata"], "objectmeta-meta-v1.json", version)
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_SPEC
    _check_embedded(spec["selector"], "labelselector-meta-v1.json", version)
    service = _find("Service", "pd-orchestrator", "gateway")
    labels = service["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])


# -- kustomizations ---------------------------------------------------------------------------
@pytest.mark.parametrize("directory", ["gateway", "sidecar"])
def test_each_kustomization_lists_every_manifest_of_its_folder(directory: str) -> None:
    folder = KUBE / directory
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    files = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    images = {image["name"] for image in kustomization["images"]}
    used = set()
    for path, doc in MANIFESTS:
        if path.parent == folder and "template" in doc.get("spec", {}):
            used |= {c["image"] for c in _containers(doc)}
    assert used <= images


# -- references between objects ---------------------------------------------------------------
WORKLOADS = [item for item in MANIFESTS if item[1]["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("item", WORKLOADS, ids=_id)
def test_workloads_select_their_pods_and_probe_named_ports(item: tuple[Path, Doc]) -> None:
    workload = item[1]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for container in _containers(workload):
        ports = {port["name"] for port in container.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in ports, (container["name"], probe)
        mounts = {m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"] for v in _pod(workload).get("volumes", [])}
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        assert mounts <= volumes | claims


@pytest.mark.parametrize("item", [i for i in MANIFESTS if i[1]["kind"] == "Service"], ids=_id)
def test_every_service_reaches_named_ports_of_a_workload(item: tuple[Path, Doc]) -> None:
    path, service = item
    selector = service["spec"]["selector"]
    targets = [
        doc
        for p, doc in WORKLOADS
        if p.parent == path.parent
        and selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(targets) == 1, "a Service selects the pods of exactly one workload"
    names = {port["name"] for c in _containers(targets[0]) for port in c.get("ports", [])}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= names


def test_the_hpa_and_the_pdb_point_at_the_gateway() -> None:
    deployment = _find("Deployment", "pd-orchestrator", "gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa = _find("HorizontalPodAutoscaler", "pd-orchestrator", "gateway")["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "pd-orchestrator")
    assert hpa["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["maxReplicas"]
    pdb = _find("PodDisruptionBudget", "pd-orchestrator", "gateway")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] < hpa["minReplicas"]


def test_the_hpa_scales_on_a_metric_the_gateway_exports() -> None:
    hpa = _find("HorizontalPodAutoscaler", "pd-orchestrator", "gateway")["spec"]
    (pods,) = [m["pods"] for m in hpa["metrics"] if m["type"] == "Pods"]
    name = pods["metric"]["name"]
    rules = yaml.safe_load((KUBE / "prometheus-adapter-rules.yaml").read_text())["rules"]
    assert [rule["name"]["as"] for rule in rules] == [name]
    assert name in rules[0]["seriesQuery"]
    exported = generate_latest(GatewayMetrics().registry).decode()
    assert re.search(rf"^# TYPE {name} gauge$", exported, re.MULTILINE)


# -- the gateway's pods -----------------------------------------------------------------------
def _gateway_config() -> Doc:
    configmap = _find("ConfigMap", "pd-orchestrator-config", "gateway")
    return dict(yaml.safe_load(configmap["data"]["config.yaml"]))


def test_the_gateway_reads_its_config_from_the_config_map() -> None:
    deployment = _find("Deployment", "pd-orchestrator", "gateway")
    (container,) = _ours(deployment)
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in _pod(deployment)["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == "pd-orchestrator-config"
    assert Path(args.config) == Path(mount["mountPath"]) / "config.yaml"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listen = {"host": "0.0.0.0", "port": ports["http"], "probe_port": ports["probe"]}
    assert _gateway_config()["listen"] == listen


def test_the_gateway_is_probed_on_its_probe_port_which_no_service_exposes() -> None:
    """Clients holding the connection cap of the main port cannot fail the probes
    (and get the gateway restarted): the probes go to ``listen.probe_port``, which
    the Service does not route clients to."""
    deployment = _find("Deployment", "pd-orchestrator", "gateway")
    (container,) = _ours(deployment)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "probe", probe
    service = _find("Service", "pd-orchestrator", "gateway")
    assert all(p["targetPort"] != "probe" for p in service["spec"]["ports"])


def test_the_config_map_passes_check_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_gateway_config()))
    result = subprocess.run(
        python_command("check-config", str(path)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    for pool in _gateway_config()["pools"]:
        for endpoint in pool["endpoints"]:
            assert endpoint["name"] in result.stdout


def test_every_endpoint_of_the_config_is_a_pod_of_a_statefulset() -> None:
    for pool in _gateway_config()["pools"]:
        for endpoint in pool["endpoints"]:
            url = urlsplit(endpoint["url"])
            pod, service_name = (url.hostname or "").split(".")
            name, _, ordinal = pod.rpartition("-")
            statefulset = _find("StatefulSet", name, "gateway")
            assert statefulset["spec"]["serviceName"] == service_name
            assert int(ordinal) < statefulset["spec"]["replicas"], endpoint
            service = _find("Service", service_name, "gateway")
            assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names
            http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
            assert url.port == http["port"]
            assert endpoint["name"] == pod


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def test_the_precise_index_matches_how_the_servers_hash_and_publish() -> None:
    precise = _gateway_config()["prefix"]["precise"]
    events = precise["events"]
    for name in ("vllm-decode", "vllm-prefill"):
        (vllm,) = _containers(_find("StatefulSet", name, "gateway"))
        flags = _flags(vllm["args"])
        assert int(flags["block-size"]) == precise["block_size"]
        assert flags["prefix-caching-hash-algo"] == precise["hash_algo"]
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["PYTHONHASHSEED"] == precise["hash_seed"]
        published = json.loads(flags["kv-events-config"])
        ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
        for key, template in (
            ("endpoint", events["publisher"]),
            ("replay_endpoint", events["replay"]),
        ):
            port = int(template.rsplit(":", 1)[1])
            assert published[key] == f"tcp://*:{port}"
            assert port in ports.values()
        json.loads(flags["kv-transfer-config"])


def test_every_vllm_server_reports_its_cached_tokens() -> None:
    """Without ``--enable-prompt-tokens-details`` vLLM's answers do not say what the
    prompt had cached, and ``goodput`` cannot learn its local prefill rate."""
    servers = [
        (path.name, container)
        for path, doc in MANIFESTS
        if doc["kind"] in ("StatefulSet", "Deployment")
        for container in _containers(doc)
        if container.get("command") == ["vllm", "serve"]
    ]
    assert len(servers) == 4
    for name, container in servers:
        assert "--enable-prompt-tokens-details" in container["args"], name


def test_the_prefill_pool_spills_as_its_servers_can() -> None:
    """The shipped prefill pool serves whole requests when its decoders are crowded
    (``spill``), which a server takes only with a connector role that also consumes
    (``kv_both``): every prefill server runs it."""
    (prefill,) = (p for p in _gateway_config()["pools"] if p["role"] == "prefill")
    assert prefill["spill"] is True
    servers = [
        container
        for path, doc in MANIFESTS
        if path.name == "vllm-prefill.yaml" and doc["kind"] == "StatefulSet"
        for container in _containers(doc)
        if container.get("command") == ["vllm", "serve"]
    ]
    assert servers
    for container in servers:
        flags = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
        (flag,) = flags
        assert json.loads(flag.split("=", 1)[1])["kv_role"] == "kv_both"


def test_the_grace_period_covers_the_drain() -> None:
    deployment = _find("Deployment", "pd-orchestrator", "gateway")
    pod = _pod(deployment)
    (container,) = _ours(deployment)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep = int(command[1])
    readiness = container["readinessProbe"]
    assert sleep >= readiness["periodSeconds"] * readiness["failureThreshold"]
    lifecycle = _gateway_config().get("lifecycle", {})
    drain = lifecycle.get("drain_seconds", LifecycleConfig().drain_seconds)
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain


@pytest.mark.parametrize("item", WORKLOADS, ids=_id)
def test_our_containers_run_unprivileged_on_a_read_only_root(item: tuple[Path, Doc]) -> None:
    workload = item[1]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    uid = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)[-1]
    for container in _ours(workload):
        context = {**_pod(workload).get("securityContext", {}), **container["securityContext"]}
        assert context["runAsNonRoot"] is True
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == uid
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_the_sidecar_takes_llm_d_flags() -> None:
    deployment = _find("Deployment", "vllm-decode", "sidecar")
    (sidecar,) = _ours(deployment)
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before vLLM
    args = sidecar["args"]
    assert args[0] == "sidecar"
    flags = _flags(args[1:])
    assert set(flags) == {
        "port",
        "vllm-port",
        "connector",
        "enable-ssrf-protection",
        "secure-proxy",
    }
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    assert int(_flags(vllm["args"])["port"]) == int(flags["vllm-port"])
    assert int(flags["port"]) == sidecar["ports"][0]["containerPort"]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "sidecar"


def test_the_sidecar_starts_from_the_manifest_with_its_mounted_allow_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = _find("Deployment", "vllm-decode", "sidecar")
    (sidecar,) = _ours(deployment)
    env = {item["name"]: item["value"] for item in sidecar["env"]}
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "allowlist")
    allowlist = _find("ConfigMap", "pd-orchestrator-sidecar-allowlist", "sidecar")
    (name,) = allowlist["data"]
    assert env["PDO_SIDECAR__ALLOWLIST_FILE"] == f"{mount['mountPath']}/{name}"
    prefill = _find("Service", "vllm-prefill", "sidecar")
    assert prefill["spec"]["clusterIP"] == "None"  # its name resolves to the pods
    assert allowlist["data"][name].split() == ["vllm-prefill"]
    local = tmp_path / name
    local.write_text(allowlist["data"][name])
    monkeypatch.setenv("PDO_SIDECAR__ALLOWLIST_FILE", str(local))
    config = sidecar_config(build_parser().parse_args(sidecar["args"]))
    assert config.sidecar.enabled and config.sidecar.ssrf_protection
    assert [e.connector for e in config.fleet()] == ["nixl"]
    assert config.listen.port == 8000 and config.fleet()[0].url == "http://127.0.0.1:8200"
