"""Synthetic recall tasks (induction heads, selective copying, MQAR) and a runner that trains a small model
on one and reports accuracy against sequence length: docs/seeds.md, "Synthetic tasks"."""
from .tasks import TASKS, coffee_induction, induction_heads, make_batch, mqar, selective_copying

__all__ = ["TASKS", "coffee_induction", "induction_heads", "make_batch", "mqar", "selective_copying"]
