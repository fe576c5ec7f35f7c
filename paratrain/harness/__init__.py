"""Downstream evaluation: lm-evaluation-harness tasks on paratrain models, on any layout."""
