"""llmplan: a declarative workflow engine for LLM inference."""

__version__ = "0.1.0"
