#!/usr/bin/env python3
"""Wrap a Mosaic kernel body into a minimal StableHLO module (stdlib only).

  python wrap_mosaic.py BODY.mlir --arg 512x512xf32 --arg 512x512xf32 \
      --result 512x512xf32 [--kernel-name NAME] [--vmem-limit BYTES] > out.stablehlo.mlir

BODY may be
  * the stable serialized TEXT form (generic syntax, `stable_mosaic.*` op names):
    emitted with "serialization_format": 1  (the form Tessera emits);
  * plain pretty Mosaic text: emitted without serialization_format
    (use --format pretty to force).
Shapes: `AxBxT` or scalar `T` (e.g. `i32`) for rank 0. Multiple --result
flags produce a tuple-returning custom call (one result_layouts entry each).
Operand order of the custom call is exactly the kernel's non-grid argument
order minus scratch: [scalar-prefetch..., inputs...]; results are the outputs.
"""
import argparse
import base64
import json
import re
import sys


def parse_type(s):
    parts = s.split("x")
    dims, elt = parts[:-1], parts[-1]
    return [int(d) for d in dims], elt


def tensor_type(s):
    dims, elt = parse_type(s)
    return "tensor<" + "".join(f"{d}x" for d in dims) + elt + ">"


def layout(s):
    dims, _ = parse_type(s)
    r = len(dims)
    if r == 0:
        return "dense<> : tensor<0xindex>"
    minor_to_major = list(range(r - 1, -1, -1))
    v = str(minor_to_major[0]) if r == 1 else str(minor_to_major).replace(" ", "")
    return f"dense<{v}> : tensor<{r}xindex>"


def detect_format(body):
    return "stable" if "stable_mosaic." in body and '"stable_mosaic.' in body else "pretty"


def kernel_name_of(body):
    # generic form: sym_name = "foo" on the func that has tpu.core_type
    for m in re.finditer(r'sym_name = "([^"]+)"[^\n]*tpu\.core_type|tpu\.core_type[^\n]*sym_name = "([^"]+)"', body):
        return m.group(1) or m.group(2)
    m = re.search(r"func\.func @(\w+)\([^\n]*tpu\.core_type", body)
    return m.group(1) if m else "kernel"


def backend_config(body, fmt, vmem_limit=None, cost=None):
    b64 = base64.b64encode(body.encode()).decode()
    cfg = {"body": b64}
    if cost:
        cfg["cost_estimate"] = cost
    if fmt == "stable":
        cfg["serialization_format"] = 1
    cfg["needs_layout_passes"] = True
    top = {"custom_call_config": cfg}
    if vmem_limit:
        top["scoped_memory_configs"] = [{"memory_space": 1, "offset": 0, "size": vmem_limit}]
    return json.dumps(top, separators=(", ", ": "))


def mlir_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\22') + '"'


def wrap(body, args, results, kernel_name=None, fmt=None, vmem_limit=None, cost=None):
    fmt = fmt or detect_format(body)
    kernel_name = kernel_name or kernel_name_of(body)
    arg_decl = ", ".join(f"%arg{i}: {tensor_type(a)}" for i, a in enumerate(args))
    operands = ", ".join(f"%arg{i}" for i in range(len(args)))
    in_tys = ", ".join(tensor_type(a) for a in args)
    res_tys = [tensor_type(r) for r in results]
    res_sig = res_tys[0] if len(res_tys) == 1 else "(" + ", ".join(res_tys) + ")"
    cfg = mlir_string(backend_config(body, fmt, vmem_limit, cost))
    op_layouts = ", ".join(layout(a) for a in args)
    res_layouts = ", ".join(layout(r) for r in results)
    n = len(results)
    lhs = "%0" if n == 1 else f"%0:{n}"
    ret = "%0" if n == 1 else ", ".join(f"%0#{i}" for i in range(n))
    return (
        "module {\n"
        f"  func.func @main({arg_decl}) -> ({', '.join(res_tys)}) {{\n"
        f"    {lhs} = stablehlo.custom_call @tpu_custom_call({operands}) {{"
        f"backend_config = {cfg}, kernel_name = \"{kernel_name}\", api_version = 1 : i32, "
        f"operand_layouts = [{op_layouts}], result_layouts = [{res_layouts}]}}"
        f" : ({in_tys}) -> {res_sig}\n"
        f"    return {ret} : {', '.join(res_tys)}\n"
        "  }\n"
        "}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("body")
    ap.add_argument("--arg", action="append", default=[])
    ap.add_argument("--result", action="append", default=[])
    ap.add_argument("--kernel-name")
    ap.add_argument("--format", choices=["stable", "pretty"])
    ap.add_argument("--vmem-limit", type=int)
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    body = open(a.body).read()
    out = wrap(body, a.arg, a.result, a.kernel_name, a.format, a.vmem_limit)
    if a.output:
        open(a.output, "w").write(out)
    else:
        sys.stdout.write(out)


if __name__ == "__main__":
    main()
