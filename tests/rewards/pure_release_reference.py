"""PURE's released outcome checker transcribed for the tests (the reference
`reward.verifier: hendrycks_math` is compared with), following its control flow:
CJReinforce/PURE@41f9363 openrlhf/utils/math_score.py:16-235 (compute_score, is_equiv,
remove_boxed, last_boxed_only_string, fix_fracs, fix_a_slash_b, remove_right_units, fix_sqrt,
strip_string). Note where it differs from PRM800K's copy of the same rules: fix_a_slash_b and
fix_fracs catch only AssertionError, so "x/y" raises and is_equiv falls back to raw equality."""


def compute_score(solution_str, ground_truth) -> float:
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:
        pass
    return 0.0


def is_equiv(str1, str2):
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        ss1, ss2 = strip_string(str1), strip_string(str2)
        return ss1 == ss2 or ss1 == ss2.replace(",", "")
    except Exception:
        return str1 == str2


def remove_boxed(s):
    if "\\boxed " in s:
        assert s[:len("\\boxed ")] == "\\boxed "
        return s[len("\\boxed "):]
    assert s[:len("\\boxed{")] == "\\boxed{"
    assert s[-1] == "}"
    return s[len("\\boxed{"):-1]


def last_boxed_only_string(string):
    idx = string.rfind("\\boxed")
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    depth, right = 0, None
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        if string[i] == "}":
            depth -= 1
            if depth == 0:
                right = i
                break
    return None if right is None else string[idx:right + 1]


def fix_fracs(string):
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":
            new_str += substr
        else:
            try:
                assert len(substr) >= 2
            except AssertionError:
                return string
            a, b = substr[0], substr[1]
            if b != "{":
                new_str += "{" + a + "}{" + b + "}" + substr[2:]
            else:
                new_str += "{" + a + "}" + b + substr[2:]
    return new_str


def fix_a_slash_b(string):
    if len(string.split("/")) != 2:
        return string
    a, b = string.split("/")
    try:
        a, b = int(a), int(b)
        assert string == "{}/{}".format(a, b)
        return "\\frac{" + str(a) + "}{" + str(b) + "}"
    except AssertionError:
        return string


def remove_right_units(string):
    if "\\text{ " in string:
        splits = string.split("\\text{ ")
        assert len(splits) == 2
        return splits[0]
    return string


def fix_sqrt(string):
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        if split[0] != "{":
            new_string += "\\sqrt{" + split[0] + "}" + split[1:]
        else:
            new_string += "\\sqrt" + split
    return new_string


def strip_string(string):
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if len(string) == 0:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = fix_sqrt(string)
    string = string.replace(" ", "")
    string = fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return fix_a_slash_b(string)
