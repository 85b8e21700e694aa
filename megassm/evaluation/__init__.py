"""Evaluation tools (docs/evaluation.md). `megassm-eval context` (cli.py, context.py): perplexity as a function
of context length, streaming long held-out documents in windows with carried recurrent state; `megassm-eval
harness` (harness.py): lm-evaluation-harness tasks; `megassm-generate` (generation.py): decoding through the
recurrent step. loading.py turns a checkpoint into one single-device model with its tokenizer."""
from .context import context_length_eval, default_edges, position_losses
from .generation import generate

__all__ = ["context_length_eval", "default_edges", "position_losses", "generate"]
