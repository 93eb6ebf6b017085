"""Server-sent-event reader shared by the benchmark clients: POST a JSON body to an
OpenAI-style streaming endpoint and yield each `data:` chunk as a dict, stopping at [DONE]."""
import json
import urllib.request


def stream_chunks(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
