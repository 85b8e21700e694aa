"""Helpers the ops' Triton kernels share (no op of their own): `lang` (@triton.jit replacements for tl.sum, tl.max,
tl.cumsum, tl.sigmoid that the CPU interpreter can call, and tsoftplus), `out` (the wrappers' output buffers)."""
