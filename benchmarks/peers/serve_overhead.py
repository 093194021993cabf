"""Single-stream TPOT through `llmrt serve` (HTTP, SSE, the engine-core process, detokenizing) against the offline
`LLM` on the same model, alternating rounds in one run; the issue's target is a difference under 10%.

The server streams a W2-like request (256 prompt tokens, 128 forced output tokens); TPOT = (last chunk - first
chunk) / (output tokens - 1) as the client sees it. The offline figure is LLM.generate's own token timestamps.
Each round uses a different prompt (no prefix-cache hit on either side).

The client runs on the same cores as the server and the engine. `--clients httpx` (the default) is the benchmark
client `llmrt bench serve` uses (httpx, ~0.45-0.55 ms of CPU a token on a 2-core Zen 4); `raw` reads the stream
with one blocking socket and no HTTP library (one `recv` a chunk), so that less of what the served figure includes
is the client's own work. `--clients httpx raw` alternates both on the same server; each is reported apart.
`nostream` times a plain (non-streamed) request by the server's own TPOT: on the same server process it cancels
this host's per-process speed draw, so streamed / nostream is the per-token cost of SSE and its client alone.

With --processes N, each side runs in N fresh processes (a server, and the offline `LLM` in a child process),
alternating, `--rounds` rounds each, best of all: on hosts where each process draws its own decode speed (the
AVX-512 test host: 4.3-4.7 or 6.7-7.7 ms a token for the 124.7M model), one server against one offline process
compares two draws, not the serving path.

usage: python serve_overhead.py MODEL_DIR WORKLOAD_JSON [--dtype float32] [--rounds 3] [--processes 1] [--out FILE]
"""
import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from llmrt import LLM, SamplingParams
from llmrt.bench.client import RequestResult, apply_chunk, completion_body, stream_completion
from llmrt.bench.server_process import serve

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--processes", type=int, default=1, help="fresh processes per side (best of all)")
ap.add_argument("--clients", nargs="+", choices=("httpx", "raw", "nostream"), default=["httpx"],
                help="stream readers to time on the server, alternating (default: httpx); nostream: one plain "
                     "response, TPOT from the server's own timing (`llmrt.tpot`), no per-token HTTP work")
ap.add_argument("--out")
ap.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)  # a child of --processes
args = ap.parse_args()


def prompt_of(wl: dict, r: int) -> list[int]:
    """W2's prompt rotated by r tokens: same length, no shared prefix between rounds."""
    p = wl["W2"]["prompt"]
    return p[r:] + p[:r]


async def served_tpot(url: str, prompt: list[int], new: int) -> float:
    """Milliseconds per output token of one streamed request, as the client sees them."""
    async with httpx.AsyncClient() as client:
        res = await stream_completion(client, url + "/v1", "m", prompt, new)
    assert res.ok and res.output_tokens == new, (res.error, res.output_tokens)
    return (res.token_times[-1] - res.token_times[0]) / (new - 1) * 1e3


def raw_tpot(url: str, prompt: list[int], new: int) -> float:
    """served_tpot with a blocking socket and the HTTP/1.1 chunked stream parsed here (no client library); each
    SSE event is folded in by the benchmark client's own `apply_chunk`."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(completion_body("m", prompt, new)).encode()
    res = RequestResult(start=time.perf_counter())
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, buf = buf.split(b"\r\n\r\n", 1)
        assert b" 200 " in head.split(b"\r\n", 1)[0] and b"chunked" in head.lower(), head
        events, done = b"", False
        while not done:
            while b"\r\n" not in buf:  # the chunk-size line
                buf += sock.recv(65536)
            size_line, buf = buf.split(b"\r\n", 1)
            size = int(size_line, 16)
            if size == 0:
                break
            while len(buf) < size + 2:
                more = sock.recv(65536)
                assert more, "stream ended inside a chunk"
                buf += more
            events += buf[:size]
            buf = buf[size + 2:]
            now = time.perf_counter()
            *whole, events = events.split(b"\n\n")
            for ev in whole:
                data = ev.removeprefix(b"data: ")
                done = data == b"[DONE]"
                if done:
                    break
                apply_chunk(res, json.loads(data), now)
    assert res.error is None and res.output_tokens == new, (res.error, res.output_tokens)
    return (res.token_times[-1] - res.token_times[0]) / (new - 1) * 1e3


def nostream_tpot(url: str, prompt: list[int], new: int) -> float:
    """The server's own TPOT (its `llmrt` timing object) of one non-streamed request: the engine core and the API
    process's output handling, without SSE chunks or a client reading them per token."""
    r = httpx.post(url + "/v1/completions", json=completion_body("m", prompt, new, stream=False), timeout=600.0)
    r.raise_for_status()
    out = r.json()
    assert out["usage"]["completion_tokens"] == new, out["usage"]
    return out["llmrt"]["tpot"] * 1e3


