"""Fail fast, in one line (issue 19, findings 4 and 5): start-up checks name the flag and what to
fix before the server starts; a failure is one JSON log line, one sentence on stderr, exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trustme
from safetensors.torch import save_file

from shared import config as config_lib
from shared import startup
from shared.config import ConsumerConfig, ProducerConfig
from shared.scd.artifact import SIDECAR_SUFFIXES

ROOT = Path(__file__).resolve().parent.parent


def run_service(service: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", service, "--port", "0", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_failure(proc: subprocess.CompletedProcess, named: str) -> None:
    assert proc.returncode == startup.EXIT_CODE, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    failed = [json.loads(line) for line in lines if line.startswith("{") and '"startup.failed"' in line]
    assert len(failed) == 1 and named in failed[0]["reason"]
    plain = [line for line in lines if not line.startswith("{")]
    assert len(plain) == 1 and "cannot start" in plain[0] and named in plain[0], lines
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr


def test_a_mistyped_model_path_fails_at_once_naming_the_path():
    proc = run_service("consumer", "--model", "checkpoints/qa-bse")
    assert_one_line_failure(proc, "--model checkpoints/qa-bse: no such local directory")
    assert '"server.started"' not in proc.stderr
    assert_one_line_failure(run_service("producer", "--artifact", "x"), "unrecognized arguments: --artifact x")


def test_an_artifact_of_other_weights_fails_the_start(tmp_path):
    meta = {
        "artifact_id": "0123456789abcdef",
        "format_version": 2,
        "producer": {"model_id": "other-base", "weight_digest": "a" * 64},
        "consumer": {"model_id": "other-tuned", "weight_digest": "b" * 64},
        "geometry": {"num_layers": 4, "hidden": 64, "kv_width": 64, "kv_element_bytes": 4},
        "schedules": [],
    }
    path = tmp_path / "other-pair.safetensors"
    save_file({"unused": torch.zeros(1)}, str(path), metadata={"scd": json.dumps(meta)})
    proc = run_service("producer", "--model", "tiny-llama", "--device", "cpu", "--artifacts", str(path))
    assert_one_line_failure(proc, "--artifacts other-pair.safetensors: calibrated for producer other-base")
    # checked before the server announces itself: nothing says started or serving first
    assert '"server.started"' not in proc.stderr and '"server.serving"' not in proc.stderr, proc.stderr[-2000:]


def test_a_folder_of_several_pairs_artifacts_loads_the_ones_for_these_weights(tmp_path):
    """--artifacts artifacts/ (the four shipped pairs): the producer on qa-base keeps
    qa-base-to-tuned, logs the three others as skipped (one line each, naming it and why) and
    serves (the keep-policy sidecars beside them are not artifacts: not read); a folder holding only
    other pairs' artifacts fails the start naming each."""
    events = []
    with subprocess.Popen(
        [sys.executable, "-m", "producer", "--port", "0", "--model", "checkpoints/qa-base", "--device", "cpu",
         "--artifacts", "artifacts"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("{"):
                    events.append(json.loads(line))
                if events and events[-1]["event"] in ("server.serving", "startup.failed"):
                    break
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    names = [e["event"] for e in events]
    assert names[-1] == "server.serving", events
    skipped = {Path(e["artifact"]).name: e["reason"] for e in events if e["event"] == "startup.artifact_skipped"}
    shipped = {p.name for p in (ROOT / "artifacts").glob("*.safetensors") if not p.name.endswith(SIDECAR_SUFFIXES)}
    assert set(skipped) == shipped - {"qa-base-to-tuned.safetensors"}, skipped
    assert all("calibrated for producer" in why and "checkpoints/qa-base" in why for why in skipped.values())
    assert max(i for i, n in enumerate(names) if n == "startup.artifact_skipped") < names.index("server.started")

    others = tmp_path / "others"
    others.mkdir()
    for name in ("qa-tuned-to-tuned", "qa-deep-base-to-lora"):
        for ext in (".safetensors", ".json"):
            (others / f"{name}{ext}").write_bytes((ROOT / "artifacts" / f"{name}{ext}").read_bytes())
    failed = run_service("producer", "--model", "checkpoints/qa-base", "--device", "cpu", "--artifacts", str(others))
    assert_one_line_failure(failed, "none of the 2 artifacts was calibrated for producer --model checkpoints/qa-base")
    assert "qa-tuned-to-tuned.safetensors (for producer checkpoints/qa-tuned)" in failed.stderr
    assert '"server.started"' not in failed.stderr


def test_devices_this_build_lacks_are_refused_before_start():
    with pytest.raises(startup.StartupError, match="--device gpu: not a device"):
        startup.check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(startup.StartupError, match="--device cuda: this torch build sees no CUDA device"):
            startup.check_device("cuda")
    startup.check_device("cpu")


def test_model_paths_are_checked_offline(tmp_path):
    with pytest.raises(startup.StartupError, match="no such local directory"):
        startup.check_model(str(tmp_path / "missing"))
    with pytest.raises(startup.StartupError, match="has no config.json"):
        startup.check_model(str(tmp_path))
    startup.check_model("tiny-llama")
    startup.check_model("smollm2-135m")  # registry models by short name (shared.pretrained): `--model smollm2-135m`
    startup.check_model("smollm2-135m-tuned")
    with pytest.raises(startup.StartupError, match="registry names: .*smollm2-135m"):
        startup.check_model("smollm2-135m-typo")


def test_busy_and_clashing_ports_are_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(startup.StartupError, match=f"--metrics-port {port}: cannot listen"):
            startup.check_ports(ProducerConfig(port=0, metrics_port=port))
    with pytest.raises(startup.StartupError, match="--health-port 50999: the same port as --port"):
        startup.check_ports(ProducerConfig(port=50999, health_port=50999))


def test_a_host_it_cannot_listen_on_is_named_whatever_the_ports():
    with pytest.raises(startup.StartupError, match="--host 999.1.1.1: cannot listen on it"):
        startup.check_ports(ProducerConfig(host="999.1.1.1", port=0))
    if socket.has_ipv6:  # an IPv6 host is checked as IPv6 (it was refused: the check bound IPv4 only)
        startup.check_ports(ProducerConfig(host="::1", port=0))


def test_what_the_server_opens_itself_fails_in_one_line_naming_the_flag(tmp_path):
    """The producer's disk tier and KV event sockets open in its constructor: a file where the
    directory should be, or an endpoint already bound, is the one-line start-up failure (it was a
    traceback and exit 1)."""
    (tmp_path / "file").write_text("not a directory")
    proc = run_service(
        "producer",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--store-disk-dir",
        str(tmp_path / "file"),
        "--store-disk-bytes",
        "1000000",
    )
    assert_one_line_failure(proc, f"--store-disk-dir {tmp_path / 'file'}")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        endpoint = f"tcp://*:{busy.getsockname()[1]}"  # tcp://*: binds (a host connects)
        proc = run_service("producer", "--model", "tiny-llama", "--device", "cpu", "--kv-events-endpoint", endpoint)
    assert_one_line_failure(proc, f"--kv-events-endpoint {endpoint!r}")


@pytest.mark.parametrize("cls, service", [(ProducerConfig, "producer"), (ConsumerConfig, "consumer")])
def test_a_misspelled_variable_of_the_service_is_refused_naming_the_likely_one(cls, service):
    """SCD_<SERVICE>_* names the settings: one that names none (a typo) would leave its setting at
    the default without a word, so it is refused as an unknown flag is; compose's host-side
    *_PUBLISH variables are not settings and pass, as do other services' variables."""
    prefix = f"SCD_{service.upper()}_"
    with pytest.raises(
        config_lib.FlagError,
        match=f"{prefix}KV_EVENT_ENDPOINT: not a setting of the {service}; did you mean {prefix}KV_EVENTS_ENDPOINT",
    ):
        config_lib.load(cls, service, [], env={f"{prefix}KV_EVENT_ENDPOINT": "tcp://*:5557"})
    other = "SCD_CONSUMER_MAX_NEW_TOKENS" if service == "producer" else "SCD_PRODUCER_MAX_CHUNK_BYTES"
    config_lib.load(cls, service, [], env={f"{prefix}HTTP_PUBLISH": "127.0.0.1:8000", other: "7", "SCD_CACHE_DIR": "/x"})
    links = ["SERVICE_HOST", "SERVICE_PORT", "SERVICE_PORT_GRPC", "PORT_50052_TCP", "PORT_50052_TCP_PROTO", "PORT_8000_TCP_ADDR"]
    config_lib.load(cls, service, [], env={prefix + name: "10.0.0.1" for name in links})  # Kubernetes' service links


@pytest.mark.parametrize("target", ["", "not a target:::", "host:50051\n"])
def test_a_producer_target_grpc_cannot_read_is_refused_naming_the_setting(target):
    with pytest.raises(ValueError, match="producer: .* is not a gRPC target"):
        ConsumerConfig(producer=target).validate()
    for fine in ("127.0.0.1:50051", "dns:///producer:50051", "ipv4:10.0.0.1:1,10.0.0.2:2", "unix:/run/p.sock", "[::1]:5"):
        ConsumerConfig(producer=fine).validate()


def test_a_certificate_that_does_not_match_its_key_is_named(tmp_path):
    ca = trustme.CA()
    one, two = ca.issue_cert("localhost"), ca.issue_cert("localhost")
    one.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    two.private_key_pem.write_to_path(tmp_path / "key.pem")
    cfg = ProducerConfig(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))
    with pytest.raises(startup.StartupError, match="the key does not match the certificate"):
        startup.check_security(cfg)
    with pytest.raises(startup.StartupError, match="--producer-tls-ca .*: no such file"):
        startup.check_security(ConsumerConfig(producer_tls_ca=str(tmp_path / "missing.pem")))


@pytest.mark.parametrize("cls, service", [(ProducerConfig, "producer"), (ConsumerConfig, "consumer")])
def test_flags_have_help_and_no_abbreviations(cls, service):
    parser = config_lib.parser_for(cls, service, {})
    described = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert set(described) == {f.name for f in dataclasses.fields(cls)}
    assert [name for name, text in described.items() if not text or text.startswith(" (env")] == []
    with pytest.raises(config_lib.FlagError, match="unrecognized arguments: --artifact x"):
        config_lib.load(cls, service, ["--artifact", "x"], env={})  # not --artifacts
    with pytest.raises(config_lib.FlagError, match=f"SCD_{service.upper()}_PORT='http'"):
        config_lib.load(cls, service, [], env={f"SCD_{service.upper()}_PORT": "http"})


async def test_rejected_tls_handshakes_are_counted_and_logged_as_json(tmp_path):
    """Issue 19, finding 7: a service process's stderr carries JSON lines only; a client the mTLS
    port refuses is one `tls.handshake_failed` line and one count of scd_tls_handshake_failures."""
    import asyncio
    import signal
    import urllib.request

    import grpc

    from bench.harness.services import free_port
    from tests.conftest import wait_serving

    ca, rogue_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    server.private_key_pem.write_to_path(tmp_path / "server.key")
    (tmp_path / "server.pem").write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    port, health, metrics = free_port(), free_port(), free_port()
    args = [
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--tls-cert",
        str(tmp_path / "server.pem"),
        "--tls-key",
        str(tmp_path / "server.key"),
        "--tls-client-ca",
        str(tmp_path / "ca.pem"),
        "--drain-grace-s",
        "0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer", *args],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(240):  # the process imports torch and loads the model first
            try:
                await wait_serving(f"127.0.0.1:{health}", timeout_s=60)
                break
            except grpc.aio.AioRpcError:
                assert proc.poll() is None, "the producer exited"
                await asyncio.sleep(0.5)
        rogue = rogue_ca.issue_cert("scd-consumer")
        for key, chain in ((None, None), (rogue.private_key_pem.bytes(), rogue.cert_chain_pems[0].bytes())):
            credentials = grpc.ssl_channel_credentials(ca.cert_pem.bytes(), private_key=key, certificate_chain=chain)
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary("/scd.v1.ProducerService/Describe")(b"", timeout=3)
        # counted from gRPC core's stderr lines by a reader thread: the count may trail the refusals a little
        count = 0.0
        for _ in range(50):
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            count = next(
                float(line.split()[-1]) for line in text.splitlines() if line.startswith("scd_tls_handshake_failures_total")
            )
            if count >= 2:
                break
            await asyncio.sleep(0.1)
        assert count >= 2
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith("{")] == []
    events = [json.loads(line)["event"] for line in lines]
    assert events.count("tls.handshake_failed") >= 2 and "server.drained" in events


