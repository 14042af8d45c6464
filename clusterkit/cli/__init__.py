"""Command-line interface: argparse, one module per verb (torchx style).

argparse rather than typer/click: it is in the standard library, lets one place
(``main``) own every exit code and error line, and keeps start-up fast for verbs
that run on every node.
"""
