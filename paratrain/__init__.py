"""paratrain: train Llama-style models across many devices, and prove the numerics."""

__version__ = "0.1.0"
