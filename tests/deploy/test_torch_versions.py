"""One torch per kind of machine: the Makefile names the CPU pin (make setup, CI, the cpu image) and the
CUDA pin (the GPU image, README's GPU install); every other place that installs or names torch says
the same. bench/NOTES.md is left out: it records which torch a past measurement ran on."""

from __future__ import annotations

import re

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.deploy.k8s_render import REPO
from tests.deploy.test_dockerfile import global_args


def make_variable(name: str) -> str:
    [value] = re.findall(rf"^{name}\s*[:?]?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    return value


def pins() -> tuple[str, str]:
    return make_variable("TORCH_CPU_VERSION"), make_variable("TORCH_CUDA_VERSION")


def test_the_makefile_installs_its_cpu_pin() -> None:
    cpu, cuda = pins()
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpu) and re.fullmatch(r"\d+\.\d+\.\d+", cuda)
    assert make_variable("TORCH_SPEC") == "torch==$(TORCH_CPU_VERSION)"


def test_the_dockerfile_builds_each_flavor_with_its_pin() -> None:
    cpu, cuda = pins()
    args = global_args()
    assert (args["TORCH_CPU_VERSION"], args["TORCH_CUDA_VERSION"]) == (cpu, cuda)
    text = (REPO / "Dockerfile").read_text()
    assert '"torch==${TORCH_CPU_VERSION}"' in text and '"torch==${TORCH_CUDA_VERSION}"' in text
    assert not re.search(r"torch==\d", text), "a literal torch version beside the ARGs"


def test_every_torch_version_named_in_the_docs_and_manifests_is_a_pin() -> None:
    cpu, cuda = pins()
    allowed = {cpu, cuda, cpu.rsplit(".", 1)[0], cuda.rsplit(".", 1)[0]}
    files = [REPO / "README.md", REPO / "Makefile", REPO / ".ci/run", *sorted((REPO / "k8s").rglob("*"))]
    for path in (f for f in files if f.is_file()):
        for version in re.findall(r"torch(?:==|\s+)(\d+\.\d+(?:\.\d+)?)", path.read_text(), re.IGNORECASE):
            assert version in allowed, f"{path.relative_to(REPO)} names torch {version}; the pins are {cpu} and {cuda}"
    gpu_install = re.findall(r"pip install torch==(\S+) --index-url \S+/cu\d+", (REPO / "README.md").read_text())
    assert gpu_install == [cuda], "README's GPU install line names the CUDA pin"


def test_the_package_admits_both_pins() -> None:
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch] = [d for d in dependencies if re.match(r"torch\b", d)]
    specifier = SpecifierSet(torch.removeprefix("torch"))
    assert all(Version(pin) in specifier for pin in pins())
