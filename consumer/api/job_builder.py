"""From a GenerateRequest to a validated GenerateJob: every client-controlled field checked against
its limit before any work that field could make expensive (text length before tokenizing;
tokenizing off the event loop, on its own thread), errors naming the field and the limit.

Knows nothing about grpc beyond reading the request message.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Mapping

from consumer.auto.chooser import AUTO_MODE, AutoChoice, Budget, Candidate, Chooser
from consumer.auto.planner import Estimate, TransferPlanner
from consumer.engine.decoding import Sampling
from consumer.exact.repair import ANCHORS_OPTION, ATTENTION, REPAIR_OPTION, parse_repair
from consumer.request.job import (
    AUDIT_FALLBACK,
    AUDIT_OFF,
    AUDIT_REPAIR,
    AUDIT_REPORT,
    AUDIT_UPGRADE,
    FAIL,
    LOCAL_PREFILL,
    ORACLE_MODE,
    VERIFY_OFF,
    VERIFY_PROVISIONAL,
    VERIFY_VERIFIED,
    Extras,
    GenerateJob,
    Repair,
)
from shared import codecs as codec_lib
from shared import tenants
from shared.codecs.kept import KEEP_OPTION, KeepRequest
from shared.config import ConsumerConfig
from shared.errors import InvalidArgument
from shared.models import LoadedModel
from shared.pb import common_pb2, consumer_pb2

DEFAULT_NEW_TOKENS = 32
POLICIES = {
    consumer_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED: FAIL,
    consumer_pb2.TRANSFER_FAILURE_POLICY_FAIL: FAIL,
    consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL: LOCAL_PREFILL,
}
AUDITS = {
    consumer_pb2.AUDIT_POLICY_UNSPECIFIED: AUDIT_OFF,
    consumer_pb2.AUDIT_POLICY_OFF: AUDIT_OFF,
    consumer_pb2.AUDIT_POLICY_REPORT: AUDIT_REPORT,
    consumer_pb2.AUDIT_POLICY_FALLBACK: AUDIT_FALLBACK,
    consumer_pb2.AUDIT_POLICY_UPGRADE: AUDIT_UPGRADE,
    consumer_pb2.AUDIT_POLICY_REPAIR: AUDIT_REPAIR,
}
VERIFIES = {
    consumer_pb2.VERIFY_POLICY_UNSPECIFIED: VERIFY_OFF,
    consumer_pb2.VERIFY_POLICY_OFF: VERIFY_OFF,
    consumer_pb2.VERIFY_POLICY_VERIFIED: VERIFY_VERIFIED,
    consumer_pb2.VERIFY_POLICY_PROVISIONAL: VERIFY_PROVISIONAL,
}
MAX_AUDIT_POSITIONS = 64
MIN_TRANSFER_SHARE = 0.2  # LOCAL_PREFILL never leaves the transfer less than this share of the deadline

Tokenize = Callable[[str, bool], Awaitable[list[int]]]


def transfer_codec(
    codecs: Mapping[str, codec_lib.Codec], spec: common_pb2.CodecSpec, default: str = ORACLE_MODE
) -> tuple[codec_lib.Codec | None, dict[str, str]]:
    """The codec and resolved options a request names (no name: the consumer's `default` mode);
    (None, {}) for the consumer's own prefill."""
    name = spec.name or default
    if name == AUTO_MODE:
        raise ValueError("mode auto is resolved by JobBuilder (consumer.auto.chooser), not here")
    if name == ORACLE_MODE:
        if spec.options:
            raise InvalidArgument(f"transfer.options: mode '{ORACLE_MODE}' takes no options, got {sorted(spec.options)[:8]}")
        return None, {}
    if name not in codecs:
        raise InvalidArgument(
            f"transfer.name: unknown codec {name[:64]!r}; supported: {sorted([*codecs, ORACLE_MODE, AUTO_MODE])}"
        )
    codec = codecs[name]
    return codec, codec.resolve(dict(spec.options))


def transfer_budget_s(planner: TransferPlanner, context_tokens: int, left_s: float) -> float:
    """LOCAL_PREFILL: how long the transfer may take and still leave time for the consumer's own
    prefill (twice its running estimate, or half the deadline before it has one)."""
    local_ms = planner.estimate_local(context_tokens).ms
    reserve = left_s / 2 if local_ms is None else 2 * local_ms / 1e3 + 0.25
    return max(left_s - reserve, MIN_TRANSFER_SHARE * left_s)


@dataclasses.dataclass(frozen=True)
class Route:
    """The transfer a request runs (JobBuilder._route): codec (None: the own prefill) and options,
    auto's choice when one was made, the candidate key, and what the job reports of it."""

    codec: codec_lib.Codec | None
    options: dict[str, str]
    auto: AutoChoice | None
    key: str  # Chooser.key of codec and options: GenerateJob.candidate_key
    fallback: str = ""  # fallback_to_oracle: why the named mode was kept or replaced
    estimate: Estimate | None = None  # a named mode's estimate at admission
    keep: KeepRequest | None = None  # auto chose a keep point: its selection (GenerateJob.keep); options lack it


def _sampling(s: consumer_pb2.SamplingParams, extras: Extras) -> Sampling:
    """The request's sampling with the HTTP API's logit processors and log-probabilities."""
    return Sampling(
        s.temperature,
        s.top_p or 1.0,
        s.seed,
        extras.logit_bias,
        extras.presence_penalty,
        extras.frequency_penalty,
        extras.top_k,
        extras.logprobs,
    )


class JobBuilder:
    def __init__(
        self,
        config: ConsumerConfig,
        loaded: LoadedModel,
        codecs: Mapping[str, codec_lib.Codec],
        planner: TransferPlanner,
        tokenize: Tokenize,
        chooser: Chooser,
        token: str = "",
        producer_token: str = "",
    ):
        self.config, self.loaded, self.codecs, self.planner, self.tokenize = config, loaded, codecs, planner, tokenize
        self.chooser = chooser
        # the bearer tokens this consumer checks and sends: the default tenants of requests without a
        # cache_salt, here and at the producer (shared.tenants)
        self.token, self.producer_token = token, producer_token
        self.default_mode: Callable[[], str] = lambda: ORACLE_MODE  # the server sets it (consumer.auto.defaults.DefaultMode)

    async def _ids(self, prompt: consumer_pb2.Prompt, field: str, limit: int, special: bool) -> list[int]:
        which = prompt.WhichOneof("input")
        if which is None:
            raise InvalidArgument(f"{field}: required (text or token_ids)")
        if which == "text":
            size = len(prompt.text.encode("utf-8", "surrogatepass"))
            if size > self.config.max_text_bytes:
                raise InvalidArgument(f"{field}.text: {size} bytes > limit max_text_bytes {self.config.max_text_bytes}")
            ids = await self.tokenize(prompt.text, special)
        else:
            ids = list(prompt.token_ids.ids)
        if not 1 <= len(ids) <= limit:
            raise InvalidArgument(f"{field}: {len(ids)} tokens not in 1..{limit}")
        vocab = self.loaded.info.vocab_size
        if max(ids) >= vocab:  # one pass in C; the first bad id only for the message
            bad = next(t for t in ids if t >= vocab)
            raise InvalidArgument(f"{field}.token_ids: id {bad} >= vocab_size {vocab}")
        return ids

    async def build(
        self, request: consumer_pb2.GenerateRequest, request_id: str, timeout_s: float, extras: Extras | None = None
    ) -> GenerateJob:
        """The job, top-down: the cheap field checks (a request that fails them costs no
        tokenization), the transfer asked for, the token ids, the transfer chosen (with the key
        auto reads and learns it under, derived here once: GenerateJob.candidate_key), the
        failure policy."""
        cfg = self.config
        extras = extras or Extras()
        max_new, salt = self._checked(request, extras)
        mode = request.transfer.name or self.default_mode()
        spec, repair = self._repair(request.transfer)
        spec, keep = _keep_option(spec)
        budget: Budget | None = None
        options: dict[str, str]
        if mode == AUTO_MODE:
            budget = dataclasses.replace(
                self.chooser.budget(dict(spec.options)), verify=VERIFIES[request.verify], no_keep=_keep_refused(request)
            )
            codec, options = None, {}
        else:
            codec, options = transfer_codec(self.codecs, spec, mode)
        if keep is not None:
            keep = _checked_keep(request, mode, codec, keep)
        context_ids = await self._ids(request.context, "context", cfg.max_context_tokens, special=True)
        question_ids = await self._ids(request.question, "question", cfg.max_question_tokens, special=False)
        tenant = tenants.tenant(salt, self.token)
        route = self._route(request, mode, budget, codec, options, context_ids, tenant, keep)
        if route.keep is not None:
            keep = route.keep
        policy = POLICIES[request.on_transfer_failure]
        unspecified = request.on_transfer_failure == consumer_pb2.TRANSFER_FAILURE_POLICY_UNSPECIFIED
        if budget is not None and unspecified and (budget.modes is None or ORACLE_MODE in budget.modes) and keep is None:
            policy = LOCAL_PREFILL  # auto may always answer by the own prefill (a kept transfer: not yet)
        return GenerateJob(
            request_id=request_id,
            context_ids=context_ids,
            question_ids=question_ids,
            codec=route.codec,
            options=route.options,
            max_new_tokens=max_new,
            sampling=_sampling(request.sampling, extras),
            stop_ids=self._stop_ids(request, extras),
            deadline=time.monotonic() + timeout_s,
            fallback=route.fallback,
            on_failure=policy,
            transfer_budget_s=transfer_budget_s(self.planner, len(context_ids), timeout_s) if policy == LOCAL_PREFILL else None,
            audit=AUDITS[request.audit],
            audit_positions=request.audit_positions or 8,
            audit_threshold=cfg.audit_threshold,
            auto=route.auto,
            candidate_key=route.key,
            estimate=route.estimate,
            verify=VERIFIES[request.verify],
            repair=repair,
            stream_interval=cfg.stream_interval,
            stop_strings=extras.stop_strings,
            verify_draft_bytes=cfg.verify_draft_bytes,
            tenant=tenant,
            producer_tenant=tenants.tenant(tenant, self.producer_token),
            keep=keep,
        )

    def _checked(self, request: consumer_pb2.GenerateRequest, extras: Extras) -> tuple[int, str]:
        """The fields checked before any tokenization: (max_new_tokens, the checked cache_salt)."""
        cfg = self.config
        max_new = request.max_new_tokens or DEFAULT_NEW_TOKENS
        if max_new > cfg.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens: {max_new} > limit {cfg.max_new_tokens}")
        s = request.sampling
        if not 0 <= s.temperature <= 10:
            raise InvalidArgument(f"sampling.temperature: {s.temperature} not in [0, 10]")
        if not 0 <= s.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p: {s.top_p} not in [0, 1]")
        if request.on_transfer_failure not in POLICIES:
            raise InvalidArgument(f"on_transfer_failure: unknown value {request.on_transfer_failure}")
        if request.audit not in AUDITS:
            raise InvalidArgument(f"audit: unknown value {request.audit}")
        if request.verify not in VERIFIES:
            raise InvalidArgument(f"verify: unknown value {request.verify}")
        salt = tenants.checked_salt(request.cache_salt)
        if request.audit_positions > MAX_AUDIT_POSITIONS:
            raise InvalidArgument(f"audit_positions: {request.audit_positions} > limit {MAX_AUDIT_POSITIONS}")
        vocab = self.loaded.info.vocab_size
        if len(request.stop_token_ids) > 64:
            raise InvalidArgument(f"stop_token_ids: {len(request.stop_token_ids)} ids > limit 64")
        bad = next((t for t in request.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"stop_token_ids: id {bad} >= vocab_size {vocab}")
        self._check_extras(extras, VERIFIES[request.verify])
        return max_new, salt

    def _route(
        self,
        request: consumer_pb2.GenerateRequest,
        mode: str,
        budget: Budget | None,
        codec: codec_lib.Codec | None,
        options: dict[str, str],
        context_ids: list[int],
        tenant: str,
        keep: KeepRequest | None = None,
    ) -> Route:
        """The transfer this request runs: auto's choice within `budget` (a keep point's selection
        split off its options into Route.keep); with fallback_to_oracle the named mode or the own
        prefill, whichever is estimated faster; else the named mode (with its keep set: `keep`)
        and its estimate. Its key is derived here, once: the chosen candidate's, or the named mode's."""
        if budget is not None:
            auto = self.chooser.choose(context_ids, budget, tenant=tenant)
            codec, chosen = self._chosen(auto)
            label = chosen.pop(KEEP_OPTION, None)
            kept = KeepRequest.parse(label).for_codec(codec) if label is not None and codec is not None else None
            return Route(codec, chosen, auto, auto.key, keep=kept)
        if request.fallback_to_oracle and codec is not None:
            named = Candidate(codec.name, options, math.nan, "named by the request")
            own = Candidate(ORACLE_MODE, {}, 0.0, "exact", 0.0)
            either = Budget(math.inf, source="fallback_to_oracle: the named mode or the consumer's own prefill")
            auto = self.chooser.choose(context_ids, either, only=[named, own], tenant=tenant)
            fallback = f"{'local' if auto.chosen.mode == ORACLE_MODE else 'remote'}: {auto.reason}"
            return Route(*self._chosen(auto), auto, auto.key, fallback=fallback)
        asked = {**options, KEEP_OPTION: keep.label} if keep is not None else options  # a keep transfer: a key of its own
        key = self.chooser.key(mode, asked)
        return Route(codec, options, None, key, estimate=self.chooser.estimate_named(mode, asked, key, context_ids, tenant))

    def _stop_ids(self, request: consumer_pb2.GenerateRequest, extras: Extras) -> frozenset[int]:
        """The request's stop ids, else the model's end-of-sequence id; and the HTTP API's."""
        eos = self.loaded.tokenizer.eos_token_id
        stop = frozenset(request.stop_token_ids) or (frozenset([eos]) if eos is not None else frozenset())
        return stop | extras.stop_token_ids

    def _check_extras(self, extras: Extras, verify: str) -> None:
        """Token ids within the vocabulary; under verified decoding no logit processor and no
        log-probabilities (its acceptance compares plain temperature/top-p distributions of two
        caches, and its tokens come from both)."""
        vocab = self.loaded.info.vocab_size
        for name, ids in (("stop_token_ids", extras.stop_token_ids), ("logit_bias", [t for t, _ in extras.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidArgument(f"{name}: token id {bad} not in 0..vocab_size-1 ({vocab - 1})")
        if verify == VERIFY_OFF:
            return
        asked = {
            "logprobs": extras.logprobs is not None,
            "logit_bias": bool(extras.logit_bias),
            "presence_penalty": bool(extras.presence_penalty),
            "frequency_penalty": bool(extras.frequency_penalty),
            "top_k": extras.top_k > 0,
        }
        first = next((n for n, on in asked.items() if on), None)
        if first is not None:
            raise InvalidArgument(
                f"{first}: not served with verified decoding (its acceptance rule compares the two caches'"
                " temperature/top-p distributions only); ask without verify, or without this field"
            )

    def _repair(self, spec: common_pb2.CodecSpec) -> tuple[common_pb2.CodecSpec, Repair | None]:
        """The transfer spec without the option `repair` (the consumer's, never a codec's), and the
        repair it asks for (consumer.exact.repair; None when absent)."""
        if REPAIR_OPTION not in spec.options:
            if ANCHORS_OPTION in spec.options:
                raise InvalidArgument(f"transfer.options.{ANCHORS_OPTION}: set only with transfer.options.{REPAIR_OPTION}")
            return spec, None
        anchors = spec.options.get(ANCHORS_OPTION, ATTENTION)
        asked = parse_repair(spec.options[REPAIR_OPTION], self.config.max_context_tokens, anchors)
        rest = common_pb2.CodecSpec()
        rest.CopyFrom(spec)
        del rest.options[REPAIR_OPTION]
        if ANCHORS_OPTION in rest.options:
            del rest.options[ANCHORS_OPTION]
        return rest, asked

    def _chosen(self, auto: AutoChoice) -> tuple[codec_lib.Codec | None, dict[str, str]]:
        chosen = auto.chosen
        if chosen.mode == ORACLE_MODE:
            return None, {}
        return self.codecs[chosen.mode], dict(chosen.options)


def _keep_option(spec: common_pb2.CodecSpec) -> tuple[common_pb2.CodecSpec, KeepRequest | None]:
    """The transfer spec without the option `keep` (the consumer's: it becomes PrefillRequest.keep,
    never a codec option), and the selection it asks for (None when absent)."""
    if KEEP_OPTION not in spec.options:
        return spec, None
    asked = KeepRequest.parse(spec.options[KEEP_OPTION])
    rest = common_pb2.CodecSpec()
    rest.CopyFrom(spec)
    del rest.options[KEEP_OPTION]
    return rest, asked


def _keep_refused(request: consumer_pb2.GenerateRequest) -> str:
    """The first field of the request that a kept cache does not serve yet ("" when none): auto
    leaves its keep points out then (`_checked_keep` refuses a named keep set with it)."""
    refused = {
        "fallback_to_oracle": request.fallback_to_oracle,
        "on_transfer_failure": request.on_transfer_failure == consumer_pb2.TRANSFER_FAILURE_POLICY_LOCAL_PREFILL,
        "audit": request.audit not in (consumer_pb2.AUDIT_POLICY_UNSPECIFIED, consumer_pb2.AUDIT_POLICY_OFF),
        "transfer.options['repair']": REPAIR_OPTION in request.transfer.options,
    }
    return next((name for name, on in refused.items() if on), "")


def _checked_keep(
    request: consumer_pb2.GenerateRequest, mode: str, codec: codec_lib.Codec | None, keep: KeepRequest
) -> KeepRequest:
    """A keep selection resolved for the named codec; INVALID_ARGUMENT naming the field that asks
    for what a kept cache does not serve yet (never dropped silently)."""
    where = f"transfer.options['{KEEP_OPTION}']"
    if codec is None:
        raise InvalidArgument(f"{where}: mode {mode!r} cannot take a keep set; name a codec (raw, quant, scd)")
    named = _keep_refused(request)
    if named:
        raise InvalidArgument(
            f"{named}: not served with {where} yet (a kept cache holds only the kept tokens); ask without one of them"
        )
    return keep.for_codec(codec)
