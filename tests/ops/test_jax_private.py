"""The one door to JAX's private names: the range it names is pyproject.toml's, and a missing name is one line."""

import tomllib
from pathlib import Path

import jax
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from iclab.ops._runtime.jax_private import SUPPORTED_JAX, PrivateJaxMissing, private

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _bounds(name: str) -> tuple[str, str]:
    """The (lowest, newest) versions pyproject.toml's dependency ``name`` allows (its ``>=`` and ``<=``)."""
    for dep in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name == name:
            spec = {s.operator: s.version for s in req.specifier}
            return spec[">="], spec["<="]
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


@pytest.mark.parametrize("name", ["jax", "jaxlib"])
def test_supported_jax_is_pyprojects_range(name):
    assert SUPPORTED_JAX == _bounds(name)


def test_the_installed_jax_is_in_the_supported_range():
    low, high = map(Version, SUPPORTED_JAX)
    assert low <= Version(jax.__version__) <= high


@pytest.mark.parametrize("module, name", [("callback", "emit_python_callback"), ("xla_bridge", "_backends"),
                                          ("lax.lax", "_convert_element_type")])
def test_the_names_iclab_reads_are_there(module, name):
    assert private(module, name) is not None


@pytest.mark.parametrize("module, name", [("callback", "no_such_name"), ("no_such_module", "emit_python_callback")])
def test_a_missing_name_is_one_line_naming_the_range(module, name):
    with pytest.raises(PrivateJaxMissing) as e:
        private(module, name)
    message = str(e.value)
    assert isinstance(e.value, ImportError)  # callers that catch ImportError catch it too
    assert "\n" not in message
    assert f"jax._src.{module}.{name}" in message
    assert f"jax {jax.__version__} lacks" in message
    assert message.endswith(f"iclab is tested with jax {SUPPORTED_JAX[0]} to {SUPPORTED_JAX[1]}")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # `from None`: no chained traceback
