from megaprm.tasks.latex import closing_brace, last_boxed


def test_closing_brace_balances_nested_braces():
    assert closing_brace("a{b{c}d}e", 0) == 7
    assert closing_brace("x{\\frac{1}{2}}", 1) == 13
    assert closing_brace("{unclosed", 0) is None


def test_last_boxed_takes_the_last_box_whole():
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{open") is None
