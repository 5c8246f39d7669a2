"""One leg of the CPU A/B of LATTICE_BATCH_PREFILL, in a fresh process: the demo through lattice_mlx.batch_generate,
greedy, B prompts of one length, N tokens each, one untimed run, then one timed run; prints one JSON line (the
tokens: a digest of every sequence's first 8).

    LATTICE_BATCH_PREFILL=0|1 python ab_prefill.py LEG REP [B] [PROMPT] [N]
"""

import hashlib
import json
import os
import sys
import time

import mlx.core as mx

from lattice_mlx import batch_generate, load
from lattice_mlx.load import DEMO_MODEL

leg, rep = sys.argv[1], int(sys.argv[2])
B, T, N = (int(x) for x in (sys.argv[3:6] + ["8", "32", "8"][len(sys.argv[3:6]):]))
model, tok = load(DEMO_MODEL)  # (the checkpoint's own dtype: what the README's first command runs on the CPU)
V = model.args.vocab_size
prompts = [[(97 * rep + 13 * i + 7 * b + 1) % V for i in range(T)] for b in range(B)]
batch_generate(model, None, prompts, max_tokens=N, max_batch=B)  # untimed (first use)
mx.synchronize()
tic = time.perf_counter()
got = batch_generate(model, None, prompts, max_tokens=N, max_batch=B)
mx.synchronize()
secs = time.perf_counter() - tic
print(json.dumps({"leg": leg, "rep": rep, "batch_prefill": os.environ.get("LATTICE_BATCH_PREFILL", ""),
                  "seconds": secs,
                  "tokens": hashlib.sha256(json.dumps([r.tokens[:8] for r in got]).encode()).hexdigest()[:16], "B": B, "T": T, "N": N}))