def test_core_log_lines_become_json_and_other_lines_pass_through():
    from shared.core_log import CoreLog

    core = CoreLog("producer")
    line = (
        "I1201 13:26:17.782330   14341 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: "
        "error:100000c0:SSL routines:OPENSSL_internal:PEER_DID_NOT_RETURN_A_CERTIFICATE: Invalid certificate verification context"
    )
    out = json.loads(core.translate(line))
    assert out["event"] == "tls.handshake_failed" and out["error"].startswith("PEER_DID_NOT_RETURN_A_CERTIFICATE")
    assert core.handshake_failures == 1
    assert core.translate("I1201 13:27:34.926793   15502 chttp2_transport.cc:1403] ipv4:127.0.0.1:1: Got goaway") is None
    assert json.loads(core.translate("E1201 13:27:34.9 15502 server.cc:10] boom"))["event"] == "grpc.core"
    assert core.translate('{"event": "server.started"}') == '{"event": "server.started"}'


def test_malloc_tuning_is_validated_and_applied_at_start():
    from shared import malloc_tuning

    with pytest.raises(ValueError, match="malloc_mmap_threshold: -1 must be >= 0"):
        config_lib.load(ConsumerConfig, "consumer", ["--malloc-mmap-threshold", "-1"], env={})
    assert malloc_tuning.tune(0) == "glibc's defaults (--malloc-mmap-threshold 0)"
    applied = malloc_tuning.tune(malloc_tuning.DEFAULT_MMAP_THRESHOLD)
    import platform

    if platform.libc_ver()[0] == "glibc":  # mallopt returned success for both thresholds
        assert applied.endswith(f"mmap threshold {1 << 25} bytes, trim threshold {1 << 26} bytes"), applied
    else:
        assert applied.startswith("unchanged: the C library is not glibc")
    assert (
        ConsumerConfig().malloc_mmap_threshold == ProducerConfig().malloc_mmap_threshold == malloc_tuning.DEFAULT_MMAP_THRESHOLD
    )


