"""Warm start (`drafter.init_from=DIR`): a DFlash export gives the drafter's initial weights. Step 0
then trains the exported model itself (its loss and held-out tau are the export's, exactly: on CPU
both run in fp32 on the same bf16-rounded weights), the optimiser starts fresh, an export of another
shape or a broken one stops the run at start-up naming what is wrong, and the run's provenance and
model card say where the weights came from."""
import hashlib
import json

import pytest
import torch

from dflash_core.loss.objective import drafter_step, evaluate_tau
from dflash_core.serving.export import WEIGHTS_NAME, export_drafter, load_exported
from dflash_core.serving.model_card import read_card_info
from launcher.config import ConfigError, compose_config
from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch
from launcher.distributed.topology import Topology
from launcher.resolve import resolve
from launcher.roles.trainer import DrafterTrainer, anchor_generator
from tests.launching import tiny_overrides, torchrun

SEQ_LEN = 64
pytestmark = pytest.mark.usefixtures("one_thread")


def _job(tiny_target_dir, *overrides):
    cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                          "run.device=cpu", f"data.fixed_length={SEQ_LEN}", "drafter.num_anchors=8", *overrides])
    return resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu"))


def _batch(dcfg, index: int) -> FeatureBatch:
    gen = torch.Generator().manual_seed(index)
    ids = torch.randint(0, dcfg.mask_token_id, (1, SEQ_LEN), generator=gen)
    hidden = torch.randn(1, SEQ_LEN, dcfg.num_features * dcfg.hidden_size, generator=gen).to(HIDDEN_DTYPE)
    return FeatureBatch(index, ids, torch.ones_like(ids), torch.arange(SEQ_LEN).unsqueeze(0), hidden, SEQ_LEN)


@pytest.fixture(scope="module")
def export_dir(tiny_target_dir, world, tmp_path_factory):
    """A drafter trained a few steps (so its weights are not an initialisation) and exported."""
    trainer = DrafterTrainer(_job(tiny_target_dir), world)
    for index in range(3):
        trainer.train_step([_batch(trainer.dcfg, index)]).result()
    return export_drafter(trainer.updated_drafter(), tmp_path_factory.mktemp("warm") / "export",
                          card={"target": str(tiny_target_dir), "steps": 3})


