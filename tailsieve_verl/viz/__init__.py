"""Plots (matplotlib, imported lazily by the CLI); the core never imports this package."""
