#!/usr/bin/env python3
"""An intray worker in plain Python with grpcio: lease, a heartbeat thread,
complete, failure with an error class, and cancellation. A finished job's
outcome and the claim of the next go in one CompleteAndLease call.

Generate the stubs from the repository root first (they are not committed):

    python -m pip install -r examples/python/requirements.txt
    python -m grpc_tools.protoc -I proto --python_out=build/py \
        --grpc_python_out=build/py proto/intray/v1/intray.proto
    python examples/python/worker.py --stubs build/py --queue py

Kinds it handles:
  echo   succeeds with {"echo": payload, "attempt": n}
  fail   fails with payload["error_class"] (retryable if payload["retryable"])
  flaky  fails retryably on attempt 1, succeeds after
  sleep  sleeps payload["seconds"], stopping early when the job is cancelled
Any other kind fails for good with class "unknown_kind".

SIGTERM or SIGINT stops leasing; the job in hand may finish within
--grace-seconds, then it is stopped and handed back (class worker_shutdown,
retryable at once). The protocol is described in docs/workers.md.
"""

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--tenant", default="", help="sent as x-intray-tenant")
    p.add_argument("--token", default=os.environ.get("INTRAY_TOKEN", ""),
                   help="bearer token (default $INTRAY_TOKEN)")
    p.add_argument("--queue", action="append", required=True, help="queue to lease from; repeat")
    p.add_argument("--worker-id", default=f"py-{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--lease-seconds", type=int, default=60, help="lease length")
    p.add_argument("--wait-seconds", type=int, default=5,
                   help="long-poll per Lease call (also bounds how fast SIGTERM is noticed)")
    p.add_argument("--grace-seconds", type=float, default=30,
                   help="after SIGTERM, how long the job in hand may run before it is stopped")
    p.add_argument("--stubs", required=True, help="folder with the generated intray/v1 stubs")
    return p.parse_args()


ARGS = parse_args()
sys.path.insert(0, ARGS.stubs)

import grpc  # noqa: E402
from google.protobuf import duration_pb2, json_format, struct_pb2  # noqa: E402
from intray.v1 import intray_pb2 as pb  # noqa: E402
from intray.v1 import intray_pb2_grpc as rpc  # noqa: E402

# Statuses that no retry can fix: the worker itself is misconfigured.
FATAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}
# The lease is gone: stop the work and report nothing.
LOST = {grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND}
# The same, as the numeric codes of a batched item's error.
LOST_CODES = {c.value[0] for c in LOST}
# The call got no answer or a passing refusal: safe to send again.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.RESOURCE_EXHAUSTED}
# Set once the grace after SIGTERM has run out: the job in hand is stopped.
HARD_STOP = threading.Event()


def log(msg, **fields):
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[py-worker] {msg} {extra}", file=sys.stderr, flush=True)


def metadata():
    md = []
    if ARGS.tenant:
        md.append(("x-intray-tenant", ARGS.tenant))
    if ARGS.token:
        md.append(("authorization", f"Bearer {ARGS.token}"))
    return md


class JobError(Exception):
    """A failed attempt: class, message, retryable, retry_after (seconds)."""

    def __init__(self, error_class, message, retryable=True, retry_after=None):
        super().__init__(message)
        self.error_class, self.message = error_class, message
        self.retryable, self.retry_after = retryable, retry_after


# The heartbeat of the job in hand, for the end of the shutdown grace.
RUNNING = {"hb": None}


def stop_now():
    """The shutdown grace ran out: the job in hand is told to stop."""
    HARD_STOP.set()
    hb = RUNNING["hb"]
    if hb is not None:
        log("grace over; stopping the job in hand", job=hb.job.job_id)
        hb.cancelled.set()


