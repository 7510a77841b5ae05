"""A completion-callback receiver for tests/webhooks.rs.

Verifies every POST with the Standard Webhooks reference library (not
intray's code), dedupes by webhook-id, and prints one line per request:
`ACCEPT id type sequence job_id job_state` the first time an id verifies,
`DUPLICATE id` after that, `REJECT reason` for a bad signature, `FAIL id`
for each of the first N requests it refuses with 503 (argv[3]).

Usage: receiver.py SECRET PORT [FAIL_FIRST [CERT KEY]]
  CERT, KEY: PEM files; the receiver then speaks HTTPS.
"""

import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

SECRET, PORT = sys.argv[1], int(sys.argv[2])
FAIL_FIRST = int(sys.argv[3]) if len(sys.argv) > 3 else 0
hook = Webhook(SECRET)
seen = set()
lock = threading.Lock()
state = {"failed": 0}


def say(*words):
    # One write under the lock: lines of concurrent requests never interleave.
    with lock:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def answer(self, code):
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        webhook_id = self.headers.get("webhook-id", "")
        with lock:
            if state["failed"] < FAIL_FIRST:
                state["failed"] += 1
                fail = True
            else:
                fail = False
        if fail:
            say("FAIL", webhook_id)
            return self.answer(503)
        try:
            event = hook.verify(body, dict(self.headers.items()))
        except WebhookVerificationError as err:
            say("REJECT", str(err).replace(" ", "_"))
            return self.answer(400)
        with lock:
            duplicate = webhook_id in seen
            seen.add(webhook_id)
        if duplicate:
            say("DUPLICATE", webhook_id)
        else:
            job = event["job"]
            say("ACCEPT", webhook_id, event["type"], event["sequence"], job["id"], job["state"])
        self.answer(204)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
if len(sys.argv) > 5:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(sys.argv[4], sys.argv[5])
    server.socket = tls.wrap_socket(server.socket, server_side=True)
print("READY", flush=True)
server.serve_forever()
