# Two commands: `make test` and `make demo`. Each creates .venv when absent and installs
# torch (the pinned CPU wheel when no torch is importable) and the project with its extras.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: test demo demo-moc docs-heatmap bench bench-store bench-placement bench-dispatch bench-hf bench-moc bench-simulate bench-runtime install clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade --quiet pip

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_PIN)"
	$(VPY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) -m lazarus.demo --dir runs/lazarus-demo

demo-moc: $(STAMP)
	$(VPY) -m moc.demo --dir runs/demo

docs-heatmap: $(STAMP)
	$(VPY) docs/make_inspect_heatmap.py --dir runs/inspect-heatmap -o docs/inspect_heatmap.png

bench: bench-store bench-placement bench-dispatch bench-hf bench-moc bench-simulate bench-runtime

bench-store: $(STAMP)
	$(VPY) benchmarks/store/main.py

bench-placement: $(STAMP)
	$(VPY) benchmarks/placement/main.py

bench-dispatch: $(STAMP)
	$(VPY) benchmarks/dispatch/main.py

bench-hf: $(STAMP)
	$(VPY) benchmarks/hf_moe/main.py

bench-moc: $(STAMP)
	$(VPY) -m pip install --quiet -e ".[dev,bench]"
	$(VPY) benchmarks/moc_overhead/main.py --reps 8

bench-runtime: $(STAMP)
	$(VPY) benchmarks/runtime/main.py

bench-simulate: $(STAMP)
	$(VPY) benchmarks/simulate/main.py

clean:
	rm -rf $(VENV) runs build *.egg-info
