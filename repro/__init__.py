"""One module per documented bug: its record, scenarios and oracles."""
