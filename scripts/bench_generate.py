"""`model.generate()` of 32 greedy tokens on a tiny transformers LlamaForCausalLM
(attn_implementation="eager"; hidden 64, 2 layers, vocab 128) under strict eager and under
DEFER_AND_FUSE, side by side, medians of N; and, for scale, the same under a TorchDispatchMode
that only passes ops through (what any recording dispatch mode costs at least).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python scripts/bench_generate.py [N]
"""
import os
import sys
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tessera  # noqa: E402
from tessera import fusion  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 9
TOKENS = 32
# Tiny tensors: intra-op threads only add hand-offs, which on a loaded machine cost
# milliseconds; one thread for every variant alike (TESSERA_BENCH_THREADS to change it).
torch.set_num_threads(int(os.environ.get("TESSERA_BENCH_THREADS", "1")))


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, tie_word_embeddings=False)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))


def gen():
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def deferred():
    with tessera.set_eager_mode(tessera.EagerMode.DEFER_AND_FUSE):
        return gen()


def passthrough():
    with PassThrough():
        return gen()


want, t_strict_cold = timed(gen)
fusion.reset_stats()
got, t_defer_cold = timed(deferred)
assert torch.equal(got, want), "DEFER_AND_FUSE generated other tokens than strict"
cold = fusion.stats()
times = {"strict": [], "defer": [], "passthrough": []}
for _ in range(N):
    for name, f in (("strict", gen), ("defer", deferred), ("passthrough", passthrough)):
        if name == "defer":
            fusion.reset_stats()
        out, t = timed(f)
        assert torch.equal(out, want)
        times[name].append(t)
warm = fusion.stats()
med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
print(f"torch threads: {torch.get_num_threads()}")
print(f"first call: strict {t_strict_cold * 1e3:.1f} ms, DEFER_AND_FUSE {t_defer_cold * 1e3:.1f} ms "
      f"({cold['ops_deferred']} ops deferred into {cold['kernels_launched']} kernels, {cold['shape_churn']} churned flushes, "
      f"cache hits {cold['cache_hits']} misses {cold['cache_misses']}, stepped aside {cold['stepped_aside']})")
for k in ("strict", "defer", "passthrough"):
    print(f"{k:12s} median of {N}: {med[k] * 1e3:7.2f} ms  {TOKENS / med[k]:7.0f} tok/s  ({med[k] / med['strict']:.2f}x strict's time)")
print(f"later calls under the mode: {warm['ops_deferred']} ops deferred, {warm['ops_eager']} eager (before the first forward), "
      f"stepped aside {warm['stepped_aside']}; program cache {fusion.stats()['native_cache']}")
