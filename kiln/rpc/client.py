"""gRPC client plumbing shared by kiln.Pipeline and the optimizer's fan-out to its peers:
channels over one address, a replica list or a DNS name (round-robin), and retries of
UNAVAILABLE with backoff inside the caller's deadline."""

from __future__ import annotations

import logging
from typing import Optional

from kiln.core import errors
from kiln.core.telemetry import current_span

RETRY_FIRST_S = 0.05  # first backoff after UNAVAILABLE; doubles per attempt, with jitter
RETRY_MAX_S = 2.0
RETRY_ATTEMPTS_NO_DEADLINE = 8  # a call without a deadline gives up after this many tries
UNREACHABLE_S = 10.0  # a service this client has not reached yet: seconds it may take to answer

log = logging.getLogger(__name__)


def channel_target(addresses: str) -> str:
    """The gRPC target for KILN_<STAGE>_ADDR: one `host:port`, a comma-separated list of
    `ip:port` replicas (balanced round-robin), or any gRPC name such as `dns:///svc:50051`
    (a headless Service: every address the name resolves to, round-robin)."""
    addrs = [a.strip() for a in addresses.split(",") if a.strip()]
    if not addrs:
        raise errors.InvalidArgument(f"empty address {addresses!r}")
    if len(addrs) == 1:
        return addrs[0]
    import ipaddress

    for a in addrs:
        host = a.rpartition(":")[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise errors.InvalidArgument(f"replica list {addresses!r}: {a!r} is not ip:port; name several "
                                         "replicas by one DNS name instead (dns:///name:port)") from None
    return "ipv4:" + ",".join(addrs)


def channel(addresses: str, auth=None):
    """A traced channel; TLS, a client certificate and a bearer token follow `auth` (default: the
    environment, see kiln.rpc.auth)."""
    import grpc

    from kiln.rpc.auth import AuthConfig, BearerTokenClientInterceptor
    from kiln.rpc.server import MAX_MESSAGE_BYTES
    from kiln.core.telemetry import instrument_channel

    auth = auth if auth is not None else AuthConfig.from_env()
    options = [("grpc.lb_policy_name", "round_robin"), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *auth.channel_options()]
    credentials = auth.channel_credentials()
    target = channel_target(addresses)
    ch = (grpc.secure_channel(target, credentials, options=options) if credentials is not None
          else grpc.insecure_channel(target, options=options))
    if auth.tokens:
        ch = grpc.intercept_channel(ch, BearerTokenClientInterceptor(auth.tokens[0]))
    return instrument_channel(ch)


def wait_ready(ch, what: str, seconds: float = UNREACHABLE_S) -> None:
    """Wait until the channel `ch` to `what` (a service at an address) is connected, saying
    that it retries after the first second; Unavailable naming it after `seconds`. A client
    pointed at a wrong address fails in seconds, not at its calls' deadline."""
    import grpc

    ready = grpc.channel_ready_future(ch)
    try:
        try:
            ready.result(timeout=min(1.0, seconds))
            return
        except grpc.FutureTimeoutError:
            log.warning("%s does not answer; retrying for up to %.0f s", what, seconds)
        try:
            ready.result(timeout=max(0.0, seconds - 1.0))
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(f"{what} did not answer within {seconds:.0f} s: is the address right "
                                     "and the service running?") from None
    finally:
        ready.cancel()


def kiln_error(e) -> errors.KilnError:
    cls = errors.BY_CODE.get(e.code().name, errors.KilnError)
    return cls(e.details())


def retrying(attempt, timeout: Optional[float]):
    """attempt(remaining seconds) until it does not fail with UNAVAILABLE (a replica down or
    restarting, the store briefly unreachable), with exponential backoff and jitter, inside the
    caller's deadline. Every kiln call is idempotent (content-addressed results; a Run is a pure
    function of its inputs), so a retry on any replica is safe. The last UNAVAILABLE is raised
    when the deadline (or, without one, the attempt limit) leaves no room for another try."""
    import random
    import time

    import grpc

    deadline = None if timeout is None else time.monotonic() + timeout
    delay = RETRY_FIRST_S
    for n in range(1, 1 << 30):
        remaining = None if deadline is None else deadline - time.monotonic()
        try:
            return attempt(remaining)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise kiln_error(e) from None
            pause = delay * random.uniform(0.5, 1.0)
            out_of_time = deadline is not None and time.monotonic() + pause >= deadline - 0.01
            if out_of_time or (deadline is None and n >= RETRY_ATTEMPTS_NO_DEADLINE):
                raise kiln_error(e) from None
            current_span().add_event("kiln.retry", {"kiln.attempt": n, "kiln.error": e.details() or ""})
            time.sleep(pause)
            delay = min(delay * 2, RETRY_MAX_S)


def call(method, request, timeout: Optional[float]):
    return retrying(lambda remaining: method(request, timeout=remaining), timeout)
