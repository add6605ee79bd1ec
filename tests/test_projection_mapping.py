import pytest

from specter.projection.mapping import RouteMap, layer_blocks


def test_blocks_cover_the_real_layers():
    for tiny, real in ((3, 26), (4, 24), (4, 32)):
        blocks = layer_blocks(tiny, real)
        assert sum(blocks, []) == list(range(real)) and all(blocks)
    with pytest.raises(ValueError):
        layer_blocks(5, 4)


def test_copies_are_permuted_deterministically():
    a = RouteMap(3, 64, 26, 64, seed=1)
    b = RouteMap(3, 64, 26, 64, seed=1)
    out = a.map(0, [0, 1, 2, 3, 4, 5])
    assert out == b.map(0, [0, 1, 2, 3, 4, 5])
    first, *rest = out.values()
    assert first == [0, 1, 2, 3, 4, 5]  # copy 0: identity
    assert any(r != first for r in rest)  # other copies differ: no shared cache state
    plain = RouteMap(3, 64, 26, 64, permute=False).map(0, [7])
    assert set(map(tuple, plain.values())) == {(7,)}


def test_fewer_tiny_experts_spread_over_the_real_range():
    m = RouteMap(2, 4, 4, 16, permute=False)
    assert [m.expert_id(e) for e in range(4)] == [0, 4, 8, 12]
    with pytest.raises(ValueError):
        m.expert_id(4)
