#!/usr/bin/env bash
# On the GPU machine: `ml4 serve --device cuda` end to end. Builds ml4-tiny with the shipped
# 512-token tekken vocabulary, starts the server on the CUDA runner, and checks with plain HTTP
# (python3 urllib; the openai package is not installed there) a chat completion, a streamed
# completion, a malformed request (400, and the server stays up) and /metrics. Prints PASS/FAIL
# lines; exit status 1 on any failure.
#
# usage: bash scripts/gpu_serve_smoke.sh CARRY_DIR   (the folder gpu_pack.sh filled, with bin/ml4)
set -uo pipefail
carry=$(cd "${1:?carry dir}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
ml4="$carry/bin/ml4"
work=$(mktemp -d)
out=${OUT:-$work}
"$ml4" make-model --preset ml4-tiny --seed 0 --out "$work/m" \
  --tokenizer "$root/tests/golden/tokenizer/tekken_trained_v15_512.json" > "$out/serve_make_model.log" 2>&1 || {
  echo "FAIL make-model"; cat "$out/serve_make_model.log"; exit 1; }
"$ml4" serve --model "$work/m" --device cuda --gpu-memory-utilization 0.05 --port 8123 \
  > "$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
python3 - <<'PY'
import json, sys, time, urllib.request, urllib.error
base = "http://127.0.0.1:8123"
def req(path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    r = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
for _ in range(120):
    try:
        if req("/health")[0] == 200: break
    except Exception:
        pass
    time.sleep(0.5)
else:
    print("FAIL server did not come up"); sys.exit(1)
ok = True
def check(name, cond, detail=""):
    global ok
    print(("PASS " if cond else "FAIL ") + name + (": " + detail if detail else ""))
    ok &= bool(cond)
st, body = req("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                        "max_tokens": 16, "temperature": 0})
j = json.loads(body) if st == 200 else {}
check("chat completion", st == 200 and j.get("choices") and j["usage"]["completion_tokens"] > 0, body[:200])
st2, body2 = req("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                          "max_tokens": 16, "temperature": 0})
check("greedy is repeatable", st2 == 200 and json.loads(body2)["choices"][0]["message"] == j["choices"][0]["message"])
st, body = req("/v1/completions", {"model": "m", "prompt": "once upon", "max_tokens": 12, "stream": True,
                                   "temperature": 0.8, "top_p": 0.9, "seed": 3})
chunks = [l for l in body.splitlines() if l.startswith("data: ")]
check("streamed completion", st == 200 and chunks and chunks[-1] == "data: [DONE]", f"{len(chunks)} events")
st, body = req("/v1/chat/completions", raw=b"{not json")
check("malformed request is a 400", st == 400, body[:120])
st, body = req("/v1/completions", {"model": "m", "prompt": "again", "max_tokens": 4})
check("still serving after it", st == 200)
st, body = req("/metrics")
check("metrics", st == 200 and "vllm:" in body)
sys.exit(0 if ok else 1)
PY
rc=$?
tail -5 "$out/serve.log"
exit $rc
