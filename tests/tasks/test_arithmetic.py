import random

import pytest

from megaprm.tasks.arithmetic import (
    CORRUPTION_KINDS,
    SEP,
    ArithmeticConfig,
    check_steps,
    corrupt_solution,
    generate_problems,
    make_problem,
    reference_solution,
    split_steps,
    step_labelled_examples,
)

CONFIGS = [
    ArithmeticConfig(),
    ArithmeticConfig(num_ops=(1, 6), operand_max=9, ops="+-*"),
    ArithmeticConfig(num_ops=(3, 3), ops="-*", allow_negative=False),
    ArithmeticConfig(num_ops=(2, 5), ops="+-", allow_negative=True),
    ArithmeticConfig(num_ops=(8, 11), operand_max=9, restate=True),  # the long task's format
]


def test_determinism_per_seed():
    cfg = ArithmeticConfig(seed=3)
    assert generate_problems(cfg, 50) == generate_problems(cfg, 50)
    assert generate_problems(cfg, 50) == generate_problems(cfg, 50, seed=3)
    assert generate_problems(cfg, 50, seed=4) != generate_problems(cfg, 50, seed=5)
    assert step_labelled_examples(cfg, 40, seed=1) == step_labelled_examples(cfg, 40, seed=1)


def test_format_example():
    p = make_problem([7, 5, 3, 8], ["+", "-", "+"])
    assert p.prompt == "7+5-3+8=" and p.answer == 17
    assert reference_solution(p) == "7+5=12\n\n12-3=9\n\n9+8=17\n\n\\boxed{17}"


@pytest.mark.parametrize("cfg", CONFIGS)
def test_reference_solutions_pass(cfg):
    for p in generate_problems(cfg, 300, seed=11):
        assert cfg.num_ops[0] <= len(p.ops) <= cfg.num_ops[1]
        assert all(1 <= b <= cfg.operand_max for b in p.operands)
        if not cfg.allow_negative:
            assert min(p.results) >= 0, p
        c = check_steps(p, reference_solution(p))
        assert c.parsed_ok and c.final_correct and c.all_steps_correct
        assert len(c.step_correct) == len(p.ops) + 1 and c.first_error_index is None


def test_default_texts_are_short():
    ps = generate_problems(ArithmeticConfig(), 500, seed=0)
    assert max(len(p.prompt) for p in ps) <= 20
    assert max(len(reference_solution(p)) for p in ps) <= 60


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("kind", CORRUPTION_KINDS)
def test_corruptions_flagged(cfg, kind):
    rng = random.Random(0)
    for p in generate_problems(cfg, 200, seed=5):
        text = corrupt_solution(p, rng, kind, cfg.allow_negative)
        c = check_steps(p, text, ends_with_eos=kind != "truncated")
        if kind == "flawed_but_correct":
            assert c.final_correct and not all(c.step_correct), text
            assert c.correct_with_wrong_step
        elif kind == "truncated":
            assert not c.final_correct and not c.parsed_ok, text
            assert reference_solution(p).startswith(text)
        else:
            assert not c.final_correct and c.parsed_ok, text
            assert c.step_correct.count(False) == 1, (text, c)  # later steps continue validly
        if not cfg.allow_negative and kind != "truncated":
            assert "=-" not in text and "{-" not in text, text


