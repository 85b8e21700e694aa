"""Evaluation tools. `megassm-eval` (cli.py): perplexity as a function of context length, streaming long
held-out documents through the model in windows with carried recurrent state (context.py)."""
from .context import context_length_eval, default_edges, position_losses

__all__ = ["context_length_eval", "default_edges", "position_losses"]
