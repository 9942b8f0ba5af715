"""The wheel holds every package: pyproject.toml lists packages by hand (models/, pallas_kernels/ and server/
install under jaxserve.*), so a new sub-package that is not listed works in an editable install and goes
missing from a real one (jaxserve.spec_decode once did: `LLM(...)` then failed at its config check)."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's); 3.10 skips this check
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = tool["package-dir"]  # package name -> folder
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    assert not sorted(listed - found), "pyproject.toml lists packages that do not exist"


def test_every_package_data_file_is_declared():
    """Files other than Python that a package reads at run time (cpu_native.py's C++ sources and headers) ship
    only if package-data names them."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = tool.get("package-data", {})
    for name, folder in tool["package-dir"].items():
        for path in [*(ROOT / folder).glob("*.cc"), *(ROOT / folder).glob("*.h")]:
            assert any(path.match(pattern) for pattern in data.get(name, [])), (
                f"{path.name} is not in [tool.setuptools.package-data] for {name}"
            )
