# helm test: send one chat completion per model through the router and check each answer.
# argv: router base URL, model names (comma-separated), API key file ("" when keys are off), timeout in seconds.
import json
import sys
import urllib.error
import urllib.request

base, models, key_file, timeout = sys.argv[1], sys.argv[2].split(","), sys.argv[3], float(sys.argv[4])
headers = {"Content-Type": "application/json"}
if key_file:
    with open(key_file) as f:
        keys = [line.strip() for line in f if line.strip()]
    headers["Authorization"] = "Bearer " + keys[0]


def check(model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, payload = response.status, json.load(response)
    except urllib.error.HTTPError as err:
        sys.exit("FAIL: HTTP %d from %s for %s: %s" % (err.code, base, model, err.read()[:500].decode(errors="replace")))
    except (urllib.error.URLError, OSError) as err:
        sys.exit("FAIL: cannot reach %s: %s" % (base, err))

    choice = (payload.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content")
    usage = payload.get("usage") or {}
    problems = []
    if status != 200:
        problems.append("status %d" % status)
    if payload.get("object") != "chat.completion":
        problems.append("object is %r, not 'chat.completion'" % payload.get("object"))
    if payload.get("model") != model:
        problems.append("answered by model %r, not %r" % (payload.get("model"), model))
    if not isinstance(text, str) or not text.strip():
        problems.append("no generated text in choices[0].message.content")
    if not usage.get("completion_tokens"):
        problems.append("usage.completion_tokens missing or zero")
    if problems:
        sys.exit("FAIL: %s: " % model + "; ".join(problems) + "\nresponse: " + json.dumps(payload)[:1000])
    print("OK: %s answered %r (%d completion tokens)" % (model, text, usage["completion_tokens"]))


for name in models:
    check(name)
