"""Paged attention: per-step metadata (built once) and backends that run it layer by layer."""
