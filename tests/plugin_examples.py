"""The example plugin packages of tests/plugins, installed by pip the way users install plugins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmplug.core.plugins import ENABLED_ENV

EXAMPLES_DIR = Path(__file__).resolve().parent / "plugins"


def pip_install_examples(packages: list[str], target: Path, scratch: Path) -> None:
    """pip-install example packages (names of folders in tests/plugins) into `target`; builds run on copies."""
    copies = []
    for package in packages:
        copy = scratch / package
        shutil.copytree(EXAMPLES_DIR / package, copy)
        copies.append(str(copy))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "--no-compile", "--disable-pip-version-check", "--target", str(target), *copies]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"pip install of {packages} failed:\n{done.stdout}\n{done.stderr}")


def run_python(code: str, site: Path, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter with `site` on its path (and `env` added); it prints one JSON line last."""
    inherited = {k: v for k, v in os.environ.items() if k not in (ENABLED_ENV, "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**inherited, "PYTHONPATH": str(site), **(env or {})}, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def use_site(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the plugins pip-installed into `site` importable and discoverable, with no allow-list from the environment."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(ENABLED_ENV, raising=False)
    return site


def example_site_fixtures(packages: list[str]):
    """A test module's `site` (the example packages pip-installed once per module) and `installed` (that site
    importable and discoverable in one test) fixtures: `site, installed = example_site_fixtures([...])`."""

    @pytest.fixture(scope="module")
    def site(tmp_path_factory) -> Path:
        target = tmp_path_factory.mktemp("examples_site")
        pip_install_examples(packages, target, tmp_path_factory.mktemp("examples_sources"))
        return target

    @pytest.fixture
    def installed(site, monkeypatch) -> Path:
        return use_site(site, monkeypatch)

    return site, installed


def save_as_npz(tiny, folder: Path) -> Path:
    """A tiny model's config.json and its weights as weights.npz (HF names): what the toy_loader example reads."""
    import numpy as np

    shutil.copy(tiny.path / "config.json", folder)
    np.savez(folder / "weights.npz", **{name: t.numpy() for name, t in tiny.hf_model.state_dict().items()})
    return folder
