"""The held-out split's advice (`services.prepare.core.heldout_advice`): a permille that holds enough groups out, never
the one that just gave too few."""

from __future__ import annotations

import re

from services.prepare.core import MIN_HELDOUT_GROUPS, heldout_advice


def advised(text: str | None) -> int:
    assert text is not None
    found = re.search(r"--heldout-permille (\d+)", text)
    assert found, text
    return int(found.group(1))


def test_a_split_large_enough_gets_no_advice():
    assert heldout_advice(MIN_HELDOUT_GROUPS, 40, 500, 50) is None


def test_the_advice_never_repeats_a_permille_that_gave_too_few():
    # 250 groups: 120 permille holds 30 out on average, but the hash held only 11 out at 50 and 24 at 120
    first = advised(heldout_advice(11, 20, 239, 50))
    assert first >= 120
    second = advised(heldout_advice(24, 40, 226, first))
    assert second > first  # before: "pass 120" again, after passing 120
    assert second >= first * MIN_HELDOUT_GROUPS / 24


def test_the_advice_stays_a_permille():
    assert advised(heldout_advice(3, 4, 40, 900)) == 999


def test_missing_pairs_are_not_mended_by_a_larger_share():
    text = heldout_advice(MIN_HELDOUT_GROUPS + 5, 0, 500, 60)
    assert text is not None and "shared `group`" in text and "--heldout-permille" not in text


def test_a_corpus_too_small_for_any_share_is_told_so():
    text = heldout_advice(2, 1, 20, 100)
    assert text is not None and "too few for any --heldout-permille" in text and "22 groups in all" in text
