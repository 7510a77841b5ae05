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
  busy   blocks for payload["seconds"], deaf to a cancel (a call that cannot stop)
Any other kind fails for good with class "unknown_kind". A handler that
raises anything but JobError fails its job as "handler_exception"
(retryable); so does anything a payload makes go wrong while the outcome is
built, which never ends the worker.

SIGTERM, SIGINT or SIGHUP (unless started with it ignored, as under nohup)
stops leasing; the job in hand may finish within --grace-seconds, then it is
told to stop and handed back (class worker_shutdown, retryable at once); a
handler deaf to that is left behind 5 s later, as at a second signal. A
second one hands the job in hand back at once, without waiting for its
handler, and gives its report one try. The protocol is described in docs/workers.md.
"""

import argparse
import json
import math
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
    p.add_argument("--wait-seconds", type=int, default=5, help="long-poll per Lease call")
    p.add_argument("--grace-seconds", type=float, default=30,
                   help="after SIGTERM, SIGINT or SIGHUP, how long the job in hand may run "
                        "before it is stopped")
    p.add_argument("--stubs", required=True, help="folder with the generated intray/v1 stubs")
    return p.parse_args()


ARGS = parse_args()
sys.path.insert(0, ARGS.stubs)

import grpc  # noqa: E402
from google.protobuf import any_pb2, duration_pb2, json_format, struct_pb2  # noqa: E402
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
# The server answers up to 64 MiB. A 1 MiB JSON payload of small numbers is
# about 6 MB as a protobuf Value, past grpcio's default 4 MiB: such a Lease
# failed here after the server had handed the job over, and the job came
# back only to fail so again until its attempts ran out.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A server's RetryInfo is waited out up to this many seconds, as the Rust
# library does: a worker should not sleep for an hour on one answer.
MAX_SERVER_DELAY = 60
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"
# What the server takes in a failure: one outside these limits would be
# refused, and then sent again as a failure of class invalid_failure.
MAX_CLASS, MAX_MESSAGE, MAX_RETRY_AFTER = 128, 16384, 7 * 24 * 3600
# A report's only try once the worker was told twice to stop: a long one
# would hold the exit back.
FORCED_CALL_TIMEOUT = 0.5
# How long a handler told to stop at the grace's end may take to return
# before it is left behind (the Rust library's cancel_timeout): a handler
# deaf to its flag would otherwise hold the exit back until it ends.
STOP_TIMEOUT = 5.0
# Set once the first stop signal came: no more leases.
STOPPING = threading.Event()
# Set once the grace after the first signal has run out, or at a second:
# the job in hand is stopped.
HARD_STOP = threading.Event()
# Set at a second signal: the job in hand is handed back without waiting
# for its handler, and its report gets one try.
FORCED = threading.Event()


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


def _varint(buf, i):
    """The varint at buf[i] and the index after it."""
    value = shift = 0
    while True:
        byte = buf[i]  # IndexError when truncated
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf):
    """(field number, value) of each field of an encoded protobuf message:
    varints as ints, length-delimited fields as bytes, fixed-width as None."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire in (1, 5):
            value, i = None, i + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"unexpected wire type {wire}")
        if i > len(buf):
            raise ValueError("truncated field")
        yield key >> 3, value


def retry_info_delay(status_bytes):
    """The delay, in seconds, of the google.rpc.RetryInfo among the details
    of an encoded google.rpc.Status, or None. Decoded by hand: the stubs of
    google/rpc are not in the requirements, and only two fields matter:
    Status.details (3, repeated Any) and RetryInfo.retry_delay (1, Duration)."""
    for number, detail in _fields(status_bytes):
        if number != 3 or not isinstance(detail, bytes):
            continue
        any_ = any_pb2.Any.FromString(detail)
        if any_.type_url != RETRY_INFO_TYPE:
            continue
        for field, delay in _fields(any_.value):
            if field == 1 and isinstance(delay, bytes):
                d = duration_pb2.Duration.FromString(delay)
                return d.seconds + d.nanos / 1e9
    return None


def server_delay(error):
    """How long the server asked to wait before the call is sent again (its
    RetryInfo, in the grpc-status-details-bin trailer), at most a minute; 0
    when it asked nothing."""
    try:
        for key, value in error.trailing_metadata() or ():
            if key == "grpc-status-details-bin":
                delay = retry_info_delay(value)
                return min(max(delay, 0), MAX_SERVER_DELAY) if delay else 0
    except Exception as e:  # a trailer that does not decode is no reason to stop
        log("could not read the status details", error=repr(e))
    return 0


