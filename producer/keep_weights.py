"""The learned keep policies this producer serves: DistillCache weights (shared.keep.distill) are
per pair, a small file beside the pair's SCD artifact (`<artifact stem>.keep.safetensors`). Loaded
once at start with the artifacts and checked against this producer's model (layers, width, KV
heads: a file for another geometry fails the start, naming it); a request naming keep policy
"distill" scores with the weights of the artifact for its consumer (the request's consumer weight
digest, or the artifact its options name), and is a FailedPrecondition naming keep.policy where
this producer holds none, or where the request names other weights than it holds
(`keep.weights`: the digest a keep point was measured with). Knows nothing about gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.codecs.kept import KeepRequest
from shared.errors import FailedPrecondition, InvalidArgument
from shared.keep import distill
from shared.keep.distill import LEARNED, DistillCache
from shared.models import ModelInfo
from shared.scd.artifact import Artifact, for_pair


@dataclass(frozen=True)
class PairWeights:
    artifact: Artifact
    policy: DistillCache

    @property
    def digest(self) -> str:
        return self.policy.digest


def check_geometry(policy: DistillCache, info: ModelInfo) -> None:
    """ValueError naming the file when its network does not fit this model."""
    net = policy.net
    if net.num_layers != info.num_layers:
        raise ValueError(f"keep weights {policy.source}: {net.num_layers} layers, the model has {info.num_layers}")
    if "normed" in net.inputs and (net.d_model, net.num_kv_heads) != (info.hidden_size, info.num_kv_heads):
        raise ValueError(
            f"keep weights {policy.source}: probe over d_model {net.d_model} x {net.num_kv_heads} KV heads,"
            f" the model has {info.hidden_size} x {info.num_kv_heads}"
        )


class KeepWeights:
    """Every loaded artifact's keep weights, where its file has them."""

    def __init__(self, artifacts: list[Artifact], info: ModelInfo):
        self.info = info
        self.pairs: dict[str, PairWeights] = {}  # artifact id -> its weights
        for art in artifacts:
            if art.path is None or art.meta["producer"]["weight_digest"] != info.weight_digest:
                continue
            path = distill.weights_path(art.path)
            if path.exists():
                policy = distill.load(path)
                check_geometry(policy, info)
                policy.net.to(info.device)  # scores the layer's inputs where the model computes them
                self.pairs[art.artifact_id] = PairWeights(art, policy)

    def digest_of(self, artifact_id: str) -> str:
        """The keep weights' digest of an artifact ("" where it has none): Describe shows it."""
        pair = self.pairs.get(artifact_id)
        return pair.digest if pair is not None else ""

    def resolve(self, keep: KeepRequest, consumer_digest: str, artifact_id: str = "") -> PairWeights | None:
        """The pair's weights a learned keep policy scores with; None for a heuristic (the registry's)."""
        if keep.policy not in LEARNED:
            return None
        with_weights = [p.artifact for p in self.pairs.values()]
        try:
            art = for_pair(with_weights, self.info.weight_digest, consumer_digest, artifact_id)
        except (InvalidArgument, FailedPrecondition):  # reworded below: the field, and the pairs it has
            art = None
        if art is None or not consumer_digest and not artifact_id and len(with_weights) > 1:
            loaded = [(p.artifact.artifact_id, p.artifact.meta["consumer"]["model_id"]) for p in self.pairs.values()]
            raise FailedPrecondition(
                f"keep.policy: {keep.policy!r} needs this pair's keep weights (<artifact>{distill.SUFFIX} beside the SCD"
                f" artifact for consumer digest {consumer_digest[:16] or '(not stated)'}"
                f"{', artifact ' + repr(artifact_id) if artifact_id else ''}); this producer holds them for: {loaded}"
            )
        pair = self.pairs[art.artifact_id]
        if keep.weights and keep.weights != pair.digest:
            raise FailedPrecondition(
                f"keep.weights: {keep.weights!r}: this producer scores {keep.policy!r} for this pair (artifact"
                f" {art.artifact_id}) with keep weights {pair.digest!r}, not the ones the caller measured"
            )
        return pair
