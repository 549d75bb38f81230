"""The README's commands run as printed. Each `python -m launcher.*` and `torchrun ... -m launcher.*`
command composes through its own module's `--cfg job`, so a renamed key, group or option fails here;
the walkthrough keeps its recipe's settings (topology, lengths, steps) and prepares the stores its
training opens; every `make` target exists; the serving commands pass the flags the project's own vLLM
servers are started with (tests/test_vllm_serving.py starts them) and draft the recipe's block. Every
command block names, in an HTML comment above it, the test or script that runs it."""
import functools
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from launcher.config import compose_config
from launcher.distributed.topology import parse_topology
from launcher.resolve import check_combinations
from launcher.serving.served_evaluate import speculative_config
from launcher.serving.vllm_server import SERVER_MODULE, VllmServer
from tests.launching import REPO
from tests.served import require_vllm_env

README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"(?:<!--(?P<note>(?:(?!-->).)*)-->\n)?```bash\n(?P<body>.*?)```", re.S)
SGLANG_MODULE = "sglang.launch_server"
# What the walkthrough's commands may set although its recipe sets it too: where the files are.
WHERE_FILES_ARE = {"target.path", "data.paths"}


def _commands() -> list[list[str]]:
    """Each command of the README's bash blocks as argv: continued lines joined, comments dropped."""
    return [argv for match in BLOCK.finditer(README)
            for line in match["body"].replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def _module(argv: list[str]) -> str | None:
    return argv[argv.index("-m") + 1] if "-m" in argv else None


def _launcher_commands() -> list[tuple[str, list[str], int | None]]:
    """(module, its key=value arguments, torchrun's --nproc-per-node or None) of every launcher command."""
    found = []
    for argv in _commands():
        module = _module(argv)
        if module and module.startswith("launcher."):
            nproc = int(argv[argv.index("--nproc-per-node") + 1]) if "--nproc-per-node" in argv else None
            found.append((module, argv[argv.index(module) + 1:], nproc))
    return found


def _overrides(args: list[str]) -> dict[str, str]:
    return dict(arg.lstrip("+").split("=", 1) for arg in args)


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _training() -> tuple[list[str], int]:
    (args, nproc), = [(args, nproc) for module, args, nproc in _launcher_commands() if module == "launcher.train"]
    return args, nproc


@functools.cache
def _trained():
    """The walkthrough's training config, composed once."""
    return compose_config(_training()[0])


def _one_command(module: str) -> list[str]:
    argv, = [argv for argv in _commands() if _module(argv) == module]
    return argv


def test_every_command_block_names_what_runs_it():
    blocks = list(BLOCK.finditer(README))
    assert len(blocks) >= 6
    for block in blocks:
        named = re.findall(r"(?:tests/\w+\.py|\.ci/run)", block["note"] or "")
        assert named, f"no test or script named above the block:\n{block['body']}"
        assert all((REPO / path).is_file() for path in named), named


def test_every_command_is_one_this_file_checks():
    known = {"make", "launcher", SERVER_MODULE, SGLANG_MODULE}
    for argv in _commands():
        module = _module(argv) or ""
        kind = argv[0] if argv[0] == "make" else module.split(".")[0] if module.startswith("launcher.") else module
        assert kind in known, f"the README shows a command no test checks: {shlex.join(argv)}"


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    commands = [argv[1:] for argv in _commands() if argv[0] == "make"]
    assert [args[0] for args in commands][:2] == ["train", "test"]
    for target, *variables in commands:
        assert re.search(rf"^{target}:", makefile, re.M), target
        for variable in variables:   # make train TARGET=smollm2 runs the rule train-smollm2
            name, _, value = variable.partition("=")
            assert name == "TARGET" and re.search(rf"^train-{value}:", makefile, re.M), variable


@pytest.mark.parametrize("module,args,nproc", _launcher_commands(),
                         ids=[f"{module}-{i}" for i, (module, _, _) in enumerate(_launcher_commands())])
def test_launcher_command_composes(module, args, nproc, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, *args, "--cfg", "job"])
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main()
    assert done.value.code == 0, capsys.readouterr().err
    assert isinstance(yaml.safe_load(capsys.readouterr().out), dict)   # the composed config, printed
    if module == "launcher.train":
        cfg = compose_config(args)
        check_combinations(cfg)
        parse_topology(cfg.topology, nproc, cfg.target.tp_size)   # the topology fits --nproc-per-node


