"""The context budget under inputs users really send: an unknown model, a window smaller than
the request, max_tokens beyond the window, skills bigger than the budget, a missing tokenizer."""

from __future__ import annotations

import pytest

from metaclaw.proxy.context_budget import TokenCounter, context_window, fit_skills


def test_a_missing_tokenizer_file_is_named_in_one_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(ValueError, match="nowhere/tokenizer.json"):
        TokenCounter(str(missing))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="tokenizer.json"):
        TokenCounter(str(broken))


def test_unknown_models_and_oversized_requests_are_left_untouched():
    assert context_window("my-finetune", None, None) is None
    assert context_window("my-finetune", None, 4096) == 4096
    counter = TokenCounter()
    # a request already bigger than the window, or asking for more output than the window
    for request, reserve in ((b"x" * 400, None), (b"{}", 10**9)):
        budget = fit_skills(["a", "b"], lambda n: "skill " * n, request, 100, reserve, counter)
        assert budget.keep == 0 and budget.record["over_window"] and budget.record["cut"] == ["a", "b"]
    # skills each bigger than what is left: all cut, the request itself still fits
    budget = fit_skills(["a", "b"], lambda n: "x" * 3000 * n, b"{}", 100, None, counter)
    assert budget.keep == 0 and not budget.record["over_window"] and budget.record["block_tokens"] == 0
