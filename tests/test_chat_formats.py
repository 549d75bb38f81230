"""Thinking and tool-calling conversations under chat templates that behave like the public Qwen3
template (reasoning, tool calls, history rewriting), a Llama-3.1-style one and a gpt-oss
(harmony) style one: the loss mask is checked token by token against the rendered string;
prompts render like training data."""
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_core.data import ChatRenderer, DataError, load_samples, normalise_record
from dflash_core.data import render as render_module
from dflash_core.data.prompts import encode_prompts, iter_prompts, stop_token_ids
from tests.test_data import supervised_runs, write_jsonl

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name, description in (("get_weather", "Current weather in a city"), ("get_time", "Local time in a city"))]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


THINKING = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 17 * 3?"},
    {"role": "assistant", "reasoning_content": "17 + 17 + 17 = 51.", "content": "17 * 3 = 51."},
    {"role": "user", "content": "And 51 / 3?"},
    {"role": "assistant", "content": "<think>\n51 / 3 = 17 because 17 * 3 = 51.\n</think>\n\n51 / 3 = 17."},
]
TOOL_CALLING = [
    {"role": "system", "content": "You are a travel assistant."},
    {"role": "user", "content": "Weather and local time in Paris?"},
    {"role": "assistant", "reasoning_content": "I need both tools.", "content": "",
     "tool_calls": [call("get_weather", city="Paris"), call("get_time", city="Paris")]},
    {"role": "tool", "name": "get_weather", "content": '{"temp_c": 18, "sky": "cloudy"}'},
    {"role": "tool", "name": "get_time", "content": '{"time": "14:05"}'},
    {"role": "assistant", "reasoning_content": "Both answers are in.",
     "content": "In Paris it is 18 C and cloudy; the local time is 14:05."},
    {"role": "user", "content": "Should I take an umbrella?"},
    {"role": "assistant", "reasoning_content": "Cloudy, no rain reported.", "content": "Probably not: it is dry."},
]
# Llama 3.1 templates take one tool call per turn.
SINGLE_TOOL_CALL = [*TOOL_CALLING[:2], {**TOOL_CALLING[2], "tool_calls": [call("get_weather", city="Paris")]},
                    *TOOL_CALLING[3:4], *TOOL_CALLING[5:]]
STYLES = {  # template, special tokens, other added tokens, tokenizer roles, assistant header, end of turn
    "qwen3": ("qwen3_style.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("llama3_style.jinja",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "harmony": ("harmony_style.jinja",
                ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"], [],
                {"eos_token": "<|return|>"}, "<|start|>assistant", "<|return|>"),
}


def build_tokenizer(style: str):
    template, specials, added, roles, _, _ = STYLES[style]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([json.dumps(c) for c in (THINKING, TOOL_CALLING, TOOLS)], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=(TEMPLATES / template).read_text(),
                                        name_or_path=f"{style}-style", **roles)
    tokenizer.add_tokens(added)  # Qwen3's <think>, <tool_call>...: added tokens, not special ones
    return tokenizer


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def style(request):
    return request.param, build_tokenizer(request.param)


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen3")


def load_one(tmp_path, tokenizer, record, **kwargs):
    samples, stats = load_samples(write_jsonl(tmp_path / "chat.jsonl", [record]), tokenizer, max_length=4096, **kwargs)
    assert len(samples) == 1 and stats["kept"] == 1
    return samples[0]


def expected_spans(text: str, header: str, end: str) -> list[tuple[int, int]]:
    """Each assistant turn after its header through its end-of-turn token, read off the text."""
    return [m.span(1) for m in re.finditer(re.escape(header) + "(.*?" + re.escape(end) + ")", text, re.DOTALL)]


def assert_mask_is_exactly(tokenizer, sample, text, spans):
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert sample["input_ids"].tolist() == encoded["input_ids"]
    for position, (start, end) in enumerate(encoded["offset_mapping"]):
        assert not any(start < edge < end for span in spans for edge in span), "a token straddles a span edge"
        inside = any(a <= start and end <= b for a, b in spans)
        assert int(sample["loss_mask"][position]) == inside, f"token {position} {text[start:end]!r}"
    masked = [tokenizer.decode(sample["input_ids"][s:e]) for s, e in supervised_runs(sample["loss_mask"])]
    assert masked == [text[a:b] for a, b in spans]
    return masked


