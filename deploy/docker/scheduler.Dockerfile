# steploop scheduler: the step loop. No torch, no model weights: it learns the KV pool from the worker.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY scripts ./scripts
COPY services ./services
RUN pip install --no-cache-dir . "grpcio-tools==1.76.0" && python scripts/gen_protos.py
EXPOSE 50051
CMD ["steploop", "scheduler"]
