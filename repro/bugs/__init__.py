"""The catalogue: one package per bug (its record in `__init__.py`, importable without torch; its
scenarios in `scenarios.py`; its mutants in `mutants.py`; `python -m repro.bugs.BUG` runs it
fixed and buggy side by side). repro.registry lists them; the tool around them is in repro/."""
