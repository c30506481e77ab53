#!/usr/bin/env python3
"""Checks Tessera's flash attention against PyTorch's scaled_dot_product_attention.

Usage: sdpa_check.py DIR. DIR holds manifest.json and raw little-endian f32 files
(q, k, v, dout, and Tessera's o, dq, dk, dv) written by tests/tests/attention_sdpa.rs.
For each case the script runs torch SDPA in float64 on the same inputs (forward, and
autograd for the gradients), then prints one JSON line per case with the max-norm
relative error of each output. Exit status 0 iff every error is within its tolerance.
"""
import json
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # no torch-tpu autoload here
import numpy as np
import torch
import torch.nn.functional as F


def load(d, name, shape):
    return torch.from_numpy(np.fromfile(os.path.join(d, name), dtype="<f4").reshape(shape).astype(np.float64))


def main():
    d = sys.argv[1]
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    ok = True
    for case in manifest["cases"]:
        name, (b, h, sq, dh), (hkv, skv) = case["name"], case["q_shape"], case["kv"]
        q = load(d, f"{name}.q", (b, h, sq, dh)).requires_grad_()
        k = load(d, f"{name}.k", (b, hkv, skv, dh)).requires_grad_()
        v = load(d, f"{name}.v", (b, hkv, skv, dh)).requires_grad_()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=case["causal"], scale=case["sm_scale"], enable_gqa=(h != hkv))
        dout = load(d, f"{name}.dout", (b, h, sq, dh))
        o.backward(dout)
        report = {"case": name}
        for out, ref in [("o", o.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]:
            got = load(d, f"{name}.{out}", tuple(ref.shape))
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
            report[out] = err
            ok &= err <= case["tolerance"]
        report["tolerance"] = case["tolerance"]
        report["torch"] = torch.__version__
        print(json.dumps(report), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
