import pytest

from launcher.config import ConfigError
from launcher.distributed.topology import parse_topology


@pytest.mark.parametrize("spec,world,targets,drafters", [("t1d1", 2, 1, 1), ("t1d2", 3, 1, 2), ("t5d3", 8, 5, 3),
                                                         ("t12d20", 32, 12, 20), ("auto", 4, 1, 3)])
def test_topology_roles(spec, world, targets, drafters):
    topo = parse_topology(spec, world)
    assert (topo.num_targets, topo.num_drafters) == (targets, drafters)
    roles = [topo.role(r) for r in range(world)]
    assert roles == ["target"] * targets + ["drafter"] * drafters
    assert topo.lead_drafter == targets


def test_topology_not_fitting_world_names_both():
    with pytest.raises(ConfigError) as err:
        parse_topology("t1d2", 2)
    assert "topology=t1d2" in str(err.value) and "WORLD_SIZE=2" in str(err.value)


def test_topology_without_a_world_takes_the_specs_own():
    # The bench's launches on one GPU: the ranks share it, so the spec alone decides the world.
    topo = parse_topology("t1d2", None)
    assert (topo.num_targets, topo.num_drafters, topo.world_size) == (1, 2, 3)
    with pytest.raises(ConfigError, match="topology=auto needs WORLD_SIZE"):
        parse_topology("auto", None)


@pytest.mark.parametrize("spec", ["t0d2", "t2d0", "x1d1", "t1", "1d1"])
def test_topology_malformed(spec):
    with pytest.raises(ConfigError, match="topology"):
        parse_topology(spec, 2)


def test_tensor_parallel_units():
    topo = parse_topology("t4d2", 6, tp_size=2)
    assert topo.num_units == 2
    assert [topo.unit_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.unit_leader(u) for u in range(2)] == [0, 2]
    with pytest.raises(ConfigError, match="tp_size"):
        parse_topology("t3d1", 4, tp_size=2)
