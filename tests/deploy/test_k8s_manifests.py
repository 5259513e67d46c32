"""Invariants of the rendered Kubernetes manifests (base and overlays), checked without a cluster."""

import posixpath

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions

from tests.deploy.k8s_render import KUSTOMIZATIONS, render

# The oldest Kubernetes the manifests support, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
CLIENT_SERVICE = "graphserve"
INTERNAL_SERVICE = "graphserve-internal"
CONTAINER = "graphserve"
ADMIN_PORT = 50052
NON_ROOT_UID = 10001

all_kustomizations = pytest.mark.parametrize("name", KUSTOMIZATIONS)


# ---- helpers over rendered documents ----------------------------------------------------------

def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workload(docs: list[dict]) -> dict:
    found = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    assert len(found) == 1, f"expected one workload, found {[d['kind'] for d in found]}"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return workload(docs)["spec"]["template"]["spec"]


def container(docs: list[dict]) -> dict:
    return next(c for c in pod_spec(docs)["containers"] if c["name"] == CONTAINER)


def flags(docs: list[dict]) -> dict[str, str]:
    """--flag=value args of the graphserve container (the form the manifests use)."""
    args = container(docs)["args"]
    assert args[0] == "serve", f"container args must start with the subcommand: {args}"
    parsed = {}
    for arg in args[1:]:
        assert arg.startswith("--") and "=" in arg, f"write flags as --flag=value: {arg!r}"
        flag, value = arg.split("=", 1)
        assert flag not in parsed, f"{flag} passed twice: {args}"
        parsed[flag] = value
    return parsed


def mount_for(docs: list[dict], path: str) -> dict:
    """The volume mount that holds path (the longest mountPath that is a parent of it)."""
    path = posixpath.normpath(path)
    mounts = [m for m in container(docs).get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} lies under no volume mount (the root filesystem is read-only)"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def volume(docs: list[dict], name: str) -> dict:
    """A pod volume by name; a StatefulSet volumeClaimTemplate reads as a PVC volume."""
    for v in pod_spec(docs).get("volumes", []):
        if v["name"] == name:
            return v
    for template in workload(docs)["spec"].get("volumeClaimTemplates", []):
        if template["metadata"]["name"] == name:
            return {"name": name, "persistentVolumeClaim": {"claimName": f"<template {name}>"}}
    raise AssertionError(f"no volume named {name}")


def pod_labels(docs: list[dict]) -> dict[str, str]:
    return workload(docs)["spec"]["template"]["metadata"]["labels"]


def selects_pods(selector: dict[str, str], docs: list[dict]) -> bool:
    labels = pod_labels(docs)
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def seconds(value: str) -> float:
    return float(value.rstrip("s"))


