#!/usr/bin/env python3
"""A soak of `tokenrouter serve`: thousands of mixed requests with random client disconnects,
while a thousand idle keep-alive connections stay open, then the server's leftovers.

Starts the server on CONFIG (keep-alive raised so the idle connections outlive the soak),
warms it up, opens IDLE keep-alive connections (each answered one `GET /health`), sends
REQUESTS requests from CONCURRENCY client threads (chat, completions and SGLang generate,
streamed or not; a share of the streams dropped after their first bytes; a share of bad
requests that must get a 4xx), then checks that every idle connection still answers, and
that no request, KV block or descriptor is left and how resident memory moved.

    scripts/soak.py [--config config.toml] [--requests 2000] [--idle 1000] [--concurrency 16]

Prints a summary and exits non-zero on any 5xx, a bad request answered 200, a lost idle
connection, or a leak.
"""

import argparse
import http.client
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="config.toml")
    p.add_argument("--binary", default=os.environ.get("BIN", "target/release/tokenrouter"))
    p.add_argument("--port", type=int, default=31400)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.3, help="share of streams dropped early")
    p.add_argument("--bad", type=float, default=0.05, help="share of malformed requests")
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def config_with_keep_alive(path, seconds):
    text = open(path).read()
    line = f"keep_alive_s = {seconds}\n"
    if re.search(r"^\[server\]\s*$", text, flags=re.M):
        text = re.sub(r"^\[server\]\s*$", "[server]\n" + line.rstrip("\n"), text, count=1, flags=re.M)
    else:
        text += "\n[server]\n" + line
    # Beside the original, so that its relative paths still resolve.
    base = os.path.dirname(os.path.abspath(path))
    out = tempfile.NamedTemporaryFile("w", suffix=".toml", dir=base, prefix=".soak-", delete=False)
    out.write(text)
    out.close()
    return out.name


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def leftovers(port):
    m = metrics(port)
    used = sum(v for k, v in m.items() if 'state="kv_blocks_used"' in k)
    return m.get("tokenrouter_active_requests", 0.0), used


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def descriptors(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def read_response(sock):
    """Reads one response with a Content-Length body; returns its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return int(head.split()[1])


def request_body(rng, max_tokens):
    kind = rng.randrange(3)
    stream = rng.random() < 0.5
    n = rng.randint(1, max_tokens)
    if kind == 0:
        body = {"messages": [{"role": "user", "content": f"soak {rng.random()}"}], "stream": stream,
                "max_tokens": n, "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000)}
        return "/v1/chat/completions", body, stream
    if kind == 1:
        return "/v1/completions", {"prompt": "def soak(", "stream": stream, "max_tokens": n}, stream
    return "/generate", {"text": "soak", "stream": stream, "sampling_params": {"max_new_tokens": n}}, stream


BAD = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("/generate", b'{"text": '),
    ("/v1/chat/completions", b"\xff\xfe not json"),
]


def client(worker, args, counts, lock):
    rng = random.Random(args.seed * 1000 + worker)
    share = args.requests // args.concurrency + (worker < args.requests % args.concurrency)
    for _ in range(share):
        if rng.random() < args.bad:
            path, raw = rng.choice(BAD)
            outcome = "bad"
        else:
            path, body, stream = request_body(rng, args.max_tokens)
            raw = json.dumps(body).encode()
            outcome = "stream" if stream else "plain"
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=600)
        try:
            conn.request("POST", path, raw, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if outcome == "stream" and resp.status == 200 and rng.random() < args.disconnect:
                resp.read(16)
                key = "disconnected"
            else:
                text = resp.read()
                key = f"{outcome} {resp.status}"
                if outcome != "bad" and resp.status == 200 and b'"error"' in text:
                    key = f"{outcome} 200 with an error event"
        except (OSError, http.client.HTTPException) as e:
            key = f"{outcome} {type(e).__name__}"
        finally:
            conn.close()
        with lock:
            counts[key] = counts.get(key, 0) + 1


def main():
    args = parse()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    config = config_with_keep_alive(args.config, 3600)
    server = subprocess.Popen([args.binary, "serve", "--config", config, "--port", str(args.port)],
                              stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                socket.create_connection(("127.0.0.1", args.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.25)
        else:
            sys.exit("the server did not come up")
        warm = argparse.Namespace(**{**vars(args), "requests": 20, "concurrency": 1, "bad": 0.0})
        client(0, warm, {}, threading.Lock())
        rss_before, fds_before = rss_mib(server.pid), descriptors(server.pid)

        idle = []
        for _ in range(args.idle):
            s = socket.create_connection(("127.0.0.1", args.port), timeout=30)
            s.sendall(HEALTH)
            read_response(s)
            idle.append(s)
        fds_idle = descriptors(server.pid)

        counts, lock = {}, threading.Lock()
        started = time.time()
        threads = [threading.Thread(target=client, args=(w, args, counts, lock)) for w in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.time() - started

        alive = 0
        for s in idle:
            try:
                s.sendall(HEALTH)
                alive += read_response(s) == 200
            except OSError:
                pass
            s.close()

        deadline = time.time() + 60
        while True:
            active, used = leftovers(args.port)
            if (active == 0 and used == 0) or time.time() > deadline:
                break
            time.sleep(0.2)
        time.sleep(1)
        rss_after, fds_after = rss_mib(server.pid), descriptors(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        os.unlink(config)

    total = sum(counts.values())
    print(f"requests: {total} in {took:.0f} s from {args.concurrency} clients "
          f"(max_tokens 1..{args.max_tokens}, seed {args.seed})")
    for key in sorted(counts):
        print(f"  {key}: {counts[key]}")
    print(f"idle keep-alive connections: {args.idle} opened, {alive} still answering after the soak")
    print(f"server descriptors: {fds_before} before, {fds_idle} with the idle connections, "
          f"{fds_after} after")
    print(f"left over: {active:.0f} active requests, {used:.0f} KV blocks in use")
    print(f"resident memory: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after "
          f"({rss_after - rss_before:+.0f} MiB)")
    failures = [k for k in counts if not re.fullmatch(r"(plain|stream) 200|bad 4\d\d|disconnected", k)]
    ok = not failures and alive == args.idle and active == 0 and used == 0
    if failures:
        print(f"FAILED: {', '.join(failures)}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
