"""The recipe's management commands."""
