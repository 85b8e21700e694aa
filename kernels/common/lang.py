"""Small replacements for triton.language's standard-library helpers (tl.sum, tl.max, tl.cumsum, tl.sigmoid;
tl.zeros is replaced by tl.full at the call sites), and tsoftplus, shared by the ops' Triton kernels.

Those are @triton.jit functions decorated when triton.language is first imported; if that import happened
before TRITON_INTERPRET=1 was set (torch imports triton for torch.compile / the flop counter), they are
compiled-mode functions that the CPU interpreter cannot call. These helpers are decorated with the kernels,
and use only builtins (tl.reduce / tl.associative_scan with the standard sum or max combiner, which the
interpreter recognizes without calling it). On the GPU they compile to exactly what tl.sum / tl.max / tl.cumsum do.
"""
import triton
import triton.language as tl


@triton.jit
def tsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def tmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def tcumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def trevcumsum(x, axis: tl.constexpr):
    """Suffix sums: element i is the sum of elements i, i + 1, ... along axis."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine, reverse=True)


@triton.jit
def tsigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tsoftplus(x):
    # max(x, 0) + log1p(exp(-|x|)), log1p by Goldberg's trick (accurate for tiny arguments)
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    l1p = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    return tl.maximum(x, 0.0) + l1p
