"""From text to token ids and back: tokenizer, chat templates, incremental detokenization, stop strings, logprobs,
the reasoning split, and generation (one engine call per choice, as text events)."""
