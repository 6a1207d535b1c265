"""`llmplan run --executor ray`: a plan's requests spread over replicas on a Ray cluster."""
