"""One module per `paratrain` command: its arguments, its usage and the call into the library (paratrain/cli.py dispatches)."""
