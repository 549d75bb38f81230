"""The package is declared once, in setup.cfg (the design card's layout); pyproject.toml holds only the
build system and the tools' settings, and every console script names a function that exists."""
import configparser
import importlib
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return parser


def test_setup_cfg_declares_the_package_and_pyproject_only_builds_it():
    cfg = _setup_cfg()
    assert cfg["metadata"]["name"] == "dflash-launcher" and cfg["metadata"]["version"]
    requires = [line for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    assert any(line.startswith("torch") for line in requires)
    assert any(line.startswith("hydra-core") for line in requires)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "project" not in pyproject, "the package is declared in setup.cfg; pyproject.toml must not redeclare it"
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"


def test_every_console_script_names_a_callable():
    scripts = [line.strip() for line in _setup_cfg()["options.entry_points"]["console_scripts"].splitlines()
               if line.strip()]
    assert scripts
    for script in scripts:
        name, target = (part.strip() for part in script.split("="))
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), f"{name} -> {target}"
