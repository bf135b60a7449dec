"""A KubeRay `RayService` generated from one of our Serve YAMLs (`summit kuberay FILE > rayservice.yaml`).

`serveConfigV2` is the Serve YAML itself with the cluster's `http_options` (the Serve proxy listens on the pod
network; KubeRay's `<name>-serve-svc` ClusterIP Service is the way in). The GPU worker group is sized from the
models' placement plans: enough `gpus_per_node`-GPU pods for every replica. Token auth: KubeRay (v1.5.1 and
later) creates the token Secret and sets RAY_AUTH_MODE / RAY_AUTH_TOKEN in every Ray container.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from app.build.options import DIRECT_PATH_ENV
from app.build.placement import plan_placement

RAY_VERSION = "2.60.0"
CLUSTER_HTTP_OPTIONS = {"host": "0.0.0.0", "port": 8000}
HTTP_COMMENT = (
    "# http_options.host 0.0.0.0 is deliberate: it binds the pod network only; KubeRay's ClusterIP Service\n"
    "# {name}-serve-svc:8000 is the way in. Expose it beyond the cluster only through an Ingress that authenticates.\n"
)


class _Dumper(yaml.SafeDumper):
    """Block style; multi-line strings (serveConfigV2) as literal blocks; no anchors."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump(doc: object) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def cluster_serve_config(serve_doc: dict, name: str) -> str:
    """The Serve YAML as the RayService runs it: cluster http_options, token auth in every Summit application."""
    doc = {**serve_doc, "http_options": {**(serve_doc.get("http_options") or {}), **CLUSTER_HTTP_OPTIONS}}
    doc["applications"] = [_with_token_auth(app) for app in doc.get("applications") or []]
    return HTTP_COMMENT.format(name=name) + dump(doc)


def _with_token_auth(app: dict) -> dict:
    runtime_env = dict(app.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), "RAY_AUTH_MODE": "token"}
    return {**app, "runtime_env": runtime_env}


def gpu_nodes(serve_doc: dict, gpus_per_node: int) -> int:
    """GPU pods needed for every GPU model's replicas (autoscaled models at their max_replicas)."""
    gpus = 0
    for app in serve_doc.get("applications") or []:
        for m in (app.get("args") or {}).get("models") or []:
            if m.get("accelerator", "gpu") != "gpu":
                continue
            plan = plan_placement(
                m.get("tensor_parallel_size", 1),
                m.get("pipeline_parallel_size", 1),
                "gpu",
                gpus_per_node,
                bool(m.get("allow_cross_node_tp", False)),
            )
            deployment = m.get("deployment") or {}
            auto = deployment.get("autoscaling_config") or {}
            gpus += plan.num_gpus * int(auto.get("max_replicas") or deployment.get("num_replicas", 1))
    return max(1, math.ceil(gpus / gpus_per_node))


# Serve's HAProxy in front of the ingress replicas instead of its Python proxy (docs/design/architecture.md); read by
# the Serve controller when Ray starts, so it is set in every Ray container.
# The direct path (app/build/options.DIRECT_PATH_ENV) in every Ray container. Serve's own HAProxy binary: its
# stats and metrics ports listen on the pod's interfaces (inside the pod network).
RAY_ENV = [{"name": k, "value": v} for k, v in DIRECT_PATH_ENV.items()]


def _container(
    name: str, image: str, resources: dict, ports: list[dict] | None = None, mounts: list[dict] | None = None
) -> dict:
    container = {
        "name": name,
        "image": image,
        "env": list(RAY_ENV),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
    }
    if ports:
        container["ports"] = ports
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _head_group(image: str) -> dict:
    ports = [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 8000, "name": "serve"},
    ]
    head = _container("ray-head", image, {"cpu": "8", "memory": "32Gi"}, ports)
    return {"rayStartParams": {"num-gpus": "0"}, "template": {"spec": {"containers": [head]}}}


def _gpu_group(image: str, gpus_per_node: int, nodes: int, models_pvc: str) -> dict:
    mounts = [{"name": "models", "mountPath": "/models", "readOnly": True}, {"name": "dshm", "mountPath": "/dev/shm"}]
    resources = {
        "cpu": str(8 * gpus_per_node),
        "memory": f"{64 * gpus_per_node}Gi",
        "nvidia.com/gpu": str(gpus_per_node),
    }
    worker = _container("ray-worker", image, resources, mounts=mounts)
    volumes = [
        {"name": "models", "persistentVolumeClaim": {"claimName": models_pvc, "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]  # NCCL's shared-memory transport
    return {
        "groupName": f"gpu-{gpus_per_node}x",
        "replicas": nodes,
        "minReplicas": nodes,
        "maxReplicas": nodes,
        "rayStartParams": {},
        "template": {
            "spec": {
                "containers": [worker],
                "volumes": volumes,
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            }
        },
    }


def rayservice(
    serve_doc: dict, name: str, image: str, gpus_per_node: int = 8, models_pvc: str = "summit-models"
) -> dict:
    nodes = gpu_nodes(serve_doc, gpus_per_node)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": cluster_serve_config(serve_doc, name),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token"},
                "headGroupSpec": _head_group(image),
                "workerGroupSpecs": [_gpu_group(image, gpus_per_node, nodes, models_pvc)],
            },
        },
    }


def render_rayservice(
    path: str | Path,
    name: str | None = None,
    image: str = "summit:0.1.0-gpu",
    gpus_per_node: int = 8,
    models_pvc: str = "summit-models",
) -> str:
    """The RayService file, with a header saying how to regenerate it."""
    path = Path(path)
    serve_doc = yaml.safe_load(path.read_text())
    name = name or f"summit-{path.stem.replace('_', '-').replace('.', '-')}"
    header = (
        f"# Generated by `summit kuberay {path.as_posix()}` from that Serve YAML: do not edit, regenerate\n"
        "# (tests/unit/test_cluster_yaml.py fails when this file drifts from a fresh generation).\n"
        "# Needs KubeRay >= 1.5.1 (authOptions: token; the operator creates the token Secret), an image with Ray\n"
        f"# {RAY_VERSION} and Summit installed (docs/deployment/kubernetes.md), and the weights on PVC {models_pvc} "
        "(mounted at /models).\n"
    )
    return header + dump(rayservice(serve_doc, name, image, gpus_per_node, models_pvc))
