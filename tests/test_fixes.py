"""Variant selection from CLI-style options."""

from __future__ import annotations

import pytest

from harness.fixes import ALL_FIXES, Fix, UsageError, describe, select_variant

PARTS = (Fix.MOE_ALIGN_GRID_PLUS_ONE, Fix.MOE_ALIGN_OOB_GUARD, Fix.MOE_ALIGN_SORT_ADAPTER_CHECK)


def test_default_is_every_fix() -> None:
    assert select_variant(PARTS) == ALL_FIXES
    assert select_variant(PARTS, "fixed") == ALL_FIXES


def test_buggy_removes_only_the_bugs_parts() -> None:
    assert select_variant(PARTS, "buggy") == ALL_FIXES - set(PARTS)
    assert select_variant(PARTS[:1], "buggy") == ALL_FIXES - {PARTS[0]}


def test_without_removes_named_parts() -> None:
    fixes = select_variant(PARTS, None, ["moe_align_oob_guard", "moe_align_grid_plus_one"])
    assert fixes == ALL_FIXES - {Fix.MOE_ALIGN_OOB_GUARD, Fix.MOE_ALIGN_GRID_PLUS_ONE}


def test_fixes_none() -> None:
    assert select_variant(PARTS, fixes="none") == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"without": ["no_such_part"]},
            "unknown fix part 'no_such_part'; valid parts: block_table_reinit_on_wake, fresh_attn",
        ),
        ({"variant": "buggy", "without": ["moe_align_oob_guard"]}, "use one of"),
        ({"variant": "fixed", "fixes": "none"}, "use one of"),
        ({"fixes": "all"}, "--fixes takes only 'none'"),
        ({"variant": "broken"}, "--variant takes fixed or buggy"),
    ],
)
def test_bad_input_is_a_usage_error(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        select_variant(PARTS, **kwargs)


def test_describe() -> None:
    assert describe(ALL_FIXES, PARTS) == "fixed"
    assert describe(ALL_FIXES - set(PARTS), PARTS) == "buggy"
    assert describe(ALL_FIXES - {PARTS[1]}, PARTS) == "without moe_align_oob_guard"
