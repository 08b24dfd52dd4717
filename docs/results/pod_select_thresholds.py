"""From the repository root:

    PYTHONPATH=. python docs/results/pod_select_thresholds.py BOOK 1024 32768 snapkv 0.5 0.6 0.7

The selection alone against PoD + the selection at equal kv_cache_bytes, with the shipped calibration
regrouped at each threshold given (what `-o threshold=T` does), first N scored tokens of a book.
MODEL=DIR (default smollm2-135m) runs another model, e.g. a `kvcli adapt` output folder."""
import json
import os
import sys
import time

from kvcli.engine.engine import Engine
from kvcli.io.documents import open_source
from kvcli.io.text import first_tokens
from kvcli.methods import make_method
from kvcli.models.load import load_model

book, budget, tokens, select = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
loaded = load_model(os.environ.get("MODEL", "smollm2-135m"))
ids, _ = first_tokens(open_source(book), loaded.tokenizer, tokens + 1)
sinks, recent = 4, budget // 2 - 3  # the selection alone: 4 sinks + 508 recent at 1024; pod's n_r includes the query
plain = {"sinks": sinks} if select == "streamingllm" else {"sinks": sinks, "recent": recent - 1}
runs = [(select, plain)]
runs += [("pod", {"select": select, "sinks": sinks, "recent": recent, "threshold": float(t)}) for t in sys.argv[5:]]
for name, options in runs:
    method = make_method(name, options)
    same_bytes = method.equal_bytes_budget(budget, loaded.model.config)
    started = time.time()
    totals = Engine(loaded.model, method, same_bytes, block=256).score([ids])
    print(json.dumps({"method": name, "options": options, "budget": same_bytes,
                      "ppl": totals.ppl, "kv_cache_bytes": totals.kv_cache_bytes,
                      "seconds": round(time.time() - started, 1)}), flush=True)
