"""Fake (meta) kernels, derived from each op's table entry.

An op's outputs are declared natively as shape and dtype expressions over its inputs and
static arguments (`kernels/src/op.rs`, `Output`); this module evaluates them on the
(possibly symbolic) shapes of the fake inputs, so `torch.compile` and `torch.export` see
each op's output shapes without running it. A native test checks every expression against
the real plans' result types, and `torch.library.opcheck` checks the fakes against the real
kernels.

Shape expressions: `x` (x's shape), `x | y` (x's shape, y's when optional x is None), or
`[item, ...]` with items `*x` (all of x's dims), `*x[a:b]`, `x.i` (dim i, negative from
the end), an integer static's name, an integer, a product `a * b` and `flag ? a : b` on a
bool static. Dtype expressions: an input's name or
a dtype (`f32`, `bf16`, `i32`, `i8`, `bool`).
"""

import torch

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32, "i8": torch.int8, "bool": torch.bool,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _split(s):
    """Splits on commas outside brackets."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(s[start:i])
            start = i + 1
    if s[start:].strip():
        out.append(s[start:])
    return [p.strip() for p in out]


def _dim(item, env):
    if "?" in item:
        cond, rest = item.split("?", 1)
        a, b = rest.split(":", 1)
        return _dim(a.strip() if env[cond.strip()] else b.strip(), env)
    if "/" in item:
        num, den = item.rsplit("/", 1)
        return _dim(num.strip(), env) // int(den)
    value = 1
    for atom in item.split("*"):
        atom = atom.strip()
        if atom.lstrip("-").isdigit():
            v = int(atom)
        elif "." in atom:
            name, d = atom.split(".", 1)
            v = env[name.strip()].shape[int(d)]
        else:
            v = env[atom]
        value = value * v
    return value


def shape_of(expr, env):
    """The shape of `expr` (see the module docs); `env` maps names to tensors and statics."""
    expr = expr.strip()
    if not expr.startswith("["):
        names = [n.strip() for n in expr.split("|")]
        return tuple(next((env[n] for n in names if env[n] is not None), env[names[0]]).shape)
    dims = []
    for item in _split(expr[1:-1]):
        if item.startswith("*"):
            name, _, rng = item[1:].partition("[")
            shape = tuple(env[name.strip()].shape)
            if rng:
                lo, _, hi = rng.rstrip("]").partition(":")
                shape = shape[int(lo) if lo.strip() else None : int(hi) if hi.strip() else None]
            dims.extend(shape)
        else:
            dims.append(_dim(item, env))
    return tuple(dims)


def dtype_of(expr, env):
    return _DTYPES[expr] if expr in _DTYPES else env[expr].dtype


def check_one_device(op, tensors):
    """Raises `error[operand-device]` unless the `(name, tensor)` pairs of a call (Nones
    skipped) are all on one device. Returns the first tensor."""
    tensors = [(n, t) for n, t in tensors if t is not None]
    first_name, like = tensors[0]
    for n, t in tensors[1:]:
        if t.device != like.device:
            raise ValueError(
                f"error[operand-device]: kernel `{op}`, input `{n}`: a tensor on {t.device}, "
                f"`{first_name}` is on {like.device}\n  help: pass every tensor on one device"
            )
    return like


def make_fake(spec):
    """The fake kernel of an op (`spec` is the op's `OpSpec`)."""
    outputs, names, defaults = spec.outputs, spec.arg_names, spec.defaults

    def fake(*args):
        args = args + defaults[len(args):]
        env = dict(zip(names, args))
        # The Meta kernel also runs when only *some* inputs are meta: results on the first
        # tensor's device would be uninitialised CPU memory. One device per call.
        like = check_one_device(spec.name, [(n, t) for n, t in zip(names, args) if isinstance(t, torch.Tensor)])
        results = []
        for _, shape, dtype in outputs:
            results.append(like.new_empty(shape_of(shape, env), dtype=dtype_of(dtype, env)))
        return results[0] if spec.single else tuple(results)

    fake.__name__ = f"tessera_{spec.name}_fake"
    return fake
