"""Errors that reach the user as one line, never as a traceback."""

import argparse


class UserError(Exception):
    """Bad input from the user (config, data, paths). The CLI prints `error: <msg>` and exits 2."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid config key, type or value."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one UserError line instead of usage + message."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")


def one_line(msg) -> str:
    """A message squeezed onto one line: messages from libraries (the Rust side of `tokenizers`) may span lines."""
    return " ".join(str(msg).split())
