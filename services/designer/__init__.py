"""The environment designer service: prompts, corpus, the design loop and its adapters."""
