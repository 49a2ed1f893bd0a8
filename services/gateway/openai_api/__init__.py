"""OpenAI's request bodies and response shapes for completions and chat (parsed and validated fields, vLLM's extras,
streamed and whole outputs), which the other APIs build on."""
