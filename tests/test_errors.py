"""Bad input raises before anything is launched, with a message naming the argument."""

import pytest
import torch
from helpers import random_topk_ids

import moe_route
from moe_route import finalize as finalize_mod
from moe_route import maps as maps_mod
from moe_route import permute as permute_mod
from moe_route.kernels.triton.expand import ExpandLaunch
from moe_route.kernels.triton.finalize import FinalizeLaunch
from moe_route.kernels.triton.routing_maps import MapsLaunch
from moe_route.reference import routing_maps_reference

T, K, E, H = 5, 2, 4, 13


@pytest.fixture
def no_launch(monkeypatch):
    """Replace the three ops (where the public functions dispatch them) and the prepared
    launches their call memos run by tripwires: validation must fail before dispatch."""

    def tripwire(*args, **kwargs):
        raise AssertionError("an op was dispatched although its input was invalid")

    monkeypatch.setattr(maps_mod, "routing_maps_tables", tripwire)
    monkeypatch.setattr(maps_mod, "_ROUTING_MAPS", tripwire)
    monkeypatch.setattr(permute_mod, "EXPAND", tripwire)
    monkeypatch.setattr(finalize_mod, "FINALIZE", tripwire)
    for launch in (MapsLaunch, ExpandLaunch, FinalizeLaunch):
        monkeypatch.setattr(launch, "__call__", tripwire)


def _maps(num_tokens=T):
    """Valid maps built without dispatching an op (so they survive the tripwires)."""
    ids = random_topk_ids(num_tokens, K, E, drop_prob=0.2)
    tables = routing_maps_reference(ids, E)
    return moe_route.RoutingMaps(*tables, num_tokens=num_tokens, top_k=K, num_experts=E)


@pytest.fixture
def maps():
    return _maps()


def _ok(maps):
    """Valid finalize arguments, to be spoiled one at a time."""
    return dict(
        y_perm=torch.randn(T * K, H),
        topk_weights=torch.rand(T, K),
        maps=maps,
        bias=torch.randn(H),
    )


# ----------------------------------------------------------------------------- topk_ids
@pytest.mark.parametrize(
    "ids,exc,match",
    [
        (torch.zeros(T, K), TypeError, r"topk_ids must be int32 or int64.*float32"),
        (torch.zeros(T, K, dtype=torch.float64), TypeError, r"topk_ids must be int32 or int64"),
        (torch.zeros(T, K, dtype=torch.int16), TypeError, r"topk_ids must be int32 or int64"),
        (torch.zeros(T, K, dtype=torch.bool), TypeError, r"topk_ids must be int32 or int64"),
        (torch.zeros(T * K, dtype=torch.int64), ValueError, r"topk_ids must have 2 dim.*\(10,\)"),
        (torch.zeros(T, K, 1, dtype=torch.int64), ValueError, r"topk_ids must have 2 dim"),
        (torch.zeros(T, 0, dtype=torch.int64), ValueError, r"topk_ids must have at least one"),
        (torch.zeros(T, E + 1, dtype=torch.int64), ValueError, r"K=5 .*num_experts=4.*K <= E"),
        ([[0, 1]], TypeError, r"topk_ids must be a torch.Tensor, got list"),
    ],
    ids=[
        "float32",
        "float64",
        "int16",
        "bool",
        "1-D",
        "3-D",
        "K=0",
        "K>E",
        "list",
    ],
)
def test_bad_topk_ids(no_launch, ids, exc, match):
    with pytest.raises(exc, match=match):
        moe_route.build_routing_maps(ids, E)


@pytest.mark.parametrize("check_ids", ["no", 0, 1.0])
def test_check_ids_must_be_a_bool_or_none(no_launch, check_ids):
    with pytest.raises(TypeError, match=r"check_ids must be a bool or None, got "):
        moe_route.build_routing_maps(random_topk_ids(T, K, E), E, check_ids=check_ids)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_experts", [2**31, 2**40])
def test_num_experts_past_the_int32_maps_blames_num_experts(no_launch, dtype, num_experts):
    """The maps' expert ids are int32: ``E`` past them is an error about ``num_experts``,
    never about an id that is in range."""
    ids = torch.zeros(T, K, dtype=dtype)
    ids[:, 1] = 1
    with pytest.raises(ValueError, match=rf"num_experts={num_experts} is more than the int32"):
        moe_route.build_routing_maps(ids, num_experts)
    with pytest.raises(ValueError, match=rf"num_experts={num_experts} is more than the int32"):
        moe_route.apply_capacity(ids, num_experts, 1)