def too_large(error):
    """Whether grpcio itself refused a message for its size: a status made
    here, which the server never sent."""
    return (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "larger than max" in (error.details() or ""))


class JobError(Exception):
    """A failed attempt: class, message, retryable, retry_after (seconds)."""

    def __init__(self, error_class, message, retryable=True, retry_after=None):
        super().__init__(message)
        self.error_class, self.message = error_class, message
        self.retryable, self.retry_after = retryable, retry_after


# The job in hand (its heartbeat and the event its end sets), for a stop.
RUNNING = {"attempt": None}
# The Lease call in flight, for a stop to cut its long poll short.
LEASING = {"call": None}


def stop_now(forced=False):
    """The shutdown grace ran out, or the worker was told again to stop: the
    job in hand is told to stop. Forced, it is not waited for."""
    if forced:
        FORCED.set()
    HARD_STOP.set()
    attempt = RUNNING["attempt"]
    if attempt is not None:
        hb, ended = attempt
        log("stopping the job in hand" + (" now" if forced else "; grace over"),
            job=hb.job.job_id)
        hb.cancelled.set()
        if forced:
            ended.set()
    if not forced:
        timer = threading.Timer(STOP_TIMEOUT, stop_now, kwargs={"forced": True})
        timer.daemon = True
        timer.start()


def on_stop_signal(signum):
    """The first stop signal drains; a second one stops at once."""
    name = signal.Signals(signum).name
    if not STOPPING.is_set():
        log("stopping: no more leases; the job in hand has the grace", signal=name,
            grace=f"{ARGS.grace_seconds}s")
        STOPPING.set()
        # Only a long poll: a job the server hands it as it goes away goes
        # back to the queue at once, its attempt given back.
        call = LEASING["call"]
        if call is not None:
            call.cancel()
        timer = threading.Timer(ARGS.grace_seconds, stop_now)
        timer.daemon = True
        timer.start()
    elif not FORCED.is_set():
        log("told again to stop", signal=name)
        stop_now(forced=True)


def watch_stop_signals():
    """Runs on_stop_signal on a thread of its own for SIGTERM, SIGINT and
    SIGHUP. A Python signal handler runs in the main thread between two
    bytecodes: setting an Event there deadlocks if the main thread was
    inside that Event's wait, and a signal that landed on another thread
    waits for the main thread to wake. The C-level handler writes each
    signal's number to the wakeup fd at once, whichever thread it hit."""
    stops = {signal.SIGTERM, signal.SIGINT}
    # Started under nohup (SIGHUP ignored), a closed terminal must not stop
    # it; otherwise SIGHUP's default action would end it mid-job, and the
    # job would wait out its lease.
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        stops.add(signal.SIGHUP)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for sig in stops:
        signal.signal(sig, lambda *_: None)

    def loop():
        while True:
            for signum in os.read(read, 64):
                if signum in stops:
                    try:
                        on_stop_signal(signum)
                    except Exception as e:  # the next signal must still be heard
                        log("could not act on a stop signal", error=describe(e))

    threading.Thread(target=loop, daemon=True, name="signals").start()


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
                own = min(interval, random.uniform(retry / 2, retry))
                # The server's RetryInfo is waited out, but the last try
                # still comes before the lease ends.
                delay = (held_until - now if now >= final
                         else min(max(own, server_delay(e)), final - now))
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


def describe(error):
    """repr() of an exception, which must not raise in turn."""
    try:
        return repr(error)
    except Exception:
        return type(error).__name__


def failure_request(job, error_class, message, retryable, retry_after=None):
    """A failure the server takes, whatever the handler gave: the class's
    characters outside [A-Za-z0-9_.:/-] become _, NUL (which PostgreSQL
    cannot store) leaves the message, and each is cut at its limit (as the
    Rust library does). A value the server refused would cost a round trip
    and come back as invalid_failure."""
    request = pb.CompleteRequest(job_id=job.job_id, lease_token=job.lease_token)
    error_class = "".join(c if (c.isascii() and c.isalnum()) or c in "_.:/-" else "_"
                          for c in str(error_class).strip())[:MAX_CLASS]
    request.failure.error_class = error_class or "error"
    request.failure.message = str(message).replace("\0", "")[:MAX_MESSAGE]
    request.failure.retryable = bool(retryable)
    if retry_after is not None:
        seconds = min(max(float(retry_after), 0.0), MAX_RETRY_AFTER)
        request.failure.retry_after.CopyFrom(duration_pb2.Duration(
            seconds=int(seconds), nanos=int((seconds % 1) * 1e9)))
    return request