class Heartbeat(threading.Thread):
    """Extends the lease every third of it while the job runs. Sets
    `cancelled` when the job is cancelled, and `lost` (and `cancelled`) when
    the lease is gone or could not be extended for a whole lease, counted
    from `received` (when the job arrived) or the last heartbeat that got
    through. No call outlasts that: a hung one must not keep the job
    running past its lease, when it may be running elsewhere."""

    def __init__(self, stub, job, received):
        super().__init__(daemon=True)
        self.stub, self.job, self.received = stub, job, received
        self.cancelled, self.lost, self.done = threading.Event(), threading.Event(), threading.Event()
        self.progress = None

    def run(self):
        interval = ARGS.lease_seconds / 3
        held_until = self.received + ARGS.lease_seconds
        # The last retry leaves a tenth of the lease (at most 1 s) for its answer.
        last_try = min(ARGS.lease_seconds / 10, 1)
        # A next job that waited for its outcome's retries is older than it looks.
        delay = max(0, self.received + interval - time.monotonic())
        retry = 0.5
        while not self.done.wait(delay):
            req = pb.HeartbeatRequest(job_id=self.job.job_id, lease_token=self.job.lease_token)
            if self.progress is not None:
                req.progress, req.message = self.progress
            sent = time.monotonic()
            try:
                if held_until <= sent:
                    raise LeaseRanOut()
                resp = self.stub.Heartbeat(req, timeout=min(10, held_until - sent),
                                           metadata=metadata())
            except (grpc.RpcError, LeaseRanOut) as e:
                code = e.code() if isinstance(e, grpc.RpcError) else None
                if code in LOST or time.monotonic() >= held_until:
                    log("lease lost", job=self.job.job_id, code=code.name if code else "ran_out")
                    self.lost.set()
                    self.cancelled.set()
                    return
                now, final = time.monotonic(), held_until - last_try
                # After the last try, only the end of the lease is left to wait for.
                delay = (held_until - now if now >= final
                         else min(interval, random.uniform(retry / 2, retry), final - now))
                retry = min(retry * 2, interval)
                log("heartbeat failed; retrying", code=code.name, retry_in=f"{delay:.2f}s")
                continue
            held_until = sent + ARGS.lease_seconds
            delay, retry = interval, 0.5
            if resp.cancel_requested and not self.cancelled.is_set():
                log("job cancelled", job=self.job.job_id)
                self.cancelled.set()


def handle(job, payload, hb):
    """The work itself. Returns the result or raises JobError."""
    if job.kind == "echo":
        return {"echo": payload, "attempt": job.attempt}
    if job.kind == "fail":
        raise JobError(payload.get("error_class", "failed"), payload.get("message", "asked to fail"),
                       retryable=bool(payload.get("retryable", False)))
    if job.kind == "flaky":
        if job.attempt == 1:
            raise JobError("flaky", "first attempt always fails", retryable=True, retry_after=0.1)
        return {"ok_on_attempt": job.attempt}
    if job.kind == "busy":
        # A blocking call that cannot be interrupted: it ignores the cancel flag.
        time.sleep(float(payload.get("seconds", 1)))
        return {"busy": True}
    if job.kind == "sleep":
        seconds = float(payload.get("seconds", 1))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            # Check the cancel flag often: cancellation should stop work fast.
            if hb.cancelled.wait(0.1):
                raise JobError("cancelled", "stopped on cancel", retryable=False)
            hb.progress = (1 - (end - time.monotonic()) / seconds, "sleeping")
        return {"slept": seconds}
    raise JobError("unknown_kind", f"no handler for kind {job.kind!r}", retryable=False)


class LeaseRanOut(Exception):
    """No heartbeat got through for a whole lease."""


class Reporter:
    """Sends outcomes. While `chain` is set (until SIGTERM or an older
    server), an outcome goes with `CompleteAndLease`, which also claims the
    worker's next job in the same transaction, and the job it brings back is
    returned to be run next."""

    def __init__(self, stub, stopping):
        self.stub, self.stopping = stub, stopping
        self.chain = True

    def report(self, job, request):
        """Reports one outcome; returns the jobs now leased to the worker."""
        if self.chain and not self.stopping.is_set():
            lease = lease_request(wait_seconds=0)
            try:
                resp = self.stub.CompleteAndLease(
                    pb.CompleteAndLeaseRequest(items=[request], lease=lease),
                    timeout=10, metadata=metadata())
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log("the server has no CompleteAndLease; using Complete")
                    self.chain = False
                else:
                    log("chained complete failed; retrying with Complete", code=e.code().name)
                # Plain Complete from here, so that this slot never gets two jobs.
            else:
                item = resp.results[0]
                # The jobs are ours whatever became of the outcome.
                jobs = arrived(resp.jobs)
                if not item.HasField("error"):
                    return jobs
                if item.error.code in LOST_CODES:
                    log("lease lost before complete; outcome dropped", job=job.job_id)
                    return jobs
                log("chained complete refused; retrying with Complete", job=job.job_id,
                    code=item.error.code, detail=item.error.message)
                # The next job's lease runs meanwhile, and its first heartbeat
                # comes a third of a lease after it starts.
                limit = ARGS.lease_seconds / 3 if jobs else ARGS.lease_seconds
                complete(self.stub, job, request, limit)
                return jobs
        complete(self.stub, job, request, ARGS.lease_seconds)
        return []


