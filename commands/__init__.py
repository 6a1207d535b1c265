"""User-facing commands built on the engine, the stages and the inference library (`llmplan.commands`).

Registered through the `llmplan.commands` entry-point group, as a third party's commands would be. Nothing
imports this package: it is the top of the import order (commands → stages → llm; all may use engine).
"""
