"""Losslessness explained (issue 44): a speculative output that leaves plain greedy decoding names the
position, the two candidates and the plain run's logit margin between them, judged a near-tie of the
compute dtype's rounding or a real difference; verification and plain decoding choose from fp32 logits."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.serving.speculative import fp32_logits, greedy_decode, next_token_logits, upcast_to_fp32
from launcher.evaluate import format_table, plain_margin, real_differences
from launcher.serving.acceptance import NEAR_TIE, NOT_A_TIE, prompt_row, summarize, tie_tolerance
from launcher.serving.served_evaluate import TOP_LOGPROBS, served_margin

PROMPT = [3, 17, 42, 8, 25]
POSITION = 3   # where the constructed speculative output leaves the plain one


def _target(dtype=torch.float32):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).to(dtype).eval()


def _report(rows):
    return {"engine": "hf", "walk": "unary", **summarize(rows, 4, speculative_s=1.0, greedy_s=1.0)}


def _diverged(target, speculative_token):
    """The plain output and a speculative one that takes `speculative_token` at POSITION instead."""
    reference = greedy_decode(target, PROMPT, 6)
    tokens = [*reference[:POSITION], speculative_token, *reference[POSITION + 1:]]
    return reference, tokens


def test_identical_outputs_give_no_divergence():
    reference = [5, 6, 7]
    rows = [prompt_row(PROMPT, reference, 1, [1, 0, 0], reference, measure=None) for _ in range(2)]
    assert all(row["lossless"] and "divergence" not in row for row in rows)
    report = _report(rows)
    assert report["lossless_counts"] == {"identical": 2, "near_ties": 0, "not_ties": 0}
    assert "lossless                   yes (2/2 identical to plain greedy decoding)" in format_table(report)
    assert real_differences(report) is None


def test_a_tie_of_the_two_top_logits_is_a_near_tie_and_a_far_token_is_not():
    target = _target()
    reference = greedy_decode(target, PROMPT, 6)
    plain = reference[POSITION]
    logits = next_token_logits(target, PROMPT + reference[:POSITION])
    runner_up, last = int(logits.topk(2).indices[1]), int(logits.argmin())
    with torch.no_grad():   # the runner-up's logit made the plain token's: a tie of the model itself
        target.lm_head.weight[runner_up] = target.lm_head.weight[plain]
    measure = plain_margin(target)

    tie = prompt_row(PROMPT, _diverged(target, runner_up)[1], 1, [0, 0, 0], reference, measure)["divergence"]
    assert (tie["position"], tie["plain_token"], tie["speculative_token"]) == (POSITION, plain, runner_up)
    assert tie["margin"] == tie["margin_fp32"] == 0.0 and tie["verdict"] == NEAR_TIE

    far = prompt_row(PROMPT, _diverged(target, last)[1], 1, [0, 0, 0], reference, measure)["divergence"]
    expected = float(logits[plain] - logits[last])
    assert far["speculative_token"] == last and far["margin"] == pytest.approx(expected, rel=1e-6)
    assert far["margin"] > far["tolerance"] and far["verdict"] == NOT_A_TIE


def test_a_bf16_evaluation_reads_the_margin_in_bf16_and_fp32_and_keeps_its_weights():
    target = _target(torch.bfloat16)
    weights = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    reference = greedy_decode(target, PROMPT, 6)
    logits = next_token_logits(target, PROMPT + reference[:POSITION])
    other = int(logits.topk(2).indices[1])
    record = prompt_row(PROMPT, _diverged(target, other)[1], 1, [0, 0, 0], reference,
                        plain_margin(target))["divergence"]
    with upcast_to_fp32(target):
        fp32 = next_token_logits(target, PROMPT + reference[:POSITION])
    plain = reference[POSITION]
    assert record["margin"] == float(logits[plain] - logits[other])
    assert record["margin_fp32"] == float(fp32[plain] - fp32[other]) != record["margin"]
    magnitude = max(abs(float(logits[plain])), abs(float(logits[other])))
    assert record["tolerance"] == tie_tolerance("bfloat16", magnitude) > tie_tolerance("float32", magnitude)
    state = target.state_dict()
    assert all(state[name].dtype == tensor.dtype and torch.equal(state[name], tensor)
               for name, tensor in weights.items())


def test_verification_and_plain_decoding_choose_from_fp32_logits():
    target = _target(torch.bfloat16)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state[0, -1]
        with fp32_logits(target):
            logits = target(ids).logits[0, -1]
        after = target(ids).logits[0, -1]
    assert logits.dtype == torch.float32 and after.dtype == torch.bfloat16   # undone on leaving
    torch.testing.assert_close(logits, hidden.float() @ target.lm_head.weight.float().T)   # fp32 rounding alone
    fp32_target = _target()
    with fp32_logits(fp32_target):   # an fp32 head is left alone
        assert "forward" not in vars(fp32_target.lm_head)


def test_the_table_names_near_ties_and_warns_of_real_differences():
    def measure(margin):
        return lambda ids, plain, speculative: {"margin": margin, "tolerance": 0.5}
    same = prompt_row(PROMPT, [1, 2, 3], 1, [0, 0, 0], [1, 2, 3])
    near = prompt_row(PROMPT, [1, 9, 3], 1, [0, 0, 0], [1, 2, 3], measure(0.004))
    far = prompt_row(PROMPT, [1, 2, 9], 1, [0, 0, 0], [1, 2, 3], measure(2.5))
    short = prompt_row(PROMPT, [1, 2], 1, [0, 0, 0], [1, 2, 3], measure(0.0))
    assert near["divergence"] == {"position": 1, "plain_token": 2, "speculative_token": 9, "margin": 0.004,
                                  "tolerance": 0.5, "verdict": NEAR_TIE}
    assert short["divergence"]["verdict"] == NOT_A_TIE and short["divergence"]["margin"] is None

    report = _report([same, near])
    assert report["lossless"] is False
    assert report["lossless_counts"] == {"identical": 1, "near_ties": 1, "not_ties": 0}
    assert ("NO (1/2 identical to plain greedy decoding; 1 near-ties: margins 0.004 at positions 1; "
            "0 real differences)") in format_table(report)

    report = _report([same, near, far, short])
    assert report["lossless_counts"] == {"identical": 1, "near_ties": 1, "not_ties": 2}
    warning = ("2 real differences) WARNING, speculation changed the output: prompt 2 at generated token 2 (margin "
               "2.5 > tolerance 0.5); prompt 3 at generated token 2 (one output ends here)")
    assert warning in format_table(report)


class _Server:
    """The plain server's answer to a logprobs request: {token id: log-probability}."""

    def __init__(self, logprobs):
        self.logprobs, self.asked = logprobs, []

    def next_token_logprobs(self, ids, count):
        self.asked.append((list(ids), count))
        return self.logprobs


def test_the_served_margin_is_the_plain_servers_logprob_difference():
    server = _Server({7: -0.69, 9: -0.70, 11: -4.0})
    record = prompt_row(PROMPT, [5, 9], 1, [0, 0, 0], [5, 7], served_margin(server, "float32"))["divergence"]
    assert server.asked == [(PROMPT + [5], TOP_LOGPROBS)]
    assert record["margin"] == pytest.approx(0.01) and record["verdict"] == NOT_A_TIE   # fp32 ULPs are tiny
    assert prompt_row(PROMPT, [5, 9], 1, [0, 0, 0], [5, 7],
                      served_margin(server, "bfloat16"))["divergence"]["verdict"] == NEAR_TIE
    missing = prompt_row(PROMPT, [5, 3], 1, [0, 0, 0], [5, 7], served_margin(server, "bfloat16"))["divergence"]
    assert missing["margin"] is None and missing["verdict"] == NOT_A_TIE and "top 20" in missing["why"]
