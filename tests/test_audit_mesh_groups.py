"""The wire audit reads replica groups in every form XLA prints them: JAX 0.12's XLA writes
them over a named mesh (``mesh['data'=2,'stage'=4] {'stage'}``), which the audit once read
as no group at all, so every reduction counted zero bytes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

# The same program compiled by JAX 0.12.0.1's XLA (``tests/data``), whose text names its
# replica groups over the mesh.
_JAX012 = Path(__file__).parent / "data" / "mesh_groups_jax0.12.hlo"


def _program():
    mesh = jax.make_mesh((2, 4), ("data", "stage"))

    def per_device(x):  # x: f32[1, 64] per device (device d = data * 4 + stage)
        a = lax.psum(x, "stage")  # groups of 4 along a row
        b = lax.psum(x[:, :8], "data")  # groups of 2 down a column
        c = lax.all_gather(x[:, :4], "data", tiled=True)
        d = lax.psum_scatter(x, ("data", "stage"), scatter_dimension=1, tiled=True)
        return a.sum() + b.sum() + c.sum() + d.sum()

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("data", "stage"), out_specs=P(),
                      check_vma=False)  # fmt: skip
    x = jax.device_put(jnp.ones((2, 256)), NamedSharding(mesh, P("data", "stage")))
    return mesh, f, x


def test_mesh_replica_groups_count_what_explicit_groups_count():
    mesh, f, x = _program()
    text = _JAX012.read_text()
    assert "replica_groups=mesh[" in text  # the form under test
    new = jaxcomm.wire_audit(text)
    here = jaxcomm.wire_audit(jax.jit(f).lower(x).compile())
    # The reference: the same program as the JAX running the tests compiles it (JAX 0.10
    # writes explicit groups, ``{{0,1,2,3},{4,5,6,7}}``), per device; and no collective of
    # the mesh form counted zero.
    np.testing.assert_array_equal(new.traffic().sent, here.traffic().sent)
    assert len(new.ops) == 4 and all((op.sent > 0).all() for op in new.ops)


def test_a_replica_group_form_it_cannot_read_is_an_error_not_zero_bytes():
    text = _JAX012.read_text()
    bad = text.replace("replica_groups=mesh[", "replica_groups=grid[", 1)
    with pytest.raises(ValueError, match="replica groups"):
        jaxcomm.wire_audit(bad)


@pytest.mark.parametrize(
    "text, groups",
    [
        ("mesh['data'=2,'stage'=4] {'stage'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['data'=2,'stage'=4] {'data'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        # An axis of size 1 (a pipeline with one data replica): every device alone, or
        # every device of the other axis together.
        ("mesh['data'=1,'stage'=2] {'data'}", [[0], [1]]),
        ("mesh['data'=1,'stage'=4] {'stage'}", [[0, 1, 2, 3]]),
        ("mesh['data'=2,'stage'=1] {'stage'}", [[0], [1]]),
        ("mesh['data'=2,'stage'=4], device_ids=(0,2,4,6,1,3,5,7) {'stage'}",
         [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ],
)  # fmt: skip
def test_mesh_replica_groups_as_explicit_groups(text, groups):
    """Each mesh form against the groups JAX 0.10's XLA writes for it."""
    from jaxcomm._src.audit import _mesh_groups

    assert _mesh_groups(text) == groups
