"""megaprm.digest: the digest of a JSON-able value, independent of key order; the compact form
stays the one every trainer checkpoint stored."""
import hashlib
import json

from megaprm.digest import json_digest


def test_key_order_does_not_matter_and_values_do():
    a = {"b": [1, 2.5, {"x": None}], "a": "s"}
    b = {"a": "s", "b": [1, 2.5, {"x": None}]}
    assert json_digest(a) == json_digest(b) and len(json_digest(a)) == 16
    assert json_digest(a) != json_digest({**a, "a": "t"})


def test_both_forms_are_the_sha256_of_the_sorted_json():
    obj = {"trainer": {"seed": 1}, "model": ("m", 2), "lr": 1e-6}
    plain = json.dumps(obj, sort_keys=True, default=str)
    compact = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    assert json_digest(obj) == hashlib.sha256(plain.encode()).hexdigest()[:16]
    assert json_digest(obj, compact=True) == hashlib.sha256(compact.encode()).hexdigest()[:16]
    assert json_digest(obj) != json_digest(obj, compact=True)


def test_values_json_cannot_hold_are_written_as_str():
    class Odd:
        def __str__(self):
            return "odd"

    assert json_digest({"k": Odd()}) == json_digest({"k": "odd"})