def prestop_sleep_seconds(docs: list[dict]) -> float:
    pre_stop = container(docs)["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert posixpath.basename(command[0]) == "sleep", f"preStop is not a sleep: {command}"
    return seconds(command[1])


# ---- rendering and schema ---------------------------------------------------------------------

@all_kustomizations
def test_render_is_deterministic(kubectl, rendered_text, name):
    assert render(kubectl, name) == rendered_text[name]


def test_validator_ships_the_pinned_versions():
    shipped = set(all_versions())
    for version in KUBERNETES_VERSIONS:
        assert version in shipped, f"kubernetes-validate has no schemas for {version}: {sorted(shipped)}"


@all_kustomizations
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_validates_strictly(rendered, name, version):
    for doc in rendered[name]:
        where = f"k8s/{name}: {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


@all_kustomizations
def test_labels_are_consistent(rendered, name):
    docs = rendered[name]
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "graphserve", f"{doc['kind']} lacks the name label"
    assert workload(docs)["spec"]["selector"]["matchLabels"].items() <= pod_labels(docs).items()


# ---- probes, ports and shutdown ---------------------------------------------------------------

@all_kustomizations
def test_probes_use_grpc_health_on_a_container_port(rendered, name):
    c = container(rendered[name])
    ports = {p["containerPort"] for p in c["ports"]}
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[probe_name]
        assert "grpc" in probe, f"{probe_name} must be the native gRPC health probe"
        assert probe["grpc"]["port"] in ports, f"{probe_name} port {probe['grpc']['port']} not in {ports}"
        assert probe["grpc"]["port"] == int(flags(rendered[name])["--port"]), f"{probe_name} not on --port"


@all_kustomizations
def test_container_ports_match_flags(rendered, name):
    f = flags(rendered[name])
    ports = {p["name"]: p["containerPort"] for p in container(rendered[name])["ports"]}
    assert ports == {"grpc": int(f["--port"]), "admin": int(f["--admin-port"]),
                     "metrics": int(f["--metrics-port"])}


@all_kustomizations
def test_startup_probe_allows_a_slow_model_load(rendered, name):
    probe = container(rendered[name])["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600


@all_kustomizations
def test_grace_period_covers_prestop_drain_and_engine_stop(rendered, name):
    """The server's shutdown is bounded by --drain-timeout + --engine-stop-timeout (plus a few
    seconds to close its ports): SIGKILL from the kubelet must not cut the stats save short."""
    docs = rendered[name]
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    budget = shutdown_budget_seconds(docs) + SHUTDOWN_SLACK_S
    assert grace >= budget, f"grace {grace}s must cover preStop + drain + engine stop + {SHUTDOWN_SLACK_S}s ({budget}s)"


@all_kustomizations
def test_liveness_does_not_restart_a_draining_pod(rendered, name):
    """Health reads NOT_SERVING while draining: liveness must not fail before the drain ends."""
    docs = rendered[name]
    probe = container(docs)["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > shutdown_budget_seconds(docs)


# Closing the admin and gRPC ports (1 s grace each) and reaping a killed engine (up to 5 s).
SHUTDOWN_SLACK_S = 8


def shutdown_budget_seconds(docs) -> float:  # noqa: ANN001
    f = flags(docs)
    return prestop_sleep_seconds(docs) + seconds(f["--drain-timeout"]) + seconds(f.get("--engine-stop-timeout", "10"))


# ---- volumes and state ------------------------------------------------------------------------

@all_kustomizations
def test_stats_file_lies_on_a_persistent_volume(rendered, name):
    docs = rendered[name]
    mount = mount_for(docs, flags(docs)["--stats-file"])
    assert not mount.get("readOnly", False), "the stats volume must be writable"
    assert "subPath" not in mount, "stats are replaced atomically in their directory: mount a directory"
    assert "persistentVolumeClaim" in volume(docs, mount["name"]), f"{mount['name']} is not a PVC"


@all_kustomizations
def test_compile_cache_lies_on_a_persistent_volume_of_its_own(rendered, name):
    """A pod that starts again (a reschedule, a scale-up from zero) finds its compiled kernels."""
    docs = rendered[name]
    mount = mount_for(docs, flags(docs)["--compile-cache-dir"])
    assert not mount.get("readOnly", False) and "subPath" not in mount
    assert "persistentVolumeClaim" in volume(docs, mount["name"]), f"{mount['name']} is not a PVC"
    assert mount["name"] != mount_for(docs, flags(docs)["--stats-file"])["name"], "its own size and lifetime"


@all_kustomizations
def test_persistent_state_is_per_replica(rendered, name):
    """A ReadWriteOnce claim shared by several replicas would not attach: one claim per pod."""
    docs = rendered[name]
    w = workload(docs)
    for v in pod_spec(docs).get("volumes", []):
        claim = v.get("persistentVolumeClaim")
        if claim and not claim.get("readOnly", False):
            pytest.fail(f"writable shared claim {claim['claimName']}: use a volumeClaimTemplate")
    if w["kind"] == "Deployment":
        assert w["spec"].get("replicas", 1) == 1


@all_kustomizations
def test_writable_paths_are_volumes(rendered, name):
    docs = rendered[name]
    for path in ("/tmp", flags(docs)["--model-cache-dir"]):
        mount = mount_for(docs, path)
        assert not mount.get("readOnly", False)
        assert "emptyDir" in volume(docs, mount["name"]), f"{path} should be an emptyDir"
    shm = volume(docs, mount_for(docs, "/dev/shm")["name"])
    assert shm["emptyDir"].get("medium") == "Memory"


@all_kustomizations
def test_admin_token_comes_from_a_secret(rendered, name):
    docs = rendered[name]
    mount = mount_for(docs, flags(docs)["--admin-token-file"])
    assert mount.get("readOnly") is True
    assert "secret" in volume(docs, mount["name"]), "the admin token file must be a Secret volume"
    for env in container(docs).get("env", []):
        if env["name"] == "GRAPHSERVE_ADMIN_TOKEN":
            assert "secretKeyRef" in env.get("valueFrom", {}), "GRAPHSERVE_ADMIN_TOKEN must come from a Secret"


# ---- security ---------------------------------------------------------------------------------

@all_kustomizations
def test_security_context(rendered, name):
    docs = rendered[name]
    pod = pod_spec(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == NON_ROOT_UID
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False, "service links would inject GRAPHSERVE_PORT=tcp://..."
    sc = container(docs)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc.get("runAsUser", NON_ROOT_UID) == NON_ROOT_UID
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    assert sc.get("privileged", False) is False


# ---- services, PDB, HPA -----------------------------------------------------------------------

@all_kustomizations
def test_client_service_is_headless_and_inference_only(rendered, name):
    docs = rendered[name]
    service = one(docs, "Service", CLIENT_SERVICE)
    assert service["spec"]["clusterIP"] == "None", "gRPC clients balance per call over a headless Service"
    assert selects_pods(service["spec"]["selector"], docs)
    container_ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    for port in service["spec"]["ports"]:
        target = container_ports.get(port["targetPort"], port["targetPort"])
        assert ADMIN_PORT not in (port["port"], target), "admin port on the client-facing Service"
        assert target == int(flags(docs)["--port"]), f"client Service exposes {port}"
    assert workload(docs)["kind"] != "StatefulSet" or workload(docs)["spec"]["serviceName"] == CLIENT_SERVICE


@all_kustomizations
def test_internal_service_carries_admin_and_metrics(rendered, name):
    docs = rendered[name]
    service = one(docs, "Service", INTERNAL_SERVICE)
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert selects_pods(service["spec"]["selector"], docs)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"admin", "metrics"}


@all_kustomizations
def test_pdb_selects_the_pods(rendered, name):
    docs = rendered[name]
    pdb = one(docs, "PodDisruptionBudget")
    assert selects_pods(pdb["spec"]["selector"]["matchLabels"], docs)


@pytest.mark.parametrize("name", ["base", "overlays/gpu"])
def test_hpa_scales_the_workload_on_waiting_requests(rendered, name):
    docs = rendered[name]
    hpa = one(docs, "HorizontalPodAutoscaler")
    w = workload(docs)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert (hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"]) == (
        w["kind"], w["metadata"]["name"])
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metrics == ["graphserve_requests_waiting"]
    assert "replicas" not in w["spec"], "the HPA owns replicas; kubectl apply would reset them"


# ---- overlays ---------------------------------------------------------------------------------

def test_gpu_overlay_requests_a_gpu(rendered):
    docs = rendered["overlays/gpu"]
    c = container(docs)
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    tolerations = pod_spec(docs)["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    assert pod_spec(docs)["nodeSelector"]
    f = flags(docs)
    assert (f["--device"], f["--dtype"], f["--cudagraph-mode"]) == ("cuda", "bfloat16", "full_and_piecewise")


def test_gpu_overlay_reads_the_model_from_a_read_only_claim(rendered):
    docs = rendered["overlays/gpu"]
    mount = mount_for(docs, flags(docs)["--model"])
    assert mount["mountPath"] == "/models" and mount.get("readOnly") is True
    claim = volume(docs, mount["name"])["persistentVolumeClaim"]
    assert claim["claimName"] == "graphserve-models" and claim.get("readOnly") is True


def test_gpu_tp2_overlay_splits_one_model_across_two_gpus_of_a_pod(rendered):
    docs = rendered["overlays/gpu-tp2"]
    c = container(docs)
    assert str(c["resources"]["requests"]["nvidia.com/gpu"]) == str(c["resources"]["limits"]["nvidia.com/gpu"]) == "2"
    f = flags(docs)
    assert f["--tensor-parallel-size"] == "2"
    assert (f["--device"], f["--dtype"], f["--model"]) == ("cuda", "bfloat16", "/models/Llama-3.1-8B-Instruct")
    assert mount_for(docs, f["--model"])["readOnly"] is True


def test_cpu_dev_overlay_has_no_gpu(rendered):
    docs = rendered["overlays/cpu-dev"]
    c = container(docs)
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in c["resources"].get(section, {})
    assert not pod_spec(docs).get("tolerations")
    f = flags(docs)
    assert (f["--device"], f["--model"]) == ("cpu", "builtin:tiny")
    assert workload(docs)["spec"]["replicas"] == 1
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert c["image"].endswith("-cpu"), "the CPU image (docker build --build-arg FLAVOR=cpu), not the CUDA one"
    assert not container(rendered["overlays/gpu"])["image"].endswith("-cpu")
