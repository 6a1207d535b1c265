"""`llmplan serve`: the OpenAI-compatible HTTP API over a resident model."""