def test_thinking_conversation_mask_is_exactly_the_assistant_spans(tmp_path, style):
    name, tokenizer = style
    text = tokenizer.apply_chat_template(THINKING, tokenize=False)
    spans = expected_spans(text, *STYLES[name][4:])
    masked = assert_mask_is_exactly(tokenizer, load_one(tmp_path, tokenizer, {"messages": THINKING}), text, spans)
    assert len(masked) == 2 and masked[1].startswith("<think>\n51 / 3 = 17 because")  # reasoning is supervised
    assert "And 51 / 3?" not in "".join(masked) and "careful math tutor" not in "".join(masked)
    if name == "qwen3":  # the template drops the reasoning of turns before the last user query
        assert "17 + 17 + 17" not in text and masked[0] == "17 * 3 = 51.<|im_end|>"


def test_tool_calling_conversation_mask_is_exactly_the_assistant_spans(tmp_path, style):
    name, tokenizer = style
    messages = TOOL_CALLING if name == "qwen3" else SINGLE_TOOL_CALL
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    spans = expected_spans(text, *STYLES[name][4:])
    sample = load_one(tmp_path, tokenizer, {"messages": messages, "tools": TOOLS})
    masked = "".join(assert_mask_is_exactly(tokenizer, sample, text, spans))
    assert len(spans) == 3 and '"get_weather"' in masked and "18 C and cloudy" in masked  # the call, the answers
    assert "temp_c" not in masked and "Weather and local time" not in masked  # tool output, user: never
    if name == "qwen3":
        assert "Cloudy, no rain reported." in masked and masked.count("<tool_call>") == 2
        # History rewriting: once the umbrella question follows, the first exchange loses its
        # reasoning, so the rendering of the turns before the first answer is no prefix of the text.
        assert "I need both tools." not in text
        head = tokenizer.apply_chat_template(messages[:5], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert "I need both tools." in head and not text.startswith(head)


def test_turns_with_special_tokens_inside_and_an_ambiguous_fast_path(tmp_path):
    tokenizer = build_tokenizer("harmony")
    messages = [THINKING[1], {"role": "assistant", "reasoning_content": "Use the tool.", "content": "",
                              "tool_calls": [call("get_weather", city="Paris")]},
                {"role": "tool", "name": "get_weather", "content": "18 C"},
                {"role": "assistant", "reasoning_content": "Got it.", "content": "It is 18 C."},
                {"role": "assistant", "content": "Anything else?"}]
    sample = load_one(tmp_path, tokenizer, {"messages": messages})
    assert [tokenizer.decode(sample["input_ids"][s:e]) for s, e in supervised_runs(sample["loss_mask"])] == [
        ('<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.get_weather'
         '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
        "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant<|channel|>final<|message|>It is 18 C.<|end|>",
        "<|channel|>final<|message|>Anything else?<|return|>"]
    # Turn 3's own text holds the template text that follows it (<|end|><|start|>assistant...final):
    # the one-probe path must notice and leave it to the per-turn probes.
    renderer, record = ChatRenderer(tokenizer), normalise_record({"messages": messages})
    full = renderer.render(record.messages)
    probes = [render_module._with_sentinel(m, chr(0xE000 + k)) if m["role"] == "assistant" else m
              for k, m in enumerate(record.messages)]
    sentinels = [chr(0xE000 + k) for k in (1, 3, 4)]
    assert render_module._regions_at_once(full, renderer.render(probes), sentinels) is None


def test_one_probe_and_per_turn_probes_agree(style):
    _, tokenizer = style
    renderer = ChatRenderer(tokenizer)
    for messages in (THINKING, SINGLE_TOOL_CALL):
        record = normalise_record({"messages": messages, "tools": TOOLS})
        full = renderer.render(record.messages, record.tools)
        turns = [k for k, m in enumerate(record.messages) if m["role"] == "assistant"]
        probes = [render_module._with_sentinel(m, chr(0xE000 + k)) if k in turns else m
                  for k, m in enumerate(record.messages)]
        at_once = render_module._regions_at_once(full, renderer.render(probes, record.tools),
                                                 [chr(0xE000 + k) for k in turns])
        assert at_once is not None
        assert at_once == [renderer._region_alone(full, record, k, chr(0xE000 + k)) for k in turns]


def test_enable_thinking_reaches_the_template_and_the_cache_key(tmp_path, qwen):
    record = {"messages": [THINKING[1], {"role": "assistant", "content": "51."}]}
    cache = tmp_path / "cache"
    runs = {}
    for kwargs in ({}, {"enable_thinking": False}):
        sample = load_one(tmp_path, qwen, record, chat_template_kwargs=kwargs, cache_dir=cache)
        runs[str(kwargs)] = [qwen.decode(sample["input_ids"][s:e]) for s, e in supervised_runs(sample["loss_mask"])]
    # Thinking on: the model writes the (empty) think block. Off: the prompt holds it, so only the answer is supervised.
    assert runs == {"{}": ["<think>\n\n</think>\n\n51.<|im_end|>"], "{'enable_thinking': False}": ["51.<|im_end|>"]}
    assert len(list(cache.glob("*/meta.json"))) == 2


def test_a_conversation_the_template_cannot_render_is_a_bad_line(tmp_path):
    tokenizer = build_tokenizer("llama3")
    path = write_jsonl(tmp_path / "calls.jsonl", [{"messages": SINGLE_TOOL_CALL, "tools": TOOLS},
                                                  {"messages": TOOL_CALLING, "tools": TOOLS}])  # two calls in a turn
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: the chat template cannot render") + ".*single tool"):
        load_samples(path, tokenizer, max_length=4096)
    samples, stats = load_samples(path, tokenizer, max_length=4096, on_bad_line="skip")
    assert len(samples) == 1 and stats["skipped_unrenderable"] == stats["bad_lines_skipped"] == 1
    assert stats["first_bad_line"].startswith(f"{path} line 2:")
    prompts = list(iter_prompts(path))
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: the chat template cannot render")):
        encode_prompts(tokenizer, prompts, max_tokens=4096)


def test_every_source_format_gives_the_same_samples(tmp_path, qwen):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "t", "messages": TOOL_CALLING, "tools": TOOLS}, {"id": "m", "messages": THINKING, "tools": TOOLS}]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")  # Arrow: absent keys come back as null
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = {name: load_samples(tmp_path / name, qwen, max_length=4096)[0]
              for name in ("chat.jsonl", "chat.parquet", "saved")}
    for samples in loaded.values():
        assert len(samples) == 2
        for got, want in zip(samples, loaded["chat.jsonl"]):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])


