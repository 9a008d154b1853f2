"""fabtrain.node.structs: what the agent's policy and the coordinator's board rely on from a record."""
import pytest

from fabtrain.node.structs import as_dict, factory, record, replace


@record
class Frozen:
    name: str
    rank: int = 0
    fields: dict = factory(dict)


@record(frozen=False)
class Mutable:
    seen: float
    procs: dict = factory(dict)


def test_a_frozen_record_is_built_compared_hashed_and_copied_by_its_fields():
    a = Frozen("trainer-0", fields={"x": 1})
    assert (a.name, a.rank, a.fields) == ("trainer-0", 0, {"x": 1})
    assert a == Frozen(name="trainer-0", rank=0, fields={"x": 1}) and a != Frozen("trainer-1")
    assert repr(a) == "Frozen(name='trainer-0', rank=0, fields={'x': 1})"
    b = replace(Frozen("p", 2), rank=3)
    assert b == Frozen("p", 3) and as_dict(b) == {"name": "p", "rank": 3, "fields": {}}
    assert hash(Frozen("p", 3, ())) == hash(Frozen("p", 3, ())) and len({Frozen("p", 3, ()), Frozen("p", 3, ())}) == 1
    with pytest.raises(AttributeError):
        b.rank = 4
    assert Frozen("a").fields is not Frozen("a").fields  # a fresh default each time


def test_a_record_of_another_class_with_the_same_fields_is_not_equal():
    @record
    class Other:
        name: str
        rank: int = 0
        fields: dict = factory(dict)
    assert Other("p") != Frozen("p")


def test_wrong_arguments_are_refused_as_a_class_refuses_them():
    with pytest.raises(TypeError, match="missing required argument 'name'"):
        Frozen()
    with pytest.raises(TypeError, match="unexpected argument 'rnak'"):
        Frozen("p", rnak=1)
    with pytest.raises(TypeError, match="a second argument 'name'"):
        Frozen("p", name="q")
    with pytest.raises(TypeError, match="takes 3 arguments, 4 were given"):
        Frozen("p", 1, {}, 2)
    with pytest.raises(TypeError):
        replace(Frozen("p"), nope=1)


def test_a_mutable_record_can_be_changed_and_is_not_hashable():
    m = Mutable(1.0)
    m.seen = 2.0
    m.procs["trainer-0"] = {}
    assert m == Mutable(2.0, {"trainer-0": {}})
    with pytest.raises(TypeError):
        hash(m)
