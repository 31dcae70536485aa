"""pyproject.toml uses the metadata forms current setuptools accepts without warnings."""

from __future__ import annotations

import re
import tomllib
import warnings

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT

PYPROJECT = REPO_ROOT / "pyproject.toml"


def test_license_is_an_spdx_string_and_build_needs_setuptools_77():
    data = tomllib.loads(PYPROJECT.read_text())
    assert data["project"]["license"] == "Apache-2.0"
    (setuptools_req,) = [r for r in data["build-system"]["requires"]
                         if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools_req)
    assert match and int(match.group(1)) >= 77, setuptools_req  # SPDX license strings: 77+


def test_setuptools_reads_it_without_deprecation_warnings():
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    messages = [str(w.message) for w in caught if "license" in str(w.message).lower()]
    assert messages == []
    assert dist.metadata.license_expression == "Apache-2.0"
