"""The export is a Hugging Face model directory: world-readable, and AutoModel with
trust_remote_code gives back the project's drafter from the code shipped inside it."""
import ast
import json
import os
import subprocess
import sys
import textwrap

import torch

from dflash_core.serving.export import MODELING_NAME, export_drafter, shipped_sources
from tests.test_export import drafter_inputs, drafter_output, drafter_to_export


def test_export_is_world_readable_whatever_the_umask(tmp_path):
    """Issue 15: mkdtemp made the export 0700 and the weights 0600."""
    previous = os.umask(0o077)
    try:
        export_drafter(drafter_to_export(), tmp_path / "out")
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o644 for p in out.iterdir()}


def test_export_ships_the_wrapper_and_the_drafter_source_unchanged(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    sources = shipped_sources()
    assert {"dflash.py", "model.py", "attention.py"} <= set(sources)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["config.json", "model.safetensors", "README.md", *sources])
    for name, source in sources.items():
        assert (tmp_path / "out" / name).read_bytes() == source.read_bytes(), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert MODELING_NAME == "dflash.py"


def test_shipped_files_import_only_torch_transformers_and_each_other():
    """transformers copies a remote module's relative imports and nothing else: any other import
    of the project would fail on a machine that has only the export."""
    sources = shipped_sources()
    siblings = {name.removesuffix(".py") for name in sources}
    allowed = {"torch", "transformers"} | set(sys.stdlib_module_names)
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] not in allowed]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                bad = [] if node.module.split(".")[0] in allowed else [node.module]
            elif isinstance(node, ast.ImportFrom):
                # `from .x import y` only: transformers does not follow `from . import x` or `from ..x`
                bad = [] if node.level == 1 and node.module in siblings else [f"{'.' * node.level}{node.module}"]
            else:
                continue
            assert not bad, f"{name} ({source}) imports {bad}"


# Runs in a fresh interpreter where dflash_core and launcher cannot be imported at all, so only the
# files inside the export can provide the model.
_LOAD_WITH_AUTOMODEL = textwrap.dedent("""
    import sys
    sys.modules["dflash_core"] = sys.modules["launcher"] = None  # `import dflash_core` now fails
    import torch
    from transformers import AutoModel

    export, inputs, output = sys.argv[1:]
    model = AutoModel.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    features, embeds, anchors, keep = torch.load(inputs)
    with torch.no_grad():
        out = model(features, embeds, anchors, keep, backend="sdpa")
    torch.save({"out": out, "class": type(model).__name__, "module": type(model).__module__,
                "keys": sorted(model.state_dict()),
                "project_modules": [m for m in sys.modules if m.split(".")[0] in ("dflash_core", "launcher")
                                    and sys.modules[m] is not None]}, output)
""")


def test_automodel_with_trust_remote_code_is_the_projects_drafter(tmp_path):
    drafter = drafter_to_export()
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    torch.save(drafter_inputs(), tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
           "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOAD_WITH_AUTOMODEL, str(tmp_path / "out"),
                           str(tmp_path / "inputs.pt"), str(tmp_path / "result.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")
    assert result["class"] == "DFlashDraftModel" and result["module"].startswith("transformers_modules.")
    assert result["project_modules"] == []
    assert result["keys"] == sorted(drafter.state_dict())  # the serving layout, no prefix
    torch.testing.assert_close(result["out"], drafter_output(drafter), rtol=1e-5, atol=1e-5)
