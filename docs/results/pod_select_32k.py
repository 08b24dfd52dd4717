"""Run from the repository root: PYTHONPATH=. python docs/results/pod_select_32k.py BOOK 1024 32768 snapkv streamingllm

PoD + selection vs selection alone at equal kv_cache_bytes, first 32,768 scored tokens of a book (as kvcli ppl)."""
import json
import sys
import time

from kvcli.engine import Engine
from kvcli.methods import make_method
from kvcli.models import load_model
from kvcli.pod.groups import shipped_groups
from kvcli.text import first_tokens, open_source

book, budget, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loaded = load_model("smollm2-135m")
ids, _ = first_tokens(open_source(book), loaded.tokenizer, tokens + 1)
groups = shipped_groups()[0]
sinks, recent = 4, budget // 2 - 3  # the selection alone: 4 sinks + 508 recent at 1024; pod's n_r includes the query
pod_budget = groups.equal_bytes_budget(budget, sinks, recent)
for select in sys.argv[4:]:
    plain_opts = {"sinks": sinks} if select == "streamingllm" else {"sinks": sinks, "recent": recent - 1}
    for name, opts, b in ((select, plain_opts, budget),
                          ("pod", {"select": select, "sinks": sinks, "recent": recent}, pod_budget)):
        method = make_method(name, opts)
        t = time.time()
        totals = Engine(loaded.model, method, b, block=256).score([ids])
        print(json.dumps({"method": name, "options": opts, "budget": b, "tokens": totals.tokens, "ppl": totals.ppl,
                          "kv_cache_bytes": totals.kv_cache_bytes, "max_cache_tokens": totals.max_cache_tokens,
                          "seconds": round(time.time() - t, 1)}), flush=True)
