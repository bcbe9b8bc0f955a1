"""Training and chat, run as `python -m metaseq.cli.train` and `python -m metaseq.cli.interactive_cli`."""
import sys

if sys.argv[:1] == ["-m"]:  # `python -m` locates one of these tools: its imports come next
    from metaseq.cli_start import stop_while_starting

    stop_while_starting()
