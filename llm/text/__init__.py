"""Text in and out: the tokenizer, the sandboxed chat template, user text, stop strings, blocklist matching."""
