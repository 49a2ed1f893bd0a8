"""Routing across scheduler replicas: the router and its parts, discovery, the KV-event cache index, request
migration, LoRA homes, and the route headers."""
