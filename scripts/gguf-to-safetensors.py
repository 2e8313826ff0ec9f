"""Converts a Llama-family GGUF into the safetensors folder vLLM loads.

Usage: gguf-to-safetensors.py MODEL.gguf OUT_DIR

transformers' GGUF loader dequantizes the weights to float32. Its
save_pretrained refuses a model it marks GGUF-quantized, so the state dict is
written with safetensors directly (lm_head.weight left out: the embeddings are
tied) beside a config.json without quantization_config, and the tokenizer
(with its chat template) is saved as usual.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    gguf, out = sys.argv[1], sys.argv[2]
    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {len(state)} tensors, {sum(t.numel() for t in state.values())} parameters")


if __name__ == "__main__":
    main()
