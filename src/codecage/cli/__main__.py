"""`python -m codecage.cli`: the same as the `codecage` command."""

from codecage.cli.app import main

main()
