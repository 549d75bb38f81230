"""Run by .venv-vllm's Python (tests/test_dflash2_engine.py): vLLM 0.32's own DFlash 2 modules on
CPU, loaded with a DFlash 2 export's tensors, applied to the test's inputs.

    python vllm_dflash2_probe.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

Writes, per layer i and convolution (attention_conv, mlp_conv), what DFlashGroupedConv.prepare
hands the sublayer (`layers.i.conv.before`) and what finish makes of the sublayer's output
(`layers.i.conv.after`); the unary top-K of LogitsProcessor.get_top_k_tokens with the export's
output_multiplier and final_logit_softcapping (`candidate_ids`, `unary`); CandidateSelector's
lattice on those candidates (`scores`); and, as JSON on stdout, vLLM's parameter names and shapes
of those modules. Imports nothing of the project: the two sides share only files."""
import json
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_dflash2 import CandidateSelector, DFlashGroupedConv


def loaded(module, tensors, prefix, names):
    """Fill `module`'s parameters from the export through each one's own weight_loader, then
    finish loading as vLLM's model loader does (the CPU linear layers pick their GEMM there)."""
    for name, param in module.named_parameters():
        full = f"{prefix}.{name}"
        names[full] = list(param.shape)
        if full in tensors:
            getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensors[full])
    for sub in module.modules():
        if hasattr(sub, "quant_method"):
            sub.quant_method.process_weights_after_loading(sub)
    return module


def main(export_dir, inputs_path, out_path):
    config = json.load(open(f"{export_dir}/config.json"))
    draft = config["dflash_config"]
    tensors, inputs = load_file(f"{export_dir}/model.safetensors"), load_file(inputs_path)
    hidden_size, dtype = config["hidden_size"], torch.float32
    out, names = {}, {}
    # Serving reads the block as 1 bonus + num_speculative_tokens queries: block_size rows.
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        with torch.no_grad():
            for i in range(config["num_hidden_layers"]):
                for conv_name in ("attention_conv", "mlp_conv"):
                    prefix = f"layers.{i}.{conv_name}"
                    conv = loaded(DFlashGroupedConv(hidden_size=hidden_size, taps=int(draft["conv_kernel_size"]),
                                                    group_size=int(draft["conv_group_size"]),
                                                    block_size=draft["block_size"], params_dtype=dtype,
                                                    prefix=prefix), tensors, prefix, names)
                    before, coefficients = conv.prepare(inputs[f"{prefix}.input"])
                    out[f"{prefix}.before"] = before
                    out[f"{prefix}.after"] = conv.finish(inputs[f"{prefix}.output"], coefficients)
            softcap = float(draft.get("final_logit_softcapping") or 0.0)
            processor = LogitsProcessor(config["vocab_size"], scale=float(draft.get("output_multiplier", 1.0)),
                                        soft_cap=softcap if softcap > 0 else None)
            lm_head = loaded(ParallelLMHead(config["vocab_size"], hidden_size, params_dtype=dtype, prefix="lm_head"),
                             {"lm_head.weight": inputs["lm_head"]}, "lm_head", {})
            hidden = inputs["hidden"]  # [R, S, H]: the drafted slots' final-normed states
            top_k = int(draft["selector_top_k"])
            ids, unary = processor.get_top_k_tokens(lm_head, hidden.flatten(0, 1), top_k)
            ids, unary = ids.view(*hidden.shape[:2], top_k), unary.view(*hidden.shape[:2], top_k)
            selector = loaded(CandidateSelector(hidden_size=hidden_size, vocab_size=config["vocab_size"],
                                                rank=int(draft["selector_rank"]), top_k=top_k, params_dtype=dtype,
                                                prefix="candidate_selector"), tensors, "candidate_selector", names)
            out.update(candidate_ids=ids, unary=unary,
                       scores=selector(ids, unary, hidden, inputs["anchor_ids"]))
    save_file({k: v.contiguous() for k, v in out.items()}, out_path)
    print(json.dumps(names))


if __name__ == "__main__":
    main(*sys.argv[1:])
