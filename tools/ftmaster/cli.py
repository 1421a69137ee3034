"""The ``ftmaster`` command line: a thin click layer over plain functions.

Each subcommand lives in the module that owns its work and is registered here.
"""

import click

from ftmaster import __version__
from ftmaster.analyze import analyze_command
from ftmaster.goodput_cli import goodput_command
from ftmaster.launch import launch_command
from ftmaster.monitor.cli import monitor_command
from ftmaster.recovery.cli import plan_command
from ftmaster.report import report_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftmaster")
def main() -> None:
    """Proactive fault tolerance for Megatron training."""


for command in (launch_command, monitor_command, plan_command, analyze_command, report_command,
                goodput_command):
    main.add_command(command)

if __name__ == "__main__":
    main()
