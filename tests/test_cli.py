"""Every command line answers the same flags: --help (groups, every key with its default and
meaning, usage), --cfg job|all (the composed config, exit 0), --info; a bad key is hydra's one-line
error without a traceback; --multirun is a one-line answer."""
import subprocess
import sys

import pytest
import yaml

from launcher.cli import parse_flags
from launcher.config import schema
from tests.launching import REPO


@pytest.mark.parametrize("config_name", sorted(schema.ROOTS))
def test_help_lists_groups_keys_defaults_and_usage(config_name, capsys):
    with pytest.raises(SystemExit) as done:
        parse_flags(["--help"], config_name, "Usage: example")
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "Usage: example" in text and "Keys (override with key=value" in text
    for spec in schema.ROOTS[config_name].__dataclass_fields__.values():
        assert f"  {spec.name}" in text or f"  {spec.name}." in text
    if config_name == "config":
        assert "  drafter: dflash5, tiny" in text and "optim.lr=0.0006  (float) [gt 0, le 1]" in text


@pytest.mark.parametrize("which", ["job", "all"])
def test_cfg_prints_the_composed_config_and_exits(which, capsys):
    with pytest.raises(SystemExit) as done:
        parse_flags(["--cfg", which, "train.steps=7"], "config", "")
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7 and ("hydra" in printed) == (which == "all")


def test_multirun_is_a_one_line_answer():
    with pytest.raises(SystemExit, match="--multirun is not supported: .*launch one job per setting"):
        parse_flags(["-m", "train.steps=1,2"], "config", "")


@pytest.mark.parametrize("module,args", [("launcher.train", ["--cfg", "job"]), ("launcher.evaluate", ["--help"]),
                                         ("launcher.export", ["--info"]), ("launcher.bench", ["--cfg", "job"])])
def test_real_entry_points_answer_the_flags(module, args):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_a_bad_key_is_one_line_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "--cfg", "job", "train.stpes=5"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "Could not override 'train.stpes'" in proc.stderr and "Traceback" not in proc.stderr
