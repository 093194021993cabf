"""Structured output: grammar-constrained decoding (xgrammar) and tool-call formats."""