def test_tool_call_shapes_normalise_to_one_form():
    expected = normalise_record({"messages": [TOOL_CALLING[1], {"role": "assistant", "content": None,
                                                                "tool_calls": [call("get_weather", city="Paris")]},
                                              {"role": "tool", "name": "get_weather", "content": "18"}]})
    flat = {"messages": [TOOL_CALLING[1], {"role": "assistant", "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]},
        {"role": "function", "name": "get_weather", "content": "18"}]}
    sharegpt = {"conversations": [{"from": "human", "value": TOOL_CALLING[1]["content"]},
                                  {"from": "function_call",
                                   "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                                  {"from": "observation", "value": "18", "name": "get_weather"}]}
    assert normalise_record(flat) == normalise_record(sharegpt) == expected
    assert expected.messages[1] == {"role": "assistant", "content": "",
                                    "tool_calls": [call("get_weather", city="Paris")]}
    for bad, reason in [({"role": "user", "content": "x", "tool_calls": [call("f")]}, "only assistant turns"),
                        ({"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]},
                         "needs a function name"),
                        ({"role": "assistant", "content": "", "tool_calls": [call("f") | {"function": {
                            "name": "f", "arguments": "[1]"}}]}, "must be an object")]:
        with pytest.raises(ValueError, match=reason):
            normalise_record({"messages": [bad]})


# ------------------------------------------------------------------------- prompts (evaluation, regeneration)
def test_prompts_render_with_tools_and_template_kwargs_like_training(tmp_path, qwen):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 7, "messages": TOOL_CALLING[:6], "tools": TOOLS},
                                              {"text": "plain"}, {"messages": [THINKING[2]]}])
    stats = {}
    prompts = list(iter_prompts(path, stats=stats))
    assert [(p.id, p.location, p.messages[-1]["role"]) for p in prompts] == [(7, f"{path} line 1", "tool")]
    assert stats["no_conversation"] == stats["no_prompt"] == 1
    [prompt] = encode_prompts(qwen, prompts, max_tokens=4096, chat_template_kwargs={"enable_thinking": False})
    text = qwen.decode(prompt.token_ids)
    assert text == qwen.apply_chat_template(TOOL_CALLING[:5], tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=False)
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    too_long = {}
    assert encode_prompts(qwen, prompts, max_tokens=10, stats=too_long) == [] and too_long["too_long"] == 1


@pytest.mark.parametrize("name", list(STYLES))
def test_stop_ids_include_the_templates_end_of_turn(name):
    tokenizer = build_tokenizer(name)
    end_of_turn = tokenizer.convert_tokens_to_ids(STYLES[name][5])
    assert set(stop_token_ids(tokenizer)) == {tokenizer.eos_token_id, end_of_turn}
    config = type("GenerationConfig", (), {"eos_token_id": [3, end_of_turn]})()
    assert set(stop_token_ids(tokenizer, config)) == {tokenizer.eos_token_id, end_of_turn, 3}
