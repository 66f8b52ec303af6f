"""Shared machinery: fix variants, outcomes, child isolation, the miniature runner, the CLI."""
