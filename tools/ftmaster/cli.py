"""The ``ftmaster`` command line: a thin click layer over plain functions.

Each subcommand lives in the module that owns its work and is registered here by its import
path. A subcommand's module is imported only when that subcommand runs (or ``--help`` lists
them all): ``analyze`` alone would add pandas and matplotlib, about half a second, to the
start of every ``ftmaster launch``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import signal
import sys

import click

from ftmaster import __version__

SUBCOMMANDS = {
    "launch": "ftmaster.launch:launch_command",
    "monitor": "ftmaster.monitor.cli:monitor_command",
    "plan": "ftmaster.recovery.cli:plan_command",
    "analyze": "ftmaster.analyze:analyze_command",
    "report": "ftmaster.report:report_command",
    "goodput": "ftmaster.goodput_cli:goodput_command",
}


class LazyGroup(click.Group):
    """A group whose subcommands are ``module:attribute`` paths, imported on first use."""

    def __init__(self, *args, lazy: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *self.lazy]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.lazy:
            return super().get_command(ctx, name)
        module, attribute = self.lazy[name].split(":")
        return getattr(importlib.import_module(module), attribute)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _one_line_usage_errors():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        with _one_line_usage_errors(), _interrupted_as_shells_expect():
            return super().invoke(ctx)  # a subcommand's import, parsing and own checks

    def __call__(self, *args, **kwargs):
        """The program itself (tests call :meth:`main`)."""
        atexit.register(_ignore_stop_signals)
        return super().__call__(*args, **kwargs)


def _ignore_stop_signals() -> None:
    """At exit the status is decided and said: a SIGTERM in the interpreter's teardown (half
    a second once torch is loaded, with Python's handlers already gone) turned a completed
    run's 0 into 143. An ignored signal stays ignored through the teardown."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _interrupted_as_shells_expect():
    """A Ctrl-C that no handler of ftmaster's takes (while ``launch``'s module is imported,
    before it installs its own; in the other commands) exits 130, 128 + SIGINT, as a shell
    expects; click said "Aborted!" and exited 1."""
    try:
        yield
    except KeyboardInterrupt:
        raise click.exceptions.Exit(128 + signal.SIGINT) from None


@contextlib.contextmanager
def _one_line_usage_errors():
    """Bad input is one line on stderr, as every other refusal: without its context click
    prints a usage error as "Error: ..." alone (not the usage and a --help hint above it)."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:  # the help itself, printed from its context
        raise
    except click.UsageError as error:
        error.ctx = None
        raise


@click.group(cls=LazyGroup, lazy=SUBCOMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftmaster")
def main() -> None:
    """Proactive fault tolerance for Megatron training."""
    _print_paths_as_the_file_system_has_them()


def _print_paths_as_the_file_system_has_them() -> None:
    """A path that is not UTF-8 (a folder named under another locale) prints with its own
    bytes; under a UTF-8 locale Python's stdout would raise on it in the
    middle of a report (stderr already writes it escaped)."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # a stdout replaced may lack it
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")


if __name__ == "__main__":
    main()
