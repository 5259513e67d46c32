"""The overlays that put a front before graphserve, checked without a cluster: overlays/gateway
(smg, discovering the graphserve pods) and overlays/inference-pool (a Gateway API Inference
Extension InferencePool over them). Built-in kinds validate against the Kubernetes schemas; the
InferencePool against the fields of its published v1 CRD, written out below."""

import copy
import json
import re

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.k8s_render import GATEWAY_KUSTOMIZATIONS, REPO, render
from tests.deploy.test_k8s_manifests import KUBERNETES_VERSIONS

GATEWAY = "overlays/gateway"
POOL = "overlays/inference-pool"
SMG = "smg"
SMG_UID = 65532
SMG_DOCKERFILE = REPO / "k8s/overlays/gateway/smg.Dockerfile"
CUSTOM_KINDS = {("inference.networking.k8s.io/v1", "InferencePool")}
H2C = "kubernetes.io/h2c"

all_gateways = pytest.mark.parametrize("name", GATEWAY_KUSTOMIZATIONS)


# ---- helpers over rendered documents ----------------------------------------------------------

def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def is_custom(doc: dict) -> bool:
    return (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS


def graphserve_docs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if not is_custom(d)
            and d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "graphserve"]


def template_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def graphserve_port(docs: list[dict]) -> int:
    c = one(docs, "StatefulSet", "graphserve")["spec"]["template"]["spec"]["containers"][0]
    return next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")


def smg_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment", SMG)["spec"]["template"]["spec"]["containers"][0]


def smg_flags(docs: list[dict]) -> dict[str, str]:
    """--flag=value (and bare --flag, value "") args of the smg container."""
    parsed = {}
    for arg in smg_container(docs)["args"]:
        assert arg.startswith("--"), f"write smg flags as --flag or --flag=value: {arg!r}"
        flag, _, value = arg.partition("=")
        assert flag not in parsed, f"{flag} passed twice"
        parsed[flag] = value
    return parsed


def env_stand_ins(docs: list[dict]) -> dict[str, str]:
    """The smg container's environment as the kubelet would resolve it (secrets as stand-ins)."""
    namespace = one(docs, "Deployment", SMG)["metadata"]["namespace"]
    env = {}
    for var in smg_container(docs).get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = namespace
        elif "secretKeyRef" in source:
            env[var["name"]] = "stand-in-secret"
        else:
            pytest.fail(f"no stand-in for env {var}")
    return env


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion; an undefined reference fails (the kubelet would leave it as is)."""
    def lookup(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in args is not in the container's env"
        return env[m.group(1)]
    return re.sub(r"\$\((\w+)\)", lookup, value)


def dockerfile_instruction(keyword: str) -> str:
    lines = [line.split(None, 1)[1] for line in SMG_DOCKERFILE.read_text().splitlines()
             if line.split(None, 1)[:1] == [keyword]]
    assert lines, f"{SMG_DOCKERFILE.name} has no {keyword}"
    return lines[-1].strip()


# ---- rendering and schema ---------------------------------------------------------------------

@all_gateways
def test_render_is_deterministic(kubectl, gateway_rendered_text, name):
    assert render(kubectl, name) == gateway_rendered_text[name]


@all_gateways
def test_graphserve_is_the_gpu_overlay_unchanged(rendered, gateway_rendered, name):
    """So every check of test_k8s_manifests on overlays/gpu holds for these graphserve pods too."""
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(graphserve_docs(gateway_rendered[name]), key=key) == sorted(rendered["overlays/gpu"], key=key)


@all_gateways
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_validate_strictly(gateway_rendered, name, version):
    for doc in gateway_rendered[name]:
        if is_custom(doc):
            continue  # no schema in kubernetes-validate: test_inference_pool_matches_the_published_v1_schema
        where = f"k8s/{name}: {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


# ---- smg: discovery, tokenizer, RBAC ----------------------------------------------------------

def test_smg_discovers_the_graphserve_pods_on_their_grpc_port(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    f, env = smg_flags(docs), env_stand_ins(docs)
    assert "--service-discovery" in f
    selector = dict(pair.split("=", 1) for pair in f["--selector"].split())
    graphserve = one(docs, "StatefulSet", "graphserve")
    assert selects(selector, template_labels(graphserve)), f"{selector} misses the graphserve pods"
    assert not selects(selector, template_labels(one(docs, "Deployment", SMG))), "smg would discover itself"
    assert int(f["--service-discovery-port"]) == graphserve_port(docs)
    # Its own namespace, through the downward API: the Role grants no other.
    assert expand(f["--service-discovery-namespace"], env) == graphserve["metadata"]["namespace"]
    grpc = next(p for p in one(docs, "Service", "graphserve")["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == H2C


def test_smg_takes_the_tokenizer_from_the_workers(gateway_rendered):
    """No local tokenizer: smg fetches it from a worker (GetTokenizer) into a writable HF_HOME."""
    docs = gateway_rendered[GATEWAY]
    f = smg_flags(docs)
    for flag in ("--model-path", "--model", "--tokenizer-path", "--disable-tokenizer-autoload"):
        assert flag not in f, f"{flag}: the smg pod has no checkpoint; the tokenizer comes from the workers"
    env = env_stand_ins(docs)
    assert env["HF_ENDPOINT"].startswith("http://127.0.0.1:"), "a Hub lookup first would need egress"
    hf_home = env["HF_HOME"]
    mounts = smg_container(docs)["volumeMounts"]
    mount = next(m for m in mounts if hf_home.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in one(docs, "Deployment", SMG)["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert "emptyDir" in volume and not mount.get("readOnly", False)


def test_smg_args_are_accepted_by_smg_itself(gateway_rendered):
    """The args, expanded as the kubelet would, through smg's own parser, checks and Rust config."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg (PyPI) is not installed")
    from smg.router import Router

    docs = gateway_rendered[GATEWAY]
    env = env_stand_ins(docs)
    assert smg_container(docs)["command"] == ["python3", "-m", "smg.launch_router"]
    args = launch_router.parse_router_args([expand(a, env) for a in smg_container(docs)["args"]])
    args.enable_igw = True  # what launch_router does when discovery is on
    args._validate_router_args()
    assert args.selected_discovery_provider() == "kubernetes"
    assert selects(args.selector, template_labels(one(docs, "StatefulSet", "graphserve")))
    assert args.service_discovery_port == graphserve_port(docs)
    assert args.service_discovery_namespace == one(docs, "Deployment", SMG)["metadata"]["namespace"]
    assert args.model_path is None and args.tokenizer_path is None and not args.disable_tokenizer_autoload
    assert [role for *_, role in args.control_plane_api_keys] == ["admin"]
    Router.from_args(args)  # builds the Rust router config; starts nothing


