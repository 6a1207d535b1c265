"""`llmplan chat`: a conversation in the terminal."""
