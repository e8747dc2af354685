"""``python -m gpushare`` runs the command-line interface."""

from gpushare.cli.fast import main

main()
