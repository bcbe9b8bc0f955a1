"""Command-line tools, run as `python -m metaseq.scripts.TOOL`."""
import sys

if sys.argv[:1] == ["-m"]:  # `python -m` locates one of these tools: its imports come next
    from metaseq.cli_start import stop_while_starting

    stop_while_starting()
