"""`llmplan bench`: load a plan's model through the engine and measure load, prefill, decode and memory.

command.py holds the CLI (registered through the `llmplan.commands` entry point group), measure.py the
llmplan side, hf.py the optional transformers baseline, report.py the JSON / Markdown / CSV output.
"""
