"""Property tests: any object the schema accepts renders, or is refused with SpecError."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from vlm_operator.api import crd
from vlm_operator.api.validation import SpecError, _forbid_unknown, parse, validate
from vlm_operator.desired import children

SPEC_SCHEMA = _forbid_unknown(crd.get_schema()["properties"]["spec"])


def as_cr(spec):
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": "prop", "namespace": "ns", "uid": "u"}, "spec": spec}


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(from_schema(SPEC_SCHEMA))
def test_schema_valid_specs_render_or_fail_cleanly(spec):
    try:
        vlmd = parse(as_cr(spec))
    except SpecError as exc:
        assert exc.problems
        assert all(":" in p for p in exc.problems)
        return
    objs = children.get_children(vlmd)
    kinds = [c["kind"] for c in objs]
    assert kinds.count("Deployment") == 1 and kinds.count("Service") == 1
    dep = objs[kinds.index("Deployment")]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == vlmd.spec["model"]
    assert all(isinstance(a, str) for a in args)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20))
def test_arbitrary_input_never_crashes_validation(junk):
    for obj in (junk, as_cr(junk), as_cr({"model": "m", "vllm": junk, "health": junk})):
        problems, _ = validate(obj)
        if problems:
            try:
                parse(obj)
            except SpecError:
                pass
            else:
                raise AssertionError("problems but parse accepted")
