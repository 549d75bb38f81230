"""The export's README.md model card says what the drafter was trained for and on, and how well it drafts."""
import yaml

from dflash_core.serving.export import export_drafter
from dflash_core.serving.model_card import acceptance_comparison, read_card_info, record_acceptance_length
from tests.test_export import drafter_to_export

INFO = {
    "target": "/models/Qwen3-8B",
    "data": ["/data/chats_a.jsonl", "/data/chats_b.parquet"],
    "steps": 6000,
    "tokens_seen": 123456789,
    "heldout_tau": 3.214,
    "command": ["torchrun", "--nproc-per-node", "8", "-m", "launcher.train", "topology=t2d6"],
    "provenance": {"code_version": "git 1a2b3c4 (dirty)", "torch": "2.11.0", "transformers": "5.17.0"},
}


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("\n---\n", 1)[0].removeprefix("---\n"))


def test_card_holds_every_training_fact(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out", card=INFO)
    card = (tmp_path / "out" / "README.md").read_text()
    for text in ("# DFlash drafter for /models/Qwen3-8B", "| Target model | /models/Qwen3-8B |",
                 "| Training data | `/data/chats_a.jsonl`, `/data/chats_b.parquet` |",
                 "| Optimiser steps | 6,000 |", "| Training tokens seen | 123,456,789 |",
                 "| 3.214 |", "`torchrun --nproc-per-node 8 -m launcher.train topology=t2d6`",
                 "| code_version | git 1a2b3c4 (dirty) |", "| torch | 2.11.0 |", "| transformers | 5.17.0 |",
                 "not measured yet",  # no real acceptance length before launcher.evaluate
                 "| Block size | 4 |", "| Target layers read (HF numbering) | `1`, `3` of 4 |",
                 "| Mask token id | 49 |", "vllm serve /models/Qwen3-8B"):
        assert text in card, text
    meta = front_matter(card)  # what the Hub parses: valid YAML, and the facts come back intact
    assert meta["library_name"] == "transformers" and meta["dflash_training"] == INFO
    assert read_card_info(tmp_path / "out") == INFO


def test_evaluation_adds_the_real_acceptance_length_and_keeps_the_rest(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out", card=INFO)
    record_acceptance_length(tmp_path / "out", 4.0625, {"prompts": 64, "max_new_tokens": 256})
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| Acceptance length (real speculative decoding, launcher.evaluate, engine hf) | 4.062 (max_new_tokens " \
           "256, prompts 64) |" in card
    assert "engine=hf`" not in card and "evaluate.engine=vllm`)" in card   # only the served row is still to measure
    assert "| Training tokens seen | 123,456,789 |" in card
    assert read_card_info(tmp_path / "out") == {**INFO, "acceptance_length": 4.0625,
                                                "acceptance_eval": {"prompts": 64, "max_new_tokens": 256}}
    assert (tmp_path / "out" / "README.md").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")) == []


def test_each_engine_keeps_its_own_acceptance_and_the_three_are_compared(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out", card=INFO)
    record_acceptance_length(tmp_path / "out", 3.0, {"prompts": 16})
    record_acceptance_length(tmp_path / "out", 3.3, {"prompts": 16}, engine="vllm")
    info = read_card_info(tmp_path / "out")
    assert info["acceptance_length"] == 3.0 and info["served_acceptance_length"] == 3.3
    assert info["served_acceptance_eval"] == {"prompts": 16}
    table = acceptance_comparison(info).splitlines()
    assert table[1].endswith("(+7.1% against real decoding)")   # held-out 3.214 against 3.0
    assert table[2].rstrip().endswith("3.000") and "+10.0%" in table[3]
    assert "not measured" in acceptance_comparison({"heldout_tau": 3.2}).splitlines()[2]


def test_card_without_facts_says_what_is_missing(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\n") and "# DFlash drafter\n" in card
    assert "| Target model | not recorded |" in card and "## Provenance\n\nnot recorded" in card
    assert read_card_info(tmp_path / "out") == {}


def test_table_cells_survive_pipes_and_newlines(tmp_path):
    info = {"target": "t", "command": "python -m x | tee log", "note": "two\nlines"}
    export_drafter(drafter_to_export(), tmp_path / "out", card=info)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| Command | `python -m x \\| tee log` |" in card and "| note | two lines |" in card
    assert read_card_info(tmp_path / "out") == info


def test_a_dflash2_card_shows_its_selector_figures_and_its_lift(tmp_path):
    from tests.test_export import dflash2_to_export
    figures = {"heldout_unary_tau": 2.9, "heldout_oracle_tau": 4.5, "heldout_recall_at_k": 0.93,
               "heldout_selector_acc": 0.71}
    export_drafter(dflash2_to_export(), tmp_path / "out", card={**INFO, **figures})
    card = (tmp_path / "out" / "README.md").read_text()
    for text in ("# DFlash 2 drafter for /models/Qwen3-8B", "| Selector top-K / rank | 5 / 6 |",
                 "| Held-out tau of the unary top-1 walk (DFlash 2 without its selector) | 2.9 |",
                 "| Held-out recall@K (the target's token among the unary top-K) | 0.93 |"):
        assert text in card, text
    assert "| heldout_" not in card   # each under its label, not again under its key
    table = acceptance_comparison(read_card_info(tmp_path / "out")).splitlines()
    assert "unary top-1 walk" in table[2] and table[2].rstrip().endswith("2.900")
    export_drafter(drafter_to_export(), tmp_path / "dflash", card=INFO)   # a DFlash's card has none of them
    assert "unary top-1" not in (tmp_path / "dflash" / "README.md").read_text()