def served_round(url: str, wl: dict, base: int, new: int, served: dict[str, list[float]]) -> None:
    """One request per client in --clients, in turn, each with its own prompt (no prefix-cache hit)."""
    for i, c in enumerate(args.clients):
        prompt = prompt_of(wl, base + 7 * i)
        if c == "httpx":
            served[c].append(asyncio.run(served_tpot(url, prompt, new)))
        else:
            served[c].append(raw_tpot(url, prompt, new) if c == "raw" else nostream_tpot(url, prompt, new))


def offline_llm(wl: dict) -> tuple[LLM, SamplingParams]:
    """The offline engine, warmed up, and the measured requests' sampling parameters."""
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024)
    llm.generate([prompt_of(wl, 999)], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    return llm, SamplingParams(max_tokens=wl["W2"]["max_new_tokens"], temperature=0.0, ignore_eos=True)


def offline_tpot(llm: LLM, greedy: SamplingParams, prompt: list[int]) -> float:
    """Milliseconds per output token of one offline generation, from its own token timestamps."""
    m = llm.generate([prompt], greedy)[0].metrics
    return (m.last_token_time - m.first_token_time) / (greedy.max_tokens - 1) * 1e3


def fresh_processes(wl: dict, new: int, opts: list[str]) -> tuple[dict[str, list[float]], list[float]]:
    """--processes: each side in fresh processes, alternating which goes first."""
    served: dict[str, list[float]] = {c: [] for c in args.clients}
    offline: list[float] = []
    for p in range(args.processes):
        for side in (("served", "offline") if p % 2 == 0 else ("offline", "served")):
            if side == "served":
                with serve(args.model, *opts) as url:
                    asyncio.run(served_tpot(url, prompt_of(wl, 998), 8 + 1))  # warm-up
                    for r in range(args.rounds):
                        served_round(url, wl, 100 * p + 10 * r, new, served)
            else:
                cmd = [sys.executable, __file__, args.model, args.workload, "--dtype", args.dtype, "--rounds",
                       str(args.rounds), "--offline-only"]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                offline += json.loads(out.strip().splitlines()[-1])
        bests = ", ".join(f"served ({c}) best {min(v[-args.rounds:]):.2f} ms" for c, v in served.items())
        print(f"processes {p}: {bests}, offline best {min(offline[-args.rounds:]):.2f} ms", flush=True)
    return served, offline


def one_process(wl: dict, new: int, opts: list[str]) -> tuple[dict[str, list[float]], list[float]]:
    """One server and the offline `LLM` in this process, rounds alternating."""
    served: dict[str, list[float]] = {c: [] for c in args.clients}
    offline: list[float] = []
    with serve(args.model, *opts) as url:
        llm, greedy = offline_llm(wl)
        asyncio.run(served_tpot(url, prompt_of(wl, 998), 8 + 1))  # warm-up
        for r in range(args.rounds):
            for side in (("served", "offline") if r % 2 == 0 else ("offline", "served")):
                if side == "served":
                    served_round(url, wl, 10 * r, new, served)
                else:
                    offline.append(offline_tpot(llm, greedy, prompt_of(wl, 10 * r + 5)))
            now = ", ".join(f"served ({c}) {v[-1]:.2f} ms" for c, v in served.items())
            print(f"round {r}: {now}, offline {offline[-1]:.2f} ms", flush=True)
    return served, offline


def main() -> None:
    """Alternate served and offline rounds; print and write the best of each and their ratio."""
    wl = json.load(open(args.workload))
    new = wl["W2"]["max_new_tokens"]
    if args.offline_only:  # one offline process of --processes: its rounds' TPOTs on stdout
        llm, greedy = offline_llm(wl)
        print(json.dumps([offline_tpot(llm, greedy, prompt_of(wl, 50 + r)) for r in range(args.rounds)]))
        return
    opts = ["--dtype", args.dtype, "--served-model-name", "m", "--max-model-len", "1024"]
    served, offline = fresh_processes(wl, new, opts) if args.processes > 1 else one_process(wl, new, opts)
    res = {"model": args.model, "dtype": args.dtype, "processes": args.processes, "rounds": args.rounds,
           "load_average": os.getloadavg(), "date": time.ctime(),
           "clients": args.clients, "offline_tpot_ms": offline, "best_offline_ms": min(offline)}
    for c, v in served.items():  # the httpx figures keep their old names
        key = "" if c == "httpx" else f"_{c}"
        res.update({f"served{key}_tpot_ms": v, f"best_served{key}_ms": min(v),
                    f"served{key}_over_offline": min(v) / min(offline),
                    f"served{key}_median_over_offline_median": statistics.median(v) / statistics.median(offline)})
    for c in served:  # streamed over plain on the same server, round by round (the same process's speed)
        if c != "nostream" and "nostream" in served:
            res[f"{c}_over_nostream_per_round"] = [a / b for a, b in zip(served[c], served["nostream"])]
            res[f"{c}_over_nostream_median"] = statistics.median(res[f"{c}_over_nostream_per_round"])
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
