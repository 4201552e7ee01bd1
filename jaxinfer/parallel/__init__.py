"""Device meshes and the mapping from logical weight axes to mesh axes."""

from jaxinfer.parallel.mesh import make_mesh, named_sharding, replica_meshes, spec_for

__all__ = ["make_mesh", "named_sharding", "replica_meshes", "spec_for"]
