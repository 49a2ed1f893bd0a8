from tests.gateway.conftest import gateway_model_dir, tokenizer  # noqa: F401 - fixtures reused here
