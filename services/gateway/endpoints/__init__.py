"""What the gateway answers over HTTP: the route table (every API's routes are added there), the OpenAI handlers,
vLLM's utility and LoRA routes, and the OpenAPI document of the whole API."""
