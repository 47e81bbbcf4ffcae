"""`kvevict audit`: a running inference server as the system under test, judged by the verdict's rule.

* `client` — HTTP with bounded concurrency, timeouts, retries on 429/503, no redirect followed, each server's key
  from its own environment variable, over https beyond loopback;
* `api` — the routes (llama-server's `/completion`, `/v1/completions`, `/v1/chat/completions`) and their answers;
* `identity` — what a server says it is (engine, model, context, KV type, build): what every record is keyed by;
* `probe` — what a server declares (context, n_keep, models) and the tokenizer round trip;
* `events` — where a deployment evicts along a generation, by its engine's rule (llama-server's context shift);
* `fidelity` — per-token top-1 agreement, reference log-probability and top-k KL (the tail rule);
* `reference` — the reference teacher-forced on the deployment's tokens: kvevict's full cache, or a server;
* `records` — keyed, append-only answers (`records/store.py`): a rerun sends nothing twice;
* `stream` — the fidelity workload; `judge` — its verdict (from the first event on, or the whole stream against a
  twin's floor) and the sink-loss signature;
* `reproduction` — the same tokens through kvevict's `llamacpp` preset; `run` — one audit end to end;
* `text`, `report` — the verdict in words, the HTML report.

Nothing here is imported by the rest of kvevict but the `audit` command.
"""
