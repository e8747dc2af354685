"""``python -m gpushare`` runs the command-line interface."""

from gpushare.cli.app import main

main()
