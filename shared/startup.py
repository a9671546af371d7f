"""Start-up checks of a service's configuration, run before the server binds or logs
`server.started`, and the one way a start-up failure is reported.

Checks (each failure is one plain sentence naming the flag and what to fix):
- `--model`: a builtin tiny name, an existing local directory holding a saved model, or a hub id
  already in the local Hugging Face cache. The services run with the Hub offline unless
  `HF_HUB_OFFLINE=0` is set, so a mistyped path fails at once instead of retrying the Hub.
- `--device`: a device this torch build has (`cuda` without a CUDA device is refused here).
- The libraries: the installed transformers has the APIs this build calls (`create_causal_mask`
  taking `cache=`: transformers 5.17 lacks it, and every request would fail INTERNAL).
- `--artifacts`: every path exists and holds artifacts this build reads. Which weights each was
  calibrated for is checked once the model is loaded, still before the server binds
  (`select_artifacts`): the ones for these weights in this role are kept, every other one is
  logged as skipped (`startup.artifact_skipped`, naming it and why); none kept is a failure.
- TLS and tokens: every PEM and token file exists; each certificate matches its key; CA files parse.
- Ports: the API, health, metrics and (consumer) HTTP ports are free (and distinct), each named by its flag.

`load_checked` loads the model and narrows `--artifacts` to those calibrated for its weights.
`fail` reports a failure as one JSON log line (`startup.failed`) plus one plain sentence on
stderr and exits with status 2: no traceback. Knows no servicer.
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

from shared import logs, pretrained, tiny
from shared.config import ConsumerConfig, ServerConfig

log = logs.get("startup")
EXIT_CODE = 2


class StartupError(Exception):
    """A configuration the service cannot start with; the message is the sentence shown."""


def hub_offline() -> bool:
    """The Hub stays offline unless HF_HUB_OFFLINE is set to a false value (0/false/no/off)."""
    import huggingface_hub.constants as hub

    offline = os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() not in ("0", "false", "no", "off")
    hub.HF_HUB_OFFLINE = offline  # read by huggingface_hub and transformers at call time
    return offline


def check_model(model: str) -> None:
    if model in tiny.BUILTIN and not Path(model).exists():
        return
    if model in pretrained.NAMES and not Path(model).exists():
        return  # a registry model by short name: built on first load (shared.pretrained.ensure names what fails)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StartupError(f"--model {model}: the directory has no config.json (not a saved Hugging Face model)")
        return
    if path.exists():
        raise StartupError(f"--model {model}: is a file; give the directory of a saved model")
    looks_local = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_local:
        raise StartupError(f"--model {model}: no such local directory ({path.resolve()})")
    offline = hub_offline()
    from huggingface_hub import try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(model, "config.json"), str)
    if not cached and offline:
        builtin = ", ".join(sorted(tiny.BUILTIN) + sorted(pretrained.NAMES))
        raise StartupError(
            f"--model {model}: no such local directory ({path.resolve()}), and no hub model of that id in the "
            f"local Hugging Face cache; check the path, or download it first (huggingface-cli download {model}), "
            f"or set HF_HUB_OFFLINE=0 to let the service download it (builtin and registry names: {builtin})"
        )


def check_device(name: str) -> None:
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise StartupError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(f"--device {name}: this torch build sees no CUDA device; use --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise StartupError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        raise StartupError(f"--device {name}: not supported here; use auto, cpu, cuda or cuda:N")


def check_artifacts(paths: Iterable[str]) -> None:
    from shared.scd.artifact import discover

    for p in paths:
        if not Path(p).exists():
            raise StartupError(f"--artifacts {p}: no such file or directory")
    try:
        discover(paths)
    except Exception as exc:
        raise StartupError(f"--artifacts: {exc}") from None


def _need_file(flag: str, path: str) -> None:
    if path and not Path(path).is_file():
        raise StartupError(f"{flag} {path}: no such file")


def _cert_and_key(cert_flag: str, cert: str, key_flag: str, key: str) -> None:
    _need_file(cert_flag, cert)
    _need_file(key_flag, key)
    if not cert:
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        why = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(exc) else f"unreadable ({exc.reason})"
        raise StartupError(f"{cert_flag} {cert} and {key_flag} {key}: {why}") from None


def _ca(flag: str, path: str) -> None:
    _need_file(flag, path)
    if path:
        try:
            ssl.create_default_context(cafile=path)
        except ssl.SSLError as exc:
            raise StartupError(f"{flag} {path}: not a PEM CA certificate ({exc.reason})") from None


def _token(flag: str, path: str) -> None:
    _need_file(flag, path)
    if path and not Path(path).read_text().strip():
        raise StartupError(f"{flag} {path}: the file is empty")


def check_security(cfg: ServerConfig) -> None:
    _cert_and_key("--tls-cert", cfg.tls_cert, "--tls-key", cfg.tls_key)
    _ca("--tls-client-ca", cfg.tls_client_ca)
    _token("--token-file", cfg.token_file)
    if isinstance(cfg, ConsumerConfig):
        _ca("--producer-tls-ca", cfg.producer_tls_ca)
        _cert_and_key("--producer-tls-cert", cfg.producer_tls_cert, "--producer-tls-key", cfg.producer_tls_key)
        _token("--producer-token-file", cfg.producer_token_file)


def check_ports(cfg: ServerConfig) -> None:
    """Every port this service will listen on is free now; two flags never name the same port."""
    ports = [("--port", cfg.port), ("--health-port", cfg.health_port), ("--metrics-port", cfg.metrics_port)]
    ports.append(("--http-port", getattr(cfg, "http_port", -1)))  # the consumer's OpenAI-compatible API
    named = [(flag, p) for flag, p in ports if p > 0]
    try:  # the address itself, whatever the ports (a port of 0 binds any free one); IPv6 too
        family = socket.getaddrinfo(cfg.host, None, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((cfg.host, 0), family=family):
            pass
    except OSError as exc:  # socket.gaierror included: a name that does not resolve
        raise StartupError(f"--host {cfg.host}: cannot listen on it ({exc.strerror or exc})") from None
    seen: dict[int, str] = {}
    for flag, port in named:
        if port in seen:
            raise StartupError(f"{flag} {port}: the same port as {seen[port]}")
        seen[port] = flag
        try:
            with socket.create_server((cfg.host, port), family=family):
                pass
        except OSError as exc:
            raise StartupError(f"{flag} {port}: cannot listen on {cfg.host}:{port} ({exc.strerror or exc})") from None


PINNED_TRANSFORMERS = "5.24.0"  # pyproject.toml's pin, named in the message


def check_libraries(mask_fn=None) -> None:
    """The installed transformers has what the KV code calls: `create_causal_mask(..., cache=...)`
    (`mask_fn`: the function to inspect; transformers' own by default)."""
    import inspect

    import transformers

    if mask_fn is None:
        from transformers.masking_utils import create_causal_mask as mask_fn
    if "cache" not in inspect.signature(mask_fn).parameters:
        raise StartupError(
            f"transformers {transformers.__version__}: create_causal_mask takes no `cache` argument, which this build"
            f" calls on every request; install transformers=={PINNED_TRANSFORMERS} (pyproject.toml)"
        )


def check(cfg: ServerConfig) -> None:
    """Every check that needs no loaded model, cheapest first."""
    check_libraries()
    check_device(cfg.device)
    check_model(cfg.model)
    check_security(cfg)
    check_ports(cfg)
    check_artifacts(cfg.artifact_paths)


def loaded_artifacts(role: str, servicer) -> None:
    """Every SCD artifact a started service (role producer|consumer) loaded is for its weights."""
    codec = servicer.codecs.get("scd")
    info = servicer.loaded.info
    artifacts_for(role, info.weight_digest, info.model_id, getattr(codec, "artifacts", []))


def _name(art) -> str:
    return art.path.name if art.path is not None else art.artifact_id


def mismatch(role: str, digest: str, model_id: str, art) -> str:
    """Why `art` was not calibrated with these weights in this role (producer|consumer), or ""."""
    want = art.meta[role]["weight_digest"]
    if want == digest:
        return ""
    return (
        f"calibrated for {role} {art.meta[role]['model_id']} (digest {want[:16]}...), "
        f"not for the loaded --model {model_id} (digest {digest[:16]}...)"
    )


def artifacts_for(role: str, digest: str, model_id: str, artifacts) -> None:
    """Every loaded artifact was calibrated with these weights in this role (producer|consumer)."""
    for art in artifacts:
        why = mismatch(role, digest, model_id, art)
        if why:
            raise StartupError(f"--artifacts {_name(art)}: {why}")


def select_artifacts(role: str, digest: str, model_id: str, paths: list[str]) -> list[str]:
    """The files among `paths` (--artifacts: files or directories) holding an artifact calibrated
    with these weights in this role; each other artifact is one `startup.artifact_skipped` line
    naming it and why. Artifacts were given but none is for these weights: StartupError naming
    each (one given: the same sentence as `artifacts_for`)."""
    from shared.scd.artifact import discover

    found = discover(paths)
    kept, skipped = [], []
    for art in found:
        why = mismatch(role, digest, model_id, art)
        if why:
            log.warning("startup.artifact_skipped", artifact=str(art.path or art.artifact_id), reason=why)
            skipped.append(f"{_name(art)} (for {role} {art.meta[role]['model_id']})")
        else:
            kept.append(str(art.path))
    if found and not kept:
        if len(found) == 1:
            artifacts_for(role, digest, model_id, found)
        raise StartupError(
            f"--artifacts {','.join(paths)}: none of the {len(found)} artifacts was calibrated for {role} "
            f"--model {model_id} (digest {digest[:16]}...): {', '.join(skipped)}"
        )
    return kept


def load_checked(service: str, cfg: ServerConfig):
    """The model loaded, and `cfg` with --artifacts narrowed to the artifact files calibrated for
    its weights in this role (others logged as skipped: select_artifacts)."""
    import dataclasses

    from shared.models import load_model

    loaded = load_model(cfg.model, cfg.dtype, cfg.device)
    if cfg.artifact_paths:
        info = loaded.info
        kept = select_artifacts(service, info.weight_digest, info.model_id, cfg.artifact_paths)
        cfg = dataclasses.replace(cfg, artifacts=",".join(kept))
    return loaded, cfg


def fail(service: str, reason: str) -> NoReturn:
    """One JSON log line, one plain sentence on stderr, exit status 2."""
    log.error("startup.failed", service=service, reason=reason)
    print(f"{service}: cannot start: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CODE)
