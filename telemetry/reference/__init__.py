"""The reference training run: a small byte-level GPT on a corpus built from the stdlib."""
