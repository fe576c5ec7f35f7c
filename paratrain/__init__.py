"""paratrain: train Llama-style models across many devices, and prove the numerics."""

__version__ = "0.1.0"

from paratrain import quiet  # noqa: E402,F401 - third-party warnings that ask nothing of the user, filtered once