def test_restating_format_and_its_rules():
    """`restate`: each equation step restates the operations still to apply; a step whose
    arithmetic is right but whose tail drops, changes or reorders an operation is wrong, and
    the repr names the knob only when set (it keys the cached starts of the other tasks)."""
    p = make_problem([7, 5, 3, 8], ["+", "-", "+"], restate=True)
    ref = reference_solution(p)
    assert ref == "7+5=12-3+8\n\n12-3=9+8\n\n9+8=17\n\n\\boxed{17}"
    assert check_steps(p, ref).all_steps_correct
    c = check_steps(p, "7+5=12-3\n\n12-3=9+8\n\n9+8=17\n\n\\boxed{17}")  # dropped +8
    assert c.step_correct == [False, True, True, True] and c.correct_with_wrong_step
    assert check_steps(p, "7+5=12+8-3\n\n12-3=9+8\n\n9+8=17\n\n\\boxed{17}"
                       ).step_correct[0] is False  # reordered
    # the plain format is not a restating step, and a restating one is not a plain step
    assert check_steps(p, "7+5=12\n\n12-3=9\n\n9+8=17\n\n\\boxed{17}").step_correct == [
        False, False, True, True]
    plain = make_problem([7, 5, 3, 8], ["+", "-", "+"])
    # (its third step has no tail to parse but starts from 9, not the 7 the unparsed steps
    # left: wrong; the boxed 17 follows the stated 17)
    assert check_steps(plain, ref).step_correct == [False, False, False, True]
    assert "restate" not in repr(ArithmeticConfig())
    assert repr(ArithmeticConfig(restate=True)).endswith("restate=True)")
    assert generate_problems(ArithmeticConfig(restate=True), 3)[0].restate


def test_step_rules():
    p = make_problem([7, 5, 3, 8], ["+", "-", "+"])
    # a true equation that is not the right step (skips an operand)
    assert check_steps(p, "7+5=12\n\n12+8=20\n\n20+0=20\n\n\\boxed{20}").step_correct == [True, False, False, True]
    # the right operands but a wrong result, then a locally valid continuation
    c = check_steps(p, "7+5=13\n\n13-3=10\n\n10+8=18\n\n\\boxed{18}")
    assert c.step_correct == [False, True, True, True] and c.first_error_index == 0
    # boxed too early (skipped steps) is wrong even if it repeats the previous result
    assert check_steps(p, "7+5=12\n\n\\boxed{12}").step_correct == [True, False]
    # garbage, an extra step, a non-final boxed step
    c = check_steps(p, "7+5=12\n\nhello\n\n\\boxed{17}")
    assert c.step_correct == [True, False, False] and not c.parsed_ok and c.final_correct
    c = check_steps(p, "7+5=12\n\n12-3=9\n\n9+8=17\n\n17+0=17\n\n\\boxed{17}")
    assert c.step_correct == [True, True, True, False, False]
    assert not check_steps(p, "\\boxed{17}\n\n7+5=12").parsed_ok
    assert check_steps(p, "").step_correct == [False]


def test_split_steps_matches_token_rules():
    assert split_steps("a\n\nb") == ["a", "b"]
    assert split_steps("a\n\n") == ["a", ""]  # EOS after the separator closes an empty step
    assert split_steps("a\n\n", ends_with_eos=False) == ["a"]
    assert split_steps("", ends_with_eos=False) == []
    assert split_steps("a\n\n\nb") == ["a", "\nb"]


@pytest.mark.parametrize("mode", ["local", "prefix"])
def test_step_labelled_examples(mode):
    cfg = ArithmeticConfig(seed=2)
    data = step_labelled_examples(cfg, 400, label_mode=mode)
    assert len(data) == 400
    fully_right = sum(all(labels) for _, _, labels in data)
    assert 0.4 < fully_right / 400 < 0.75  # half reference, plus truncations that stop cleanly
    for prompt, steps, labels in data:
        assert prompt.endswith("=") and len(steps) == len(labels) and set(labels) <= {0, 1}
        if mode == "prefix":
            assert labels == sorted(labels, reverse=True)
    text = SEP.join(data[0][1])
    assert SEP.join(split_steps(text)) == text


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_ops": (0, 2)}, "num_ops"),
        ({"num_ops": (3, 2)}, "num_ops"),
        ({"num_ops": (2,)}, "num_ops"),
        ({"operand_max": 1}, "operand_max"),
        ({"ops": "+/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"ops": "-"}, "allow_negative"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ArithmeticConfig(**kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        corrupt_solution(make_problem([1, 2], ["+"]), random.Random(0), "typo")
    with pytest.raises(ValueError, match="label_mode"):
        step_labelled_examples(ArithmeticConfig(), 2, label_mode="first")
