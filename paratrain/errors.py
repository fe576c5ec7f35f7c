"""Errors that reach the user as one line, never as a traceback."""

import argparse
import errno
import sys
from contextlib import contextmanager


class UserError(Exception):
    """Bad input from the user (config, data, paths). The CLI prints `error: <msg>` and exits 2."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid config key, type or value."""


def did_you_mean(word: str, choices, cutoff: float = 0.75) -> str:
    """` (did you mean 'X'?)` for the choice closest to a mistyped word (a command, an option, a setting's value),
    else "": every command line and config suggests the same way. (Options take 0.75: at difflib's 0.6 `--promt`
    suggested `--nproc`; the names of settings, presets and rows take 0.6.)"""
    import difflib  # lazy: only a mistyped word needs it

    close = difflib.get_close_matches(str(word), sorted(choices), n=1, cutoff=cutoff)
    return f" (did you mean '{close[0]}'?)" if close else ""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one UserError line instead of usage + message."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")

    def parse_known_args(self, args=None, namespace=None):
        """Also refuses NaN and infinity for every float option: no command can use them; and names the option a
        mistyped one is closest to, before any other complaint (a missing required argument)."""
        import math

        self._refuse_unknown_options(sys.argv[1:] if args is None else args)
        namespace, rest = super().parse_known_args(args, namespace)
        for key, value in vars(namespace).items():
            if isinstance(value, float) and not math.isfinite(value):
                self.error(f"argument --{key.replace('_', '-')}: must be a finite number, got {value}")
        return namespace, rest

    def _refuse_unknown_options(self, args) -> None:
        """`--name` or `--name=value` that is no option of this parser (nor, argparse allowing it, the start of
        one): one line with the closest option. After a subcommand its own parser looks."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        for arg in args:
            if arg == "--" or (not arg.startswith("-") and self._subparsers is not None):
                return
            name = arg.split("=", 1)[0]
            if not arg.startswith("--") or " " in arg or name in self._option_string_actions:
                continue  # (argparse reads a word with a space as a value: --prompt "--- ACT I ---")
            if self.allow_abbrev and any(o.startswith(name) for o in options):
                continue  # an abbreviation: argparse takes it, or says which options it could be
            self.error(f"unrecognized arguments: {name}{did_you_mean(name, options)}")  # (argparse's words)


def one_line(msg) -> str:
    """A message squeezed onto one line: messages from libraries (the Rust side of `tokenizers`) may span lines."""
    return " ".join(str(msg).split())


# -- failures after launch: which are the environment's (exit 2, never retried) ---------------------------------

# An OSError with one of these is the machine's state or the user's paths, not a bug: a retry fails the same way.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                                errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT,
                                errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.ELOOP})


def causes(error: BaseException):
    """The error, what it wraps (DCP's CheckpointException keeps every rank's exception in `failures`), and its
    __cause__ / __context__ chain; each once."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint.api.CheckpointException: rank -> (exc, trace)
            for item in failures.values():
                todo.append(item[0] if isinstance(item, tuple) else item if isinstance(item, BaseException) else None)
        todo += [e.__cause__, e.__context__]


def describe_os_error(e: OSError, where=None) -> str:
    text = e.strerror or str(e)
    if e.filename is not None:
        text += f": {e.filename}"
        if e.filename2 is not None:
            text += f" -> {e.filename2}"
    elif where is not None:
        text += f" (writing in {where})"
    return text


# torch's file writer (torch.save, which DCP uses for non-tensor items) reports a short write without its errno.
_SHORT_WRITE = ("unexpected pos", "file write failed", "failed writing file")


def environment_problem(error: BaseException, where=None) -> str | None:
    """One line for an error caused by the environment (full disk, read-only or missing path, permissions, a name
    too long) anywhere in `error`'s chain, else None. `where`: the folder being written, if any."""
    for e in causes(error):
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
            return describe_os_error(e, where)
    for e in causes(error):
        if isinstance(e, RuntimeError) and any(s in str(e) for s in _SHORT_WRITE):
            return _short_write(e, where)
    return None


def _short_write(e: BaseException, where) -> str:
    import shutil
    from pathlib import Path

    detail = " ".join(str(e).split())[:160]
    place = f" (writing in {where})" if where is not None else ""
    if where is not None:
        folder = Path(where)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if free is not None and free < 2**20:
            return f"No space left on device ({free // 1024} KiB free){place}"
    return f"a write stopped short{place}: {detail}"


# -- the one place an exception is caught whatever its class --------------------------------------------------------

INTERRUPTS = (KeyboardInterrupt, SystemExit)


@contextmanager
def translated(translate, cleanup=None, untouched=INTERRUPTS):
    """Run the block; an error it raises goes to `translate`, which returns the error to raise in its place (a
    one-line UserError) or None to let it go on as it is (a bug keeps its traceback).

    This is the only place paratrain catches BaseException (tests/test_architecture.py checks it): DCP's
    CheckpointException derives from it, not from Exception, so `except Exception` misses a failed save or load.
    `untouched` (KeyboardInterrupt and SystemExit) go on without being translated. `cleanup` runs after any failure,
    those included, once translate has looked (a save's cause is read before its partial files are removed)."""
    try:
        yield
    except BaseException as error:
        replacement = None if isinstance(error, untouched) else translate(error)
        if cleanup is not None:
            cleanup()
        if replacement is None or replacement is error:
            raise
        raise replacement from None


def environment_error(error: BaseException) -> UserError | None:
    """`translated`'s rule at an entry point: a failure the environment caused (a full disk, a read-only or missing
    folder) becomes its one line; a UserError goes on as it is, and so does anything else (a bug)."""
    if isinstance(error, UserError):
        return None
    problem = environment_problem(error)
    return None if problem is None else UserError(problem)


class PeerFailed(Exception):
    """Raised on the ranks that did not fail themselves when another rank's part of a shared step failed: that rank
    reports the error; these stop quietly with its exit code."""
