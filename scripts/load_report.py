#!/usr/bin/env python3
"""Mixed-load report for a running shelfserve: both lanes at once, per-lane numbers.

usage: load_report.py [--voice URL] [--agent URL] [--duration 60] [--agents 6]
                      [--voice-rate 0.5] [--json OUT]

Workload (standard library only, greedy so runs are comparable):
- agent lane: `--agents` closed-loop clients, each sending a long chat request (a ~300-token
  context plus a question, max_tokens 128) and immediately the next one when it finishes;
- voice lane: open-loop arrivals at `--voice-rate` requests/s (exponential gaps, seeded), each a
  short chat turn with max_tokens 24 — the latency-sensitive traffic that must jump the queue.

Per lane it reports completed and failed requests, requests/s, output tokens/s (completion tokens
from the usage block over the run's wall time), TTFT p50/p95/p99 (send → first content chunk) and
inter-token gap p50/p95. Progress is printed every 5 s. Requests still running at the end are
waited for (not counted as failures) so every number covers whole requests.
"""
import argparse
import json
import random
import sys
import threading
import time

from sse import stream_chunks

CONTEXT = (
    "You are reviewing a service that schedules work for a fleet of delivery robots. The service "
    "keeps a queue per warehouse, assigns each order to the nearest idle robot, and re-plans when "
    "a robot reports a blocked aisle. Orders carry a priority; medical supplies go first. Robots "
    "report battery level every ten seconds and return to a charger below twenty percent. The "
    "planner runs every second and must finish within two hundred milliseconds. Last week the "
    "planner missed its deadline during the lunch peak, robots idled, and three medical orders "
    "were late. Logs show the planner recomputing routes for every robot on every tick, even for "
    "robots whose surroundings had not changed, and a lock held while writing metrics. "
) * 2
AGENT_QUESTIONS = [
    "List the three most likely causes of the missed deadlines and how to confirm each.",
    "Propose a change to the planner that avoids recomputing unchanged routes.",
    "Write a short plan to test the fix under a simulated lunch peak.",
    "What metrics should the team add to see this problem before customers do?",
]
VOICE_TURNS = [
    "What's the weather like on Mars?",
    "Set a timer for ten minutes.",
    "Say hello in French.",
    "How many legs does a spider have?",
    "Tell me a one-line joke.",
]


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


class Lane:
    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()
        self.ttft, self.gaps, self.done, self.failed, self.tokens = [], [], 0, [], 0

    def record(self, ttft, gaps, tokens):
        with self.lock:
            self.ttft.append(ttft)
            self.gaps.extend(gaps)
            self.done += 1
            self.tokens += tokens

    def fail(self, err):
        with self.lock:
            self.failed.append(err)


def chat(base, messages, max_tokens, lane):
    body = {
        "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times, tokens = [], 0
    try:
        for chunk in stream_chunks(base + "/chat/completions", body, timeout=900):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    except Exception as e:  # a refused or broken request must show in the report
        lane.fail(repr(e))
        return
    if not times:
        lane.fail("no content")
        return
    lane.record(times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--voice", default="http://127.0.0.1:8888/v1")
    ap.add_argument("--agent", default="http://127.0.0.1:8889/v1")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--voice-rate", type=float, default=0.5)
    ap.add_argument("--json")
    a = ap.parse_args()

    voice, agent = Lane("voice"), Lane("agent")
    start = time.perf_counter()
    end = start + a.duration
    threads = []

    def agent_loop(i):
        n = 0
        while time.perf_counter() < end:
            q = AGENT_QUESTIONS[(i + n) % len(AGENT_QUESTIONS)]
            chat(a.agent, [{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}], 128, agent)
            n += 1

    for i in range(a.agents):
        t = threading.Thread(target=agent_loop, args=(i,))
        t.start()
        threads.append(t)

    rng = random.Random(7)
    next_voice, k, last_report = start + rng.expovariate(a.voice_rate), 0, start
    while time.perf_counter() < end:
        now = time.perf_counter()
        if now >= next_voice:
            turn = VOICE_TURNS[k % len(VOICE_TURNS)]
            t = threading.Thread(target=chat, args=(a.voice, [{"role": "user", "content": turn}], 24, voice))
            t.start()
            threads.append(t)
            k += 1
            next_voice += rng.expovariate(a.voice_rate)
        if now - last_report >= 5:
            last_report = now
            print(f"[{now - start:5.0f}s] voice done {voice.done} failed {len(voice.failed)} | "
                  f"agent done {agent.done} failed {len(agent.failed)}", file=sys.stderr, flush=True)
        time.sleep(0.02)
    print("duration reached; waiting for requests in flight...", file=sys.stderr, flush=True)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start

    rows = []
    for lane in (voice, agent):
        rows.append({
            "lane": lane.name, "completed": lane.done, "failed": len(lane.failed),
            "req_per_s": lane.done / wall, "out_tok_per_s": lane.tokens / wall,
            "ttft_p50_ms": 1000 * percentile(lane.ttft, 50), "ttft_p95_ms": 1000 * percentile(lane.ttft, 95),
            "ttft_p99_ms": 1000 * percentile(lane.ttft, 99),
            "itl_p50_ms": 1000 * percentile(lane.gaps, 50), "itl_p95_ms": 1000 * percentile(lane.gaps, 95),
            "errors": lane.failed[:3],
        })
    print(f"\nmixed load: {wall:.0f} s wall, {a.agents} closed-loop agent clients, "
          f"voice arrivals {a.voice_rate}/s")
    print("| lane | done | failed | req/s | out tok/s | TTFT p50 | p95 | p99 | ITL p50 | p95 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lane']} | {r['completed']} | {r['failed']} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p95_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
              f"{r['itl_p50_ms']:.0f} ms | {r['itl_p95_ms']:.0f} ms |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"wall_s": wall, "agents": a.agents, "voice_rate": a.voice_rate, "lanes": rows}, f, indent=1)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
