"""tests/hf_logits.py for several exports in one process (one transformers import for all of them):

    python tests/hf_logits_many.py TOKENS.pt RESULT.pt OUT_DIR [OUT_DIR ...]

RESULT.pt: {OUT_DIR: {"logits", "class", "info"}}. A process of its own for the reason tests/hf_logits.py gives; any
working directory (the repository root's kernels/ is no package: docs/architecture.md "Layout")."""
import sys

import torch
import transformers

tokens_path, result_path, *outs = sys.argv[1:]
tokens = torch.load(tokens_path)
result = {}
for out in outs:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    hf.eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    result[out] = {"logits": logits, "class": type(hf).__name__,
                   "info": {k: list(v) for k, v in info.items()
                            if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}}
torch.save(result, result_path)