def outcome_request(job, ending):
    """The report of what the handler came to (`ending`: its "result", or
    the "error" it raised; neither when it was left behind)."""
    if "result" in ending:
        try:
            value = struct_pb2.Value()
            json_format.Parse(json.dumps(ending["result"]), value)
        except Exception as e:
            # It would not be sendable the next time either.
            return failure_request(job, "invalid_result",
                                   f"the result cannot be sent: {describe(e)}", retryable=False)
        request = pb.CompleteRequest(job_id=job.job_id, lease_token=job.lease_token)
        request.success.result.CopyFrom(value)
        return request
    error = ending.get("error")
    if isinstance(error, JobError):
        return failure_request(job, error.error_class, error.message, error.retryable,
                               error.retry_after)
    if error is not None:  # a bug in the handler: let another attempt try
        return failure_request(job, "handler_exception", describe(error), retryable=True)
    return shutdown_request(job)


def shutdown_request(job):
    """Stopped by the shutdown, not by its own failure: it runs again at
    once elsewhere."""
    return failure_request(job, "worker_shutdown", "the worker stopped before the job finished",
                           retryable=True, retry_after=0)


def safe_outcome_request(job, ending):
    """outcome_request, which no value from a handler or a payload may turn
    into an exception: one here would end the worker, and the job would end
    every worker that leased it until its attempts ran out."""
    try:
        return outcome_request(job, ending)
    except Exception as e:
        return failure_request(job, "handler_exception",
                               f"the outcome could not be built: {describe(e)}", retryable=True)


class Reporter:
    """Sends outcomes. While `chain` is set (until a stop signal, an older
    server or a refused claim), an outcome goes with `CompleteAndLease`,
    which also claims the worker's next job in the same transaction, and the
    job it brings back is returned to be run next."""

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
                elif e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # Refused for its claim (an outcome is refused in its
                    # item), which the next call would repeat.
                    log("the server refused the claim sent with an outcome; using Complete",
                        detail=e.details())
                    self.chain = False
                else:
                    log("chained complete failed; retrying with Complete", code=e.code().name)
                # Plain Complete from here, so that this slot never gets two jobs.
                complete(self.stub, job, request, ARGS.lease_seconds, wait=server_delay(e))
                return []
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


def complete(stub, job, request, limit, wait=0):
    """Sends the outcome with Complete; retries what may pass for up to
    `limit` seconds (at most a lease, after which the lease is likely gone),
    the last try at the limit, each after the server's RetryInfo delay if
    it sent one (`wait`: the one of the call this retries). An outcome the
    server refuses as invalid (a result over its size limit) is sent once
    more as a failure, so that the job does not wait out its lease: a
    refused result as a final one, a refused failure as retryable as it
    was. Told twice to stop, the worker gives it one short try."""
    backoff = 0.1
    deadline = time.monotonic() + limit
    replaced = False
    if wait > 0:
        FORCED.wait(min(wait, limit))
    while True:
        try:
            # A hung call must not hold a next job back past the limit.
            left = deadline - time.monotonic()
            timeout = FORCED_CALL_TIMEOUT if FORCED.is_set() else min(10, max(0.5, left))
            stub.Complete(request, timeout=timeout, metadata=metadata())
            return
        except grpc.RpcError as e:
            if e.code() in LOST:
                log("lease lost before complete; outcome dropped", job=job.job_id)
                return
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and not replaced:
                log("the server refused the outcome", job=job.job_id, detail=e.details())
                refused = "result" if request.HasField("success") else "failure"
                retryable = request.failure.retryable if refused == "failure" else False
                request = failure_request(job, f"invalid_{refused}",
                                          f"the server refused the {refused}: {e.details()}",
                                          retryable)
                replaced = True
                continue
            left = deadline - time.monotonic()
            if e.code() not in TRANSIENT or left <= 0 or FORCED.is_set():
                log("complete failed", job=job.job_id, code=e.code().name, detail=e.details())
                return
            delay = min(left, max(random.uniform(backoff / 2, backoff), server_delay(e)))
            log("complete failed; retrying", job=job.job_id, code=e.code().name,
                retry_in=f"{delay:.2f}s")
            # Told to stop now during the wait: the try after it is the last.
            FORCED.wait(delay)
            backoff = min(backoff * 2, 5)


# From 2**53 on a double no longer holds every integer.
EXACT = 2.0 ** 53


def whole_numbers(value):
    """The payload as the producer wrote it: a protobuf Value holds every
    number as a double, so a 5 arrives as 5.0. Whole numbers under 2**53
    become ints again (not -0.0, whose sign an int would lose), as in the
    Rust worker and `intray work`."""
    if isinstance(value, float):
        whole = value.is_integer() and abs(value) < EXACT
        return int(value) if whole and not (value == 0 and math.copysign(1, value) < 0) else value
    if isinstance(value, list):
        return [whole_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_numbers(v) for k, v in value.items()}
    return value


