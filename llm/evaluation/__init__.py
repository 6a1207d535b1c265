"""What a precision costs: perplexity and divergence from a reference."""