def _make_smollm2_commands(tmp_path) -> list[list[str]]:
    """The launcher commands `make train TARGET=smollm2` runs on a fresh machine, as argv after `-m`: the
    Makefile run with a PYTHON that records its arguments and runs nothing (every rule of its data, none
    of install's)."""
    log, recorder = tmp_path / "argv.jsonl", tmp_path / "python"
    recorder.write_text(f'#!/bin/sh\nexec {sys.executable} -c "import json, sys; '
                        f'open(sys.argv[1], \'a\').write(json.dumps(sys.argv[2:]) + chr(10))" {log} "$@"\n')
    recorder.chmod(0o755)
    subprocess.run(["make", "-s", "-o", ".installed", "train-smollm2", f"PYTHON={recorder}",
                    "VLLM_VENV=.venv-vllm", f"SMOLLM2={tmp_path / 'target'}", f"SMOLLM2_DATA={tmp_path / 'data'}",
                    f"RUN_DIR={tmp_path / 'run'}"],
                   cwd=REPO, check=True, capture_output=True)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    return [argv[argv.index("-m", argv.index("-m") + 1) + 1:] if argv[1] == "torch.distributed.run" else argv[1:]
            for argv in runs]


def test_make_train_smollm2_commands_compose(tmp_path, monkeypatch, capsys):
    """Each launcher command of `make train TARGET=smollm2` composes through its module's --cfg job (a value
    hydra cannot parse, such as the code set's system prompt with its commas unquoted, failed only after
    ten minutes of building the chat set)."""
    commands = _make_smollm2_commands(tmp_path)
    modules = [module for module, *_ in commands]
    assert {"launcher.fetch_target", "launcher.synthesize", "launcher.regenerate", "launcher.humaneval",
            "launcher.prepare", "launcher.train", "launcher.evaluate"} <= set(modules), modules
    for module, *args in commands:
        monkeypatch.setattr(sys, "argv", [module, *args, "--cfg", "job"])
        with pytest.raises(SystemExit) as done:
            importlib.import_module(module).main()
        assert done.value.code == 0, f"{module} {shlex.join(args)}: {capsys.readouterr().err}"
        capsys.readouterr()


def test_walkthrough_keeps_its_recipe_and_says_its_steps():
    args, _ = _training()
    recipe_name = _overrides(args)["recipe"]
    recipe = OmegaConf.load(REPO / "conf" / "recipe" / f"{recipe_name}.yaml")
    recipe_keys = {f"{section}.{key}" for section, body in recipe.items() if OmegaConf.is_dict(body) for key in body}
    changed = (set(_overrides(args)) & (recipe_keys | {"topology"})) - WHERE_FILES_ARE
    assert not changed, f"the walkthrough overrides its recipe's {sorted(changed)}"
    composed = compose_config([f"recipe={recipe_name}"])
    assert f"train.steps={composed.train.steps}" in README and f"`{composed.topology}`" in README
    assert f"conf/recipe/{recipe_name}.yaml" in README


def test_prepare_writes_the_stores_training_opens():
    trained_paths = _overrides(_training()[0])["data.paths"]
    prepared = [compose_config(args) for module, args, _ in _launcher_commands()
                if module == "launcher.prepare" and _overrides(args)["data.paths"] == trained_paths]
    assert prepared, "no launcher.prepare of the training data"
    for cfg in prepared:
        assert cfg.target == _trained().target and cfg.data == _trained().data


def test_vllm_command_passes_the_flags_the_project_serves_with():
    argv = _one_command(SERVER_MODULE)
    trained = _trained()
    export = str(Path(trained.run.dir) / "export")
    assert argv[0] == ".venv-vllm/bin/python" and argv[1:3] == ["-m", SERVER_MODULE]
    spec = json.loads(_option(argv, "--speculative-config"))
    served = VllmServer(trained.target.path, speculative=spec, python=sys.executable).command
    flags = [arg for arg in argv if arg.startswith("--")]
    assert set(flags) <= {arg for arg in served if arg.startswith("--")}, flags
    assert _option(argv, "--model") == trained.target.path
    assert spec == speculative_config(export, trained.drafter.block_size)


def test_vllm_command_runs_as_printed_in_the_cpu_build():
    """The README's server command itself, in .venv-vllm (the CPU wheel, whose `vllm` script fails: issue 44),
    up to argument parsing: its module imports and its values convert (a malformed --speculative-config is
    refused here; --help then exits before a model is needed)."""
    require_vllm_env()
    argv = _one_command(SERVER_MODULE)
    done = subprocess.run([str(REPO / argv[0]), *argv[1:], "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0 and "--speculative-config" in done.stdout, done.stderr[-3000:]


def test_sglang_command_drafts_the_recipes_block():
    argv = _one_command(SGLANG_MODULE)
    trained = _trained()
    assert _option(argv, "--model-path") == trained.target.path
    assert _option(argv, "--speculative-algorithm") == "DFLASH"
    assert _option(argv, "--speculative-draft-model-path") == str(Path(trained.run.dir) / "export")
    assert int(_option(argv, "--speculative-dflash-block-size")) == trained.drafter.block_size
