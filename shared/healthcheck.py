"""`python -m shared.healthcheck HOST:PORT [--service NAME] [--tls-ca CA] [--tls-cert C --tls-key K]`:
exit 0 when the server's gRPC health for NAME ("" = readiness, "liveness" = compute heartbeat,
"producer-link" = a consumer's link to its producers) is SERVING, 1 otherwise, and print one (on stderr)
line saying so: `SERVING`, `NOT_SERVING: <why>` (the server's reason, sent with the answer:
loading, draining, the default mode needs the producer, ...), or `UNREACHABLE: <why>` when no
answer came (connection refused, TLS handshake failed, timed out, unknown service). Used by the
Docker health checks (no grpc_health_probe binary needed); health needs no token. On a TLS port
pass the CA (and, under mTLS, a client certificate); the plaintext `--health-port` needs none."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REASON_KEY = "scd-health-reason"  # shared.health_service.REASON_KEY (not imported: keeps this module light)


def status(
    address: str, timeout_s: float = 3.0, service: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
) -> tuple[bool, str]:
    """(serving, the line to print)."""
    credentials = None
    if tls_ca:  # shared.security pulls in shared.logs (structlog, rich): over half of a plaintext probe's
        from shared import security  # start-up, which Docker pays every 5 s per container under a 4 s timeout

        credentials = security.channel_credentials(tls_ca, tls_cert, tls_key)
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code == grpc.StatusCode.NOT_FOUND:
                return False, f"UNREACHABLE: {address} has no health service {service!r}"
            return False, f"UNREACHABLE: {address}: {code.name if code else 'error'}: {(details or '').strip()[:300]}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True, "SERVING"
    why = dict(call.trailing_metadata() or ()).get(REASON_KEY, "")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return False, f"{name}: {why}" if why else name


def check(
    address: str, timeout_s: float = 3.0, service: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
) -> bool:
    return status(address, timeout_s, service, tls_ca, tls_cert, tls_key)[0]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.healthcheck")
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051")
    parser.add_argument("--service", default="", help='health service name: "" readiness, "liveness", "producer-link"')
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--tls-ca", default="")
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    args = parser.parse_args(argv)
    serving, line = status(args.address, args.timeout_s, args.service, args.tls_ca, args.tls_cert, args.tls_key)
    print(line, file=sys.stderr, flush=True)  # stderr: a script loop reading stdout stays clean
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