def test_discovery_rbac_is_least_privilege(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    deployment = one(docs, "Deployment", SMG)
    namespace, pod = deployment["metadata"]["namespace"], deployment["spec"]["template"]["spec"]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    account = one(docs, "ServiceAccount", pod["serviceAccountName"])
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": namespace}]
    assert role["metadata"]["namespace"] == namespace == binding["metadata"]["namespace"]
    # The watch authenticates with the account's token; graphserve's own account stays tokenless.
    assert pod["automountServiceAccountToken"] is True and account.get("automountServiceAccountToken") is not False
    assert account["metadata"]["name"] != one(docs, "StatefulSet")["spec"]["template"]["spec"]["serviceAccountName"]


def test_smg_admin_routes_need_a_key_from_a_secret(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    key_id, name, role, key = smg_flags(docs)["--control-plane-api-keys"].split(":", 3)
    assert role == "admin"
    var = re.fullmatch(r"\$\((\w+)\)", key)
    assert var, "the key must come from the environment, not the manifest"
    env = {e["name"]: e for e in smg_container(docs)["env"]}
    assert "secretKeyRef" in env[var.group(1)]["valueFrom"]


# ---- smg: ports, probes, Service, shutdown, security, image -----------------------------------

def test_smg_ports_probes_and_service(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    c, f = smg_container(docs), smg_flags(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(f["--port"]), "health": int(f["--health-check-port"]),
                     "metrics": int(f["--prometheus-port"])}
    assert len(set(ports.values())) == 3
    for probe_name, path in (("livenessProbe", "/liveness"), ("readinessProbe", "/readiness")):
        probe = c[probe_name]["httpGet"]
        assert (probe["path"], ports.get(probe["port"], probe["port"])) == (path, ports["health"])
    annotations = one(docs, "Deployment", SMG)["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service = one(docs, "Service", SMG)
    smg_labels = template_labels(one(docs, "Deployment", SMG))
    assert selects(service["spec"]["selector"], smg_labels)
    assert not selects(service["spec"]["selector"], template_labels(one(docs, "StatefulSet", "graphserve")))
    assert [ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]] == [ports["http"]]
    pdb = one(docs, "PodDisruptionBudget", SMG)
    assert selects(pdb["spec"]["selector"]["matchLabels"], smg_labels)
    assert one(docs, "Deployment", SMG)["spec"]["replicas"] > pdb["spec"]["maxUnavailable"]


def test_smg_drains_within_the_grace_period(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    grace = one(docs, "Deployment", SMG)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(smg_flags(docs)["--shutdown-grace-period-secs"])


def test_smg_security_context(gateway_rendered):
    docs = gateway_rendered[GATEWAY]
    pod = one(docs, "Deployment", SMG)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == SMG_UID
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["enableServiceLinks"] is False
    sc = smg_container(docs)["securityContext"]
    assert sc["runAsNonRoot"] is True and sc.get("runAsUser", SMG_UID) == SMG_UID
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    assert sc.get("privileged", False) is False
    tmp = next(m for m in smg_container(docs)["volumeMounts"] if m["mountPath"] == "/tmp")
    assert any(v["name"] == tmp["name"] and "emptyDir" in v for v in pod["volumes"])


def test_smg_image_is_the_one_its_dockerfile_builds(gateway_rendered):
    c = smg_container(gateway_rendered[GATEWAY])
    version = re.search(r"^ARG SMG_VERSION=(\S+)$", SMG_DOCKERFILE.read_text(), re.M).group(1)
    assert c["image"] == f"registry.example.com/smg:{version}"
    assert '"smg==${SMG_VERSION}"' in SMG_DOCKERFILE.read_text()
    assert dockerfile_instruction("USER") == str(SMG_UID)
    assert json.loads(dockerfile_instruction("ENTRYPOINT")) == c["command"]


# ---- InferencePool ----------------------------------------------------------------------------

# spec of inference.networking.k8s.io/v1 InferencePool, field by field as its published CRD
# defines it (gateway-api-inference-extension bundles v1.4.0 to v1.6.0; appProtocol came in
# v1.4.0). Written out here because no package registry this project installs from ships the CRD.
# additionalProperties false: the API server prunes or (strict field validation) rejects unknown
# fields. The CRD's two CEL rules are checked in cel_errors().
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "appProtocol": {"enum": ["http", H2C]},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253,
                                  "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                                 "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def cel_errors(pool: dict) -> list[str]:
    spec, errors = pool.get("spec", {}), []
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("port number must be unique")
    picker = spec.get("endpointPickerRef")
    if picker is not None and picker.get("kind", "Service") == "Service" and "port" not in picker:
        errors.append("port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    return errors


def pool_errors(pool: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(INFERENCE_POOL_V1)
    found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(pool)]
    return found + cel_errors(pool)


def test_inference_pool_matches_the_published_v1_schema(gateway_rendered):
    pool = one(gateway_rendered[POOL], "InferencePool")
    assert pool_errors(pool) == []
    assert [d["kind"] for d in gateway_rendered[POOL] if is_custom(d)] == ["InferencePool"]


@pytest.mark.parametrize("path, value", [
    (("spec", "appProtocol"), "grpc"),
    (("spec", "targetPorts"), [{"number": 50051}, {"number": 50051}]),
    (("spec", "targetPorts"), [{"port": 50051}]),
    (("spec", "endpointPickerRef"), {"name": "graphserve-epp"}),
    (("spec", "selector"), {"matchLabels": {}}),
    (("spec", "targetPort"), [{"number": 50051}]),
])
def test_the_pool_check_refuses_what_the_api_server_would(gateway_rendered, path, value):
    pool = copy.deepcopy(one(gateway_rendered[POOL], "InferencePool"))
    pool[path[0]][path[1]] = value
    assert pool_errors(pool), f"{path}={value!r} passed the InferencePool check"


def test_inference_pool_targets_the_grpc_port_over_h2c(gateway_rendered):
    docs = gateway_rendered[POOL]
    pool, graphserve = one(docs, "InferencePool"), one(docs, "StatefulSet", "graphserve")
    # The selector matches pods of the pool's own namespace only.
    assert pool["metadata"]["namespace"] == graphserve["metadata"]["namespace"]
    assert selects(pool["spec"]["selector"]["matchLabels"], template_labels(graphserve))
    assert pool["spec"]["targetPorts"] == [{"number": graphserve_port(docs)}]
    assert pool["spec"]["appProtocol"] == H2C
    grpc = next(p for p in one(docs, "Service", "graphserve")["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == pool["spec"]["appProtocol"]