def test_step_zero_trains_the_exported_model(tiny_target_dir, world, export_dir):
    job = _job(tiny_target_dir, f"drafter.init_from={export_dir}", "run.seed=7")   # another seed: another init
    digest = hashlib.sha256((export_dir / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert job.init_from.path == export_dir.resolve() and job.init_from.weights_sha256 == digest
    trainer = DrafterTrainer(job, world)
    held_out = _batch(trainer.dcfg, 100)
    cold = trainer.evaluate([held_out])   # its own initialisation, before the export's weights are in
    trainer.start_from(job.init_from)
    exported = load_exported(export_dir)
    for name, value in exported.state_dict().items():
        assert torch.equal(trainer.drafter.state_dict()[name], value), name
    assert trainer.optimizer.state_dict()["step"] == 0          # no updates and no moments: AdamW starts fresh
    assert all(not piece.tensor.any() for piece in trainer.optimizer.checkpoint_pieces(writing=False)
               if not piece.key.startswith("model."))
    assert trainer.scheduler.last_epoch == 0

    expected_eval = evaluate_tau(exported.eval(), trainer.head, held_out.input_ids, held_out.loss_mask,
                                 held_out.hidden, job.step, position_ids=held_out.position_ids).summary()
    assert trainer.evaluate([held_out]) == expected_eval
    assert expected_eval["anchor_fill"] > 0 and expected_eval["loss"] != cold["loss"]   # the test can fail

    batch = _batch(trainer.dcfg, 0)
    expected = drafter_step(exported.train(), trainer.head, batch.input_ids, batch.loss_mask, batch.hidden, job.step,
                            position_ids=batch.position_ids,
                            generator=anchor_generator(torch.device("cpu"), job.run.seed, batch.index)).counts
    result = trainer.train_step([batch]).result()
    assert torch.equal(result.counts.loss_sum, expected.loss_sum.double())
    assert torch.equal(result.counts.weight_sum, expected.weight_sum.double())
    assert float(result.counts.loss_sum) > 0


def test_an_export_of_another_shape_is_refused_naming_each_field(tiny_target_dir, export_dir):
    with pytest.raises(ConfigError) as error:
        _job(tiny_target_dir, f"drafter.init_from={export_dir}", "drafter.num_layers=3", "drafter.block_size=6")
    message = str(error.value)
    assert (f"drafter.init_from='{export_dir}': the export's drafter differs from the configured one in 4 fields:"
            in message)
    # Layer ids follow the layer count (drafter.target_layer_ids=null: the published drafters' spread).
    assert "target_layer_ids: export [0, 2], configured [0, 1, 2] (drafter.target_layer_ids)" in message
    assert "num_hidden_layers: export 2, configured 3 (drafter.num_layers)" in message
    assert "block_size: export 8, configured 6 (drafter.block_size)" in message
    assert "layer_types: export ['full_attention', 'full_attention'], configured" in message


def test_a_drafter_without_a_learned_k_norm_starts_only_from_an_export_whose_k_norm_is_ones(tiny_target_dir, world,
                                                                                            export_dir, tmp_path):
    """drafter.learn_k_norm=false has no k_norm weights to take: an export whose k_norm was trained is refused
    naming the setting; one trained with it false (exported as ones) starts it, every weight taken."""
    learned = load_exported(export_dir)
    with torch.no_grad():   # three steps leave k_norm within bf16's rounding of 1: a trained one is not
        learned.layers[1].self_attn.k_norm.weight.mul_(1.5)
    learned = export_drafter(learned, tmp_path / "learned")
    with pytest.raises(ConfigError, match=r"1 field: learn_k_norm: export True, configured False "
                                          r"\(drafter\.learn_k_norm\)"):
        _job(tiny_target_dir, f"drafter.init_from={learned}", "drafter.learn_k_norm=false")
    trainer = DrafterTrainer(_job(tiny_target_dir, "drafter.learn_k_norm=false"), world)
    assert not [name for name, _ in trainer.drafter.named_parameters() if "k_norm" in name]
    trainer.train_step([_batch(trainer.dcfg, 0)]).result()
    fixed = export_drafter(trainer.updated_drafter(), tmp_path / "fixed")
    exported = load_exported(fixed).state_dict()
    k_norms = [name for name in exported if "k_norm" in name]
    ones = torch.ones(trainer.dcfg.head_dim)
    assert len(k_norms) == trainer.dcfg.num_hidden_layers and all(torch.equal(exported[n], ones) for n in k_norms)

    assert _job(tiny_target_dir, f"drafter.init_from={fixed}").init_from   # ones fit a learned k_norm too
    job = _job(tiny_target_dir, f"drafter.init_from={fixed}", "drafter.learn_k_norm=false", "run.seed=7")
    warm = DrafterTrainer(job, world)
    warm.start_from(job.init_from)
    taken = warm.drafter.state_dict()
    assert set(taken) == set(exported) - set(k_norms)
    assert all(torch.equal(value, exported[name]) for name, value in taken.items())


def test_a_missing_or_broken_export_is_named(tiny_target_dir, export_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"drafter.init_from='/nowhere': no such directory \(a DFlash export"):
        _job(tiny_target_dir, "drafter.init_from=/nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((export_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"no model.safetensors in it"):
        _job(tiny_target_dir, f"drafter.init_from={broken}")
    weights = (export_dir / WEIGHTS_NAME).read_bytes()
    (broken / WEIGHTS_NAME).write_bytes(weights[: len(weights) // 2])   # an interrupted copy
    with pytest.raises(ValueError, match=rf"{broken / WEIGHTS_NAME}: not a readable safetensors file"):
        _job(tiny_target_dir, f"drafter.init_from={broken}")
    (broken / "config.json").write_text('{"architectures": ')
    with pytest.raises(ValueError, match=rf"{broken / 'config.json'}: not valid JSON"):
        _job(tiny_target_dir, f"drafter.init_from={broken}")


def test_an_export_in_z_labs_layout_starts_a_run(tiny_target_dir, export_dir, tmp_path):
    """z-lab's config.json keeps block_size at the top level only (dflash_config: mask token and layer ids)."""
    theirs = tmp_path / "z-lab"
    theirs.mkdir()
    (theirs / WEIGHTS_NAME).write_bytes((export_dir / WEIGHTS_NAME).read_bytes())
    config = json.loads((export_dir / "config.json").read_text())
    del config["dflash_config"]["block_size"]
    (theirs / "config.json").write_text(json.dumps(config))
    assert _job(tiny_target_dir, f"drafter.init_from={theirs}").init_from.path == theirs.resolve()


def test_a_dflash2_started_from_a_dflash_export_decodes_exactly_as_the_export(tiny_target_dir, world, export_dir,
                                                                            monkeypatch):
    """The export's backbone, the convolutions and selector at identity: at step 0 the DFlash 2 (drafting with its
    selector's walk, as vLLM does) decodes the evaluation prompts with the export's tokens, drafts and
    acceptance, and scores held-out data with the export's figures. DFLASH_TEST_EXPORT=DIR starts it from that
    export instead (`make train`'s, whose drafts the target accepts)."""
    import os

    from transformers import AutoModelForCausalLM

    from dflash_core.drafter.dflash2 import DFlash2Drafter, parameter_names
    from dflash_core.serving.speculative import DrafterCache, default_walk, speculative_generate
    from tests.served import evaluation_prompts
    source = os.environ.get("DFLASH_TEST_EXPORT") or export_dir
    job = _job(tiny_target_dir, "drafter.kind=dflash2", "drafter.selector_top_k=4", "drafter.selector_rank=8",
               f"drafter.init_from={source}")
    trainer = DrafterTrainer(job, world)
    trainer.start_from(job.init_from)
    dflash2, dflash = trainer.updated_drafter().eval(), load_exported(source).eval()
    assert type(dflash2) is DFlash2Drafter and default_walk(dflash2) == "selector"
    state = dflash2.state_dict()
    for name, value in dflash.state_dict().items():
        assert torch.equal(state[name], value), name
    assert state["candidate_selector.predecessor_codebook"].abs().sum() > 0   # random: only B = 0 keeps the walk
    assert set(state) - set(dflash.state_dict()) == set(parameter_names(job.drafter))

    held_out = _batch(trainer.dcfg, 100)
    got = trainer.evaluate([held_out])
    want = evaluate_tau(dflash, trainer.head, held_out.input_ids, held_out.loss_mask, held_out.hidden, job.step,
                        position_ids=held_out.position_ids).summary()
    assert {key: got[key] for key in want} == want
    assert (got["unary_tau"], got["unary_decode_tau"]) == (want["tau"], want["decode_tau"])

    drafts = []
    draft = DrafterCache.draft
    monkeypatch.setattr(DrafterCache, "draft", lambda cache, ids: drafts.append(draft(cache, ids)) or drafts[-1])
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    decoded = {}
    for drafter in (dflash, dflash2):
        drafts.clear()
        results = [speculative_generate(target, drafter, ids, max_new_tokens=32)
                   for ids in evaluation_prompts(tiny_target_dir, 4)]
        decoded[type(drafter)] = ([r.tokens for r in results], [r.accepted for r in results],
                                  [d.tolist() for d in drafts])
    assert decoded[DFlash2Drafter] == decoded[type(dflash)] and len(drafts) >= 4 * 4


def test_a_dflash2_export_starts_only_a_dflash2_of_its_settings(tiny_target_dir, world, export_dir, tmp_path):
    job = _job(tiny_target_dir, "drafter.kind=dflash2", "drafter.selector_top_k=4", f"drafter.init_from={export_dir}")
    trainer = DrafterTrainer(job, world)
    trainer.start_from(job.init_from)
    exported = export_drafter(trainer.updated_drafter(), tmp_path / "dflash2")
    with pytest.raises(ConfigError, match=r"differs from the configured one in 1 field: kind: export 'dflash2', "
                                          r"configured 'dflash' \(drafter.kind\)"):
        _job(tiny_target_dir, f"drafter.init_from={exported}")
    with pytest.raises(ConfigError, match=r"selector_top_k: export 4, configured 16 \(drafter.selector_top_k\)"):
        _job(tiny_target_dir, "drafter.kind=dflash2", f"drafter.init_from={exported}")
    again = _job(tiny_target_dir, "drafter.kind=dflash2", "drafter.selector_top_k=4", "run.seed=3",
                 f"drafter.init_from={exported}")
    resumed = DrafterTrainer(again, world)
    resumed.start_from(again.init_from)
    for name, value in load_exported(exported).state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], value), name


@pytest.mark.multiproc
def test_launched_warm_start_records_its_origin_and_resume_takes_precedence(tiny_target_dir, export_dir, tmp_path):
    run_dir = tmp_path / "run"
    base = [*tiny_overrides(tmp_path, tiny_target_dir), "drafter=tiny", "topology=t1d1", "train.eval_every=0",
            f"run.dir={run_dir}", f"drafter.init_from={export_dir}"]
    mismatched = torchrun(2, *base, "drafter.num_layers=3", "train.steps=2")
    assert mismatched.returncode != 0
    for tag in ("target0", "drafter1"):   # every rank stops naming the fields
        assert f"[{tag}] ERROR failed: ConfigError: drafter.init_from=" in mismatched.stderr, mismatched.stderr[-3000:]
    assert "num_hidden_layers: export 2, configured 3 (drafter.num_layers)" in mismatched.stderr

    proc = torchrun(2, *base, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    origin = {"path": str(export_dir.resolve()),
              "weights_sha256": hashlib.sha256((export_dir / WEIGHTS_NAME).read_bytes()).hexdigest()}
    assert json.loads((run_dir / "provenance.json").read_text())["init_from"] == origin
    assert read_card_info(run_dir / "export")["init_from"] == origin
    card = (run_dir / "export" / "README.md").read_text()
    assert f"| Initial weights (drafter.init_from, drafter.init) | the export {origin['path']}" in card
    assert "drafter weights from" in (run_dir / "logs" / "drafter1.log").read_text()

    resumed = torchrun(2, *base, "train.steps=4")   # the run's own checkpoint wins over init_from
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = (run_dir / "logs" / "drafter1.log").read_text().split("resuming at step 2", 1)
    assert len(log) == 2 and "drafter weights from" not in log[1]
