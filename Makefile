# Two commands: `make test` (lint, then the tests) and `make demo` (`make test-gpu` / `make bench-gpu` where a GPU is). Each creates .venv when absent and installs
# torch (the pinned CPU wheel when no torch is importable) and the project with its extras.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0
# torchtitan (Python >= 3.11) without its declared needs: its datasets<4.8 pins an fsspec
# older than s3fs wants, and wandb/tensorboard are not imported by the parts moc uses. The
# `titan` extra brings what its modules do import (einops, tyro, torchdata, spmd_types, triton...).
TORCHTITAN_PIN ?= torchtitan==0.3.0

.PHONY: test lint netns-deps test-gpu demo demo-moc docs-heatmap bench bench-store bench-placement bench-node-gpus bench-dispatch bench-hf bench-moc bench-simulate bench-runtime bench-peers bench-trace bench-control bench-exact bench-gpu gpu-check gpu-wheels soak soak-matrix install bytecode check-install clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade --quiet pip

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_PIN)"
	$(VPY) -m pip install --quiet -e ".[dev]"
	if $(VPY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
	  $(VPY) -m pip install --quiet -e ".[dev,titan]" && $(VPY) -m pip install --quiet --no-deps "$(TORCHTITAN_PIN)"; fi
	touch $(STAMP)

install: $(STAMP)

# The project's bytecode, written once (an editable install under PYTHONDONTWRITEBYTECODE
# otherwise compiles every module again in every process: 0.13 s of a quiet core per
# worker start, paid by every joining node and every test process). Up-to-date files are skipped.
bytecode: $(STAMP)
	$(VPY) -m compileall -q -j 0 lazarus moc storage_backends examples benchmarks tests

# ruff (rules in pyproject.toml) over the tree, mypy over the packages; first in `make test`
lint: $(STAMP)
	$(VPY) -m ruff check .
	$(VPY) -m mypy

test: lint $(STAMP) bytecode netns-deps
	$(VPY) -m pytest -q

# The multi-host tests (tests/lazarus/runtime/test_netns.py: network namespaces on a bridge)
# cut traffic with nftables: installed, quietly, where we are root with apt-get and nft is
# missing (CI here). Elsewhere those tests skip, saying what is missing.
netns-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v nft >/dev/null && [ ! -x /usr/sbin/nft ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq nftables >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
	    apt-get install -y -qq nftables >/dev/null 2>&1; } || echo "nftables could not be installed: the netns tests skip"; fi

# Only the CUDA tests (tests/gpu, marker `gpu`); they skip, with the reason, without a GPU.
# GPU_PY=python3 uses an interpreter that already has a CUDA torch (no .venv is made).
GPU_PY ?= $(VPY)
GPU_DEPS := $(if $(filter $(VPY),$(GPU_PY)),$(STAMP))
test-gpu: $(GPU_DEPS)
	$(GPU_PY) -m pytest -q -m gpu tests/gpu

demo: $(STAMP) bytecode
	$(VPY) -m examples.lazarus_demo --dir runs/lazarus-demo $(DEMO_ARGS)

demo-moc: $(STAMP) bytecode
	$(VPY) -m examples.moc_demo --dir runs/demo

docs-heatmap: $(STAMP)
	$(VPY) docs/make_inspect_heatmap.py --dir runs/inspect-heatmap -o docs/inspect_heatmap.png

bench: bench-store bench-placement bench-node-gpus bench-dispatch bench-hf bench-moc bench-simulate bench-runtime

bench-store: $(STAMP)
	$(VPY) benchmarks/store/main.py

bench-placement: $(STAMP)
	$(VPY) benchmarks/placement/main.py

bench-node-gpus: $(STAMP)
	$(VPY) benchmarks/node_gpus/main.py

bench-dispatch: $(STAMP)
	$(VPY) benchmarks/dispatch/main.py

bench-hf: $(STAMP)
	$(VPY) benchmarks/hf_moe/main.py

bench-moc: $(STAMP)
	$(VPY) -m pip install --quiet -e ".[dev,bench]"
	$(VPY) benchmarks/moc_overhead/main.py --reps 8
	$(VPY) benchmarks/moc_hf/main.py --profile

bench-runtime: $(STAMP) bytecode
	$(VPY) benchmarks/runtime/main.py

bench-simulate: $(STAMP)
	$(VPY) benchmarks/simulate/main.py

# The control plane at 64, 256 and 1,024 simulated agents against the real controller process
# (not part of `make test` or `make bench`: ~3 min; QUICK=1: 64 and 256 only, < 2 min).
bench-control: $(STAMP) bytecode
	$(VPY) benchmarks/control/main.py --store $(if $(QUICK),--quick)

# Lazarus vs torchft (README settings and tuned) vs checkpoint-restart, same model and faults
# (not part of `make bench`: about 6 minutes; QUICK=1 for the under-3-minutes form).
bench-peers: $(STAMP) bytecode
	$(VPY) benchmarks/peers/main.py $(if $(QUICK),--quick)

# A real AWS spot trace (shared/traces) replayed live, 60x compressed, on at most 3 nodes: Lazarus vs
# checkpoint-restart vs torchft, then `lazarus simulate` with the costs measured, predicted vs measured
# (not part of `make bench`: about 5 minutes; QUICK=1: a 30-minute segment, about 3 minutes).
bench-trace: $(STAMP) bytecode
	$(VPY) benchmarks/trace/main.py $(if $(QUICK),--quick)

# Exact mode (MoCConfig(exact=True)) vs full checkpoints every step vs PEC K=1 every 50 steps on
# benchmarks/moc_hf's 1.3 GB Qwen3-MoE, then ETTR against MTBF from `lazarus simulate` (not part
# of `make bench`: ~15 min on 2 loaded cores; QUICK=1: a small model, ~2 min).
bench-exact: $(STAMP)
	$(VPY) -m pip install --quiet -e ".[dev,bench]"
	$(VPY) benchmarks/exact/main.py $(if $(QUICK),--quick --out runs/bench-exact-quick)
	$(VPY) benchmarks/exact/ettr.py $(if $(QUICK),--quick --out runs/bench-exact-quick)

# Chaos soak of a live job (not part of `make test`): MINUTES of seeded random faults,
# LOAD CPU-bound busy processes beside it. NETWORK=netns: every host in its own network
# namespace, and the network's faults (partitions, cuts, a flapping link; needs root, nft).
MINUTES ?= 10
SEED ?= 0
LOAD ?= 0
NETWORK ?= loopback
soak: $(STAMP) bytecode
	$(VPY) benchmarks/soak/main.py --minutes $(MINUTES) --seed $(SEED) --load $(LOAD) --network $(NETWORK)

# The soak for SEEDS seeds (a count, or a comma list) x MINUTES x LOADS (not part of `make test`
# nor `make bench`; 10 x 10 min x {0, 2}: 20 soaks of 12-18 min, 4-5 hours on 2 cores). One table: benchmarks/soak/matrix.md
# (NETWORK=netns: benchmarks/soak/matrix-netns-runs.md).
SEEDS ?= 10
LOADS ?= 0,2
soak-matrix: $(STAMP) bytecode
	$(VPY) benchmarks/soak/matrix.py --seeds $(SEEDS) --minutes $(MINUTES) --loads $(LOADS) --network $(NETWORK)

# Not part of `make bench`: needs a CUDA GPU (moc stall vs DCP / torch.save, D2H bandwidth,
# MoE layer with the CUDA dispatch kernel).
bench-gpu: $(GPU_DEPS)
	$(GPU_PY) benchmarks/gpu/main.py

# Every GPU check in one command on a bare GPU machine (its python3 has a CUDA torch): missing
# packages from the wheels in .whl/, tests/gpu, a reduced bench-gpu; one summary, gpu-check.md
# (benchmarks/gpu/check.py). `make gpu-wheels` fetches the wheels first where pip reaches PyPI.
GPU_CHECK_PY ?= python3
gpu-check:
	$(GPU_CHECK_PY) benchmarks/gpu/check.py $(GPU_CHECK_ARGS)

GPU_WHEEL_PY ?= 3.12
gpu-wheels:
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl "zstandard>=0.21"

# The README's install lines in a fresh venv with the stock pip of each Python given (not in `make test`).
INSTALL_PYTHONS ?= $(PY)
check-install:
	bash .ci/check_install.sh $(INSTALL_PYTHONS)

clean:
	rm -rf $(VENV) runs build *.egg-info .mypy_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
