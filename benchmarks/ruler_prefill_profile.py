import time, torch
from kvevict.models import load_model
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import check_budget
from kvevict.eval.ruler.protocols import prefill, decode
from kvevict.eval.ruler.registry import get_task
from kvevict.eval.ruler.sample import fit
from kvevict.eval.ruler.words import Material
from kvevict.eval.prompts import stop_ids
model, tok = load_model("smollm2-135m")
P = ["window", "streamingllm", "h2o", "snapkv"]
prompt = fit(get_task("niah_single_2"), 2128, 1, 0, framing(tok), Material())
stops = stop_ids(tok)
def t(f):
    t0 = time.perf_counter(); r = f(); return r, time.perf_counter() - t0
for budget in ["50%"]:
    e = check_budget(prompt, "agnostic", P, budget)
    st, s = t(lambda: prefill(model, prompt.context, P, e, "original")); print(f"shared prefill 4 rows: {s:.2f} s")
    st.cache.freeze(); _, s = t(lambda: st.feed(model, prompt.question)); print(f"question 4 rows: {s:.2f} s")
    out, s = t(lambda: decode(model, tok, st, 128, stops)); print(f"decode 4 rows: {s:.2f} s, lengths {[len(o) for o in out]}")
    for spec in ["full"] + P:
        st, s = t(lambda: prefill(model, prompt.context, [spec], None if spec == "full" else e, "original")); st.cache.freeze(); st.feed(model, prompt.question)
        out, s2 = t(lambda: decode(model, tok, st, 128, stops))
        print(f"{spec}: prefill {s:.2f} s, decode {s2:.2f} s for {len(out[0])} tokens")
