"""`python -m shared.healthcheck HOST:PORT [--service NAME] [--tls-ca CA] [--tls-cert C --tls-key K]`:
exit 0 when the server's gRPC health for NAME ("" = readiness, "liveness" = compute heartbeat)
is SERVING, 1 otherwise. Used by the Docker health checks (no grpc_health_probe binary needed);
health needs no token. On a TLS port pass the CA (and, under mTLS, a client certificate); the
plaintext `--health-port` needs none."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import security


def check(
    address: str, timeout_s: float = 3.0, service: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
) -> bool:
    credentials = security.channel_credentials(tls_ca, tls_cert, tls_key)
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m shared.healthcheck")
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051")
    parser.add_argument("--service", default="", help='health service name: "" readiness, "liveness"')
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--tls-ca", default="")
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.timeout_s, args.service, args.tls_ca, args.tls_cert, args.tls_key) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
