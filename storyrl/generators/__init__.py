"""Story generators: TAPM-style models and zero-shot VLM prompting (to come)."""
