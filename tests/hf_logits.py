"""Load an exported directory with transformers and write its logits for given tokens, in a process of its own:

    python tests/hf_logits.py OUT_DIR TOKENS.pt RESULT.pt

The interop tests compare these logits with ours. A transformers model loaded inside a pytest-xdist worker was
followed, at random, by `ValueError: vector::reserve` or a segfault in later custom-op calls of the same worker
(tests/test_seed_scan.py under the Triton interpreter, torch 2.13 CPU; cause not found), so the load and the
forward run here instead."""
import sys

import torch
import transformers

out, tokens_path, result_path = sys.argv[1:4]
hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
hf.eval()
with torch.no_grad():
    logits = hf(torch.load(tokens_path)).logits
torch.save({"logits": logits, "class": type(hf).__name__, "eos": hf.config.eos_token_id,
            "info": {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}},
           result_path)
