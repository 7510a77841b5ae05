#!/usr/bin/env python3
"""Ingress latency: N sequential signed POSTs to /hooks/{source} on one
keep-alive connection, each with a new webhook-id (so each makes a job),
then the p50/p99/max of the answer times. Standard library only; the
signature is computed here, independently of the server.

Usage: scripts/ingress-latency.py URL SECRET [N]
  URL     http://127.0.0.1:8080/hooks/payments
  SECRET  the source's whsec_... secret
  N       requests (default 2000), after 100 of warm-up
"""

import base64
import hashlib
import hmac
import http.client
import json
import sys
import time
import urllib.parse
import uuid


def main():
    url, secret = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    key = base64.b64decode(secret.removeprefix("whsec_"))
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80)
    times = []
    for i in range(n + 100):
        body = json.dumps({"event": "bench", "i": i}).encode()
        msg_id = f"msg_{uuid.uuid4().hex}"
        ts = str(int(time.time()))
        mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
        headers = {
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": ts,
            "webhook-signature": "v1," + base64.b64encode(mac).decode(),
        }
        started = time.perf_counter()
        conn.request("POST", parts.path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200:
            sys.exit(f"request {i}: HTTP {response.status}")
        if i >= 100:
            times.append(elapsed)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1000
    print(f"ingress n={len(times)} p50={pick(0.50):.2f}ms p99={pick(0.99):.2f}ms max={times[-1] * 1000:.2f}ms")


if __name__ == "__main__":
    main()
