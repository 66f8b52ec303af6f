"""Shared machinery: fix variants, outcomes, child isolation, the miniature runner, the CLI."""

from harness import bytecode

bytecode.install()  # first: every project module imported after it is cached (harness.bytecode)