def test_torch_threads_is_validated_and_sets_the_intra_op_pool():
    with pytest.raises(ValueError, match="torch_threads: -1 must be >= 0"):
        config_lib.load(ConsumerConfig, "consumer", ["--torch-threads", "-1"], env={})
    assert config_lib.load(ProducerConfig, "producer", [], env={"SCD_PRODUCER_TORCH_THREADS": "1"}).torch_threads == 1
    # a started service runs with it: the flag is applied before the model loads
    code = (
        "import sys, torch, shared.service_main as s\n"
        "s.run = lambda main: print('threads', torch.get_num_threads())\n"
        "s.main('consumer', __import__('shared.config', fromlist=['x']).ConsumerConfig, object, sys.argv[1:])\n"
    )
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code, "--torch-threads", "1", "--model", "tiny-llama", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "threads 1" in out.stdout, out.stderr[-2000:]


def test_a_transformers_without_the_apis_this_build_calls_is_refused_naming_the_pin():
    """transformers 5.17 (seen on a GPU machine's image) has create_causal_mask without `cache=`:
    every request failed INTERNAL; the start now fails and says which version to install."""
    startup.check_libraries()  # the installed one passes
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"transformers=={startup.PINNED_TRANSFORMERS}"' in pyproject  # the message names the real pin

    def old_mask(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
        return None

    with pytest.raises(startup.StartupError, match=r"create_causal_mask takes no `cache` argument.*transformers==5\.24\.0"):
        startup.check_libraries(old_mask)


def test_intra_op_threads_one_on_cuda_unless_configured_or_set_by_omp():
    from shared.torch_threads import intra_op_threads

    assert intra_op_threads(3, "cuda:0", {})[0] == 3  # --torch-threads wins
    assert intra_op_threads(0, "cuda:0", {})[0] == 1
    assert intra_op_threads(0, "cuda", {"OMP_NUM_THREADS": "4"})[0] == 0  # torch follows the variable
    assert intra_op_threads(0, "cpu", {})[0] == 0  # torch's default on a CPU model
    threads, why = intra_op_threads(0, "auto", {})
    assert (threads == 1) == torch.cuda.is_available() and why


def test_core_log_translates_fd2_while_python_writes_the_real_stderr_directly():
    """A service's own lines skip the core-log pipe (no second pass on the reader thread); gRPC
    core's lines on fd 2 still become JSON lines; both reach the process's stderr."""
    script = (
        "import os, sys\n"
        "from shared import core_log\n"
        "core = core_log.install('producer')\n"
        "print('direct', sys.stderr.fileno() != 2, file=sys.stderr, flush=True)\n"
        "os.write(2, b'E1201 13:27:34.9 15502 server.cc:10] boom\\n')\n"
        "core.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "direct True" in lines
    (core,) = [json.loads(line) for line in lines if line.startswith("{")]
    assert core["event"] == "grpc.core" and core["message"] == "boom" and core["service"] == "producer"


def test_a_service_whose_stderr_reader_went_away_keeps_logging_without_failing():
    """stderr is a pipe whose reader closed (EPIPE on every write): log lines are lost, never
    raised into the code that logs (a request would fail on its log line), and the process exits 0."""
    script = (
        "import time\n"
        "from shared import core_log, logs\n"
        "core_log.install('producer')\n"
        "logs.configure('producer', 'INFO')\n"
        "time.sleep(0.5)\n"  # the reader below is gone by now
        "for i in range(200):\n"
        "    logs.get('producer.test').info('line', i=i)\n"
        "print('ok', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    child.stderr.close()
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "ok"


def test_libraries_log_records_are_json_lines_too():
    """grpc's and aiohttp's standard-library records (e.g. grpc's "ExecuteBatchError raised in core"
    when a caller cancels as a stream ends, aiohttp's "Error handling request") were printed as
    plain text with multi-line tracebacks among the services' JSON lines: each is one JSON line,
    its traceback a bounded dict, beside structlog's own."""
    code = (
        "import logging\n"
        "from shared import logs\n"
        "logs.configure('svc')\n"
        "try:\n"
        "    raise ConnectionResetError('Connection lost')\n"
        "except ConnectionResetError:\n"
        "    logging.getLogger('aiohttp.server').exception('Error handling request from %s', '10.0.0.1')\n"
        "logging.getLogger('grpc._cython.cygrpc').error('ExecuteBatchError raised in core by servicer method')\n"
        "logs.get('x').info('ours', n=1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # every line is JSON
    assert [r["event"] for r in lines] == [
        "Error handling request from 10.0.0.1",
        "ExecuteBatchError raised in core by servicer method",
        "ours",
    ]
    assert lines[0]["logger"] == "aiohttp.server" and lines[0]["level"] == "error" and lines[0]["service"] == "svc"
    assert lines[0]["exception"][0]["exc_type"] == "ConnectionResetError"


def test_configuring_the_logs_keeps_other_handlers_such_as_pytests(caplog):
    """configure replaces only its own handler (it replaced every root handler: pytest's caplog
    saw nothing logged after a test configured the logs)."""
    import logging

    from shared import logs

    with caplog.at_level("INFO"):
        logs.configure("tests", "INFO")
        logs.configure("tests", "INFO")  # twice: still one JSON handler
        logging.getLogger("grpc").warning("seen by caplog")
        ours = [h for h in logging.getLogger().handlers if getattr(h, "scd_json", False)]
        logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))  # as conftest left it
    assert "seen by caplog" in caplog.text and len(ours) == 1