def arrived(jobs):
    """Leased jobs paired with when they arrived: their leases run from then."""
    now = time.monotonic()
    return [(job, now) for job in jobs]


def run_job(stub, reporter, job, received):
    """Runs one job and reports it; returns the next jobs the report brought."""
    hb = Heartbeat(stub, job, received)
    # Set when the handler has returned or raised, or at once when the
    # worker is told twice to stop.
    ended = threading.Event()
    ending = {}

    def work():
        try:
            payload = (whole_numbers(json_format.MessageToDict(job.payload))
                       if job.HasField("payload") else None)
            ending["result"] = handle(job, payload, hb)
        except Exception as e:
            ending["error"] = e
        finally:
            ended.set()

    RUNNING["attempt"] = (hb, ended)
    if HARD_STOP.is_set():
        hb.cancelled.set()
    hb.start()
    if FORCED.is_set():
        ended.set()
    else:
        # In a thread of its own, so that a handler deaf to its cancel flag
        # cannot hold a forced stop back: it is left behind, and ends with
        # the process.
        threading.Thread(target=work, daemon=True, name=f"job-{job.job_id}").start()
    ended.wait()
    ending = dict(ending)  # what a handler left behind writes later is not reported
    RUNNING["attempt"] = None
    hb.done.set()
    # A heartbeat in flight may yet find the lease lost; not waited for
    # when told to stop now.
    while hb.is_alive() and not FORCED.is_set():
        hb.join(0.1)
    if hb.lost.is_set():
        return []  # someone else may own the job now: write nothing
    request = safe_outcome_request(job, ending)
    if HARD_STOP.is_set() and not request.HasField("success"):
        # A success after the grace did the work: it stands.
        request = shutdown_request(job)
    if request.HasField("success"):
        log("job succeeded", job=job.job_id, kind=job.kind)
    else:
        log("job failed", job=job.job_id, error_class=request.failure.error_class,
            retryable=request.failure.retryable)
    return reporter.report(job, request)


def lease_request(wait_seconds):
    """A claim of one job that long-polls up to `wait_seconds` (0: answer at once)."""
    return pb.LeaseRequest(
        worker_id=ARGS.worker_id, queues=ARGS.queue, max_jobs=1,
        lease_duration=duration_pb2.Duration(seconds=ARGS.lease_seconds),
        wait=duration_pb2.Duration(seconds=wait_seconds))


def lease(stub):
    """One Lease call, which a stop signal cuts short: the jobs it brought,
    or None when it was cut."""
    call = stub.Lease.future(lease_request(ARGS.wait_seconds),
                             timeout=ARGS.wait_seconds + 10, metadata=metadata())
    LEASING["call"] = call
    try:
        # A signal that came before the call was stored found nothing to cancel.
        if STOPPING.is_set():
            call.cancel()
        return arrived(call.result().jobs)
    except grpc.FutureCancelledError:
        return None
    finally:
        LEASING["call"] = None


def main():
    watch_stop_signals()
    channel = grpc.insecure_channel(ARGS.addr, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    stub = rpc.WorkerServiceStub(channel)
    reporter = Reporter(stub, STOPPING)
    log("worker started", addr=ARGS.addr, queues=",".join(ARGS.queue), worker_id=ARGS.worker_id)
    backoff = 0.1
    while not STOPPING.is_set():
        try:
            jobs = lease(stub)
            backoff = 0.1
        except grpc.RpcError as e:
            if STOPPING.is_set():
                break
            if e.code() in FATAL:
                log("the server refused the worker", code=e.code().name, detail=e.details())
                return 2
            if too_large(e):
                # The server handed a job over that could not be received:
                # it comes back when its lease ends, at its next attempt.
                log("a leased job is larger than this worker's receive limit; it is lost until "
                    "its lease ends", limit_bytes=MAX_MESSAGE_BYTES, detail=e.details())
            # UNAVAILABLE and friends: back off with jitter, at least as long
            # as the server asked, then try again.
            delay = max(random.uniform(backoff / 2, backoff), server_delay(e))
            log("lease failed; retrying", code=e.code().name, retry_in=f"{delay:.2f}s")
            STOPPING.wait(delay)
            backoff = min(backoff * 2, 30)
            continue
        while jobs:
            jobs.extend(run_job(stub, reporter, *jobs.pop(0)))
    log("worker stopped")
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