def complete(stub, job, request, limit):
    """Sends the outcome with Complete; retries what may pass for up to
    `limit` seconds (at most a lease, after which the lease is likely gone),
    the last try at the limit. An outcome the server refuses as invalid (a
    result over its size limit) is sent once more as a failure, so that the
    job does not wait out its lease: a refused result as a final one, a
    refused failure as retryable as it was."""
    backoff = 0.1
    deadline = time.monotonic() + limit
    replaced = False
    while True:
        try:
            # A hung call must not hold a next job back past the limit.
            left = deadline - time.monotonic()
            stub.Complete(request, timeout=min(10, max(0.5, left)), metadata=metadata())
            return
        except grpc.RpcError as e:
            if e.code() in LOST:
                log("lease lost before complete; outcome dropped", job=job.job_id)
                return
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and not replaced:
                log("the server refused the outcome", job=job.job_id, detail=e.details())
                refused = "result" if request.HasField("success") else "failure"
                retryable = request.failure.retryable if refused == "failure" else False
                request = pb.CompleteRequest(job_id=job.job_id, lease_token=job.lease_token)
                request.failure.error_class = f"invalid_{refused}"
                request.failure.message = f"the server refused the {refused}: {e.details()}"[:16384]
                request.failure.retryable = retryable
                replaced = True
                continue
            left = deadline - time.monotonic()
            if e.code() not in TRANSIENT or left <= 0:
                log("complete failed", job=job.job_id, code=e.code().name, detail=e.details())
                return
            time.sleep(min(left, random.uniform(backoff / 2, backoff)))
            backoff = min(backoff * 2, 5)


def arrived(jobs):
    """Leased jobs paired with when they arrived: their leases run from then."""
    now = time.monotonic()
    return [(job, now) for job in jobs]


def run_job(stub, reporter, job, received):
    """Runs one job and reports it; returns the next jobs the report brought."""
    payload = json.loads(json_format.MessageToJson(job.payload)) if job.HasField("payload") else None
    hb = Heartbeat(stub, job, received)
    RUNNING["hb"] = hb
    if HARD_STOP.is_set():
        hb.cancelled.set()
    hb.start()
    request = pb.CompleteRequest(job_id=job.job_id, lease_token=job.lease_token)
    try:
        result = handle(job, payload, hb)
        value = struct_pb2.Value()
        json_format.Parse(json.dumps(result), value)
        request.success.result.CopyFrom(value)
        log("job succeeded", job=job.job_id, kind=job.kind)
    except JobError as e:
        request.failure.error_class = e.error_class
        request.failure.message = e.message
        request.failure.retryable = e.retryable
        if e.retry_after is not None:
            request.failure.retry_after.CopyFrom(duration_pb2.Duration(
                seconds=int(e.retry_after), nanos=int((e.retry_after % 1) * 1e9)))
        log("job failed", job=job.job_id, error_class=e.error_class, retryable=e.retryable)
    except Exception as e:  # a bug in the handler: let another attempt try
        request.failure.error_class = "handler_exception"
        request.failure.message = repr(e)
        request.failure.retryable = True
    finally:
        RUNNING["hb"] = None
        hb.done.set()
        hb.join()
    if hb.lost.is_set():
        return []  # someone else may own the job now: write nothing
    if HARD_STOP.is_set() and not request.HasField("success"):
        # Stopped by the shutdown, not by its own failure: it runs again at
        # once elsewhere. A success after the grace did the work: it stands.
        request = pb.CompleteRequest(job_id=job.job_id, lease_token=job.lease_token)
        request.failure.error_class = "worker_shutdown"
        request.failure.message = "the worker stopped before the job finished"
        request.failure.retryable = True
        request.failure.retry_after.CopyFrom(duration_pb2.Duration(seconds=0))
    return reporter.report(job, request)


def lease_request(wait_seconds):
    """A claim of one job that long-polls up to `wait_seconds` (0: answer at once)."""
    return pb.LeaseRequest(
        worker_id=ARGS.worker_id, queues=ARGS.queue, max_jobs=1,
        lease_duration=duration_pb2.Duration(seconds=ARGS.lease_seconds),
        wait=duration_pb2.Duration(seconds=wait_seconds))


def main():
    stopping = threading.Event()

    def stop(*_):
        if stopping.is_set():
            return
        stopping.set()
        timer = threading.Timer(ARGS.grace_seconds, stop_now)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    channel = grpc.insecure_channel(ARGS.addr)
    stub = rpc.WorkerServiceStub(channel)
    reporter = Reporter(stub, stopping)
    log("worker started", addr=ARGS.addr, queues=",".join(ARGS.queue), worker_id=ARGS.worker_id)
    backoff = 0.1
    while not stopping.is_set():
        try:
            jobs = arrived(stub.Lease(lease_request(ARGS.wait_seconds),
                                      timeout=ARGS.wait_seconds + 10, metadata=metadata()).jobs)
            backoff = 0.1
        except grpc.RpcError as e:
            if e.code() in FATAL:
                log("the server refused the worker", code=e.code().name, detail=e.details())
                return 2
            # UNAVAILABLE and friends: back off with jitter, then try again.
            delay = random.uniform(backoff / 2, backoff)
            log("lease failed; retrying", code=e.code().name, retry_in=f"{delay:.2f}s")
            stopping.wait(delay)
            backoff = min(backoff * 2, 30)
            continue
        while jobs:
            jobs.extend(run_job(stub, reporter, *jobs.pop(0)))
    log("worker stopped")
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