@pytest.mark.parametrize(
    "bad,dtype",
    [(b, d) for d in (torch.int32, torch.int64) for b in (E, E + 7, -2)]
    + [(-(2**40), torch.int64)],
)
def test_out_of_range_ids_on_cpu(no_launch, bad, dtype):
    ids = random_topk_ids(T, K, E).to(dtype)
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=rf"topk_ids\[3, 1\] = {bad} is out of range.*\[0, 4\)"):
        moe_route.build_routing_maps(ids, E)
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\]"):
        moe_route.build_routing_maps(ids, E, check_ids=True, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_unchecked_out_of_range_ids_count_as_dropped(backend):
    # Documented: check_ids=False skips the value check; the kernels then treat ids outside
    # [-1, E) as dropped (-1) and never index out of bounds.
    ids = torch.tensor([[0, 9], [-3, 2], [3, 1]])
    maps = moe_route.build_routing_maps(ids, E, check_ids=False, backend=backend)
    assert maps.expert_for_source_row.tolist() == [0, -1, 3, -1, 2, 1]
    assert maps.expert_first_token_offset.tolist() == [0, 1, 2, 3, 4]
    assert sorted(maps.expanded_dest_row_to_expanded_source_row.tolist()) == list(range(6))
    # The two dropped slots (s=1, s=3) sit after the 4 routed rows, in source order.
    assert maps.expanded_dest_row_to_expanded_source_row.tolist()[4:] == [1, 3]


def test_too_many_expanded_rows(no_launch):
    # A stride-0 view: 2**31 rows of ids without the memory. The int32 maps cannot index them.
    ids = torch.zeros(1, 1, dtype=torch.int32).expand(2**31, 1)
    with pytest.raises(ValueError, match=r"T\*K=2147483648 expanded rows"):
        moe_route.build_routing_maps(ids, E, check_ids=False)


@pytest.mark.parametrize(
    "num_experts,exc,match",
    [
        (0, ValueError, r"num_experts must be >= 1, got 0"),
        (-3, ValueError, r"num_experts must be >= 1, got -3"),
        (4.0, TypeError, r"num_experts must be an int, got float"),
        (True, TypeError, r"num_experts must be an int, got bool"),
        (torch.tensor(4), TypeError, r"num_experts must be an int, got Tensor"),
        ("4", TypeError, r"num_experts must be an int, got str"),
    ],
)
def test_bad_num_experts(no_launch, num_experts, exc, match):
    with pytest.raises(exc, match=match):
        moe_route.build_routing_maps(torch.zeros(T, 1, dtype=torch.int64), num_experts)


@pytest.mark.parametrize("backend", ["cuda", "Triton", "", "pytorch", "Reference"])
def test_bad_backend_string(no_launch, maps, backend):
    ids = random_topk_ids(T, K, E)
    match = rf"backend={backend!r}: expected 'auto' or one of"
    with pytest.raises(ValueError, match=match):
        moe_route.build_routing_maps(ids, E, backend=backend)
    with pytest.raises(ValueError, match=match):
        moe_route.expand_rows(torch.randn(T, H), maps, backend=backend)
    with pytest.raises(ValueError, match=match):
        moe_route.finalize_moe_routing(**_ok(maps), backend=backend)


def test_bad_backend_env(no_launch, maps, monkeypatch):
    monkeypatch.setenv("MOE_ROUTE_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"MOE_ROUTE_BACKEND='cuda'"):
        moe_route.build_routing_maps(random_topk_ids(T, K, E), E)
    with pytest.raises(ValueError, match=r"MOE_ROUTE_BACKEND='cuda'"):
        moe_route.expand_rows(torch.randn(T, H), maps)


# ----------------------------------------------------------------------------- expand
@pytest.mark.parametrize(
    "x,exc,match",
    [
        (torch.randn(T), ValueError, r"x must have 2 dimensions.*\(5,\)"),
        (torch.randn(T, H, 1), ValueError, r"x must have 2 dimensions"),
        (torch.ones(T, H, dtype=torch.int32), TypeError, r"x must have dtype in .*int32"),
        (torch.ones(T, H, dtype=torch.complex64), TypeError, r"x must have dtype in"),
        (torch.randn(T + 1, H), ValueError, r"maps were built for T=5 tokens but x has 6"),
        (torch.randn(T - 1, H), ValueError, r"maps were built for T=5 tokens but x has 4"),
        (torch.randn(T, H, device="meta"), ValueError, r"maps are on cpu but x is on meta"),
        (torch.randn(T, H).numpy(), TypeError, r"x must be a torch.Tensor, got ndarray"),
    ],
    ids=["1-D", "3-D", "int32", "complex", "T+1", "T-1", "device", "numpy"],
)
def test_bad_expand_input(no_launch, maps, x, exc, match):
    with pytest.raises(exc, match=match):
        moe_route.expand_rows(x, maps)


def test_expand_needs_routing_maps(no_launch, maps):
    tables = (maps.expanded_source_row_to_expanded_dest_row, maps.expert_first_token_offset)
    with pytest.raises(TypeError, match=r"maps must be a RoutingMaps .* got tuple"):
        moe_route.expand_rows(torch.randn(T, H), tables)


# ----------------------------------------------------------------------------- finalize
@pytest.mark.parametrize(
    "field,value,exc,match",
    [
        ("y_perm", torch.randn(T * K + 1, H), ValueError, r"y_perm must have T\*K = 10 rows"),
        ("y_perm", torch.randn(T, H), ValueError, r"y_perm must have T\*K = 10 rows"),
        ("y_perm", torch.randn(T * K * H), ValueError, r"y_perm must have 2 dimensions"),
        ("y_perm", torch.ones(T * K, H, dtype=torch.int64), TypeError, r"y_perm must have dtype"),
        ("topk_weights", torch.rand(T, K + 1), ValueError, r"K=3 slots .* built with K=2"),
        ("topk_weights", torch.rand(T, 1), ValueError, r"K=1 slots .* built with K=2"),
        ("topk_weights", torch.rand(T + 1, K), ValueError, r"T=5 tokens but topk_weights has 6"),
        ("topk_weights", torch.rand(T * K), ValueError, r"topk_weights must have 2 dimensions"),
        ("topk_weights", torch.ones(T, K, dtype=torch.int32), TypeError, r"topk_weights must"),
        ("bias", torch.randn(H + 1), ValueError, r"bias must be \[H\] = \[13\] or \[T, H\]"),
        ("bias", torch.randn(1, H), ValueError, r"bias must be \[H\].*\(1, 13\)"),
        ("bias", torch.randn(T), ValueError, r"bias must be \[H\]"),
        ("bias", torch.randn(T * K, H), ValueError, r"bias must be \[H\]"),
        ("bias", torch.randn(T, H, 1), ValueError, r"bias must be \[H\]"),
        ("bias", torch.ones(H, dtype=torch.int64), TypeError, r"bias must have dtype"),
        ("bias", [0.0] * H, TypeError, r"bias must be a torch.Tensor"),
        ("y_perm", torch.randn(T * K, H, device="meta"), ValueError, r"expected one device"),
        ("bias", torch.randn(H, device="meta"), ValueError, r"bias is on meta .*one device"),
        ("maps", None, TypeError, r"maps must be a RoutingMaps"),
    ],
)
def test_bad_finalize_input(no_launch, maps, field, value, exc, match):
    kwargs = _ok(maps)
    kwargs[field] = value
    with pytest.raises(exc, match=match):
        moe_route.finalize_moe_routing(**kwargs)


def test_finalize_maps_for_another_batch(no_launch):
    other = _maps(T + 2)
    with pytest.raises(ValueError, match=r"maps were built for T=7 tokens but topk_weights has 5"):
        moe_route.finalize_moe_routing(torch.randn(T * K, H), torch.rand(T, K), other)


# ----------------------------------------------------------------------------- RoutingMaps
def test_routing_maps_dataclass_checks_its_fields(maps):
    fields = dict(
        expanded_source_row_to_expanded_dest_row=maps.expanded_source_row_to_expanded_dest_row,
        expanded_dest_row_to_expanded_source_row=maps.expanded_dest_row_to_expanded_source_row,
        expert_for_source_row=maps.expert_for_source_row,
        expert_first_token_offset=maps.expert_first_token_offset,
        num_tokens=T,
        top_k=K,
        num_experts=E,
    )
    moe_route.RoutingMaps(**fields)  # the valid one
    for name in ("expanded_source_row_to_expanded_dest_row", "expert_for_source_row"):
        bad = dict(fields, **{name: fields[name].long()})
        with pytest.raises(ValueError, match=rf"RoutingMaps.{name}: expected \[10\] int32"):
            moe_route.RoutingMaps(**bad)
        bad = dict(fields, **{name: fields[name][:-1]})
        with pytest.raises(ValueError, match=rf"RoutingMaps.{name}: expected \[10\] int32"):
            moe_route.RoutingMaps(**bad)
    off = fields["expert_first_token_offset"]
    for bad_off in (off.int(), off[:-1]):
        with pytest.raises(ValueError, match=r"expert_first_token_offset: expected \[5\] int64"):
            moe_route.RoutingMaps(**dict(fields, expert_first_token_offset=bad_off))
    with pytest.raises(ValueError, match=r"expected \[12\] int32"):
        moe_route.RoutingMaps(**dict(fields, num_tokens=T + 1))
    with pytest.raises(Exception, match="cannot assign"):
        maps.num_tokens = 3  # frozen


@pytest.mark.parametrize(
    ("field", "value", "exc", "match"),
    [
        ("num_tokens", 5.0, TypeError, r"RoutingMaps.num_tokens must be an int, got float 5.0"),
        ("num_tokens", -5, ValueError, r"RoutingMaps.num_tokens=-5: expected an int >= 0"),
        ("top_k", True, TypeError, r"RoutingMaps.top_k must be an int, got bool"),
        ("top_k", 0, ValueError, r"RoutingMaps.top_k=0: expected an int >= 1"),
        ("top_k", -2, ValueError, r"RoutingMaps.top_k=-2: expected an int >= 1"),
        ("num_experts", 4.0, TypeError, r"RoutingMaps.num_experts must be an int, got float"),
        ("num_experts", 0, ValueError, r"RoutingMaps.num_experts must be >= 1, got 0"),
        ("num_experts", -1, ValueError, r"RoutingMaps.num_experts must be >= 1, got -1"),
    ],
)
def test_routing_maps_sizes_are_ints_in_range(maps, field, value, exc, match):
    """``T, K, E`` are Python ints (not bools) in range; checked before the tables, whose
    expected shapes come from them."""
    sizes = dict(num_tokens=T, top_k=K, num_experts=E)
    sizes[field] = value
    with pytest.raises(exc, match=match):
        moe_route.RoutingMaps(*maps.tensors(), **sizes)


def test_routing_maps_of_no_tokens(maps):
    empty = torch.zeros(0, dtype=torch.int32)
    off = torch.zeros(E + 1, dtype=torch.int64)
    got = moe_route.RoutingMaps(empty, empty, empty, off, num_tokens=0, top_k=K, num_experts=E)
    assert got.num_expanded_rows == 0


def test_routing_maps_constructor_has_no_unchecked_mode(maps):
    """The public constructor always checks: no keyword turns the checks off, and a forged
    dest row (which the kernels would read out of bounds) is rejected, by
    ``dataclasses.replace`` as well."""
    import dataclasses

    tables = maps.tensors()
    with pytest.raises(TypeError, match="trusted"):
        moe_route.RoutingMaps(*tables, T, K, E, trusted=True)
    forged = tables[0].clone()
    forged[0] = 2**30
    with pytest.raises(ValueError, match=r"expanded_source_row_to_expanded_dest_row\[0\] = "):
        moe_route.RoutingMaps(forged, *tables[1:], T, K, E)
    with pytest.raises(ValueError, match=r"expanded_source_row_to_expanded_dest_row\[0\] = "):
        dataclasses.replace(maps, expanded_source_row_to_expanded_dest_row=forged)
    built = moe_route.build_routing_maps(random_topk_ids(T, K, E), E, backend="torch")
    with pytest.raises(ValueError, match="is out of range"):
        dataclasses.replace(built, expanded_source_row_to_expanded_dest_row=forged)
    assert not any(f.name == "trusted" for f in dataclasses.fields(moe_route.RoutingMaps))
