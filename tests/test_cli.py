"""Every command line answers the same flags: --help (groups, every key with its default and
meaning, usage), --cfg job|all (the composed config, exit 0), --info; a bad key is hydra's one-line
error without a traceback; --multirun is a one-line answer. Under torchrun every command dies with it."""
import os
import signal
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
        assert "  drafter: dflash2, dflash5, tiny" in text and "optim.lr=0.0006  (float) [gt 0, le 1]" in text


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


def test_prepare_opens_its_help_with_itself_and_logs_as_prepare():
    """Issue 46: `prepare --help` opened with the training command and its lines were tagged [train]."""
    shown = subprocess.run([sys.executable, "-m", "launcher.prepare", "--help"], cwd=REPO, capture_output=True,
                           text=True, timeout=120, check=False)
    assert shown.returncode == 0 and shown.stdout.startswith("`python -m launcher.prepare key=value ...`")
    failed = subprocess.run([sys.executable, "-m", "launcher.prepare", "data.max_length=abc"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert failed.returncode == 1 and "[train]" not in failed.stderr
    assert "[prepare] ERROR failed: ConfigError: data.max_length='abc' (the override data.max_length=abc): must be " \
           "of type int" in failed.stderr


_PARENT_DEATH_SIGNAL = """
import ctypes, importlib, sys
libc = ctypes.CDLL("libc.so.6")
def signal_on_parent_death(overrides):
    value = ctypes.c_int()
    libc.prctl(2, ctypes.byref(value))   # PR_GET_PDEATHSIG
    print(sys.argv[0], value.value)
    return 0
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    module.run = signal_on_parent_death   # main() looks run up when it runs
    libc.prctl(1, 0)                      # PR_SET_PDEATHSIG: none, so each entry point must set its own
    sys.argv[0] = name
    try:
        module.main()
    except SystemExit:
        pass
"""


def test_every_entry_point_under_torchrun_dies_with_it():
    """issue 31: after a SIGKILL of torchrun, launcher.regenerate's workers went on as orphans (only
    launcher.train asked the kernel for SIGKILL on its parent's death); the bench's child torchrun
    dies with the bench."""
    modules = ["launcher.train", "launcher.evaluate", "launcher.regenerate", "launcher.export"]
    proc = subprocess.run([sys.executable, "-c", _PARENT_DEATH_SIGNAL, *modules], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, "LOCAL_RANK": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:-1] == [f"{module} {int(signal.SIGKILL)}" for module in modules], proc.stdout

    from launcher.bench.stages import child_env, stream
    code, tail = stream([sys.executable, "-c", _PARENT_DEATH_SIGNAL.split("for name")[0] + "signal_on_parent_death(0)"],
                        env=child_env(tiny=True), timeout_s=60, prefix="child")
    assert code == 0 and tail.endswith(f" {int(signal.SIGKILL)}"), tail


def test_importing_the_code_prints_no_torchao_noise_and_hides_nothing_else():
    """transformers imports torchao with every command; what torchao's import logs about its optional compiled
    extensions that cannot load here (`_C_mxfp8`, ...) and torch's notes on its enums are not the user's to
    act on. Another warning of the same loggers still shows."""
    program = ("import importlib.util, logging, sys; import launcher.resolve; "   # what every command imports
               "assert 'torchao' in sys.modules or importlib.util.find_spec('torchao') is None; "
               "logging.getLogger('torchao').warning('a torchao warning that stays')")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=True)
    assert "Failed to load" not in done.stderr and "register_constant()" not in done.stderr, done.stderr
    assert "a torchao warning that stays" in done.stderr
