"""TAPM-style storytellers (placeholder; the generator follows)."""
